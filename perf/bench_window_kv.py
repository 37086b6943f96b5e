"""Benchmark: KV cache bytes one long sequence reserves with sliding_window_kv 'window' vs 'full'.

A Gemma-3-shaped model's KV (gemma-3-1b: 1 kv head of 256 dims, bfloat16, window 512, every
6th layer global, the other 5 local), the engine's own accounting (no weights, no pool):
    full      KVCacheManager: every layer holds a block per 16 positions
    window    window_kv.HybridKVCache: global layers as above, local layers a ring of
              ceil((window + chunk - 1) / block) + 1 blocks (chunk: max_num_batched_tokens)
For each layer count and sequence length:
    full_bytes, window_bytes   what admission reserves for the sequence (prompt + max_tokens)
    ratio                      window_bytes / full_bytes

    .venv/bin/python perf/bench_window_kv.py [--layers 26,6] [--tokens 4096,8192,32768] [--chunk 512]
Prints the CPU it ran on (the figures are the accounting's, the same on any host); writes
results/bench_window_kv/bench_window_kv.csv.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from tritonlm.engine.kv_cache import KVCacheManager
from tritonlm.engine.model_shape import ModelShape
from tritonlm.engine.window_kv import HybridKVCache
from tritonlm.perf.machine import describe_cpu
from tritonlm.perf.report import add_out_arg, table, write_csv


def gemma3_shape(layers: int) -> tuple[ModelShape, list[int | None]]:
    """gemma-3-1b's KV shape with `layers` layers; every 6th global (window None), the rest local (512)."""
    spec = ModelShape("llama", layers, 4, 1, 256, 262144, 32768, torch.bfloat16, "gemma3_text")
    return spec, [None if (i + 1) % 6 == 0 else 512 for i in range(layers)]


def reserved(layers: int, tokens: int, block: int, chunk: int) -> tuple[int, int]:
    """(full mode's bytes, window mode's bytes) one sequence of `tokens` reserves."""
    spec, windows = gemma3_shape(layers)
    budget = 2 * (tokens + block) * spec.bytes_per_token
    full = KVCacheManager(spec, budget, block)
    full.allocate(0, tokens)
    window = HybridKVCache(spec, budget, block, windows, chunk, 1, tokens)
    window.allocate(0, tokens)
    return full.reserved_bytes(0), window.reserved_bytes(0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", default="26,6", help="layer counts, comma-separated (default 26 as gemma-3-1b, and 6: 5 local to 1 global)")
    ap.add_argument("--tokens", default="4096,8192,32768", help="sequence lengths, comma-separated")
    ap.add_argument("--block", type=int, default=16, help="kv_block_size (default 16)")
    ap.add_argument("--chunk", type=int, default=512, help="max_num_batched_tokens, a step's most new tokens per row (default 512)")
    add_out_arg(ap, "bench_window_kv")
    args = ap.parse_args()
    cpu = describe_cpu()
    print(f"CPU: {cpu}", flush=True)
    rows = []
    for layers in (int(x) for x in args.layers.split(",")):
        local = sum(1 for w in gemma3_shape(layers)[1] if w is not None)
        for tokens in (int(x) for x in args.tokens.split(",")):
            full, window = reserved(layers, tokens, args.block, args.chunk)
            rows.append({"layers": layers, "local": local, "global": layers - local, "tokens": tokens,
                         "full_mib": round(full / 2**20, 2), "window_mib": round(window / 2**20, 2),
                         "ratio": round(window / full, 3)})
    shape = f"gemma-3-1b KV (1 kv head x 256, bfloat16, window 512), block {args.block}, chunk {args.chunk}"
    print(f"\n{shape}")
    print(table(rows, list(rows[0])))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "bench_window_kv.csv", [{"cpu": cpu, "shape": shape, **r} for r in rows])
    print(f"wrote {out / 'bench_window_kv.csv'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
