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
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tritonlm.client.generate import GenerateError, generate_grpc  # noqa: E402
from tritonlm.commands.instances import set_instances  # noqa: E402
from tritonlm.export.repository import write_generate_config  # noqa: E402
from tritonlm.server import TritonServer, free_ports  # noqa: E402

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


def write_model(repo: Path, name: str, hf_src: Path, params: dict, instances: int, kind: str, max_context: int) -> None:
    import shutil

    model_dir = repo / name
    shutil.copytree(hf_src, model_dir / "1" / "hf")
    write_generate_config(
        model_dir, name, max_context=max_context,
        extra_parameters={"max_num_seqs": "64", "max_num_batched_tokens": "512", **params},
    )
    set_instances(model_dir, instances, kind)


def run_clients(url: str, model: str, concurrency: int, seconds: float, max_tokens: int) -> dict:
    stop = time.monotonic() + seconds
    lock = threading.Lock()
    latencies: list[float] = []
    tokens = [0]
    errors = [0]

    def client(i: int) -> None:
        import tritonclient.grpc as grpcclient

        conn = grpcclient.InferenceServerClient(url)
        k = i
        while time.monotonic() < stop:
            t0 = time.perf_counter()
            try:
                r = generate_grpc(url, model, PROMPTS[k % len(PROMPTS)], client=conn, max_tokens=max_tokens,
                                  stream=True, exclude_input_in_output=True, end_id=-1, timeout_s=120)
            except GenerateError:
                with lock:
                    errors[0] += 1
                continue
            finally:
                k += 1
            with lock:
                latencies.append(time.perf_counter() - t0)
                tokens[0] += r.num_output_tokens
        conn.close()

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    lat = sorted(latencies)
    return {
        "requests": len(lat),
        "errors": errors[0],
        "tokens_per_s": tokens[0] / wall,
        "requests_per_s": len(lat) / wall,
        "p50_s": statistics.median(lat) if lat else float("nan"),
        "p99_s": lat[min(len(lat) - 1, int(0.99 * len(lat)))] if lat else float("nan"),
        "wall_s": wall,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layouts", default="unsplit,x2,tp2,pp2", help=f"comma-separated, of {list(LAYOUTS)}")
    ap.add_argument("--concurrency", default="8,32")
    ap.add_argument("--seconds", type=float, default=20.0, help="measuring time per (layout, concurrency)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--out", default=str(ROOT / "results"))
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
                        f"p50 {res['p50_s']:.2f} s  p99 {res['p99_s']:.2f} s  ({res['requests']} requests, {res['errors']} errors)",
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
        f"{args.max_tokens} new tokens per request, greedy, gRPC streaming; {os.cpu_count()} CPU cores; {args.seconds:.0f} s per row.",
        "",
        "| layout | processes | clients | tokens/s | vs unsplit | requests/s | p50 latency s | p99 latency s | requests | errors |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        rel = f"{r['tokens_per_s'] / base[r['concurrency']]:.2f}x" if r["concurrency"] in base else "-"
        lines.append(
            f"| {r['layout']} | {r['processes']} | {r['concurrency']} | {r['tokens_per_s']:.1f} | {rel} | "
            f"{r['requests_per_s']:.2f} | {r['p50_s']:.2f} | {r['p99_s']:.2f} | {r['requests']} | {r['errors']} |"
        )
    table = "\n".join(lines)
    (out / "bench_parallel.md").write_text(table + "\n")
    print("\n" + table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
