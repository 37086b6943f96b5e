"""Build small generation-model repositories for tests (seeded tiny weights, no downloads)."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from tritonlm.export.repository import write_generation_model
from tritonlm.models.builtin import build_tiny


@lru_cache(maxsize=None)
def tiny(name: str = "tiny-gpt2"):
    """(model, tokenizer) shared by every test of a process: the HF reference."""
    return build_tiny(name)


def add_generation_model(repo: Path, name: str, builtin: str = "tiny-gpt2", **parameters) -> Path:
    """repo/name/{config.pbtxt, 1/hf/} for a built-in tiny model; parameters go to config.pbtxt."""
    model, tok = tiny(builtin)
    return write_generation_model(repo, name, model, tok, **parameters)


def hf_greedy(prompt: str, max_tokens: int, builtin: str = "tiny-gpt2", **kwargs) -> list[int]:
    """transformers' own generate(), greedy: the reference token ids (EOS and after removed)."""
    model, tok = tiny(builtin)
    ids = tok(prompt, return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=max_tokens, do_sample=False, pad_token_id=tok.eos_token_id, **kwargs)
    new = out[0, ids.input_ids.shape[1]:].tolist()
    if tok.eos_token_id in new:
        new = new[: new.index(tok.eos_token_id)]
    return new
