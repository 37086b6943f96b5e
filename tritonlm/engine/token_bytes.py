"""Each token id's bytes, for the tokenizers whose decode is context-free.

A byte-level BPE tokenizer (GPT-2, Llama 3, Qwen2/3, gpt-oss, SmolLM2: the `tokenizers`
decoder ByteLevel) spells each byte of its text as one printable character of GPT-2's
byte-to-unicode map. Its decode maps every token's characters back to bytes and reads the
concatenation as UTF-8, invalid or unfinished sequences as U+FFFD. So the text of any ids is
the lossy UTF-8 decode of their bytes joined, and with a table id -> bytes the detokenizer
decodes only the new tokens' bytes instead of asking the tokenizer to decode a window of
tokens twice per token (tritonlm/engine/detok.py).

The table is made once per tokenizer object, and only used once it agrees with the
tokenizer's own decode: of every id alone, and of sequences of ids that would show a decode
that is not context-free. Any other tokenizer (SentencePiece-style decoders, Python
tokenizers, a class with its own decode), or one that fails the check, has no table and the
detokenizer asks the tokenizer.
"""

from __future__ import annotations

import codecs
import logging
import random
import sys
import threading
import weakref
from dataclasses import dataclass

__all__ = ["UTF8_MAX_UNFINISHED", "byte_level_bytes", "bytes_to_unicode", "rust_tokenizer", "token_bytes"]

log = logging.getLogger(__name__)

UTF8_MAX_UNFINISHED = 3  # the longest unfinished UTF-8 sequence: a 4-byte character's first three bytes
CHECKED_SEQUENCES = 64  # random sequences of ids whose decode the table must reproduce
CHECKED_ADDED = 64  # added tokens checked between an unfinished character and its continuation


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from each byte to the character that spells it in a byte-level vocabulary:
    the printable Latin-1 bytes as themselves, the others as U+0100 onwards, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + shifted)
            shifted += 1
    return dict(sorted(chars.items()))


# str.translate table: each spelling character -> the Latin-1 character of its byte, so that
# encoding the result as Latin-1 gives the bytes. The characters below U+0100 that spell no
# byte become one Latin-1 cannot encode, so a token holding one falls back whole, as in
# byte_level_bytes.
_SPELLED_BYTE = {ord(c): chr(b) for b, c in bytes_to_unicode().items()}
_SPELLED_BYTE.update({c: "\uffff" for c in range(256) if c not in _SPELLED_BYTE})


def byte_level_bytes(token: str) -> bytes:
    """The bytes the ByteLevel decoder reads from one token's string: each character's byte;
    a token with any character outside the map gives its own UTF-8 instead, whole, as the
    decoder does."""
    try:
        return token.translate(_SPELLED_BYTE).encode("latin-1")
    except UnicodeEncodeError:
        return token.encode("utf-8")


def rust_tokenizer(tokenizer):
    """The Rust tokenizer (`tokenizers.Tokenizer`) that `tokenizer.decode(ids,
    skip_special_tokens=True, clean_up_tokenization_spaces=False)` hands the ids to unchanged,
    or None. That holds for a transformers tokenizers-backed tokenizer whose class keeps
    transformers' own `decode` and `_decode` (which, without the clean-up, only pass a list of
    ids on); any other (a class that overrides either, a Python tokenizer) decodes its own way."""
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
        return None
    return getattr(tokenizer, "_tokenizer", None)


@dataclass(frozen=True)
class _Entry:
    backend: object  # the Rust tokenizer the table was made from
    size: int  # its vocabulary size then, added tokens included: add_tokens grows it in place
    table: tuple[bytes, ...] | None


