"""Loading a model's tokenizer, and checking that a draft model shares its target's."""

from __future__ import annotations

import logging

from tritonlm.engine.settings import SettingsError

log = logging.getLogger(__name__)


def error_summary(e: Exception) -> str:
    """`TypeName: first line of the message`, for errors that name a config field."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}"


def load_tokenizer(hf_dir, field: str = "hf_dir"):
    """The tokenizer saved in hf_dir; a folder without one refuses to load, naming `field`."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(hf_dir))
    except Exception as e:  # transformers raises OSError/ValueError/... for a missing or broken tokenizer
        raise SettingsError(
            f"{field}: no usable tokenizer in {hf_dir} ({error_summary(e)}); save the model's tokenizer there "
            "(tokenizer.json, or vocab.json + merges.txt) or re-export the model"
        ) from None
    if tok.eos_token_id is None:
        log.warning("tokenizer of %s has no EOS token: generation stops only on max_tokens/stop words", hf_dir)
    return tok


class TokenizerMismatch(SettingsError):
    """A draft's tokenizer maps some tokens to other ids than its target's. The message is
    the engine's (naming the draft_model parameter); the fields let other layers (export)
    word it their own way."""

    def __init__(self, message: str, *, differ: int, total: int, example: str,
                 target_id: int | None, draft_id: int | None, target_size: int, draft_size: int):
        super().__init__(message)
        self.differ = differ  # tokens whose id differs (or that only one side has)
        self.total = total  # tokens in either vocabulary
        self.example = example
        self.target_id, self.draft_id = target_id, draft_id
        self.target_size, self.draft_size = target_size, draft_size


def check_same_tokenizer(target_tokenizer, draft_tokenizer, draft_dir) -> None:
    """A draft proposes token ids the target verifies: both must mean the same text by
    every id. Compares the whole vocabularies (token -> id), special tokens included;
    TokenizerMismatch (a SettingsError naming draft_model) when they differ."""
    target, draft = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
    if target == draft:
        return
    tokens = set(target) | set(draft)
    differ = sorted(t for t in tokens if target.get(t) != draft.get(t))
    example = differ[0]
    raise TokenizerMismatch(
        f"draft_model: the draft's tokenizer ({draft_dir}) differs from the target's: {len(differ)} of "
        f"{len(tokens)} tokens map to other ids (e.g. {example!r} is "
        f"{target.get(example)} in the target, {draft.get(example)} in the draft); a draft model must use "
        "the target's tokenizer: pick a draft of the same model family or save the target's tokenizer with it",
        differ=len(differ), total=len(tokens), example=example, target_id=target.get(example),
        draft_id=draft.get(example), target_size=len(target), draft_size=len(draft),
    )
