"""Benchmark: guided JSON with compact whitespace against flexible (bounded) whitespace, and
llguidance's own unbounded whitespace, on real weights: finished, valid answers per request.

SmolLM2-135M-Instruct (real weights, from the package cache), in-process engine, greedy.
Each of perf/json_schemas.py's requests (a short request in words through the model's chat
template; the schema, or any JSON object, as the guide) runs once per whitespace mode, all of
a mode's requests at once:

- compact: no whitespace between JSON tokens (`GuidedDecoding.compact`);
- flexible: one space, or a newline and a bounded indentation (guided.JSON_WHITESPACE);
- unbounded: any run of whitespace (llguidance's `whitespace_flexible`), for reference.

An answer counts as finished and valid when it ended on its own (finish_reason stop) and
parses as JSON valid for its schema (jsonschema, the full schema). Also per mode: answers
cut by max_tokens, failed rows (a violation the answer check found), tokens per answer, and
the longest run of whitespace in any answer.

    .venv/bin/python perf/bench_json_whitespace.py [--max-tokens 256] [--modes compact,flexible,unbounded]

Prints the table with the CPU; writes results/bench_json_whitespace/{summary,answers}.csv.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import threading
import time
from pathlib import Path

import jsonschema


from json_schemas import SCHEMAS  # noqa: E402

import tritonlm.engine.guided as guided  # noqa: E402
from tritonlm.engine.engine import Engine  # noqa: E402
from tritonlm.engine.kv_cache import KVCacheManager  # noqa: E402
from tritonlm.engine.request import GenerationRequest, GuidedDecoding, SamplingParams  # noqa: E402
from tritonlm.engine.runners.torch_runner import TorchRunner  # noqa: E402
from tritonlm.engine.scheduler import SchedulerConfig  # noqa: E402
from tritonlm.models.loading import load_model  # noqa: E402
from tritonlm.perf.machine import describe_cpu  # noqa: E402
from tritonlm.perf.report import add_out_arg, table, write_csv  # noqa: E402

MODES = ("compact", "flexible", "unbounded")
# llguidance's unbounded whitespace: any run of JSON whitespace between tokens
UNBOUNDED = {"whitespace_flexible": True, "whitespace_pattern": None}
WHITESPACE_RUN = re.compile(r"[ \t\n\r]+")


def make_engine(model, tok, streams: int, max_context: int) -> Engine:
    runner = TorchRunner(model)
    budget = (streams + 2) * (max_context + 16) * runner.spec.bytes_per_token
    cache = KVCacheManager(runner.spec, budget, 16, allocate_kv=runner.allocate_kv)
    return Engine(runner, tok, cache, SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=512), max_context=max_context)


def run_all(engine: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[list[dict], float]:
    """All requests at once -> (text, finish_reason, error, tokens) each, and the wall time."""
    out = [{"text": [], "finish_reason": None, "error": None, "tokens": 0} for _ in prompts]
    done = threading.Event()
    lock = threading.Lock()
    left = [len(prompts)]
    t0 = time.monotonic()

    def callback(i: int):
        def on_event(ev):
            with lock:
                out[i]["text"].append(ev.text)
                out[i]["tokens"] += len(ev.token_ids)
                if ev.finished:
                    out[i]["finish_reason"], out[i]["error"] = ev.finish_reason, ev.error
                    left[0] -= 1
                    if not left[0]:
                        done.set()
        return on_event

    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.submit(GenerationRequest(p, sp, callback(i)))
    if not done.wait(1800):
        raise RuntimeError("requests did not finish")
    for o in out:
        o["text"] = "".join(o["text"])
    return out, time.monotonic() - t0


def judge(text: str, reason: str | None, schema: dict | None) -> bool:
    """Finished on its own, and JSON valid for the full schema (any object without one)."""
    if reason != "stop":
        return False
    try:
        value = json.loads(text)
    except ValueError:
        return False
    if schema is None:
        return isinstance(value, dict)
    return jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)(schema).is_valid(value)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m", help="smollm2-135m (default) or tiny-gpt2")
    ap.add_argument("--max-tokens", type=int, default=256, help="tokens per answer at most (default 256)")
    ap.add_argument("--modes", default=",".join(MODES), help=f"whitespace modes, comma-separated (default {','.join(MODES)})")
    ap.add_argument("--limit", type=int, default=0, help="the first N requests only (0: all)")
    add_out_arg(ap, "bench_json_whitespace")
    args = ap.parse_args()
    modes = args.modes.split(",")
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        ap.error(f"--modes: unknown {unknown}; known: {', '.join(MODES)}")
    cases = SCHEMAS[:args.limit] if args.limit else SCHEMAS
    model, tok, _ = load_model(args.model, progress=lambda *a, **k: None)

    def prompt(question: str) -> list[int]:
        if getattr(tok, "chat_template", None):
            msgs = [{"role": "user", "content": question}]
            return list(tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"])
        return list(tok(question).input_ids)

    prompts = [prompt(q) for _, q, _ in cases]
    max_context = max(len(p) for p in prompts) + args.max_tokens + 16
    summary, answers = [], []
    for mode in modes:
        def guide(schema: dict | None) -> GuidedDecoding:
            kind, spec = ("json_object", "") if schema is None else ("json_schema", json.dumps(schema))
            return GuidedDecoding(kind, spec, compact=mode == "compact")

        params = [SamplingParams(max_tokens=args.max_tokens, temperature=0, guided=guide(s)) for _, _, s in cases]
        saved = dict(guided.JSON_WHITESPACE_OPTIONS), guided.JSON_WHITESPACE_DEFAULT
        if mode == "unbounded":
            guided.JSON_WHITESPACE_OPTIONS["unbounded"], guided.JSON_WHITESPACE_DEFAULT = UNBOUNDED, "unbounded"
        elif mode == "flexible":
            guided.JSON_WHITESPACE_DEFAULT = "flexible"
        engine = make_engine(model, tok, len(prompts), max_context)  # a compiler of its own: this mode's grammars
        engine.start()
        try:
            run_all(engine, prompts[:1], params[:1])  # warm-up: kernels, the tokenizer's vocabulary for the guides
            results, wall = run_all(engine, prompts, params)
        finally:
            engine.shutdown()
            guided.JSON_WHITESPACE_OPTIONS.clear()
            guided.JSON_WHITESPACE_OPTIONS.update(saved[0])
            guided.JSON_WHITESPACE_DEFAULT = saved[1]
        for (name, _, schema), r in zip(cases, results):
            runs = WHITESPACE_RUN.findall(r["text"])
            answers.append({"mode": mode, "schema": name, "finish_reason": r["finish_reason"],
                            "finished_valid": judge(r["text"], r["finish_reason"], schema), "tokens": r["tokens"],
                            "longest_whitespace": max((len(w) for w in runs), default=0), "error": r["error"] or "",
                            "text": r["text"]})
        rows = [a for a in answers if a["mode"] == mode]
        valid = [a for a in rows if a["finished_valid"]]
        summary.append({
            "mode": mode, "requests": len(rows), "finished_valid": len(valid),
            "finished_valid_per_request": len(valid) / len(rows),
            "length": sum(a["finish_reason"] == "length" for a in rows),
            "failed": sum(a["finish_reason"] == "error" for a in rows),
            "tokens_per_answer": statistics.mean(a["tokens"] for a in rows),
            "tokens_per_valid_answer": statistics.mean(a["tokens"] for a in valid) if valid else 0.0,
            "longest_whitespace": max(a["longest_whitespace"] for a in rows), "wall_s": wall})
        print(f"{mode}: {len(valid)}/{len(rows)} finished and valid ({wall:.0f} s)", flush=True)
    print(f"CPU: {describe_cpu()}")
    print(f"{args.model}, in-process engine, greedy, up to {args.max_tokens} tokens per answer, "
          f"{len(cases)} requests per mode")
    print(table(summary, ["mode", "requests", "finished_valid", "finished_valid_per_request", "length", "failed",
                          "tokens_per_answer", "tokens_per_valid_answer", "longest_whitespace", "wall_s"]))
    by_schema = {}
    for a in answers:
        by_schema.setdefault(a["schema"], {})[a["mode"]] = ("ok" if a["finished_valid"] else a["finish_reason"])
    print(table([{"schema": k, **v} for k, v in by_schema.items()], ["schema", *modes]))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "summary.csv", summary)
    write_csv(out / "answers.csv", answers)
    print(f"wrote {out / 'summary.csv'} and {out / 'answers.csv'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
