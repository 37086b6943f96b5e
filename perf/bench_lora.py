"""Benchmark: multi-LoRA serving on the CPU, SmolLM2-135M in float32 (real weights).

The in-process Engine (tritonlm/engine/engine.py) on a TorchRunner with adapters attached
(lora.apply.attach_lora) runs --streams greedy requests at once (an end id that never fires, so
each makes exactly --tokens tokens), stepped on this thread. The adapters are random PEFT
adapters (init_lora_weights=False, made by PEFT itself and saved as it saves them) of rank 8 on
--targets, and one of rank 64 on the same targets. Cases, each in the same run:

    base          every stream on the base model
    mixed N       the streams spread over N distinct rank-8 adapters (stream i: adapter i % N);
                  N > streams: the streams take the first `streams` of them, the others stay loaded
    mixed 16, rank-64 beside   mixed 16 with one stream under the rank-64 adapter instead
    16 one at a time   the mixed-16 requests with max_loras=1: the scheduler runs one adapter's
                  requests at a time (what one-adapter-per-batch serving, llama.cpp's, does)

Per case, after a warm-up round, --repeat rounds going round the cases (a neighbour's burst
on a shared host then touches each case alike): decode tok/s (the median over every timed
decode-only step of its rows over its wall time, the step loop's whole cost: scheduling, the
forward pass, sampling, events; a median, so bursts of other work on the host weigh little),
the rounds' mean decode rates, and end-to-end tok/s (every token over the round's wall time,
prefill included, the best round). "vs base" is decode tok/s over base's; "16 one at a time"
is compared with mixed 16 end to end (its decode steps hold 2 rows, not 32). stack_steps:
steps whose adapter rows ran inside the C++ decoder stack.

First, the decode step alone (runner.forward of one token for each row, --context tokens
cached, from block tables as the engine's steps come), each case's step in turn, --step-reps
times, the median of wall and of CPU time (every thread of the process; with --threads 1 a
step's CPU time leaves out the time it was preempted): the least noisy figures on a shared
host. "16 one at a time" is there a 2-row step of one adapter (32 streams over 16 adapters,
one adapter's rows per step).

    .venv/bin/python perf/bench_lora.py [--streams 32] [--tokens 32] [--adapters 1,4,16,64]
        [--targets q_proj,v_proj] [--repeat 3] [--context 128] [--step-reps 20]
        [--steps-only] [--decode native|python] [--out DIR]

Prints the host and tables; writes bench_lora.csv and bench_lora_steps.csv under
results/bench_lora/ (or --out).
"""

from __future__ import annotations

import argparse
import copy
import gc
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from tritonlm.engine.batch import StepBatch
from tritonlm.engine.engine import Engine
from tritonlm.engine.kv_cache import KVCacheManager
from tritonlm.engine.lora import attach_lora, load_adapter
from tritonlm.engine.request import GenerationEvent, GenerationRequest, SamplingParams
from tritonlm.engine.runners.torch_runner import TorchRunner
from tritonlm.engine.scheduler import SchedulerConfig
from tritonlm.models.loading import load_model
from tritonlm.perf.machine import describe_cpu
from tritonlm.perf.report import add_out_arg, table, write_csv
from bench_engine_overhead import set_server_threads  # perf/ is the script's own folder on sys.path

NAME = "bench_lora"
BLOCK_SIZE = 16
PROMPT_LEN = 8
RANK = 8
BIG_RANK = 64
GOAL_VS_BASE = 0.85
STEP_COLUMNS = ["case", "rows", "distinct", "step_ms", "tok_s", "vs_base", "cpu_ms", "tok_per_cpu_s", "cpu_vs_base"]


