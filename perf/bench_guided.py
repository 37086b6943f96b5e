"""Benchmark: guided decoding (a JSON schema) against unconstrained generation, side by side
in one run (in-process engine, no server).

SmolLM2-135M-Instruct (real weights, from the package cache; `--model tiny-gpt2` for the
seeded tiny model). For 1, 8 and 32 streams arriving at once: the same chat prompts
(asking for an inventory as JSON), greedy, once unconstrained and once under a JSON schema
(an object holding an array of items), alternating per round so both see the same
machine. Unconstrained requests ignore EOS (plain greedy); the schema asks for more items
than fit, so guided answers run to max_tokens too: both modes make the same tokens. The
guide's own time (masks filled and applied) is timed inside the sampler and shown as ms per
decode step. TTFT at 1 stream: a schema
the engine has not seen (compiled at submit), the same schema again (from the cache),
and no schema.

    .venv/bin/python perf/bench_guided.py [--streams 1,8,32] [--max-tokens 64] [--rounds 2]

Prints the table and the ratios with the CPU; writes results/bench_guided/bench_guided.csv.
Goal: guided tok/s at 32 streams >= 0.8x unconstrained.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

from tritonlm.engine.engine import Engine
from tritonlm.engine.kv_cache import KVCacheManager
from tritonlm.engine.request import GenerationRequest, GuidedDecoding, SamplingParams
from tritonlm.engine.runners.torch_runner import TorchRunner
from tritonlm.engine.scheduler import SchedulerConfig
from tritonlm.models.loading import load_model
from tritonlm.perf.machine import describe_cpu
from tritonlm.perf.report import add_out_arg, table, write_csv

ITEM = {"type": "object", "properties": {"name": {"type": "string"}, "quantity": {"type": "integer"},
                                         "aisle": {"type": "string"}}, "required": ["name", "quantity", "aisle"]}
# at least 12 items: longer than --max-tokens, so a guided answer runs to max_tokens like an
# unconstrained one and both modes make the same tokens
SCHEMA = {"type": "object", "properties": {"store": {"type": "string"},
                                           "items": {"type": "array", "items": ITEM, "minItems": 12}},
          "required": ["store", "items"]}
PRODUCTS = ["apples", "rice", "soap", "coffee", "paper", "milk", "bread", "tea"]


class GuideTimer:
    """Seconds spent in the sampler's guide work (sampler.guide_masks: sync + fill; guided.apply_masks)
    and in the whole of each step's token choice (ModelExecutor.sample)."""

    def __init__(self, engine: Engine):
        import tritonlm.engine.sampler as sampler

        self.seconds = 0.0
        self.sample_seconds = 0.0
        sampler.guide_masks, sampler.apply_masks = self._timed(sampler.guide_masks), self._timed(sampler.apply_masks)
        self.output_seconds = 0.0
        engine.executor.sample = self._timed(engine.executor.sample, "sample_seconds")
        engine.output.process = self._timed(engine.output.process, "output_seconds")

    def _timed(self, fn, counter: str = "seconds"):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                setattr(self, counter, getattr(self, counter) + time.perf_counter() - t0)
        return wrapper


def make_engine(model, tok, streams: int, max_context: int) -> Engine:
    runner = TorchRunner(model)
    budget = (streams + 2) * (max_context + 16) * runner.spec.bytes_per_token
    cache = KVCacheManager(runner.spec, budget, 16, allocate_kv=runner.allocate_kv)
    return Engine(runner, tok, cache, SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=512), max_context=max_context)


