"""Precision settings side by side on SmolLM2-135M (real weights): speed and agreement.

For each `dtype` (float32, bfloat16, int8, int8_weight_only, and what `auto` picks here) in one run, plus
float32 with plain [in, out] weights (`x @ w`, the layout before the runner packs them at
load), float32 in oneDNN's blocked layout (`-blocked`; the default where tritonlm's AVX-512 or
AVX2 kernels build is its own 16-wide output panels, layers.PanelLinear), int8 through
fbgemm's kernel (`int8-fbgemm`, TRITONLM_INT8_KERNEL=fbgemm; the default is tritonlm's
i8_linear), and float32 / int8 with `attention_backend: gather`
(each row's K/V copied, then SDPA; the default reads them in place with the paged-attention
kernel), and float32 / int8 with the layers run by the Python loop (`-loop`; the default
runs a decode step's layers in one C++ call, the DecoderStack), to show what those changes buy:
    step_ms   median decode step of the torch runner, batch B, context --context
    tok_s     B / step_ms
    vs_fp32   float32's step time / this one's (higher is faster)
    agree     teacher-forced greedy agreement with transformers' float32 generate() on
              --prompts prompts x --tokens tokens (tritonlm_bench.agreement)

    .venv/bin/python perf/bench_precision.py                 # 32 prompts x 128 tokens
    .venv/bin/python perf/bench_precision.py --quick         # 8 x 32, batches 1 and 32
    .venv/bin/python perf/bench_precision.py --rows float32,int8,int8_weight_only   # those rows only
Prints the CPU it ran on; writes results/bench_precision/bench_precision.csv and .png.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

from tritonlm.engine.precision import resolve_precision
from tritonlm.engine.runners.layers import INT8_KERNEL_ENV
from tritonlm.engine.runners.model import Transformer
from tritonlm.engine.runners.torch_runner import TorchRunner
from tritonlm.engine.runners.weight_only import calibration_ids, quantize_weight_only
from tritonlm.perf.machine import describe_cpu
from tritonlm.perf.report import add_out_arg, optional_figure, save_figure, write_csv
from tritonlm_bench.agreement import smollm2_reference, teacher_forced_agreement
from tritonlm_bench.steptime import decode_step_ms


@contextlib.contextmanager
def int8_kernel_forced(kernel: str | None) -> Iterator[None]:
    """TRITONLM_INT8_KERNEL=kernel while a runner is built (it is read at load), then as it was."""
    before = os.environ.get(INT8_KERNEL_ENV)
    if kernel is not None:
        os.environ[INT8_KERNEL_ENV] = kernel
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(INT8_KERNEL_ENV, None)
        else:
            os.environ[INT8_KERNEL_ENV] = before


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--context", type=int, default=192)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rows", default=None, help="comma-separated row names to run (default: all)")
    add_out_arg(ap, "bench_precision")
    args = ap.parse_args()
    if args.quick:
        args.prompts, args.tokens, args.batches, args.reps = 8, 32, "1,32", 5
    cpu = describe_cpu()
    print(f"CPU: {cpu}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    model, prompts, reference = smollm2_reference(args.prompts, args.tokens)
    auto = resolve_precision("auto", "cpu")
    print(f"dtype auto here: {auto.name} ({auto.reason})")
    settings = [("float32", {}), ("float32-blocked", {}), ("float32-gather", {"attention": "gather"}), ("float32-plain", {}),
                ("bfloat16", {"dtype": torch.bfloat16}), ("int8", {"int8": True}), ("int8-fbgemm", {"int8": True}),
                ("int8-gather", {"int8": True, "attention": "gather"}), ("int8_weight_only", {"int8_weight_only": True}),
                ("int8_weight_only-gptq", {}),
                ("float32-loop", {}), ("int8-loop", {"int8": True})]
    if args.rows:
        wanted = args.rows.split(",")
        unknown = set(wanted) - {name for name, _ in settings}
        if unknown or "float32" not in wanted:
            ap.error(f"--rows: {sorted(unknown) or 'float32 is needed'} (rows: {', '.join(n for n, _ in settings)}; "
                     "float32 is the baseline)")
        settings = [(name, kwargs) for name, kwargs in settings if name in wanted]
    rows = []
    for name, kwargs in settings:
        with int8_kernel_forced("fbgemm" if name == "int8-fbgemm" else None):
            runner = TorchRunner(model, **kwargs)
        if name == "float32-plain":
            runner.transformer = Transformer.from_hf(model)  # the same weights, [in, out], not blocked
            runner.transformer.use_paged_kernel()
        if name == "float32-blocked":
            runner.transformer = Transformer.from_hf(model)  # oneDNN's blocked layout instead of the panels
            runner.transformer.block_weights("blocked")
            runner.transformer.use_paged_kernel()
        if name == "int8_weight_only-gptq":  # GPTQ's rounding, calibrated on seeded random tokens
            runner.transformer = Transformer.from_hf(model)
            quantize_weight_only(runner.transformer, calibration_ids(model))
            runner.transformer.block_weights()
            runner.transformer.use_paged_kernel()
        if name.endswith("-loop"):
            runner.transformer.decoder_stack = None  # the layers through the Python loop, not the C++ stack
        agree = teacher_forced_agreement(runner, prompts, reference)
        for batch in map(int, args.batches.split(",")):
            ms = decode_step_ms(runner, batch, args.context, args.reps)
            rows.append({"dtype": name, "attention": runner.attention, "auto_picks": name == auto.name, "batch": batch,
                         "context": args.context,
                         "step_ms": round(ms, 2), "tok_s": round(batch / ms * 1000, 1),
                         "agree": round(agree.fraction, 4), "agreed": agree.agreed, "total": agree.total, "cpu": cpu})
        del runner
    fp32 = {r["batch"]: r["step_ms"] for r in rows if r["dtype"] == "float32"}
    for r in rows:
        r["vs_fp32"] = round(fp32[r["batch"]] / r["step_ms"], 2)
    print(f"\n{'dtype':<15} {'attention':<9} {'batch':>5} {'step_ms':>9} {'tok_s':>8} {'vs_fp32':>8} {'agree':>7}")
    for r in rows:
        mark = " (auto)" if r["auto_picks"] else ""
        print(f"{r['dtype']:<15} {r['attention']:<9} {r['batch']:>5} {r['step_ms']:>9.1f} {r['tok_s']:>8.1f} "
              f"{r['vs_fp32']:>8.2f} {r['agree']:>7.4f}{mark}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "bench_precision.csv", rows)
    drawn = optional_figure(figsize=(6, 4))
    if drawn:
        fig, ax = drawn
        for name, _ in settings:
            pts = [r for r in rows if r["dtype"] == name]
            ax.plot([r["batch"] for r in pts], [r["tok_s"] for r in pts], marker="o",
                    label=f"{name} (agree {pts[0]['agree']:.3f})")
        ax.set_xlabel("batch")
        ax.set_ylabel("decode tokens/s (in-process)")
        ax.set_title(f"SmolLM2-135M decode, context {args.context}\n{cpu}", fontsize=8)
        ax.legend()
        save_figure(fig, out / "bench_precision.png", dpi=120)
    print(f"wrote {out / 'bench_precision.csv'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
