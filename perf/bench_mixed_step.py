"""Benchmark: a step that runs a new prompt's chunk beside decoding rows, with the chunk in a
pass of its own (apart) and as one-token rows in the decoding rows' pass (together).

The in-process Engine (tritonlm/engine/engine.py) over a built-in model (SmolLM2-135M by
default, float32, the CPU's TorchRunner), stepped on this thread. For each (rows, chunk):
`rows` requests are decoding (64-token prompts, answers long enough to outlast the
measurement), their decode steps are timed, then a request with a `chunk`-token prompt
arrives and the step that runs its whole prompt beside the decodes is timed. The executor's
chunk_rows decides the mode (ModelExecutor._run_beside_decodes): 0 runs the chunk apart,
a number at least the chunk runs it together. The two modes alternate within each
repetition, so a noisy host weighs on both alike; medians over --reps.

Columns: decode_ms (a decode step of the rows alone), apart_ms and together_ms (the mixed
step), what the chunk added to the decode step in each mode, and together / apart. The
runner's own chunk_rows (the largest chunk it runs together) is printed with the CPU.

    .venv/bin/python perf/bench_mixed_step.py [--model smollm2-135m] [--rows 1,4,16]
        [--chunks 8,16,32,64,128,256] [--reps 5] [--out DIR]

Writes bench_mixed_step.csv and bench_mixed_step.png (what the chunk added, per mode) under
results/bench_mixed_step/ (or --out).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

from tritonlm.engine.loader import build_engine
from tritonlm.engine.model_shape import ModelShape
from tritonlm.engine.request import GenerationRequest, SamplingParams
from tritonlm.engine.settings import EngineSettings
from tritonlm.perf.machine import describe_cpu
from tritonlm.perf.report import add_out_arg, optional_figure, save_figure, style_axes, table, write_csv
from tritonlm_bench.benchrepo import save_weights_once

NAME = "bench_mixed_step"
PROMPT = 64  # the decoding rows' prompts
DECODE_STEPS = 3  # decode steps timed before the chunk arrives (the median kept)


def parse_ints(text: str, flag: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"{flag}: comma-separated positive integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise SystemExit(f"{flag}: comma-separated positive integers, got {text!r}")
    return values


def mixed_step(engine, rows: int, chunk: int, rng: random.Random, vocab: int) -> tuple[float, float]:
    """(a decode step of `rows` rows, the step that runs a `chunk`-token prompt beside them),
    seconds; every request is cancelled and the engine idle afterwards."""
    def request(prompt: int, answer: int) -> GenerationRequest:
        ids = [rng.randrange(100, vocab) for _ in range(prompt)]
        return GenerationRequest(ids, SamplingParams(max_tokens=answer, end_id=-1), lambda event: None)

    running = [request(PROMPT, 64) for _ in range(rows)]
    for r in running:
        engine.submit(r, admission=False)
    def decoding() -> bool:  # every one submitted is running past its prompt (they reach the scheduler at a step)
        running = engine.scheduler.running
        return len(running) >= rows and not any(s.in_prefill for s in running)

    for _ in range(rows * (PROMPT + 2)):  # far more steps than their prompts take
        if decoding():
            break
        engine.step()
    else:
        raise RuntimeError(f"{rows} rows did not all start decoding (max_num_seqs, or the KV cache, too small?)")
    decode = []
    for _ in range(DECODE_STEPS):
        t0 = time.perf_counter()
        engine.step()
        decode.append(time.perf_counter() - t0)
    arrival = request(chunk, 2)
    engine.submit(arrival, admission=False)
    t0 = time.perf_counter()
    engine.step()
    mixed = time.perf_counter() - t0
    for r in running + [arrival]:
        engine.cancel(r.request_id)
    while engine.has_work():
        engine.step()
    return statistics.median(decode), mixed


def draw(path: Path, rows: list[dict], title: str) -> Path | None:
    made = optional_figure(1, 1, figsize=(8, 4.5))
    if not made:
        return None
    fig, ax = made
    for n in sorted({r["rows"] for r in rows}):
        mine = [r for r in rows if r["rows"] == n]
        chunks = [r["chunk"] for r in mine]
        ax.plot(chunks, [r["apart_added_ms"] for r in mine], marker="o", ms=3, linestyle="--", label=f"{n} rows: apart")
        ax.plot(chunks, [r["together_added_ms"] for r in mine], marker="o", ms=3, label=f"{n} rows: together")
    ax.set_xscale("log", base=2)
    style_axes(ax, "prompt tokens in the step", "ms the chunk adds to the decode step", title)
    return save_figure(fig, path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m", help="a built-in model (default smollm2-135m; tiny-gpt2 for a smoke run)")
    ap.add_argument("--rows", default="1,4,16", help="decoding rows beside the chunk (default 1,4,16)")
    ap.add_argument("--chunks", default="8,16,32,64,128,256", help="the arriving prompt's tokens (default 8,...,256)")
    ap.add_argument("--reps", type=int, default=5, help="repetitions of each point (default 5)")
    ap.add_argument("--seed", type=int, default=0)
    add_out_arg(ap, NAME)
    args = ap.parse_args()
    row_counts, chunks = parse_ints(args.rows, "--rows"), parse_ints(args.chunks, "--chunks")
    if args.reps < 1:
        raise SystemExit(f"--reps: at least 1, got {args.reps}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from tritonlm.models.loading import load_model

    model, tok, _ = load_model(args.model, progress=lambda *a, **k: None)
    weights = save_weights_once(model, tok, out / "weights" / args.model)
    context = PROMPT + max(chunks) + 128
    # room for every row and the arriving prompt at full context: none waits for the cache
    kv_bytes = (max(row_counts) + 2) * context * ModelShape.from_hf_config(model.config).bytes_per_token
    settings = EngineSettings.from_params({"hf_dir": weights.name, "max_context": str(context), "kv_cache_bytes": str(kv_bytes),
                                           "max_num_batched_tokens": str(max(512, max(row_counts) + max(chunks))),
                                           "enable_prefix_caching": "false"}, weights.parent)
    engine = build_engine(settings)
    executor, vocab = engine.executor, min(model.config.vocab_size, len(tok))
    own = executor.chunk_rows
    cpu = describe_cpu()
    print(f"CPU: {cpu}\nthe runner's chunk_rows: {own}", flush=True)
    rng = random.Random(args.seed)
    engine.compute.call(mixed_step, engine, 1, 8, rng, vocab)  # the first steps after load run cold
    results = []
    for n in row_counts:
        for chunk in chunks:
            times = {"apart": [], "together": [], "decode": []}
            for _ in range(args.reps):
                for mode, chunk_rows in (("apart", 0), ("together", max(chunk, own))):
                    executor.chunk_rows = chunk_rows
                    decode_s, mixed_s = engine.compute.call(mixed_step, engine, n, chunk, rng, vocab)
                    times[mode].append(mixed_s)
                    times["decode"].append(decode_s)
            decode, apart, together = (statistics.median(times[k]) * 1e3 for k in ("decode", "apart", "together"))
            row = {"rows": n, "chunk": chunk, "decode_ms": round(decode, 2), "apart_ms": round(apart, 2),
                   "together_ms": round(together, 2), "apart_added_ms": round(apart - decode, 2),
                   "together_added_ms": round(together - decode, 2), "together_vs_apart": round(together / apart, 2)}
            results.append(row)
            print(f"{n} rows, {chunk} prompt tokens: decode {decode:.1f} ms, apart {apart:.1f} ms, together "
                  f"{together:.1f} ms", flush=True)
    executor.chunk_rows = own
    engine.shutdown("the benchmark is done")
    title = f"{args.model}, the step that runs a prompt beside decoding rows (CPU: {cpu})"
    print()
    print(table(results, title=title))
    print(f"wrote {write_csv(out / f'{NAME}.csv', [{**r, 'cpu': cpu, 'runner_chunk_rows': own} for r in results])}")
    png = draw(out / f"{NAME}.png", results, f"{args.model}: apart vs together")
    if png:
        print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
