#!/usr/bin/env python3
"""Check an exported decoder against its PyTorch model on fresh inputs.

    python export/verify_artifact.py MODEL ARTIFACT [--format onnx|onnx-int8|onnx-fp16|torchscript] [--seed N]

MODEL is anything `tritonlm export` accepts; ARTIFACT a model.onnx or model.pt it wrote.
Prints max logit diff and top-1 agreement per case; exits 1 when out of tolerance.
"""

import argparse
import json
import sys
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("artifact")
    p.add_argument("--format", default=None, help="default: from the artifact's export.json, else onnx/torchscript")
    p.add_argument("--seed", type=int, default=12345)
    args = p.parse_args()

    from tritonlm.export.verify import onnx_decoder_fn, torchscript_decoder_fn, verify_decoder
    from tritonlm.models.loading import ModelLoadError, load_model

    path = Path(args.artifact)
    if not path.is_file():
        print(f"error: {path} is not a file", file=sys.stderr)
        return 1
    fmt = args.format
    if fmt is None:
        try:
            fmt = json.loads((path.parent / "export.json").read_text())["format"]
        except (OSError, KeyError, json.JSONDecodeError):
            fmt = "torchscript" if path.suffix == ".pt" else "onnx"
    try:
        model, _, _ = load_model(args.model)
    except ModelLoadError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    fn = torchscript_decoder_fn(path) if fmt == "torchscript" else onnx_decoder_fn(path)
    report = verify_decoder(fn, model, fmt, seed=args.seed)
    for c in report.cases:
        print(f"{c.name:<12} positions {c.positions:>3}  max |logit diff| {c.max_abs_diff:.3g}  top-1 {c.top1_agree}/{c.positions}")
    print(report.summary())
    failure = report.failure()
    if failure:
        print(f"error: out of tolerance: {failure}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
