"""Benchmark: the generation model through the real server vs the obvious way to serve.

One run, one machine, side by side:
  * tritonlm (continuous batching + paged KV cache) at 1, 8, 32 concurrent streaming
    gRPC clients, 128 output tokens each: output tokens/s, TTFT and ITL p50/p99;
  * the naive baseline: one request at a time, transformers generate() with its KV
    cache, batch 1 (in-process, so it is an upper bound for a naive server);
  * the same engine with its KV cache switched off (use_kv_cache=false), 512 tokens.
Models: a GPT-2-small-shaped model (124M parameters, seeded random weights, GPT-2's
vocabulary) and smollm2-135m (real weights). Writes CSV and PNG under results/.

    .venv/bin/python perf/bench_generate.py [--quick]
"""

from __future__ import annotations

import argparse
import csv
import sys
import time
from pathlib import Path

from tritonlm.engine.model_shape import ModelShape
from tritonlm.export.repository import default_kv_cache_bytes
from tritonlm.paths import REPO_ROOT
from tritonlm.perf.machine import describe_cpu
from tritonlm.perf.report import add_out_arg, optional_figure, save_figure, style_axes
from tritonlm.server import TritonServer, free_ports
from tritonlm_bench.benchrepo import link_generation_model, save_weights_once
from tritonlm_bench.streaming import closed_loop, grpc_stream, summarize_streams

PROMPTS = [
    "The history of the city begins",
    "In a quiet village by the sea, an old fisherman",
    "Machine learning systems are deployed",
    "Here is a recipe for bread: first",
    "The committee met on Tuesday to discuss",
    "Once upon a time, in a kingdom far away,",
    "The stock market today",
    "Scientists have discovered a new species of",
]


def load_point(url: str, model: str, clients: int, requests_per_client: int, max_tokens: int) -> dict:
    """`clients` streaming gRPC clients, each sending requests_per_client requests back to back."""
    run = closed_loop(lambda _conn, c, k: grpc_stream(url, model, PROMPTS[(c + k) % len(PROMPTS)], max_tokens),
                      clients, requests_per_client=requests_per_client)
    if run.errors:
        raise RuntimeError(f"{len(run.errors)} request(s) failed; first: {run.errors[0]}")
    return {"clients": clients, **summarize_streams(run.records, run.wall_s)}


