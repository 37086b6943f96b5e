#!/usr/bin/env python3
"""Decode speed of the exported artifacts against transformers eager, and the memory roofline.

A GPT-2-small-shaped model (GPT2Config() defaults: 12 layers, 768 wide, 50257 vocab, tied
LM head; random weights, nothing downloaded) is exported to fp32 ONNX, int8 ONNX and
TorchScript. Each path then runs a greedy-shaped decode loop (prompt of PROMPT tokens, then
STEPS single-token steps feeding back the returned KV cache) at batch 1 and batch 8.

Batch-1 decode reads every weight once per token, so its ceiling is
    roofline tokens/s = memory bandwidth / weight bytes.
Bandwidth is measured here (best of a multi-threaded torch read and a numpy copy, taken
at the start and again before each round; best of all).

    python perf/bench_export.py [--steps 64] [--repeats 3] [--out results/bench_export.csv]
"""

from __future__ import annotations

import argparse
import csv
import gc
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from tritonlm.perf.machine import describe_cpu

PROMPT = 8


# ---- memory bandwidth -------------------------------------------------------------------------

def measure_bandwidth(gib: float = 1.0, repeats: int = 5) -> dict[str, float]:
    """Bytes/s: torch sum over a large tensor (reads, all intra-op threads) and numpy copy
    (read + write counted)."""
    n = int(gib * (1 << 30)) // 4
    t = torch.ones(n, dtype=torch.float32)
    t.sum()  # touch
    best_read = 0.0
    for _ in range(repeats):
        s = time.perf_counter()
        t.sum()
        best_read = max(best_read, 4 * n / (time.perf_counter() - s))
    del t
    a = np.ones(n // 2, dtype=np.float32)
    b = np.empty_like(a)
    np.copyto(b, a)
    best_copy = 0.0
    for _ in range(repeats):
        s = time.perf_counter()
        np.copyto(b, a)
        best_copy = max(best_copy, 2 * a.nbytes / (time.perf_counter() - s))
    del a, b
    gc.collect()
    return {"torch_read": best_read, "numpy_copy": best_copy, "best": max(best_read, best_copy)}


def onnx_weight_bytes(path: Path) -> int:
    """Initializer bytes a decode step reads: all of them except tables only gathered from
    (token/position embeddings read a few rows per step)."""
    import onnx

    graph = onnx.load(str(path), load_external_data=True).graph
    users: dict[str, set[str]] = {}
    for node in graph.node:
        for i in node.input:
            users.setdefault(i, set()).add(node.op_type)
    total = 0
    for t in graph.initializer:
        if users.get(t.name, set()) <= {"Gather"} and users.get(t.name):
            continue
        total += len(t.raw_data) if t.raw_data else onnx.numpy_helper.to_array(t).nbytes
    return total


def torch_weight_bytes(model) -> int:
    """Parameter bytes a decode step reads: all but the position embedding table (the token
    embedding is the tied LM head, read in full)."""
    skip = {id(p) for n, p in model.named_parameters() if n.endswith("wpe.weight")}
    return sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in skip)


# ---- decode loops -----------------------------------------------------------------------------

def _prompt(batch: int, vocab: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, size=(batch, PROMPT)).astype(np.int64)


