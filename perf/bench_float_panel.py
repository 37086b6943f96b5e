"""Benchmark: float32 projections, tritonlm's 16-wide output panels against oneDNN's blocked layout.

Every projection of SmolLM2-135M's 30 layers (qkv 576 x 960, o 576 x 576, gate_up 576 x 3072,
down 1536 x 576; seeded random weights), one after another as a decode step runs them, so each
reads its weights from memory as in a model's step, not from the caches:
    panel    torch.ops.tritonlm.panel_linear (kernels/float_panel.cpp, layers.PanelLinear): the
             loaded build's level (AVX-512 or AVX2: TRITONLM_KERNEL_ISA forces one)
    blocked  oneDNN's blocked layout (layers.BlockedLinear), what runs where panels are not built
Median milliseconds of the 120 projections per row count, over --rounds alternating rounds (a
shared host's speed drifts over minutes), and the weights' bytes per second.

    .venv/bin/python perf/bench_float_panel.py [--rows 1,2,8,32] [--rounds 5] [--reps 5]
    TRITONLM_KERNEL_ISA=avx2 ONEDNN_MAX_CPU_ISA=AVX2 .venv/bin/python perf/bench_float_panel.py
        # the code an AVX2-only CPU runs, on both sides (an AVX2 panel build; oneDNN capped)
Prints the CPU and the kernels' level; writes results/bench_float_panel/bench_float_panel.csv.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from tritonlm.engine.runners.layers import BlockedLinear, FloatLinear, Linear, PanelLinear, panels_available
from tritonlm.perf.machine import describe_cpu
from tritonlm.perf.report import add_out_arg, table, write_csv
from tritonlm_bench.steptime import row_counts

LAYERS = 30
SHAPES = [("qkv", 576, 960), ("o", 576, 576), ("gate_up", 576, 3072), ("down", 1536, 576)]  # SmolLM2-135M


def step_ms(projections: list[tuple[int, Linear]], inputs: dict[int, torch.Tensor], reps: int) -> float:
    """Median milliseconds of every projection run once, in order."""
    times = []
    for _ in range(reps + 1):  # the first pass pays for first-call setup
        t0 = time.perf_counter()
        for n_in, p in projections:
            p(inputs[n_in])
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:]) * 1000


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,2,8,32", help="comma-separated row counts (default 1,2,8,32)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=5, help="timed passes per round (default 5)")
    add_out_arg(ap, "bench_float_panel")
    args = ap.parse_args()
    try:
        counts = row_counts(args.rows)
    except ValueError as e:
        ap.error(str(e))
    if not panels_available():
        sys.exit("this build has no panel kernel (tritonlm's C++ kernels at an AVX2 or AVX-512 level are needed)")
    from tritonlm.engine.kernels import loaded_build

    build = loaded_build()
    onednn_cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "")
    cpu = describe_cpu()
    print(f"CPU: {cpu}; torch {torch.__version__}, {torch.get_num_threads()} threads; kernels: {build.level} "
          f"({build.why})" + (f"; ONEDNN_MAX_CPU_ISA={onednn_cap}" if onednn_cap else ""), flush=True)
    gen = torch.Generator().manual_seed(0)
    plain = [(n_in, FloatLinear(torch.randn(n_in, n_out, generator=gen) / n_in**0.5, None))
             for _ in range(LAYERS) for _, n_in, n_out in SHAPES]
    layouts = {"panel": [(n, PanelLinear.from_float(p)) for n, p in plain],
               "blocked": [(n, BlockedLinear.from_float(p)) for n, p in plain]}
    del plain
    weight_bytes = LAYERS * sum(n_in * n_out for _, n_in, n_out in SHAPES) * 4
    times: dict[tuple[int, str], list[float]] = {}
    for rnd in range(args.rounds):
        for rows in counts:
            inputs = {n_in: torch.randn(rows, n_in, generator=gen) for n_in in {s[1] for s in SHAPES}}
            for name, projections in layouts.items():
                times.setdefault((rows, name), []).append(step_ms(projections, inputs, args.reps))
        print(f"round {rnd + 1}/{args.rounds} done", flush=True)
    results = []
    for rows in counts:
        panel, blocked = (statistics.median(times[(rows, k)]) for k in ("panel", "blocked"))
        results.append({"rows": rows, "panel_ms": round(panel, 2), "blocked_ms": round(blocked, 2),
                        "panel_gbs": round(weight_bytes / panel / 1e6, 1),
                        "blocked_gbs": round(weight_bytes / blocked / 1e6, 1),
                        "speedup": round(blocked / panel, 2)})  # > 1: panels faster
    print(f"\nCPU: {cpu}; kernels {build.level}" + (f"; ONEDNN_MAX_CPU_ISA={onednn_cap}" if onednn_cap else "")
          + f"; {LAYERS} layers x {len(SHAPES)} projections, {weight_bytes / 1e6:.0f} MB of weights; "
          f"median of {args.rounds} alternating rounds")
    print(table(results, list(results[0])))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "bench_float_panel.csv", [{"cpu": cpu, "kernels": build.level, "onednn_cap": onednn_cap or "native",
                                               **r} for r in results])
    print(f"wrote {out / 'bench_float_panel.csv'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