def naive_baseline(model, tok, requests: int, max_tokens: int) -> float:
    """transformers generate(), batch 1, one request after another: tokens/s."""
    import torch

    with torch.inference_mode():
        ids = tok(PROMPTS[0], return_tensors="pt")
        model.generate(**ids, max_new_tokens=4, do_sample=False, pad_token_id=tok.eos_token_id)  # warm-up
        t0 = time.perf_counter()
        total = 0
        for i in range(requests):
            ids = tok(PROMPTS[i % len(PROMPTS)], return_tensors="pt")
            out = model.generate(
                **ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False, pad_token_id=tok.eos_token_id
            )
            total += out.shape[1] - ids.input_ids.shape[1]
    return total / (time.perf_counter() - t0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_out_arg(ap, "bench_generate")
    ap.add_argument("--models", default="gpt2-small,smollm2-135m")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--kv-off-tokens", type=int, default=512)
    ap.add_argument("--quick", action="store_true", help="fewer requests (a smoke run)")
    ap.add_argument("--bf16", action="store_true", help="also serve each model with dtype bfloat16 (CPUs with bf16 matmuls)")
    ap.add_argument("--no-kv-off", action="store_true", help="skip the KV-cache-off comparison (slow: O(n^2))")
    args = ap.parse_args()
    out = Path(args.out)
    repo = out / "repo"
    repo.mkdir(parents=True, exist_ok=True)
    cache = REPO_ROOT / ".cache"
    print(f"CPU: {describe_cpu()}")
    models = {}
    for name in args.models.split(","):
        if name == "gpt2-small":
            from tritonlm.models.gpt2_vocab import gpt2_small_random

            model, tok = gpt2_small_random(cache)
            ctx = 1024
        elif name == "smollm2-135m":
            from tritonlm.models.loading import load_model

            model, tok, _ = load_model("smollm2-135m")
            ctx = 2048
        else:
            raise SystemExit(f"unknown model {name}: use gpt2-small or smollm2-135m")
        key = name.replace("-", "_")
        weights = save_weights_once(model, tok, out / "weights" / key)
        # room for the top concurrency's sequences at full context, and a few more
        kv = default_kv_cache_bytes(ModelShape.from_hf_config(model.config), ctx, sequences=36)
        link_generation_model(repo, key, weights, ctx, kv_cache_bytes=kv, max_num_seqs=32)
        link_generation_model(repo, key + "_nokv", weights, ctx, kv_cache_bytes=kv, use_kv_cache="false", max_num_seqs=32)
        models[key] = (model, tok)
        if args.bf16:
            link_generation_model(repo, key + "_bf16", weights, ctx, kv_cache_bytes=kv, dtype="bfloat16", max_num_seqs=32)
    rows: list[dict] = []
    levels = [int(c) for c in args.concurrency.split(",")]
    server = TritonServer(repo, *free_ports(3), log_path=out / "tritonserver.log")
    server.start(timeout_s=900)
    try:
        for key, (model, tok) in models.items():
            grpc_stream(server.grpc_url, key, PROMPTS[0], 8)  # warm-up
            for c in levels:
                per_client = 1 if (args.quick or c >= 8) else 4
                print(f"[{key}] {c} clients x {per_client} requests x {args.max_tokens} tokens ...", flush=True)
                point = load_point(server.grpc_url, key, c, per_client, args.max_tokens)
                rows.append({"model": key, "path": "tritonlm", **point})
                if args.bf16:
                    grpc_stream(server.grpc_url, key + "_bf16", PROMPTS[0], 8)
                    point = load_point(server.grpc_url, key + "_bf16", c, per_client, args.max_tokens)
                    rows.append({"model": key, "path": "tritonlm bfloat16", **point})
            print(f"[{key}] naive baseline: transformers generate, batch 1 ...", flush=True)
            naive = naive_baseline(model, tok, 2 if args.quick else 4, args.max_tokens)
            rows.append({"model": key, "path": "naive generate() batch 1", "clients": 1, "requests": 4, "tokens_per_s": naive})
            if args.no_kv_off:
                continue
            print(f"[{key}] KV cache on vs off, {args.kv_off_tokens} tokens ...", flush=True)
            on = grpc_stream(server.grpc_url, key, PROMPTS[1], args.kv_off_tokens)
            off = grpc_stream(server.grpc_url, key + "_nokv", PROMPTS[1], args.kv_off_tokens)
            rows.append({"model": key, "path": f"KV on, {args.kv_off_tokens} tok", "clients": 1, "requests": 1,
                         "tokens_per_s": on.tokens / on.latency_s})
            rows.append({"model": key, "path": f"KV off, {args.kv_off_tokens} tok", "clients": 1, "requests": 1,
                         "tokens_per_s": off.tokens / off.latency_s})
    finally:
        server.stop()
    fields = ["model", "path", "clients", "requests", "tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms"]
    with open(out / "bench_generate.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{r[k]:.2f}" if isinstance(r.get(k), float) else r.get(k, "")) for k in fields})
    print()
    print(f"{'model':<14} {'path':<26} {'clients':>7} {'tok/s':>8} {'TTFT p50/p99 ms':>17} {'ITL p50/p99 ms':>16}")
    for r in rows:
        lat = f"{r['ttft_p50_ms']:.0f}/{r['ttft_p99_ms']:.0f}" if "ttft_p50_ms" in r else "-"
        itl = f"{r['itl_p50_ms']:.1f}/{r['itl_p99_ms']:.1f}" if "itl_p50_ms" in r else "-"
        print(f"{r['model']:<14} {r['path']:<26} {r['clients']:>7} {r['tokens_per_s']:>8.1f} {lat:>17} {itl:>16}")
    print()
    for key in models:
        mine = {r["clients"]: r["tokens_per_s"] for r in rows if r["model"] == key and r["path"] == "tritonlm"}
        naive = next(r["tokens_per_s"] for r in rows if r["model"] == key and r["path"].startswith("naive"))
        top = max(mine)
        print(f"{key}: {top} clients / naive = {mine[top] / naive:.1f}x (target >= 10x)")
        half = {r["clients"]: r["tokens_per_s"] for r in rows if r["model"] == key and r["path"] == "tritonlm bfloat16"}
        if half:
            print(f"{key}: bfloat16, {top} clients / naive (fp32) = {half[top] / naive:.1f}x")
        if not args.no_kv_off:
            on = next(r["tokens_per_s"] for r in rows if r["model"] == key and r["path"].startswith("KV on"))
            off = next(r["tokens_per_s"] for r in rows if r["model"] == key and r["path"].startswith("KV off"))
            print(f"{key}: KV on / off at {args.kv_off_tokens} tokens = {on / off:.1f}x (target >= 5x)")
    drawn = optional_figure(figsize=(6, 4))
    if drawn:
        fig, ax = drawn
        for key in models:
            pts = [(r["clients"], r["tokens_per_s"]) for r in rows if r["model"] == key and r["path"] == "tritonlm"]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{key} tritonlm")
            naive = next(r["tokens_per_s"] for r in rows if r["model"] == key and r["path"].startswith("naive"))
            ax.axhline(naive, linestyle="--", linewidth=1, label=f"{key} naive generate()")
        ax.set_xscale("log", base=2)
        style_axes(ax, "concurrent streaming clients", "output tokens/s", legend_size=7)
        save_figure(fig, out / "bench_generate.png", dpi=120)
    print(f"\nwrote {out / 'bench_generate.csv'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
