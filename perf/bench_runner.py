"""Micro-benchmark: per-step DECODE time of the runners vs context length and batch size.

GPT-2-small shape (GPT2Config defaults: 12 layers, 768 hidden, 124M parameters), random
weights. For each (runner, batch, context) the KV pool is filled with random values (the
step time does not depend on them, so no prefill is needed), each sequence's slots are
scattered over shuffled blocks of 16, and one new token per sequence is run.

Columns:
    ctx          tokens attended by the step: a past of ctx-1 plus the one new token
    step_ms      fastest wall time of one decode step (forward + KV write) over --reps
    step_med_ms  median of the same runs (a large gap to step_ms = a noisy machine)
    tok_s        batch / step_ms
    gather_ms    (fastest) the pool -> dense [B, Hkv, L, D] gather alone (all layers, K and V), as the
                 runners do it (index_select into a reused buffer)
    kv_mib       live KV cache bytes of the batch (B x ctx x 72 KiB for this shape)

The gap between step_ms at ctx=64 and at ctx=1024 is the per-step cost of the cache
(gather copy + attention; for ONNX also the graph's `present = past + new` copy): the
KV-cache copy arithmetic of docs/architecture.md, measured rather than guessed.

    .venv/bin/python perf/bench_runner.py                  # torch and onnx, full grid
    .venv/bin/python perf/bench_runner.py --quick          # a smaller grid
    .venv/bin/python perf/bench_runner.py --runners torch --contexts 64,1024 --batches 1,8
    .venv/bin/python perf/bench_runner.py --onnx-path .cache/gpt2-small.onnx   # export once, reuse
Writes results/bench_runner.csv (relative to the repository root) and prints a table.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from tritonlm.engine.batch import StepBatch
from tritonlm.engine.runners import load_runner
from tritonlm.engine.runners.base import gather_kv, kv_rows
from tritonlm.paths import REPO_ROOT
from tritonlm.perf.machine import describe_cpu
from tritonlm_bench.steptime import time_calls

BLOCK = 16


def gpt2_small():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config()).eval()


def scattered_slots(batch: int, length: int, seed: int) -> tuple[torch.Tensor, int]:
    """[batch, length] slot table over shuffled blocks (block 0 = scratch), and the pool size."""
    per_seq = -(-length // BLOCK)
    num_blocks = 1 + batch * per_seq
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(num_blocks - 1, generator=g) + 1  # blocks 1..N-1, shuffled
    table = torch.empty(batch, per_seq * BLOCK, dtype=torch.int64)
    offs = torch.arange(BLOCK)
    for b in range(batch):
        blocks = order[b * per_seq : (b + 1) * per_seq]
        table[b] = (blocks.unsqueeze(1) * BLOCK + offs).reshape(-1)
    return table[:, :length], num_blocks * BLOCK


def fastest_and_median(fn, warmup: int, reps: int) -> tuple[float, float]:
    """(fastest, median) seconds over reps: on a shared machine the fastest run is the
    least disturbed by others' work, the median shows how noisy it was."""
    times = time_calls(fn, reps, warmup)
    return min(times), statistics.median(times)


def bench_one(runner, kind: str, batch: int, ctx: int, warmup: int, reps: int) -> dict:
    spec = runner.spec
    past = ctx - 1  # ctx = tokens attended this step: past + the 1 new token (GPT-2's limit is 1024)
    table, num_slots = scattered_slots(batch, ctx, seed=batch * 10007 + ctx)
    pool = runner.allocate_kv(num_slots)
    g = torch.Generator().manual_seed(1)
    for t in pool.k + pool.v:
        t.copy_(torch.randn(t.shape, generator=g) * 0.5)
    step = StepBatch(
        input_ids=torch.randint(0, spec.vocab_size, (batch, 1), generator=g),
        num_new=torch.ones(batch, dtype=torch.int64),
        past_len=torch.full((batch,), past, dtype=torch.int64),
        slot_table=table,
    )
    step_s, step_med = fastest_and_median(lambda: runner.forward(step, pool), warmup, reps)

    rows = kv_rows(table if kind == "torch" else table[:, :past], spec.num_kv_heads)
    buf = torch.empty(rows.numel() * spec.head_dim, dtype=spec.dtype)

    def gather():  # what one step gathers: every layer's K and V, into a reused buffer
        with torch.inference_mode():
            for cache in pool.k + pool.v:
                gather_kv(cache, rows, batch, out=buf)  # [B, Hkv, L, D]

    gather_s, _ = fastest_and_median(gather, 1, reps)
    kv_bytes = batch * ctx * spec.bytes_per_token
    return {
        "runner": kind,
        "batch": batch,
        "ctx": ctx,
        "step_ms": round(step_s * 1e3, 2),
        "step_med_ms": round(step_med * 1e3, 2),
        "tok_s": round(batch / step_s, 1),
        "gather_ms": round(gather_s * 1e3, 2),
        "kv_mib": round(kv_bytes / 2**20, 1),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runners", default="torch,onnx")
    ap.add_argument("--contexts", default="64,128,256,512,1024")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: leave as is)")
    ap.add_argument(
        "--onnx-path", default=None, help="GPT-2-small decoder to reuse, exported there first if missing (default: a temp dir)"
    )
    ap.add_argument("--out", default="results/bench_runner.csv", help="CSV path, relative to the repository root")
    ap.add_argument("--quick", action="store_true", help="contexts 64,1024 and batches 1,8: a smoke run")
    args = ap.parse_args(argv)
    if args.quick:
        args.contexts, args.batches = "64,1024", "1,8"
    if args.threads:
        torch.set_num_threads(args.threads)
    kinds = [k.strip() for k in args.runners.split(",") if k.strip()]
    contexts = [int(x) for x in args.contexts.split(",")]
    batches = [int(x) for x in args.batches.split(",")]

    model = gpt2_small()
    rows = []
    print(f"# CPU: {describe_cpu()}")
    print(f"# torch threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.2f} (others' work skews times)")
    with tempfile.TemporaryDirectory() as tmp:
        for kind in kinds:
            if kind == "torch":
                runner = load_runner("torch", model)
            elif kind == "onnx":
                path = Path(args.onnx_path) if args.onnx_path else Path(tmp) / "gpt2-small.onnx"
                if not path.is_file():
                    from tritonlm.export.onnx_export import export_decoder_onnx

                    t0 = time.perf_counter()
                    path = export_decoder_onnx(model, path)
                    print(f"# exported GPT-2-small decoder in {time.perf_counter() - t0:.0f} s", flush=True)
                runner = load_runner("onnx", model, onnx_path=path)
            else:
                raise SystemExit(f"unknown runner {kind!r} in --runners (torch, onnx)")
            for batch in batches:
                for ctx in contexts:
                    row = bench_one(runner, kind, batch, ctx, args.warmup, args.reps)
                    rows.append(row)
                    print(
                        f"{kind:5s} B={batch:3d} ctx={ctx:5d}  step {row['step_ms']:9.2f} ms  "
                        f"{row['tok_s']:8.1f} tok/s  gather {row['gather_ms']:8.2f} ms  kv {row['kv_mib']:8.1f} MiB",
                        flush=True,
                    )
            del runner

    out = REPO_ROOT / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)

    print("\n| runner | batch | ctx | step ms (min) | step ms (median) | tok/s | gather ms | KV MiB |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['runner']} | {r['batch']} | {r['ctx']} | {r['step_ms']} | {r['step_med_ms']} | {r['tok_s']} | "
            f"{r['gather_ms']} | {r['kv_mib']} |"
        )
    print(f"\n# load average at the end {os.getloadavg()[0]:.2f}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
