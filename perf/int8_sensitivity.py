"""Where int8's disagreement with float32 comes from, on SmolLM2-135M (real weights).

The int8 model (`dtype: int8`: residual rotation, SmoothQuant, per-channel int8 weights,
per-token int8 activations) is built again with some projections left float32
(runners.quant.quantize_int8's keep_float), and each variant is measured:
    float_share  of the projections' weights kept float
    agree        teacher-forced greedy agreement with transformers' float32 generate()
                 (tritonlm_bench.agreement), on bench_precision.py's prompts (perf/tritonlm_bench/agreement.py)
    step_ms      median decode step at batch --batch, context --context (tok_s = batch / step)

Variants: int8 as served; the LM head kept; every down; every MLP (gate_up and down) and
the head; every o, down and the head; the first half of the layers and the head; all
(float32 through the same folds: agreement 1.0 checks the method). --per-layer adds each
layer kept whole, to see whether a few layers carry the error.

    .venv/bin/python perf/int8_sensitivity.py              # 32 prompts x 128 tokens
    .venv/bin/python perf/int8_sensitivity.py --per-layer  # + one row per layer
Prints the CPU it ran on; writes results/int8_sensitivity/int8_sensitivity.csv.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from tritonlm.engine.runners.layers import Int8Linear
from tritonlm.engine.runners.model import Transformer
from tritonlm.engine.runners.torch_runner import TorchRunner
from tritonlm.perf.machine import describe_cpu
from tritonlm.perf.report import add_out_arg, write_csv
from tritonlm_bench.agreement import smollm2_reference, teacher_forced_agreement
from tritonlm_bench.steptime import decode_step_ms


def layer_of(name: str) -> int | None:
    """3 for "layers.3.down", None for "lm_head"."""
    return int(name.split(".")[1]) if name.startswith("layers.") else None


def kind_of(name: str) -> str:
    return name.rsplit(".", 1)[-1]


def variants(layers: int, per_layer: bool) -> list[tuple[str, Callable[[str], bool]]]:
    half = layers // 2
    out: list[tuple[str, Callable[[str], bool]]] = [
        ("int8", lambda n: False),
        ("head", lambda n: n == "lm_head"),
        ("every down", lambda n: kind_of(n) == "down"),
        ("every MLP + head", lambda n: n == "lm_head" or kind_of(n) in ("gate_up", "fc", "down")),
        ("every o, down + head", lambda n: n == "lm_head" or kind_of(n) in ("o", "down")),
        (f"layers 0-{half - 1} + head", lambda n: n == "lm_head" or layer_of(n) < half),
        ("all (float32)", lambda n: True),
    ]
    if per_layer:
        out += [(f"layer {i}", lambda n, i=i: layer_of(n) == i) for i in range(layers)]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=192)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--per-layer", action="store_true", help="also each layer kept float, alone")
    add_out_arg(ap, "int8_sensitivity")
    args = ap.parse_args()
    cpu = describe_cpu()
    print(f"CPU: {cpu}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    model, prompts, reference = smollm2_reference(args.prompts, args.tokens)
    params = {n: p.w.numel() for n, p in Transformer.from_hf(model).projection_names().items()}  # float, unsliced
    rows = []
    print(f"\n{'kept float':<24} {'float_share':>11} {'agree':>7} {'step_ms':>8} {'tok_s':>7}", flush=True)
    for name, keep in variants(model.config.num_hidden_layers, args.per_layer):
        runner = TorchRunner(model, int8=True, int8_keep_float=keep)
        kept = [n for n, p in runner.transformer.projection_names().items() if not isinstance(p, Int8Linear)]
        share = sum(params[n] for n in kept) / sum(params.values())
        agree = teacher_forced_agreement(runner, prompts, reference)
        ms = decode_step_ms(runner, args.batch, args.context, args.reps)
        rows.append({"kept_float": name, "float_share": round(share, 3), "agree": round(agree.fraction, 4),
                     "agreed": agree.agreed, "total": agree.total, "batch": args.batch, "context": args.context,
                     "step_ms": round(ms, 2), "tok_s": round(args.batch / ms * 1000, 1), "cpu": cpu})
        r = rows[-1]
        print(f"{name:<24} {r['float_share']:>11.3f} {r['agree']:>7.4f} {r['step_ms']:>8.1f} {r['tok_s']:>7.1f}", flush=True)
        del runner
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "int8_sensitivity.csv", rows)
    print(f"wrote {out / 'int8_sensitivity.csv'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