def make_adapters(model, folder: Path, count: int, targets: list[str]) -> list[Path]:
    """count random rank-8 PEFT adapters and one rank-64 adapter (the last) of `model` (a copy
    is adapted), saved by PEFT's save_pretrained; returns their folders."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    configs = [LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=targets, init_lora_weights=False)] * count
    configs.append(LoraConfig(r=BIG_RANK, lora_alpha=BIG_RANK, target_modules=targets, init_lora_weights=False))
    names = [f"a{i}" for i in range(count)] + ["big"]
    peft_model = get_peft_model(copy.deepcopy(model), configs[0], adapter_name=names[0])
    for name, config in zip(names[1:], configs[1:]):
        peft_model.add_adapter(name, config)
    with torch.no_grad():  # small updates, so the text stays the model's kind of text
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.mul_(0.01)
    peft_model.save_pretrained(str(folder), selected_adapters=names)
    return [folder / name for name in names]  # PEFT saves an adapter not named "default" in folder/<name>


def build_engine(runner: TorchRunner, tok: Any, streams: int, tokens: int, max_loras: int) -> Engine:
    blocks = streams * -(-(PROMPT_LEN + tokens) // BLOCK_SIZE) + 2  # + the scratch block, + one spare
    cache = KVCacheManager(runner.spec, blocks * BLOCK_SIZE * runner.spec.bytes_per_token, BLOCK_SIZE,
                           allocate_kv=runner.allocate_kv)
    config = SchedulerConfig(max_num_seqs=streams, max_num_batched_tokens=max(512, streams * PROMPT_LEN),
                             max_queue_size=max(1024, streams), max_loras=max_loras)
    return Engine(runner, tok, cache, config, max_context=PROMPT_LEN + tokens + BLOCK_SIZE)


class StepClock:
    """Wall time of the engine's steps, split into decode-only steps and the rest, and how
    many forward passes ran adapter rows inside the C++ decode step."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.decode_s = 0.0
        self.decode_tokens = 0
        self.decode_rates: list[float] = []  # rows / seconds of each decode-only step
        self._width = 0
        self._rows = 0
        self._forward = engine.runner.forward

        def forward(batch, pool):
            self._width = max(self._width, batch.width)
            self._rows += batch.batch_size
            return self._forward(batch, pool)

        engine.runner.forward = forward

    def step(self) -> None:
        self._width, self._rows = 0, 0
        t0 = time.perf_counter()
        self.engine.step()
        dt = time.perf_counter() - t0
        if self._width == 1:
            self.decode_s += dt
            self.decode_tokens += self._rows
            self.decode_rates.append(self._rows / dt)

    def close(self) -> None:
        del self.engine.runner.__dict__["forward"]


def run_round(engine: Engine, adapters: list, tokens: int) -> dict[str, Any]:
    """One request per entry of `adapters` (None: the base), all submitted at once, stepped to the end."""
    counts = [0] * len(adapters)

    def sink(i: int):
        def on_event(ev: GenerationEvent) -> None:
            counts[i] += len(ev.token_ids)
        return on_event

    params = SamplingParams(max_tokens=tokens, end_id=-1)
    for i, adapter in enumerate(adapters):
        prompt = [100 + (7 * i) % 900 + j for j in range(PROMPT_LEN)]  # rows differ
        engine.submit(GenerationRequest(prompt, params, sink(i), lora=adapter))
    gc.collect()
    clock = StepClock(engine)
    state = engine.runner.transformer.lora
    fast0 = getattr(state, "stack_steps", 0)  # 0 where the adapters never ran in the stack
    t0 = time.perf_counter()
    try:
        while engine.has_work() or engine._inbox:
            clock.step()
    finally:
        clock.close()
    wall = time.perf_counter() - t0
    if any(c != tokens for c in counts):
        raise SystemExit(f"expected {tokens} tokens per request, got {sorted(set(counts))}")
    fast = getattr(state, "stack_steps", 0) - fast0
    return {"decode_tok_s": clock.decode_tokens / clock.decode_s, "e2e_tok_s": sum(counts) / wall,
            "rates": clock.decode_rates,
            "decode_steps_s": clock.decode_s, "stack_steps": fast}


