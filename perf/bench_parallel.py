"""Benchmark (not a test): data parallel (instances) and model parallel (TP / PP) through
the real tritonserver, as generation throughput under concurrent clients.

Layouts, each the same GPT-2-shaped model (random seeded weights, the built-in tiny
tokenizer's 512-token vocabulary; default 6 layers x 512 hidden x 8 heads, ~19M
parameters, big enough that a step is not all overhead):
    unsplit   1 instance, 1 process
    2 inst    instance_group count 2 (data parallel): 2 engines, 2 processes
    TP 2      tensor_parallel_size 2: 1 instance over 2 processes (gloo all-reduces)
    PP 2      pipeline_parallel_size 2: 1 instance over 2 processes (micro-batches)
For each layout and each concurrency C, C client threads loop over gRPC streaming
requests (a short prompt, max_tokens new tokens, greedy) for --seconds; the table
reports generated tokens/s, requests/s and request latency p50/p99.

Read with care: on a machine with few cores, the layouts share those cores, so splitting
a model shows its overhead (messages per step, all-reduces, idle stages) rather than a
speed-up; 2 instances compete for the same cores as 1. Model parallelism pays off when
each rank gets its own device (GPU) or cores.

    .venv/bin/python perf/bench_parallel.py                          # all layouts, C = 8 and 32
    .venv/bin/python perf/bench_parallel.py --layouts unsplit,tp2 --seconds 10
Writes results/bench_parallel.csv and results/bench_parallel.md (relative to the
repository root) and prints the table.
"""

from __future__ import annotations

import argparse
import csv
import sys
import tempfile
import time
from pathlib import Path

from tritonlm.commands.instances import set_instances
from tritonlm.paths import REPO_ROOT
from tritonlm.perf.machine import describe_cpu
from tritonlm.server import TritonServer, free_ports
from tritonlm_bench.benchrepo import link_generation_model
from tritonlm_bench.streaming import closed_loop, grpc_stream, summarize_streams

LAYOUTS = {
    # name -> (label, extra parameters, instances, instance kind)
    "unsplit": ("unsplit", {}, 1, "auto"),
    "x2": ("2 instances", {}, 2, "auto"),
    "tp2": ("TP 2", {"tensor_parallel_size": "2"}, 1, "model"),
    "pp2": ("PP 2", {"pipeline_parallel_size": "2"}, 1, "model"),
}
PROMPTS = [
    "The capital of France is",
    "Once upon a time there was a small robot who wanted",
    "def main(): return",
    "Numbers: 1 2 3 4 5",
]


def save_model(folder: Path, layers: int, hidden: int, heads: int, positions: int) -> None:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from tritonlm.models.builtin import tiny_tokenizer

    tok = tiny_tokenizer()
    config = GPT2Config(
        vocab_size=len(tok), n_positions=positions, n_embd=hidden, n_layer=layers, n_head=heads,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config).eval()
    model.save_pretrained(folder)
    tok.save_pretrained(folder)


def write_model(repo: Path, name: str, weights: Path, params: dict, instances: int, kind: str, max_context: int) -> None:
    model_dir = link_generation_model(repo, name, weights, max_context, max_num_seqs=64, max_num_batched_tokens=512, **params)
    set_instances(model_dir, instances, kind)


def run_clients(url: str, model: str, concurrency: int, seconds: float, max_tokens: int) -> dict:
    """`concurrency` streaming gRPC clients sending requests back to back for `seconds`; a
    failed request is counted and the client goes on."""
    import tritonclient.grpc as grpcclient

    run = closed_loop(
        lambda conn, c, k: grpc_stream(url, model, PROMPTS[(c + k) % len(PROMPTS)], max_tokens, client=conn, timeout_s=120),
        concurrency, seconds=seconds, connect=lambda: grpcclient.InferenceServerClient(url), stop_on_error=False,
    )
    summary = summarize_streams(run.records, run.wall_s)
    return {key: summary[key] for key in ("requests", "tokens_per_s", "requests_per_s", "latency_p50_s", "latency_p99_s",
                                          "wall_s")} | {"errors": len(run.errors)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layouts", default="unsplit,x2,tp2,pp2", help=f"comma-separated, of {list(LAYOUTS)}")
    ap.add_argument("--concurrency", default="8,32")
    ap.add_argument("--seconds", type=float, default=20.0, help="measuring time per (layout, concurrency)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--out", default=str(REPO_ROOT / "results"))
    args = ap.parse_args()
    layouts = [x for x in args.layouts.split(",") if x]
    unknown = [x for x in layouts if x not in LAYOUTS]
    if unknown:
        ap.error(f"unknown layouts {unknown}; known: {list(LAYOUTS)}")
    concurrency = [int(c) for c in args.concurrency.split(",")]
    max_context = 256
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-parallel-") as tmp:
        tmp = Path(tmp)
        hf = tmp / "hf"
        save_model(hf, args.layers, args.hidden, args.heads, max_context)
        repo = tmp / "repo"
        for name in layouts:
            label, params, instances, kind = LAYOUTS[name]
            write_model(repo, f"bench_{name}", hf, params, instances, kind, max_context)
        http, grpc, metrics = free_ports(3)
        server = TritonServer(repo, http, grpc, metrics, model_control="explicit", log_path=tmp / "server.log")
        server.start(timeout_s=300)
        import tritonclient.http as httpclient

        admin = httpclient.InferenceServerClient(server.http_url)
        try:
            for name in layouts:
                label, params, instances, _ = LAYOUTS[name]
                model = f"bench_{name}"
                t0 = time.perf_counter()
                admin.load_model(model)
                load_s = time.perf_counter() - t0
                run_clients(server.grpc_url, model, 4, 3.0, args.max_tokens)  # warm-up
                for c in concurrency:
                    res = run_clients(server.grpc_url, model, c, args.seconds, args.max_tokens)
                    ranks = 2 if params else 1
                    row = {"layout": label, "processes": instances * ranks, "concurrency": c, "load_s": round(load_s, 1), **res}
                    rows.append(row)
                    print(
                        f"{label:12s} C={c:3d}  {res['tokens_per_s']:7.1f} tok/s  {res['requests_per_s']:5.2f} req/s  "
                        f"p50 {res['latency_p50_s']:.2f} s  p99 {res['latency_p99_s']:.2f} s  ({res['requests']} requests, {res['errors']} errors)",
                        flush=True,
                    )
                admin.unload_model(model)
                time.sleep(2)
        finally:
            server.stop()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "bench_parallel.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    base = {r["concurrency"]: r["tokens_per_s"] for r in rows if r["layout"] == "unsplit"}
    lines = [
        f"Model: GPT-2 shape, {args.layers} layers x {args.hidden} hidden x {args.heads} heads, vocab 512; "
        f"{args.max_tokens} new tokens per request, greedy, gRPC streaming; CPU: {describe_cpu()}; {args.seconds:.0f} s per row.",
        "",
        "| layout | processes | clients | tokens/s | vs unsplit | requests/s | p50 latency s | p99 latency s | requests | errors |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        rel = f"{r['tokens_per_s'] / base[r['concurrency']]:.2f}x" if r["concurrency"] in base else "-"
        lines.append(
            f"| {r['layout']} | {r['processes']} | {r['concurrency']} | {r['tokens_per_s']:.1f} | {rel} | "
            f"{r['requests_per_s']:.2f} | {r['latency_p50_s']:.2f} | {r['latency_p99_s']:.2f} | {r['requests']} | {r['errors']} |"
        )
    table = "\n".join(lines)
    (out / "bench_parallel.md").write_text(table + "\n")
    print("\n" + table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
