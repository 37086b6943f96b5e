"""Benchmark: prefix caching, on vs off, side by side in one run (in-process engine).

SmolLM2-135M (real weights). Workload "shared": 32 requests arrive at once, each a chat
with the same ~400-token system prompt and its own question; one earlier request with
that system prompt warmed the cache (the steady state of a deployment, where every
request carries it). Workload "distinct": 32 prompts of the same length sharing nothing
(what caching costs when it cannot help). Greedy outputs must be identical on and off.
Prints TTFT p50/p99, output tok/s and the ratios; writes CSV and PNG to
results/bench_prefix/.

    .venv/bin/python perf/bench_prefix.py [--requests 32] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

from tritonlm.engine.engine import Engine
from tritonlm.engine.kv_cache import KVCacheManager
from tritonlm.engine.request import GenerationRequest, SamplingParams
from tritonlm.engine.runners.torch_runner import TorchRunner
from tritonlm.engine.scheduler import SchedulerConfig
from tritonlm.models.loading import load_model
from tritonlm.perf.machine import describe_cpu
from tritonlm.perf.report import add_out_arg, plot_xy, table, write_csv
from tritonlm.perf.stats import percentile

SYSTEM = (
    "You are the support assistant of a company that runs language models for its customers. "
    "Answer briefly and precisely. Never invent product names, prices or dates. When a question is "
    "about billing, point to the billing page; when it is about an outage, point to the status page. "
    "Keep a friendly tone, use plain words, and prefer short lists over long paragraphs. "
) * 5
QUESTIONS = [
    "How do I reset my password?", "Why was I charged twice?", "Is the API down right now?",
    "Can I export my data?", "What models do you serve?", "How fast is the streaming API?",
    "Where do I find my invoices?", "Can I raise my rate limit?",
]


def run(model, tok, prompts: list[list[int]], warm: list[int] | None, caching: bool, max_tokens: int) -> dict:
    runner = TorchRunner(model)
    longest = max(len(p) for p in prompts) + max_tokens
    budget = (len(prompts) + 2) * (longest + 16) * runner.spec.bytes_per_token
    cache = KVCacheManager(runner.spec, budget, 16, allocate_kv=runner.allocate_kv, prefix_caching=caching)
    engine = Engine(runner, tok, cache, SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=512), max_context=2048)
    engine.start()
    try:
        if warm is not None:  # an earlier request with the shared prefix
            done = threading.Event()
            engine.submit(GenerationRequest(warm, SamplingParams(max_tokens=1, end_id=-1), lambda e: e.finished and done.set()))
            done.wait(120)
        first: dict[int, float] = {}
        tokens: dict[int, list[int]] = {}
        finished = threading.Event()
        lock = threading.Lock()
        t0 = time.monotonic()
        reqs = [GenerationRequest(p, SamplingParams(max_tokens=max_tokens, end_id=-1), None) for p in prompts]

        def on_event(ev):
            with lock:
                if ev.token_ids and ev.request_id not in first:
                    first[ev.request_id] = time.monotonic()
                tokens.setdefault(ev.request_id, []).extend(ev.token_ids)
                if ev.finished and sum(1 for r in reqs if len(tokens.get(r.request_id, [])) >= max_tokens) == len(reqs):
                    finished.set()

        for r in reqs:
            r.on_event = on_event
            r.arrival = t0
            engine.submit(r)
        finished.wait(600)
        wall = time.monotonic() - t0
    finally:
        engine.shutdown()
    ttft = [first[r.request_id] - t0 for r in reqs]
    return {
        "caching": "on" if caching else "off",
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "output_tok_s": len(reqs) * max_tokens / wall,
        "wall_s": wall,
        "cached_tokens": cache.hit_tokens,
        "outputs": [tokens[r.request_id] for r in reqs],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=32, help="requests arriving at once, per workload (default 32)")
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens each request generates (default 32)")
    add_out_arg(ap, "bench_prefix")
    args = ap.parse_args()
    model, tok, _ = load_model("smollm2-135m", progress=lambda *a, **k: None)

    def chat(system: str, question: str) -> list[int]:
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        return list(tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"])

    shared = [chat(SYSTEM, f"{QUESTIONS[i % len(QUESTIONS)]} (ticket {i})") for i in range(args.requests)]
    warm = chat(SYSTEM, "Hello")
    # distinct: the same lengths, every prompt its own (the system prompt's words shuffled per request)
    words = SYSTEM.split()
    distinct = []
    for i in range(args.requests):
        rot = words[i * 7 % len(words):] + words[: i * 7 % len(words)]
        distinct.append(chat(f"[{i}] " + " ".join(rot), QUESTIONS[i % len(QUESTIONS)]))

    print(f"CPU: {describe_cpu()}")
    print(f"SmolLM2-135M, {args.requests} requests at once, {args.max_tokens} tokens each, greedy; "
          f"shared prefix {len(warm) - 4} tokens")
    rows = []
    for workload, prompts, warm_ids in (("shared", shared, warm), ("distinct", distinct, None)):
        results = {on: run(model, tok, prompts, warm_ids, on, args.max_tokens) for on in (False, True)}
        same = results[True]["outputs"] == results[False]["outputs"]
        for on in (False, True):
            r = results[on]
            rows.append({"workload": workload, **{k: v for k, v in r.items() if k != "outputs"}, "same_output": same})
    print(table(rows, ["workload", "caching", "ttft_p50_s", "ttft_p99_s", "output_tok_s", "wall_s", "cached_tokens", "same_output"]))
    s_off, s_on, d_off, d_on = rows
    print(f"shared prefix:  TTFT p50 {s_off['ttft_p50_s'] / s_on['ttft_p50_s']:.1f}x lower with caching, "
          f"throughput {s_on['output_tok_s'] / s_off['output_tok_s']:.2f}x")
    print(f"no shared prefix: throughput with caching {d_on['output_tok_s'] / d_off['output_tok_s']:.3f}x of off")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "bench_prefix.csv", rows)
    plot_xy(out / "bench_prefix.png", "caching (0 off, 1 on)", "TTFT p50 (s)", {
        w: ([0, 1], [r["ttft_p50_s"] for r in rows if r["workload"] == w]) for w in ("shared", "distinct")
    }, title=f"prefix caching, SmolLM2-135M, {args.requests} requests")
    print(f"wrote {out / 'bench_prefix.csv'} and bench_prefix.png")
    return 0 if all(r["same_output"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