def step_times(runner: TorchRunner, cases: list[tuple[str, list]], context: int,
               reps: int) -> dict[str, tuple[float, float]]:
    """Median wall and CPU ms (every thread of this process) of one decode step (one token for each case's rows, context - 1 tokens cached,
    from block tables as the engine's steps come) per case; the cases alternate step by step,
    so load from other processes falls on each of them alike."""
    rows = max(len(adapters) for _, adapters in cases)
    cache = KVCacheManager(runner.spec, (rows * (context // BLOCK_SIZE + 2) + 1) * BLOCK_SIZE * runner.spec.bytes_per_token,
                           BLOCK_SIZE, allocate_kv=runner.allocate_kv)
    for b in range(rows):
        cache.allocate(b, context)
    batches = []
    for _, adapters in cases:
        n = len(adapters)
        batch = StepBatch.from_block_table([[7]] * n, [context - 1] * n, cache.device_table.gather(list(range(n))),
                                           BLOCK_SIZE, False)
        batch.adapters = adapters
        batches.append(batch)
    times: list[list[float]] = [[] for _ in cases]
    cpu: list[list[float]] = [[] for _ in cases]
    for rep in range(reps + 1):  # rep 0: warm-up
        for i, batch in enumerate(batches):
            t0, c0 = time.perf_counter(), time.process_time()
            runner.forward(batch, cache.pool)
            if rep:
                times[i].append(time.perf_counter() - t0)
                cpu[i].append(time.process_time() - c0)
    return {label: (1000 * statistics.median(t), 1000 * statistics.median(c))
            for (label, _), t, c in zip(cases, times, cpu)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_out_arg(ap, NAME)
    ap.add_argument("--streams", type=int, default=32, help="concurrent requests")
    ap.add_argument("--tokens", type=int, default=32, help="tokens each request generates")
    ap.add_argument("--adapters", default="1,4,16,64", help="distinct rank-8 adapters of the mixed cases")
    ap.add_argument("--targets", default="q_proj,v_proj", help="the adapters' PEFT target_modules")
    ap.add_argument("--repeat", type=int, default=3, help="timed rounds per case (the best is kept)")
    ap.add_argument("--context", type=int, default=128, help="tokens cached per row in the step-time table")
    ap.add_argument("--step-reps", type=int, default=20, help="timed steps per case in the step-time table")
    ap.add_argument("--steps-only", action="store_true", help="the step-time table alone, no engine rounds")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: the server's default)")
    ap.add_argument("--decode", choices=("native", "python"), default="native",
                    help="decode steps in one C++ call (Transformer.decode_step), or the Python path")
    args = ap.parse_args()
    counts = [int(x) for x in args.adapters.split(",") if x.strip()]
    if 16 not in counts:  # the rank-64 and one-at-a-time cases compare with mixed 16
        counts.append(16)
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    streams = args.streams

    threads, why = set_server_threads(args.threads or None)
    print(f"host: {describe_cpu()}")
    print(f"torch threads: {threads} ({why}); torch {torch.__version__}", flush=True)
    model, tok, _ = load_model("smollm2-135m", progress=lambda *a, **k: None)
    runner = TorchRunner(model)
    runner.lean_decode = args.decode == "native"
    state = attach_lora(runner.transformer)
    with tempfile.TemporaryDirectory() as tmp:
        folders = make_adapters(model, Path(tmp), max(counts + [16]), targets)
        loaded = [load_adapter(f, runner.transformer, name=f"a{i}", max_rank=BIG_RANK) for i, f in enumerate(folders)]
    rank8, big = loaded[:-1], loaded[-1]
    del model
    gc.collect()

    cases: list[tuple[str, list, int]] = [("base", [None] * streams, 0)]
    for n in counts:
        cases.append((f"mixed {n}", [rank8[i % n] for i in range(streams)], 0))
    mixed16 = [rank8[i % 16] for i in range(streams)]
    cases.append(("mixed 16, rank-64 beside", mixed16[:-1] + [big], 0))
    cases.append(("16 one at a time", sorted(mixed16, key=lambda a: a.name), 1))

    # the decode step alone, the cases alternating step by step (one at a time: 2 rows of one adapter)
    step_cases = [(label, adapters) for label, adapters, max_loras in cases if not max_loras]
    step_cases.append(("16 one at a time", [rank8[0]] * (streams // 16)))
    step_ms = step_times(runner, step_cases, args.context, args.step_reps)
    steps: list[dict[str, Any]] = []
    for label, adapters in step_cases:
        wall, cpu = step_ms[label]
        steps.append({"case": label, "rows": len(adapters), "distinct": len({id(a) for a in adapters if a is not None}),
                      "step_ms": wall, "tok_s": 1000 * len(adapters) / wall, "cpu_ms": cpu,
                      "tok_per_cpu_s": 1000 * len(adapters) / cpu})
    for r in steps:
        r["vs_base"] = r["tok_s"] / steps[0]["tok_s"]
        r["cpu_vs_base"] = r["tok_per_cpu_s"] / steps[0]["tok_per_cpu_s"]
        print(f"step {r['case']:>26}: {r['step_ms']:.1f} ms, {r['tok_s']:.1f} tok/s, {r['vs_base']:.3f} x base; "
              f"CPU {r['cpu_ms']:.1f} ms, {r['cpu_vs_base']:.3f} x base", flush=True)

    if args.steps_only:
        print(table(steps, STEP_COLUMNS))
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        for r in steps:
            r.update(streams=streams, context=args.context, targets=",".join(targets), host=describe_cpu())
        print(f"wrote {write_csv(out / f'{NAME}_steps.csv', steps)}")
        return 0

    # every case's engine side by side; rounds go round the cases (a neighbour's burst on a
    # shared host then touches each case alike), and each case keeps its best round
    engines = [build_engine(runner, tok, streams, args.tokens, max_loras) for _, _, max_loras in cases]
    rounds: list[list[dict[str, float]]] = [[] for _ in cases]
    for rep in range(args.repeat + 1):  # round 0: warm-up
        for i, (label, adapters, _) in enumerate(cases):
            got = run_round(engines[i], adapters, args.tokens)
            if rep:
                rounds[i].append(got)
            print(f"round {rep} {label:>26}: decode {got['decode_tok_s']:.1f} tok/s, end to end {got['e2e_tok_s']:.1f}",
                  flush=True)
    results: list[dict[str, Any]] = []
    for (label, adapters, _), got in zip(cases, rounds):
        rates = sorted(rate for r in got for rate in r["rates"])
        results.append({"case": label, "distinct": len({id(a) for a in adapters if a is not None}),
                        "decode_tok_s": rates[len(rates) // 2], "e2e_tok_s": max(r["e2e_tok_s"] for r in got),
                        "runs_decode_tok_s": " / ".join(f"{r['decode_tok_s']:.0f}" for r in got),
                        "stack_steps": sum(r["stack_steps"] for r in got)})
    del engines
    del state

    base = results[0]["decode_tok_s"]
    by_case = {r["case"]: r for r in results}
    for r in results:
        r["vs_base"] = r["decode_tok_s"] / base
    serial, mixed = by_case["16 one at a time"], by_case["mixed 16"]
    serial["vs_base"] = float("nan")  # its decode steps hold 2 rows: compared end to end below
    speedup = mixed["e2e_tok_s"] / serial["e2e_tok_s"]
    beside = by_case["mixed 16, rank-64 beside"]["decode_tok_s"] / mixed["decode_tok_s"]
    print()
    print(f"SmolLM2-135M float32, {streams} streams, prompt {PROMPT_LEN} tokens, {args.tokens} tokens each, greedy; "
          f"adapters rank {RANK} on {','.join(targets)} (one of rank {BIG_RANK}); decode steps {args.decode}")
    print(table(results, ["case", "distinct", "decode_tok_s", "vs_base", "e2e_tok_s", "runs_decode_tok_s",
                          "stack_steps"]))
    worst = min(by_case[f"mixed {n}"]["vs_base"] for n in counts)
    print(f"mixed batches vs base (decode): worst {worst:.3f} (goal >= {GOAL_VS_BASE}: "
          f"{'met' if worst >= GOAL_VS_BASE else 'NOT met'})")
    print(f"rank-64 adapter beside 16 rank-8 adapters: {beside:.3f}x the rank-8 batch's decode tok/s")
    print(f"mixed 16 vs one adapter at a time (end to end): {speedup:.2f}x")
    print()
    print(f"decode step alone, context {args.context}, median of {args.step_reps} steps per case, the cases alternating:")
    print(table(steps, STEP_COLUMNS))
    by_step = {r["case"]: r for r in steps}
    worst = min(by_step[f"mixed {n}"]["vs_base"] for n in counts)
    print(f"mixed batches vs base (step): worst {worst:.3f} (goal >= {GOAL_VS_BASE}: "
          f"{'met' if worst >= GOAL_VS_BASE else 'NOT met'}); rank-64 beside: "
          f"{by_step['mixed 16, rank-64 beside']['tok_s'] / by_step['mixed 16']['tok_s']:.3f}x mixed 16; "
          f"mixed 16 vs one at a time: {by_step['mixed 16']['tok_s'] / by_step['16 one at a time']['tok_s']:.2f}x")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for r in results:
        r.update(streams=streams, tokens=args.tokens, targets=",".join(targets), decode=args.decode,
                 host=describe_cpu())
    for r in steps:
        r.update(streams=streams, context=args.context, targets=",".join(targets), decode=args.decode,
                 host=describe_cpu())
    print(f"wrote {write_csv(out / f'{NAME}.csv', results)} and {write_csv(out / f'{NAME}_steps.csv', steps)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
