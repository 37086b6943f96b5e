"""Benchmark: one int8 projection, tritonlm's own kernel (i8_linear, 8-bit activations) per path against fbgemm's.

Int8Linear as a model uses it (weights quantized per output channel, each row's activations
quantized alone), on SmolLM2-135M's projection shapes (seeded random weights) at 1 and 32
rows (one stream's decode step; a batch of 32 or a prefill chunk):
    fbgemm_8bit     torch.ops.tritonlm.int8_linear, fbgemm with 8-bit activations (CPUs with VNNI only)
    fbgemm_7bit     the same with 7-bit activations (reduce_range: what a CPU without VNNI runs)
    tritonlm_<isa>  torch.ops.tritonlm.i8_linear forced to each path this build has (i8_isas())
Median microseconds per call over --rounds alternating rounds (a shared host's speed drifts
over minutes, which runs minutes apart would read as a difference between kernels).

A call repeated back to back finds its weights (0.3-28 MB here) in the caches, which a
model's step, reading every layer's weights in turn, does not. --cold reads a buffer twice
the last-level cache before each timed call, so the weights come from memory, and adds each
kernel's weight bytes per second (`_gbs`) to compare with the host's read bandwidth
(printed: tritonlm.perf.roofline.read_bandwidth).

    .venv/bin/python perf/bench_int8_gemm.py [--rounds 5] [--reps 50] [--paths avx2] [--rows 1,8,32,256] [--cold]
    FBGEMM_ENABLE_INSTRUCTIONS=AVX2 .venv/bin/python perf/bench_int8_gemm.py
        # fbgemm's AVX2 kernel on a CPU with VNNI: the fbgemm a CPU without VNNI runs
Prints the CPU it ran on; writes results/bench_int8_gemm/bench_int8_gemm.csv.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from tritonlm.engine.runners.layers import INT8_VNNI, Int8Linear, PinnedRows
from tritonlm.perf.machine import describe_cpu
from tritonlm.perf.roofline import last_level_cache_bytes, read_bandwidth
from tritonlm.perf.report import add_out_arg, table, write_csv
from tritonlm_bench.steptime import row_counts, time_calls

# (name, in, out): SmolLM2-135M's projections, and its LM head
SHAPES = [("qkv", 576, 960), ("o", 576, 576), ("gate_up", 576, 3072), ("down", 1536, 576), ("lm_head", 576, 49152)]
ROWS = (1, 32)


def kernels(w: torch.Tensor, paths: list[str]) -> dict[str, Int8Linear]:
    """Every way this host can run w [in, out] in int8 (i8_linear on `paths`), by name."""
    out = {}
    for bits, reduce_range in ((8, False), (7, True)):
        if bits == 8 and not INT8_VNNI:
            continue  # fbgemm saturates 8-bit activations without VNNI (the CPU's, or capped)
        lin = Int8Linear.from_float(w, None)
        lin.cpp_op, lin.reduce_range, lin.pinned = True, reduce_range, PinnedRows()
        out[f"fbgemm_{bits}bit"] = lin
    for isa in paths:
        lin = Int8Linear.from_float(w, None)
        lin.use_act8(isa)
        out[f"tritonlm_{isa}"] = lin
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rows", default=",".join(map(str, ROWS)),
                    help="comma-separated row counts (default 1,32: one stream's decode step, a batch of 32)")
    ap.add_argument("--reps", type=int, default=50, help="calls timed per round (default 50)")
    ap.add_argument("--paths", default=None,
                    help="comma-separated i8_linear paths to time (default: every one this build has, i8_isas())")
    ap.add_argument("--cold", action="store_true",
                    help="evict the caches before each timed call: weights read from memory, as in a model's step")
    add_out_arg(ap, "bench_int8_gemm")
    args = ap.parse_args()
    from tritonlm.engine.kernels import kernels_available

    ok, why = kernels_available()
    if not ok:
        sys.exit(f"tritonlm's C++ kernels are not available: {why}")
    have = list(torch.ops.tritonlm.i8_isas())
    paths = [p.strip() for p in args.paths.split(",") if p.strip()] if args.paths else have
    try:
        counts = row_counts(args.rows)
    except ValueError as e:
        ap.error(str(e))
    if not paths or any(p not in have for p in paths):
        ap.error(f"--paths {args.paths!r}: name one or more of this build's i8_linear paths, {', '.join(have)}")
    cpu = describe_cpu()
    fbgemm_isa = os.environ.get("FBGEMM_ENABLE_INSTRUCTIONS", "")
    print(f"CPU: {cpu}; torch {torch.__version__}, {torch.get_num_threads()} threads; i8_linear paths "
          f"{torch.ops.tritonlm.i8_isas()}" + (f"; FBGEMM_ENABLE_INSTRUCTIONS={fbgemm_isa}" if fbgemm_isa else ""),
          flush=True)
    gen = torch.Generator().manual_seed(0)
    cases = []
    for name, n_in, n_out in SHAPES:
        lins = kernels(torch.randn(n_in, n_out, generator=gen) / n_in**0.5, paths)
        for rows in counts:
            cases.append((name, n_in, n_out, rows, torch.randn(rows, n_in, generator=gen), lins))
    if args.cold:
        evict = torch.ones(max(64 << 20, 2 * last_level_cache_bytes()) // 4)  # [bytes / 4]
        bandwidth = read_bandwidth(torch.get_num_threads())
        print(f"read bandwidth, {torch.get_num_threads()} threads: {bandwidth / 1e9:.1f} GB/s", flush=True)

        def timed(fn) -> list[float]:  # each call after the caches were filled with other data
            fn()
            out = []
            for _ in range(args.reps):
                evict.sum()
                t0 = time.perf_counter()
                fn()
                out.append(time.perf_counter() - t0)
            return out
    else:
        def timed(fn) -> list[float]:
            return time_calls(fn, args.reps)
    times: dict[tuple, list[float]] = {}
    for rnd in range(args.rounds):
        for name, n_in, n_out, rows, x, lins in cases:
            for kernel, lin in lins.items():
                t = timed(lambda: lin.apply(x, None))
                times.setdefault((name, rows, kernel), []).append(statistics.median(t) * 1e6)
        print(f"round {rnd + 1}/{args.rounds} done", flush=True)
    results = []
    for name, n_in, n_out, rows, _, lins in cases:
        row = {"shape": name, "in": n_in, "out": n_out, "rows": rows}
        for kernel in lins:
            row[f"{kernel}_us"] = round(statistics.median(times[(name, rows, kernel)]), 1)
            if args.cold:
                row[f"{kernel}_gbs"] = round(n_in * n_out / row[f"{kernel}_us"] / 1e3, 1)
        base = row.get("fbgemm_7bit_us")
        best = next(k for k in lins if k.startswith("tritonlm_"))
        if row.get("fbgemm_8bit_us"):  # > 1: tritonlm faster than fbgemm's VNNI kernel
            row[f"{best}_vs_fbgemm_8bit"] = round(row["fbgemm_8bit_us"] / row[f"{best}_us"], 2)
        if base:
            row[f"{best}_vs_fbgemm_7bit"] = round(base / row[f"{best}_us"], 2)  # > 1: tritonlm faster
        avx2 = row.get("tritonlm_avx2_us")
        if avx2 and base:
            row["tritonlm_avx2_vs_fbgemm_7bit"] = round(base / avx2, 2)
        results.append(row)
    print(f"\nCPU: {cpu}; median us per call of {args.rounds} alternating rounds x {args.reps} calls"
          + ("; caches evicted before each call (--cold)" if args.cold else "")
          + (f"; FBGEMM_ENABLE_INSTRUCTIONS={fbgemm_isa}" if fbgemm_isa else ""))
    print(table(results, list(results[0])))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "bench_int8_gemm.csv", [{"cpu": cpu, "fbgemm_isa": fbgemm_isa or "native", "cold": args.cold, **r}
                                            for r in results])
    print(f"wrote {out / 'bench_int8_gemm.csv'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
