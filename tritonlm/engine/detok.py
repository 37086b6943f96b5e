"""Incremental detokenization: token ids in, safe pieces of text out.

Decoding one token at a time breaks multi-byte characters (byte-level BPE splits
them across tokens) and drops leading spaces (SentencePiece-style tokenizers).
Byte-level BPE tokenizers decode context-free (tritonlm/engine/token_bytes.py): for
them each step decodes only the new tokens' bytes, with the bytes of an unfinished
character kept back until the next step. Any other tokenizer decodes a short
window of recent tokens with and without the new ones, and the difference is
emitted, held back while it ends in an incomplete character (U+FFFD). Stop strings
are matched on the text itself, so one split across two tokens is still found;
text that could still turn into a stop string is held back until it cannot.
"""

from __future__ import annotations

import codecs
from typing import Callable

from tritonlm.engine.token_bytes import UTF8_MAX_UNFINISHED, rust_tokenizer, token_bytes

REPLACEMENT = "\ufffd"


def text_decoder(tokenizer) -> Callable[[list[int]], str]:
    """ids -> tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False).

    For a tokenizers-backed (fast) tokenizer most of a decode is transformers' argument
    handling around the Rust one. Where the tokenizer only hands the ids to its Rust tokenizer
    (token_bytes.rust_tokenizer), that one is called directly; any other tokenizer decodes the
    ordinary way."""

    def plain(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    if rust_tokenizer(tokenizer) is None:
        return plain

    def direct(ids: list[int]) -> str:
        # the attribute each time, as transformers' _decode reads it
        return tokenizer._tokenizer.decode(ids, skip_special_tokens=True)

    return direct


def _bytes_from(table: tuple[bytes, ...], ids: list[int], start: int) -> bytes:
    """The bytes of ids[start:] joined; ids past the table (a model's vocabulary may be padded
    past the tokenizer's) have none, as the tokenizer decodes them to nothing."""
    try:
        if len(ids) == start + 1:  # one token per step (no speculative decoding): no list to join
            return table[ids[start]]
        return b"".join([table[i] for i in ids[start:]])
    except IndexError:
        return b"".join([table[i] if i < len(table) else b"" for i in ids[start:]])


class IncrementalDetokenizer:
    def __init__(self, tokenizer, token_ids: list[int], stop_words: tuple[str, ...] = ()):
        """token_ids: the sequence's history (the prompt so far), by reference: the engine
        appends generated tokens to it and `update()` reads what is new."""
        self.tokenizer = tokenizer
        self.ids = token_ids
        self.read_offset = len(self.ids)  # the history before this has been read
        self._table = token_bytes(tokenizer)
        if self._table is None:
            self._decode = text_decoder(tokenizer)
            # decode windows start a few tokens back so the first new token sees its left context
            self.prefix_offset = max(len(self.ids) - 5, 0)
        else:
            # the bytes since the last step that ended on a whole character; at first those of a
            # character the prompt leaves unfinished, so that the tokens that finish it send it
            # whole. The prompt's last few bytes hold all of them.
            tail, start = b"", len(self.ids)
            while len(tail) < UTF8_MAX_UNFINISHED and start > 0:
                start -= 1
                tail = _bytes_from(self._table, [self.ids[start]], 0) + tail
            _, used = codecs.utf_8_decode(tail, "replace", False)
            self._undecoded = tail[used:]
            self._prompt_unfinished = bool(self._undecoded)  # see _after_prompt
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
        if self._table is not None:
            ids = self.ids
            if len(ids) > self.read_offset:
                data = self._undecoded + _bytes_from(self._table, ids, self.read_offset)
                self.read_offset = len(ids)
                text, used = codecs.utf_8_decode(data, "replace", False)
                # A step that ends inside a character sends nothing, as the window decode does:
                # its bytes are decoded again with the next step's. Text that ends in U+FFFD for
                # an invalid byte (one that can start no character), or in U+FFFD itself, goes
                # out at once, as in the decode of the whole sequence: no later byte can change
                # it. The window decode cannot tell that from an unfinished character and holds
                # it until a step ends on a whole one.
                self.incomplete = used < len(data)
                if self.incomplete:
                    self._undecoded = data
                else:
                    self._undecoded = b""
                    self._held += self._after_prompt(text) if self._prompt_unfinished else text
            return self._release(final=False)
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
        if self._table is not None:
            data = self._undecoded + _bytes_from(self._table, self.ids, self.read_offset)
            self.read_offset, self._undecoded = len(self.ids), b""
            # an unfinished character's bytes as the tokenizer decodes them at the end: U+FFFD
            text = codecs.utf_8_decode(data, "replace", True)[0]
            self._held += self._after_prompt(text) if self._prompt_unfinished else text
        elif self.read_offset < len(self.ids):
            prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
            full = self._decode(self.ids[self.prefix_offset :])
            self._held += full[len(prefix) :]
            self.read_offset = len(self.ids)
        return self._release(final=True)

    def _after_prompt(self, text: str) -> str:
        """The first text decoded after a prompt that ends inside a character, less the U+FFFD
        that the prompt's text shows for it where the answer does not finish it (or finishes it
        as U+FFFD itself)."""
        self._prompt_unfinished = False
        return text[1:] if text.startswith(REPLACEMENT) else text

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