# by tokenizer object: engines (and their tokenizers) may be built on several threads
_tables: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def token_bytes(tokenizer) -> tuple[bytes, ...] | None:
    """tokenizer's table id -> bytes (special tokens: none, as the engine skips them), or None
    where its decode is not context-free byte-level BPE (then only the tokenizer can decode).
    Made at the first call for a tokenizer object (the engine calls it when it is built, so
    no request waits for it), and again if the tokenizer's vocabulary has grown since (the
    engine never changes its tokenizer; a token made special in place, with no new token,
    would keep its old entry). Ids from the table's length up decode to nothing, as in the
    tokenizer."""
    backend = rust_tokenizer(tokenizer)
    if backend is None:
        return None
    size = backend.get_vocab_size(with_added_tokens=True)
    try:
        entry = _tables.get(tokenizer)
    except TypeError:  # a tokenizer class that cannot be a weak key (unhashable, no weak references)
        return None
    if entry is None or entry.backend is not backend or entry.size != size:
        with _lock:
            entry = _tables.get(tokenizer)
            if entry is None or entry.backend is not backend or entry.size != size:
                try:
                    table = _build(backend)
                except Exception:  # noqa: BLE001 - an unforeseen tokenizer: it decodes the ordinary way
                    log.debug("no token byte table for %s", type(tokenizer).__name__, exc_info=True)
                    table = None
                entry = _tables[tokenizer] = _Entry(backend, size, table)
    return entry.table


def _build(backend) -> tuple[bytes, ...] | None:
    from tokenizers import decoders

    if type(backend.decoder) is not decoders.ByteLevel:  # exactly this decoder: none inside a Sequence
        return None
    added = backend.get_added_tokens_decoder()  # id -> AddedToken
    size = max(backend.get_vocab_size(with_added_tokens=True), max(added, default=-1) + 1)

    def decode(ids: list[int]) -> str:
        return backend.decode(ids, skip_special_tokens=True)

    # decode_batch hands each list to a thread pool, slower for lists of one id than this loop
    texts = [decode([i]) for i in range(size)]
    # each id's token string, an added token's content included (None: no such id)
    strings = [backend.id_to_token(i) for i in range(size)]
    table = [b"" if token is None else byte_level_bytes(token) for token in strings]
    for i, token in added.items():
        if token.special:
            table[i] = b""
        elif table[i].decode("utf-8", "replace") != texts[i]:
            # where the tokenizer does not pass an added token through the byte-level decoder,
            # it stands for its own text (the sequences below check how it joins its neighbours)
            table[i] = texts[i].encode("utf-8")
    if [b.decode("utf-8", "replace") for b in table] != texts:
        wrong = next(i for i, (b, t) in enumerate(zip(table, texts)) if b.decode("utf-8", "replace") != t)
        log.debug("token byte table: id %d is %r, the tokenizer decodes it as %r", wrong, table[wrong], texts[wrong])
        return None
    if decode([size]) != "":
        log.debug("token byte table: id %d, past the vocabulary, decodes to text", size)
        return None
    for ids in _probes(table, sorted(added)):
        joined = b"".join(table[i] for i in ids).decode("utf-8", "replace")
        if joined != decode(ids):
            log.debug("token byte table: %r decodes to %r, its bytes to %r", ids, decode(ids), joined)
            return None
    return tuple(table)


def _probes(table: list[bytes], added: list[int]) -> list[list[int]]:
    """Sequences of ids whose decode shows whether it is the decode of their bytes joined: an
    unfinished character, then an added token (special or not), then bytes that would finish
    it; and random sequences over tokens with multi-byte characters' bytes, added tokens and
    any tokens."""
    rng = random.Random(0)
    unfinished = next((i for i, b in enumerate(table) if b and _unfinished(b)), None)
    continuing = next((i for i, b in enumerate(table) if b and all(0x80 <= c < 0xC0 for c in b)), None)
    probes = []
    if unfinished is not None and continuing is not None:
        probes += [[unfinished, a, continuing] for a in rng.sample(added, min(len(added), CHECKED_ADDED))]
    multibyte = [i for i, b in enumerate(table) if not b.isascii()]
    pool = rng.sample(multibyte, min(len(multibyte), 256)) + added[:CHECKED_ADDED]
    pool += rng.sample(range(len(table)), min(len(table), 64))
    probes += [rng.choices(pool, k=rng.randint(2, 16)) for _ in range(CHECKED_SEQUENCES)] if pool else []
    return probes


def _unfinished(data: bytes) -> bool:
    """data ends inside a multi-byte character that more bytes could still finish."""
    _, used = codecs.utf_8_decode(data, "replace", False)
    return used < len(data)
