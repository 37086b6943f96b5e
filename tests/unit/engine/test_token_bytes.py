"""tritonlm/engine/token_bytes.py: each token id's bytes, for byte-level BPE tokenizers.

For every id the table holds bytes whose lossy UTF-8 decode is the tokenizer's own decode of
that id, and joined, of any ids (special tokens skipped, as the engine decodes). There is a
table only for tokenizers whose decode is exactly that (transformers' decode handing the ids
to a Rust tokenizer whose decoder is ByteLevel); it is made once per tokenizer object, again
when the vocabulary grows, and a tokenizer that fails the check gets none."""

from __future__ import annotations

import logging
import random
import threading
import weakref

from tests.helpers.models import make_engine, sentencepiece_style_tokenizer, tiny
from tritonlm.engine import token_bytes as module
from tritonlm.engine.token_bytes import byte_level_bytes, bytes_to_unicode, token_bytes
from tritonlm.models.builtin import TOKENIZER_DIR, tiny_tokenizer


def lossy(data: bytes) -> str:
    return data.decode("utf-8", "replace")


def decode(tok, ids: list[int]) -> str:
    return tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def test_bytes_to_unicode_is_gpt2s_map_and_spells_the_tiny_vocabulary():
    chars = bytes_to_unicode()
    assert list(chars) == list(range(256)) and len(set(chars.values())) == 256
    assert (chars[ord("a")], chars[ord("!")], chars[ord(" ")], chars[ord("\n")], chars[0]) == ("a", "!", "Ġ", "Ċ", "Ā")
    _, tok = tiny()
    vocab = tok.get_vocab()
    assert all(c in vocab for c in chars.values())  # the 256 base tokens: one byte each


def test_byte_level_bytes_reads_each_character_as_its_byte():
    assert byte_level_bytes("Ġhello") == b" hello"
    assert byte_level_bytes("ðŁĻĤ") == "🙂".encode()
    assert byte_level_bytes("ðŁ") == b"\xf0\x9f"  # the start of 🙂
    # a character that spells no byte: the token's own UTF-8, all of it (the ByteLevel decoder's rule)
    assert byte_level_bytes("Ġa b") == "Ġa b".encode()
    assert byte_level_bytes("你") == "你".encode()


def test_the_table_decodes_every_id_and_any_ids_as_the_tokenizer_does():
    _, tok = tiny()
    table = token_bytes(tok)
    assert table is not None and len(table) == len(tok)
    assert all(lossy(b) == decode(tok, [i]) for i, b in enumerate(table))
    assert table[tok.eos_token_id] == b""  # special: skipped
    assert any(lossy(b) == "\ufffd" for b in table)  # ids that are part of a character: joining must finish them
    rng = random.Random(3)
    for _ in range(300):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randint(1, 12))]
        assert lossy(b"".join(table[i] for i in ids)) == decode(tok, ids), ids


def test_one_table_per_tokenizer_object_made_again_when_its_vocabulary_grows():
    tok = tiny_tokenizer()  # its own object: tokens are added
    first = token_bytes(tok)
    assert token_bytes(tok) is first
    other = token_bytes(tiny_tokenizer())
    assert other == first and other is not first
    tok.add_tokens(["<extra>"])
    grown = token_bytes(tok)
    assert grown is not first and len(grown) == len(first) + 1 and grown[-1] == b"<extra>"


def test_threads_building_engines_at_once_share_one_table():
    tok = tiny_tokenizer()
    tables, barrier = [], threading.Barrier(4)

    def build():
        barrier.wait()
        tables.append(token_bytes(tok))

    threads = [threading.Thread(target=build) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(tables) == 4 and all(t is tables[0] for t in tables) and tables[0] is not None


def test_the_engine_makes_its_tokenizers_table_when_it_is_built(monkeypatch):
    monkeypatch.setattr(module, "_tables", weakref.WeakKeyDictionary())
    engine = make_engine()
    assert module._tables[engine.tokenizer].table is not None


def test_added_tokens_read_as_the_tokenizer_reads_them_and_special_ones_are_nothing():
    tok = tiny_tokenizer()
    tok.add_tokens(["<extra>", "Ġhey", "x y", "ðŁĻ"])  # the last spells the start of 🙂
    tok.add_special_tokens({"additional_special_tokens": ["<|tool|>"]})
    table = token_bytes(tok)
    assert table is not None
    extra, hey, xy, partial, tool = tok.convert_tokens_to_ids(["<extra>", "Ġhey", "x y", "ðŁĻ", "<|tool|>"])
    assert [table[i] for i in (extra, hey, xy, partial, tool)] == [b"<extra>", b" hey", b"x y", b"\xf0\x9f\x99", b""]
    smile = tok("🙂").input_ids
    for ids in ([partial, smile[2]], [smile[0], tool, smile[1], smile[2]], [smile[0], extra, smile[1], smile[2]],
                [smile[0], smile[1], xy, smile[2]], [hey, partial, tok.eos_token_id, smile[2], len(tok) + 7]):
        assert lossy(b"".join(table[i] for i in ids if i < len(table))) == decode(tok, ids), ids


def test_tokenizers_that_do_not_decode_byte_level_have_no_table():
    from tokenizers import Tokenizer, decoders
    from transformers import PreTrainedTokenizerFast

    assert token_bytes(sentencepiece_style_tokenizer()) is None  # Metaspace and byte fallback
    assert token_bytes(object()) is None

    class OwnDecode(PreTrainedTokenizerFast):
        def decode(self, *args, **kwargs):
            return super().decode(*args, **kwargs)

    assert token_bytes(OwnDecode(tokenizer_file=str(TOKENIZER_DIR / "tokenizer.json"))) is None
    wrapped = Tokenizer.from_file(str(TOKENIZER_DIR / "tokenizer.json"))
    wrapped.decoder = decoders.Sequence([decoders.ByteLevel()])  # not exactly ByteLevel: not known to be context-free
    assert token_bytes(PreTrainedTokenizerFast(tokenizer_object=wrapped)) is None


class TokenByToken:
    """A Rust tokenizer whose decode of several ids is each id's decode joined: every id
    alone decodes right, but a character split across tokens does not."""

    def __init__(self, backend):
        self._backend = backend

    def __getattr__(self, name):
        return getattr(self._backend, name)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(self._backend.decode([i], skip_special_tokens=skip_special_tokens) for i in ids)


def test_a_table_that_disagrees_with_the_tokenizer_is_not_used(monkeypatch, caplog):
    caplog.set_level(logging.DEBUG, logger=module.__name__)
    tok = tiny_tokenizer()
    tok._tokenizer = TokenByToken(tok._tokenizer)
    assert token_bytes(tok) is None
    assert "its bytes to" in caplog.text  # the sequences of ids caught it
    caplog.clear()
    monkeypatch.setattr(module, "byte_level_bytes", lambda s: byte_level_bytes(s).upper())
    assert token_bytes(tiny_tokenizer()) is None
    assert "the tokenizer decodes it as" in caplog.text  # the single ids caught it
    monkeypatch.undo()
    assert token_bytes(tiny_tokenizer()) is not None


def test_a_tokenizer_class_that_cannot_be_a_weak_key_has_no_table():
    from transformers import PreTrainedTokenizerFast

    class Unhashable(PreTrainedTokenizerFast):
        __hash__ = None

    assert token_bytes(Unhashable(tokenizer_file=str(TOKENIZER_DIR / "tokenizer.json"))) is None
