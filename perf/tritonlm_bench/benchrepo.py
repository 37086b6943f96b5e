"""Model repositories the benchmark scripts serve (perf/*.py): what the server loads, written
the way `tritonlm export` writes a generation model (tritonlm/export/repository.py).

A benchmark often serves one set of weights under several names, each with other
settings (dtype, KV cache on or off, instances, parallelism): the weights are saved once,
outside the repository, and each entry's `1/hf` links to them.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from tritonlm.export.repository import write_generate_config


def save_weights_once(model, tokenizer, folder: Path) -> Path:
    """model and tokenizer saved to folder (Hugging Face layout), unless a previous run did."""
    if not (folder / "config.json").is_file():
        folder.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    return folder


def link_generation_model(repo: Path, name: str, weights: Path, max_context: int, **parameters) -> Path:
    """repo/name: the generation model's config.pbtxt (parameters as strings) and `1/hf` a
    relative link to the saved weights."""
    model_dir = Path(repo) / name
    link = model_dir / "1" / "hf"
    link.parent.mkdir(parents=True, exist_ok=True)
    if link.is_symlink() or link.is_file():
        link.unlink()
    elif link.is_dir():  # weights saved in place by an earlier run
        shutil.rmtree(link)
    link.symlink_to(os.path.relpath(weights, link.parent))
    write_generate_config(model_dir, name, max_context=max_context, extra_parameters={k: str(v) for k, v in parameters.items()})
    return model_dir


def tiny_model_repo(repo: Path, name: str = "tiny", **parameters):
    """repo, emptied first, holding one generation model: the built-in tiny-gpt2 (seeded
    random weights, nothing downloaded) under `name`. Returns (model, tokenizer), the same
    weights the server loads."""
    from tritonlm.export.repository import write_generation_model
    from tritonlm.models.builtin import build_tiny

    repo = Path(repo)
    if repo.exists():
        shutil.rmtree(repo)
    model, tokenizer = build_tiny("tiny-gpt2")
    write_generation_model(repo, name, model, tokenizer, **parameters)
    return model, tokenizer