def generate(engine: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> dict:
    """All requests at once -> wall time, TTFT per request, tokens per request."""
    first: dict[int, float] = {}
    counts: dict[int, int] = {}
    done = threading.Event()
    lock = threading.Lock()
    t0 = time.monotonic()
    reqs = [GenerationRequest(p, sp, None) for p, sp in zip(prompts, params)]
    finished: set[int] = set()

    def on_event(ev):
        with lock:
            if ev.token_ids and ev.request_id not in first:
                first[ev.request_id] = time.monotonic()
            counts[ev.request_id] = counts.get(ev.request_id, 0) + len(ev.token_ids)
            if ev.finished:
                if ev.error:
                    print(f"request failed: {ev.error}", file=sys.stderr)
                finished.add(ev.request_id)
                if len(finished) == len(reqs):
                    done.set()

    for r in reqs:
        r.on_event = on_event
        r.arrival = t0
        engine.submit(r)
    if not done.wait(900):
        raise RuntimeError("requests did not finish")
    wall = time.monotonic() - t0
    return {"wall_s": wall, "ttft": [first[r.request_id] - t0 for r in reqs], "tokens": [counts[r.request_id] for r in reqs]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m", help="smollm2-135m (default) or tiny-gpt2")
    ap.add_argument("--streams", default="1,8,32", help="concurrent streams, comma-separated (default 1,8,32)")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens per request at most (default 64)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of (unconstrained, guided) per stream count (default 2)")
    add_out_arg(ap, "bench_guided")
    args = ap.parse_args()
    model, tok, _ = load_model(args.model, progress=lambda *a, **k: None)

    def prompt(i: int) -> list[int]:
        question = (f"List the {PRODUCTS[i % len(PRODUCTS)]} and other items of store {i} as JSON "
                    "with the store name and each item's name, quantity and aisle.")
        if getattr(tok, "chat_template", None):
            msgs = [{"role": "user", "content": question}]
            return list(tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"])
        return list(tok(question).input_ids)

    guide = GuidedDecoding("json_schema", json.dumps(SCHEMA))
    n_max = args.max_tokens
    streams = [int(s) for s in args.streams.split(",")]
    max_context = max(len(prompt(i)) for i in range(max(streams))) + n_max + 16
    engine = make_engine(model, tok, max(streams), max_context)
    engine.start()
    timer = GuideTimer(engine)
    rows = []
    try:
        def params(guided: bool) -> SamplingParams:
            if not guided:  # plain greedy (its fast path), every request its max_tokens
                return SamplingParams(max_tokens=n_max, end_id=-1)
            return SamplingParams(max_tokens=n_max, guided=guide)

        generate(engine, [prompt(0)], [params(True)])  # warm-up: kernels, the tokenizer's vocabulary for the guides
        for n in streams:
            prompts = [prompt(i) for i in range(n)]
            runs: dict[bool, list[dict]] = {False: [], True: []}
            steps = {False: 0, True: 0}
            sample_s = {False: 0.0, True: 0.0}
            output_s = {False: 0.0, True: 0.0}
            timer.seconds = 0.0
            for r in range(args.rounds):
                for guided in ((False, True) if r % 2 == 0 else (True, False)):
                    before, sample_before, output_before = engine.stats.steps, timer.sample_seconds, timer.output_seconds
                    runs[guided].append(generate(engine, prompts, [params(guided)] * n))
                    steps[guided] += engine.stats.steps - before
                    sample_s[guided] += timer.sample_seconds - sample_before
                    output_s[guided] += timer.output_seconds - output_before
            for guided in (False, True):
                tok_s = [sum(x["tokens"]) / x["wall_s"] for x in runs[guided]]
                rows.append({"streams": n, "mode": "json_schema" if guided else "unconstrained",
                             "output_tok_s": statistics.median(tok_s),
                             "tokens_per_request": statistics.mean(t for x in runs[guided] for t in x["tokens"]),
                             "ttft_p50_s": statistics.median(t for x in runs[guided] for t in x["ttft"]),
                             "step_ms": 1e3 * sum(x["wall_s"] for x in runs[guided]) / steps[guided],
                             "sample_ms_per_step": 1e3 * sample_s[guided] / steps[guided],
                             "output_ms_per_step": 1e3 * output_s[guided] / steps[guided],
                             "guide_ms_per_step": 1e3 * timer.seconds / steps[True] if guided else 0.0})
        # TTFT at 1 stream: a schema never seen (its compile in the submit), then the same again
        ttft = {"new schema": [], "cached schema": [], "no schema": []}
        for r in range(5):
            fresh = GuidedDecoding("json_schema", json.dumps({**SCHEMA, "description": f"round {r} {time.time()}"}))
            for label, g in (("new schema", fresh), ("cached schema", fresh), ("no schema", None)):
                out = generate(engine, [prompt(r)], [SamplingParams(max_tokens=4, guided=g)])
                ttft[label].append(out["ttft"][0])  # from before submit: a new schema's compile included
    finally:
        engine.shutdown()
    print(f"CPU: {describe_cpu()}")
    print(f"{args.model}, in-process engine, greedy, up to {n_max} tokens per request, median of {args.rounds} rounds")
    print(table(rows, ["streams", "mode", "output_tok_s", "tokens_per_request", "ttft_p50_s", "step_ms",
                       "sample_ms_per_step", "guide_ms_per_step", "output_ms_per_step"]))
    ratios = {}
    for n in streams:
        free, guided = (next(r for r in rows if r["streams"] == n and r["mode"] == m) for m in ("unconstrained", "json_schema"))
        ratios[n] = guided["output_tok_s"] / free["output_tok_s"]
        # the same forward passes: what guiding adds is the token choice's extra time per step
        added = guided["sample_ms_per_step"] - free["sample_ms_per_step"]
        print(f"{n:>2} streams: guided tok/s {ratios[n]:.2f}x unconstrained; the token choice adds {added:.1f} ms "
              f"to a {free['step_ms']:.0f} ms step: {free['step_ms'] / (free['step_ms'] + added):.2f}x at equal forward passes")
    ttft_rows = [{"ttft_at_1_stream": label, "median_s": statistics.median(v)} for label, v in ttft.items()]
    print(table(ttft_rows, ["ttft_at_1_stream", "median_s"]))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "bench_guided.csv", rows + [{"streams": 1, "mode": r["ttft_at_1_stream"], "ttft_p50_s": r["median_s"]}
                                                for r in ttft_rows])
    print(f"wrote {out / 'bench_guided.csv'}")
    goal = ratios.get(32)
    if goal is not None:
        print(f"goal (32 streams >= 0.8x): {'met' if goal >= 0.8 else 'NOT met'} ({goal:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
