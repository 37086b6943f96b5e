"""Benchmark: the Triton paged-decode kernel (tritonlm/engine/kernels/paged_decode.py) on a CUDA GPU.

One decode step's attention for one layer of SmolLM2-135M's shape (9 query / 3 kv heads of
64) at 1 / 32 / 128 / 256 rows, every row --context keys on shuffled blocks. Each call is
captured in a CUDA graph and replayed --iters times, so the time is the GPU's, not Python's
launch cost. Per batch and config:
    us         microseconds per call
    gb_per_s   the K/V bytes the rows' keys hold, read per second (the bound a decode step is)
    replay_err the largest difference, after the graph is replayed with other lengths (1 up
               to the context), from an eager call of the kernel on those lengths: anything in
               the call fixed by tensor values at capture would show (0 when nothing is)
The kernel's exactness against a float64 reference is the unit tests'
(tests/unit/engine/kernels/test_paged_decode.py, also with the attention options).

    python3 perf/bench_paged_decode.py [--sweep] [--window N] [--softcap C] [--sinks]
                                       [--dtype bfloat16] [--context 512] [--iters 200]
--sweep also times block_n, num_warps and num_splits choices, for whoever tunes the defaults.
Prints the GPU it ran on; writes results/bench_paged_decode/bench_paged_decode.csv. Exits 2
without a CUDA GPU (or with TRITON_INTERPRET set: the interpreter is not timed).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path
from typing import Any

import torch

from tritonlm.engine.kernels.paged_decode import available, default_num_splits, paged_decode_attention
from tritonlm.perf.machine import describe_gpu
from tritonlm.perf.report import add_out_arg, table, write_csv

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
SWEEP = tuple({"block_n": bn, "num_warps": nw, "num_splits": ns} for bn in (32, 64) for nw in (4, 8) for ns in (None, 1))


def bench(
    batches: tuple[int, ...] = (1, 32, 128, 256),
    context: int = 512,
    heads: int = 9,
    kv_heads: int = 3,
    head_dim: int = 64,
    block_size: int = 16,
    dtype: torch.dtype = torch.bfloat16,
    iters: int = 200,
    configs: tuple[dict[str, int | None], ...] = ({},),
    window: int = 0,
    softcap: float = 0.0,
    sinks: bool = False,
) -> list[dict[str, Any]]:
    """Times the kernel on the current CUDA device for each batch size and each config
    (keyword tuning arguments of paged_decode_attention, {} for the defaults), with the
    attention options given (sinks: a random logit per head). Prints a line per timing and
    returns the rows (see the module's docstring)."""
    if os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes", "y"):
        raise RuntimeError("unset TRITON_INTERPRET: the benchmark times the compiled kernel")
    if not torch.cuda.is_available():
        raise RuntimeError("the benchmark needs a CUDA GPU")
    dev = torch.device("cuda")
    ok, why = available(dev)
    if not ok:
        raise RuntimeError(why)
    g = torch.Generator().manual_seed(0)
    elem = torch.empty((), dtype=dtype).element_size()
    scale = head_dim**-0.5
    options: dict[str, Any] = dict(window=window, softcap=softcap)
    if sinks:
        options["sinks"] = torch.randn(heads, generator=g).to(dev, dtype)
    read = min(context, window) if window else context  # keys a row's query reads
    results: list[dict[str, Any]] = []
    for bsz in batches:
        blocks_per_row = math.ceil(context / block_size)
        num_blocks = bsz * blocks_per_row + 1  # block 0 stays the scratch block
        slots = num_blocks * block_size
        k_cache = torch.randn((slots, kv_heads, head_dim), generator=g).to(dev, dtype)
        v_cache = torch.randn((slots, kv_heads, head_dim), generator=g).to(dev, dtype)
        table_ = (torch.randperm(num_blocks - 1, generator=g) + 1).view(bsz, blocks_per_row).to(dev, torch.int32)
        lens = torch.full((bsz,), context, dtype=torch.int32, device=dev)
        q = torch.randn((bsz, heads, head_dim), generator=g).to(dev, dtype)
        out = torch.empty_like(q)
        for config in configs:

            def call(dest: torch.Tensor) -> None:
                paged_decode_attention(q, k_cache, v_cache, table_, lens, block_size, scale, dest, **options, **config)

            lens.fill_(context)
            call(out)  # compiles
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up off the default stream, as graph capture wants
                for _ in range(3):
                    call(out)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                call(out)
            for _ in range(10):
                graph.replay()
            t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0.record()
            for _ in range(iters):
                graph.replay()
            t1.record()
            torch.cuda.synchronize()
            us = t0.elapsed_time(t1) * 1e3 / iters
            # the captured call at other lengths against an eager call at the same lengths
            lens.copy_(torch.randint(1, context + 1, (bsz,), generator=g).to(dev, torch.int32))
            graph.replay()
            eager = torch.empty_like(out)
            call(eager)
            torch.cuda.synchronize()
            err = (out.float() - eager.float()).abs().max().item()
            kv_bytes = 2 * bsz * read * kv_heads * head_dim * elem
            splits = config.get("num_splits") or default_num_splits(bsz, kv_heads, dev)
            row = {"batch": bsz, "context": context, "window": window, "softcap": softcap, "sinks": sinks,
                   "config": str(dict(config) or "defaults"), "splits": splits, "us": round(us, 2),
                   "gb_per_s": round(kv_bytes / (us * 1e-6) / 1e9, 1), "replay_err": err}
            results.append(row)
            print(f"B={bsz:4d} ctx={context} splits={splits:2d} {config or 'defaults'}: {us:8.2f} us/call "
                  f"{row['gb_per_s']:8.1f} GB/s K/V read, replay vs eager max |diff| {err:.2e}", flush=True)
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    ap.add_argument("--context", type=int, default=512, help="keys per row (default 512)")
    ap.add_argument("--iters", type=int, default=200, help="graph replays timed per point (default 200)")
    ap.add_argument("--window", type=int, default=0, help="a sliding window of N keys (default 0: none)")
    ap.add_argument("--softcap", type=float, default=0.0, help="attention logit soft-cap (default 0: none)")
    ap.add_argument("--sinks", action="store_true", help="attention sinks: a logit per query head")
    ap.add_argument("--sweep", action="store_true", help="also time block_n / num_warps / num_splits choices")
    add_out_arg(ap, "bench_paged_decode")
    args = ap.parse_args()
    gpu = describe_gpu("cuda:0")
    if not gpu:
        print("no CUDA GPU: the benchmark times the compiled kernel on one", file=sys.stderr)
        return 2
    print(f"GPU: {gpu}; torch {torch.__version__}", flush=True)
    configs = ({},) + (SWEEP if args.sweep else ())
    rows = bench(context=args.context, dtype=DTYPES[args.dtype], iters=args.iters, configs=configs,
                 window=args.window, softcap=args.softcap, sinks=args.sinks)
    print(f"\nGPU: {gpu}; {args.dtype}, SmolLM2-135M's attention (9 / 3 heads of 64), one layer")
    print(table(rows, list(rows[0])))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "bench_paged_decode.csv", [{"gpu": gpu, "dtype": args.dtype, **r} for r in rows])
    print(f"wrote {out / 'bench_paged_decode.csv'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
