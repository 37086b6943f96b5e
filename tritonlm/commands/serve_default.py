"""`tritonlm serve-default`: export a model into the repository unless it is there already
(exported from the same model and draft), then serve the repository as `tritonlm serve`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tritonlm.commands import serve as serve_command
from tritonlm.commands.export import options_from_args
from tritonlm.errors import CliError
from tritonlm.export.pipeline import ExportError, export
from tritonlm.models.loading import sanitize_name


def add_parser(sub) -> None:
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
    serve_command.add_server_args(s)
    s.set_defaults(func=run_serve_default, default_formats="onnx")


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
    serve_command.check_server_args(args)  # refuse an unsafe host / model-control mix before exporting
    repo = Path(args.repo)
    name = args.name or sanitize_name(args.model)
    if not args.force and already_exported(repo, name, args.model, args.draft):
        print(f"{name} is already in {repo} (exported from {args.model}); serving it (--force exports again)")
    else:
        print(f"exporting {args.model} into {repo} as {name} ...", flush=True)
        args.runtime = "auto"
        try:
            export(options_from_args(args), out=lambda s: print(s, flush=True))
        except ExportError as e:
            raise CliError(str(e)) from None
    return serve_command.serve(repo, args)
