"""Incremental detokenization: token ids in, safe pieces of text out.

Decoding one token at a time breaks multi-byte characters (byte-level BPE splits
them across tokens) and drops leading spaces (SentencePiece-style tokenizers).
So each step decodes a short window of recent tokens with and without the new
ones and emits the difference, and holds text back while it ends in an
incomplete character (U+FFFD). Stop strings are matched on the text itself, so
one split across two tokens is still found; text that could still turn into a
stop string is held back until it cannot.
"""

from __future__ import annotations

import sys
from typing import Callable

REPLACEMENT = "\ufffd"


def text_decoder(tokenizer) -> Callable[[list[int]], str]:
    """ids -> tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False).

    Two decodes per generated token make the detokenizer one of the engine's larger
    per-token costs, and for a tokenizers-backed (fast) tokenizer most of a decode is
    transformers' argument handling around the Rust one. Where the tokenizer's class keeps
    transformers' own `decode` and `_decode` (which, without the clean-up, only hand a list
    of ids to the Rust tokenizer), that one is called directly; any other tokenizer (a
    class that overrides either, a Python one) decodes the ordinary way."""

    def plain(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    # not loaded: the tokenizer cannot be one of its classes (and this costs no import)
    fast_module = sys.modules.get("transformers.tokenization_utils_tokenizers")
    base_module = sys.modules.get("transformers.tokenization_utils_base")
    backend_cls = getattr(fast_module, "TokenizersBackend", None)
    base_cls = getattr(base_module, "PreTrainedTokenizerBase", None)
    cls = type(tokenizer)
    if (
        backend_cls is None
        or base_cls is None
        or not isinstance(tokenizer, backend_cls)
        or getattr(cls, "decode", None) is not base_cls.decode
        or getattr(cls, "_decode", None) is not backend_cls._decode
        or "decode" in vars(tokenizer)
        or "_decode" in vars(tokenizer)
    ):
        return plain

    def direct(ids: list[int]) -> str:
        # the attribute each time, as transformers' _decode reads it
        return tokenizer._tokenizer.decode(ids, skip_special_tokens=True)

    return direct


class IncrementalDetokenizer:
    def __init__(self, tokenizer, token_ids: list[int], stop_words: tuple[str, ...] = ()):
        """token_ids: the sequence's history (the prompt so far), by reference: the engine
        appends generated tokens to it and `update()` reads what is new."""
        self.tokenizer = tokenizer
        self._decode = text_decoder(tokenizer)
        self.ids = token_ids
        # decode windows start a few tokens back so the first new token sees its left context
        self.prefix_offset = max(len(self.ids) - 5, 0)
        self.read_offset = len(self.ids)
        self.stop_words = tuple(s for s in stop_words if s)
        self._held = ""  # decoded text not yet emitted (may be the start of a stop word)
        # all text emitted so far, in pieces: one string grown per token would be copied whole each time
        self._emitted: list[str] = []
        self.stopped = False
        self.incomplete = False  # the last update ended inside a multi-byte character

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._emitted)

    def update(self) -> str:
        """After tokens were appended to the history: the text now safe to send (maybe empty)."""
        if self.stopped:
            return ""
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        self.incomplete = full.endswith(REPLACEMENT)
        if len(full) > len(prefix) and not self.incomplete:
            self._held += full[len(prefix) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
        return self._release(final=False)

    def flush(self) -> str:
        """At the end of generation: whatever is still held back (incomplete bytes included)."""
        if self.stopped:
            return ""
        if self.read_offset < len(self.ids):
            prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
            full = self._decode(self.ids[self.prefix_offset :])
            self._held += full[len(prefix) :]
            self.read_offset = len(self.ids)
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        held = self._held
        if self.stop_words:
            hits = [(held.find(s), s) for s in self.stop_words if s in held]
            if hits:
                pos = min(h[0] for h in hits)
                self.stopped = True
                self._held = ""
                out = held[:pos]
                self._emitted.append(out)
                return out
            if not final:
                keep = self._stop_prefix_len(held)
                out, self._held = (held[: len(held) - keep], held[len(held) - keep :]) if keep else (held, "")
                self._emitted.append(out)
                return out
        self._held = ""
        self._emitted.append(held)
        return held

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest tail of text that is a proper prefix of some stop word."""
        best = 0
        for s in self.stop_words:
            for n in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:n]):
                    best = max(best, n)
                    break
        return best
