"""Built-in tiny models with seeded random weights, for tests and offline demos.

`tiny-gpt2` and `tiny-gpt2-draft` share one byte-level BPE vocabulary (shipped in
tiny_tokenizer/), so one can draft for the other. Same name -> same weights, on
every machine: weights come from torch.manual_seed, never from the internet.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

TOKENIZER_DIR = Path(__file__).resolve().parent / "tiny_tokenizer"


@dataclass(frozen=True)
class TinySpec:
    n_layer: int
    n_embd: int
    n_head: int
    n_positions: int
    seed: int


BUILTIN_TINY: dict[str, TinySpec] = {
    "tiny-gpt2": TinySpec(n_layer=2, n_embd=64, n_head=4, n_positions=256, seed=1234),
    "tiny-gpt2-draft": TinySpec(n_layer=1, n_embd=32, n_head=2, n_positions=256, seed=4321),
}


def tiny_tokenizer():
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_file=str(TOKENIZER_DIR / "tokenizer.json"),
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        unk_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )


def build_tiny(name: str):
    """(model, tokenizer) for a built-in tiny GPT-2, float32, eval mode."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    spec = BUILTIN_TINY[name]
    tok = tiny_tokenizer()
    config = GPT2Config(
        vocab_size=len(tok),
        n_positions=spec.n_positions,
        n_embd=spec.n_embd,
        n_layer=spec.n_layer,
        n_head=spec.n_head,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        # Untied: with tied random embeddings every token predicts itself and
        # greedy text is one token repeated, which tests nothing.
        tie_word_embeddings=False,
    )
    torch.manual_seed(spec.seed)
    model = GPT2LMHeadModel(config)
    # Random init gives near-uniform logits; a larger LM head gives them a shape,
    # so greedy choices are decisive and sampling has a distribution to test.
    with torch.no_grad():
        model.lm_head.weight.mul_(10.0)
    model.eval()
    return model, tok
