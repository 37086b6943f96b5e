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

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer, token_ids: list[int], stop_words: tuple[str, ...] = ()):
        """token_ids: the sequence's history (the prompt so far), by reference: the engine
        appends generated tokens to it and `update()` reads what is new."""
        self.tokenizer = tokenizer
        self.ids = token_ids
        # decode windows start a few tokens back so the first new token sees its left context
        self.prefix_offset = max(len(self.ids) - 5, 0)
        self.read_offset = len(self.ids)
        self.stop_words = tuple(s for s in stop_words if s)
        self._held = ""  # decoded text not yet emitted (may be the start of a stop word)
        self.text = ""  # all text emitted so far
        self.stopped = False
        self.incomplete = False  # the last update ended inside a multi-byte character

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

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
                self.text += out
                return out
            if not final:
                keep = self._stop_prefix_len(held)
                out, self._held = (held[: len(held) - keep], held[len(held) - keep :]) if keep else (held, "")
                self.text += out
                return out
        self._held = ""
        self.text += held
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
