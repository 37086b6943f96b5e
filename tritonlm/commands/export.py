"""`tritonlm export`: export a model into a Triton model repository. tritonlm/export does
the work; this module reads the command line into its ExportOptions."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tritonlm.errors import CliError
from tritonlm.export.pipeline import (
    ALL_FORMATS,
    ExportError,
    ExportOptions,
    export,
    export_summary_json,
    parse_formats,
)


def add_parser(sub) -> None:
    p = sub.add_parser(
        "export",
        help="export a model (ONNX / int8 / fp16 / TorchScript) into a Triton model repository",
        description="Export MODEL, verify every artifact against PyTorch, and write a Triton model repository: "
        "forward-pass models NAME_onnx, NAME_onnx_int8, NAME_onnx_fp16, NAME_torchscript and the generation "
        "model NAME.",
    )
    p.add_argument("model", help="built-in (tiny-gpt2, tiny-gpt2-draft, smollm2-135m), .gguf file, "
                   "Hugging Face model folder, or Hugging Face id (gpt2, distilgpt2)")
    add_export_args(p)
    p.add_argument("--formats", default=None,
                   help=f"comma-separated, from {','.join(ALL_FORMATS)}, or none: the generation model alone "
                   "(default: all the model's family exports)")
    p.add_argument("--json", action="store_true", help="print a JSON summary at the end")
    p.set_defaults(func=run_export)


def add_export_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--name", default=None, help="Triton model name (default: sanitized model name)")
    p.add_argument("--repo", default="model_repository", help="model repository folder (default: model_repository)")
    p.add_argument("--draft", default=None, help="draft model for speculative decoding (must share the tokenizer)")
    p.add_argument("--max-context", type=int, default=None, help="context length (default: the model's positions)")
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N: where Triton runs the models")
    p.add_argument("--runtime", default="auto", choices=["auto", "native", "python"],
                   help="forward models on Triton's own onnxruntime/pytorch backends (native) or inside the "
                   "tritonlm backend (python); default: native when the server has those backends")
    p.add_argument("--generate-runtime", default="torch", choices=["torch", "onnx"],
                   help="what the generation model NAME runs (default: torch)")
    p.add_argument("--max-queue-delay-us", type=int, default=5000, help="dynamic batching delay (default 5000)")
    p.add_argument("--max-batch-size", type=int, default=16, help="forward models' max_batch_size (default 16)")
    p.add_argument("--instances", type=int, default=1, help="model instances per forward model (default 1)")
    p.add_argument("--kv-cache-bytes", type=_bytes, default=None,
                   help="KV cache budget of the generation model (default: 8 full-context sequences)")
    p.add_argument("--kv-cache-fraction", type=float, default=None,
                   help="KV cache budget as a fraction of free memory (instead of --kv-cache-bytes)")
    p.add_argument("--force", action="store_true", help="re-export even when verified artifacts are already there")


def _bytes(text: str) -> int:
    from tritonlm.engine.settings import SettingsError, parse_bytes

    try:
        return parse_bytes("--kv-cache-bytes", text)
    except SettingsError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def options_from_args(args: argparse.Namespace) -> ExportOptions:
    """ExportOptions from `tritonlm export`'s arguments, or serve-default's (which lack some:
    those take export's defaults)."""
    return ExportOptions(
        model=args.model,
        name=args.name,
        repo=Path(args.repo),
        formats=None if args.formats is None else parse_formats(args.formats),
        default_formats=parse_formats(getattr(args, "default_formats", None) or "all"),
        draft=args.draft,
        max_context=args.max_context,
        device=args.device,
        runtime=getattr(args, "runtime", "auto"),
        generate_runtime=getattr(args, "generate_runtime", "torch"),
        max_queue_delay_us=getattr(args, "max_queue_delay_us", 5000),
        max_batch_size=getattr(args, "max_batch_size", 16),
        instances=getattr(args, "instances", 1),
        kv_cache_bytes=getattr(args, "kv_cache_bytes", None),
        kv_cache_fraction=getattr(args, "kv_cache_fraction", None),
        force=args.force,
    )


def run_export(args: argparse.Namespace) -> int:
    try:
        result = export(options_from_args(args), out=lambda s: print(s, flush=True))
    except ExportError as e:
        raise CliError(str(e)) from None
    if args.json:
        print(json.dumps(export_summary_json(result), indent=2))
    return 0