def decode_onnx(path: Path, cfg, batch: int, steps: int) -> float:
    """tokens/s (batch x steps new tokens / time of the decode steps; prefill excluded)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    n = cfg.n_layer
    head = cfg.n_embd // cfg.n_head
    ids = _prompt(batch, cfg.vocab_size)
    feed = {"input_ids": ids, "attention_mask": np.ones((batch, PROMPT), dtype=np.int64),
            "position_ids": np.tile(np.arange(PROMPT), (batch, 1)).astype(np.int64)}
    for i in range(n):
        for kv in ("key", "value"):
            feed[f"past_key_values.{i}.{kv}"] = np.zeros((batch, cfg.n_head, 0, head), dtype=np.float32)
    out_names = [o.name for o in sess.get_outputs()]
    outs = sess.run(out_names, feed)
    start = None
    for step in range(steps + 1):
        if step == 1:
            start = time.perf_counter()  # the first decode step is warm-up
        nxt = outs[0][:, -1].argmax(-1).reshape(batch, 1).astype(np.int64)
        p = outs[1].shape[2]
        feed = {"input_ids": nxt, "attention_mask": np.ones((batch, p + 1), dtype=np.int64),
                "position_ids": np.full((batch, 1), p, dtype=np.int64)}
        for i in range(n):
            feed[f"past_key_values.{i}.key"] = outs[1 + 2 * i]
            feed[f"past_key_values.{i}.value"] = outs[2 + 2 * i]
        outs = sess.run(out_names, feed)
    elapsed = time.perf_counter() - start
    del sess
    return batch * steps / elapsed


def decode_torchscript(path: Path, cfg, batch: int, steps: int) -> float:
    module = torch.jit.load(str(path)).eval()
    n = cfg.n_layer
    head = cfg.n_embd // cfg.n_head
    ids = torch.from_numpy(_prompt(batch, cfg.vocab_size))
    past = [torch.zeros(batch, cfg.n_head, 0, head) for _ in range(2 * n)]
    with torch.no_grad(), torch.jit.optimized_execution(False):
        outs = module(ids, torch.ones(batch, PROMPT, dtype=torch.long),
                      torch.arange(PROMPT).repeat(batch, 1), *past)
        start = None
        for step in range(steps + 1):
            if step == 1:
                start = time.perf_counter()
            nxt = outs[0][:, -1].argmax(-1, keepdim=True)
            p = outs[1].shape[2]
            outs = module(nxt, torch.ones(batch, p + 1, dtype=torch.long),
                          torch.full((batch, 1), p, dtype=torch.long), *outs[1:])
    return batch * steps / (time.perf_counter() - start)


def decode_eager(model, cfg, batch: int, steps: int) -> float:
    from transformers import DynamicCache

    ids = torch.from_numpy(_prompt(batch, cfg.vocab_size))
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        out = model(input_ids=ids, cache=cache, use_cache=True)
        start = None
        for step in range(steps + 1):
            if step == 1:
                start = time.perf_counter()
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            out = model(input_ids=nxt, cache=out.cache, use_cache=True)
    return batch * steps / (time.perf_counter() - start)


# ---- main -------------------------------------------------------------------------------------

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=64, help="decode steps timed per run (default 64)")
    ap.add_argument("--repeats", type=int, default=3, help="runs per path; the best is reported (default 3)")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--out", default="results/bench_export.csv")
    ap.add_argument("--workdir", default=None, help="where the artifacts go (default: a temporary folder)")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]

    from transformers import GPT2Config, GPT2LMHeadModel

    from tritonlm.export.onnx_export import export_decoder_onnx, quantize_int8
    from tritonlm.export.torchscript_export import export_decoder_torchscript

    print(f"CPU: {describe_cpu()}; torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
    bw = measure_bandwidth()
    print(f"memory bandwidth: torch read {bw['torch_read'] / 1e9:.1f} GB/s, numpy copy {bw['numpy_copy'] / 1e9:.1f} GB/s "
          f"-> {bw['best'] / 1e9:.1f} GB/s", flush=True)

    torch.manual_seed(0)
    cfg = GPT2Config()  # GPT-2 small shape
    model = GPT2LMHeadModel(cfg).eval()
    params = sum(p.numel() for p in model.parameters())  # tied LM head counted once
    if args.workdir:
        Path(args.workdir).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        tmp = Path(tmp)
        t0 = time.perf_counter()
        fp32 = export_decoder_onnx(model, tmp / "fp32.onnx")
        print(f"exported fp32 ONNX in {time.perf_counter() - t0:.0f} s", flush=True)
        t0 = time.perf_counter()
        int8 = quantize_int8(fp32, tmp / "int8.onnx")
        print(f"quantized int8 in {time.perf_counter() - t0:.0f} s", flush=True)
        ts = export_decoder_torchscript(model, tmp / "model.pt")
        weight_bytes = {"onnx-fp32": onnx_weight_bytes(fp32), "onnx-int8": onnx_weight_bytes(int8),
                         "torchscript": torch_weight_bytes(model), "eager": torch_weight_bytes(model)}
        file_bytes = {"onnx-fp32": fp32.stat().st_size, "onnx-int8": int8.stat().st_size,
                      "torchscript": ts.stat().st_size, "eager": params * 4}
        gc.collect()
        paths = {
            "onnx-fp32": lambda b: decode_onnx(fp32, cfg, b, args.steps),
            "onnx-int8": lambda b: decode_onnx(int8, cfg, b, args.steps),
            "torchscript": lambda b: decode_torchscript(ts, cfg, b, args.steps),
            "eager": lambda b: decode_eager(model, cfg, b, args.steps),
        }
        # Round-robin over the paths, best of the repeats: on a shared machine, load that
        # comes and goes then hits every path alike.
        best: dict[tuple[str, int], float] = {}
        for r in range(args.repeats):
            # bandwidth too is best-of across the rounds: the roofline is what the machine can do
            again = measure_bandwidth(repeats=3)
            for k in bw:
                bw[k] = max(bw[k], again[k])
            for name, fn in paths.items():
                for b in batches:
                    tps = fn(b)
                    best[(name, b)] = max(best.get((name, b), 0.0), tps)
                    print(f"  round {r + 1}: {name:<12} batch {b}: {tps:7.1f} tokens/s", flush=True)
                    gc.collect()
        rows = []
        for name in paths:
            for b in batches:
                roof = bw["best"] / weight_bytes[name] * b
                rows.append({"path": name, "batch": b, "tokens_per_s": best[(name, b)],
                             "weight_bytes": weight_bytes[name], "file_bytes": file_bytes[name],
                             "roofline_tokens_per_s": roof, "fraction_of_roofline": best[(name, b)] / roof})

    by = {(r["path"], r["batch"]): r["tokens_per_s"] for r in rows}
    print()
    print(f"GPT-2 small shape, {params / 1e6:.0f}M params, prompt {PROMPT}, {args.steps} decode steps, best of {args.repeats}")
    print(f"memory bandwidth {bw['best'] / 1e9:.1f} GB/s")
    print("weights MB = bytes one decode step reads (embedding tables that are only gathered excluded)")
    print(f"{'path':<12} {'batch':>5} {'tokens/s':>9} {'weights MB':>10} {'roofline':>9} {'of roofline':>11}")
    for r in rows:
        print(f"{r['path']:<12} {r['batch']:>5} {r['tokens_per_s']:>9.1f} {r['weight_bytes'] / 1e6:>10.0f} "
              f"{r['roofline_tokens_per_s']:>9.1f} {r['fraction_of_roofline']:>10.0%}")
    if (("onnx-int8", 1) in by) and (("onnx-fp32", 1) in by):
        ratio = by[("onnx-int8", 1)] / by[("onnx-fp32", 1)]
        print(f"int8 / fp32 at batch 1: {ratio:.2f}x (target >= 2x)")
        fp32_row = next(r for r in rows if r["path"] == "onnx-fp32" and r["batch"] == 1)
        print(f"fp32 ONNX batch 1: {fp32_row['fraction_of_roofline']:.0%} of roofline (target >= 85%)")

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["path", "batch", "tokens_per_s", "weight_bytes", "file_bytes", "roofline_tokens_per_s",
                                          "fraction_of_roofline", "bandwidth_bytes_per_s", "steps"])
        w.writeheader()
        for r in rows:
            w.writerow({**r, "bandwidth_bytes_per_s": bw["best"], "steps": args.steps})
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
