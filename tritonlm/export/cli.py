"""`tritonlm export` and `tritonlm serve-default`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tritonlm.export.pipeline import ALL_FORMATS


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

    s = sub.add_parser(
        "serve-default",
        help="export a model into a repository if not there yet, then serve the repository",
    )
    s.add_argument("--model", default="smollm2-135m", help="model to serve (default: smollm2-135m)")
    s.add_argument("--draft", default=None, help="draft model for speculative decoding (same tokenizer)")
    s.add_argument("--name", default=None, help="Triton model name (default: from the model name)")
    s.add_argument("--formats", default=None,
                   help="formats to export when exporting (default: onnx, where the model's family exports it)")
    s.add_argument("--max-context", type=int, default=None)
    s.add_argument("--device", default="cpu")
    s.add_argument("--force", action="store_true", help="export again even if the model is already there")
    from tritonlm.commands.serve import add_server_args

    add_server_args(s)
    s.set_defaults(func=run_serve_default, default_formats="onnx")


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


def options_from_args(args: argparse.Namespace):
    from tritonlm.export.pipeline import ExportOptions, parse_formats

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
    from tritonlm.cli import CliError
    from tritonlm.export.pipeline import ExportError, export, export_summary_json

    try:
        result = export(options_from_args(args), out=lambda s: print(s, flush=True))
    except ExportError as e:
        raise CliError(str(e)) from None
    if args.json:
        print(json.dumps(export_summary_json(result), indent=2))
    return 0


def default_name(model: str) -> str:
    from tritonlm.models.loading import sanitize_name

    return sanitize_name(model)


def stamped_model_ref(stamp: dict) -> str | None:
    """The model reference an export.json was made from. Repositories exported before the
    key was named "model_ref" carry it as "spec"."""
    source = stamp.get("source", {})
    return source.get("model_ref", source.get("spec"))


def already_exported(repo: Path, name: str, model: str, draft: str | None) -> bool:
    """The generation entry is there, exported from the same model (and draft)."""
    cfg = repo / name / "config.pbtxt"
    try:
        stamp = json.loads((repo / name / "1" / "export.json").read_text())
    except (OSError, json.JSONDecodeError):
        return False
    if not cfg.is_file() or stamped_model_ref(stamp) != model:
        return False
    if draft:
        try:
            dstamp = json.loads((repo / f"{name}_draft" / "1" / "export.json").read_text())
        except (OSError, json.JSONDecodeError):
            return False
        if stamped_model_ref(dstamp) != draft or "draft_model" not in cfg.read_text():
            return False
    elif "draft_model" in cfg.read_text():
        return False
    return True


def run_serve_default(args: argparse.Namespace) -> int:
    from tritonlm.cli import CliError
    from tritonlm.commands.serve import check_server_args, serve
    from tritonlm.export.pipeline import ExportError, export

    check_server_args(args)  # refuse an unsafe host / model-control mix before exporting
    repo = Path(args.repo)
    name = args.name or default_name(args.model)
    if not args.force and already_exported(repo, name, args.model, args.draft):
        print(f"{name} is already in {repo} (exported from {args.model}); serving it (--force exports again)")
    else:
        print(f"exporting {args.model} into {repo} as {name} ...", flush=True)
        args.runtime = "auto"
        try:
            export(options_from_args(args), out=lambda s: print(s, flush=True))
        except ExportError as e:
            raise CliError(str(e)) from None
    return serve(repo, args)


def main(argv: list[str] | None = None) -> int:
    """`tritonlm` with these subcommands (the export/ scripts call it)."""
    from tritonlm.cli import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
