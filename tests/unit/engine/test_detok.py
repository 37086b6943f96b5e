"""tritonlm/engine/detok.py: incremental detokenization and stop strings.

The pieces sent one step at a time must join to the tokenizer's own decode of all the
tokens, and no piece may carry half a character: checked directly over the tiny model's
byte-level BPE (which splits multi-byte characters across tokens) and a SentencePiece-style
tokenizer built here (Metaspace, byte fallback: decoding one token at a time drops its
leading space), and through the engine. Stop strings are found in the text, also across
tokens, and nothing of one is sent."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers.models import MIXED_PROMPTS, Collector, drain, hf_greedy_text, make_engine, tiny
from tritonlm.engine.detok import IncrementalDetokenizer

REPLACEMENT = "\ufffd"


def run(tok, prompt: list[int], steps: list[list[int]], stop_words: tuple[str, ...] = ()) -> tuple[list[str], str]:
    """The pieces update() returns after each step's tokens are appended, and flush()'s tail."""
    history = list(prompt)
    detok = IncrementalDetokenizer(tok, history, stop_words)
    pieces = []
    for new in steps:
        history.extend(new)
        pieces.append(detok.update())
    return pieces, detok.flush()


def decode(tok, ids: list[int]) -> str:
    return tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def continuation(tok, prompt: list[int], generated: list[int]) -> str:
    """The reference: the whole sequence decoded at once, less the prompt's text."""
    before = decode(tok, prompt)
    assert not before.endswith(REPLACEMENT), "the prompt must end on a whole character"
    whole = decode(tok, prompt + generated)
    assert whole.startswith(before)
    return whole[len(before):]


def sentencepiece_style_tokenizer():
    """A Llama-style tokenizer built offline: Unigram pieces with a "▁" for the space,
    byte fallback for what no piece covers, a decoder that strips the text's first space."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    pieces = ["▁hello", "▁world", "▁the", "▁round", "▁is", "▁", "ro", "und"] + list("abcdefghijklmnopqrstuvwxyz,.")
    vocab = [("<unk>", 0.0), ("<s>", 0.0), ("</s>", 0.0)] + [(f"<0x{i:02X}>", -20.0) for i in range(256)]
    vocab += [(p, -1.0) for p in pieces]
    tk = Tokenizer(models.Unigram(vocab, unk_id=0, byte_fallback=True))
    tk.pre_tokenizer = pre_tokenizers.Metaspace()
    tk.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


# ---------------------------------------------------------------------------- the pieces


TEXTS = ["Café naïve — 你好，世界 🙂 done", "🙂🙂🙂 emoji only then ascii", " leading space and tabs\tand\nnewlines",
         "plain ascii text, nothing else"]


@pytest.mark.parametrize("text", TEXTS, ids=["mixed", "emoji", "whitespace", "ascii"])
def test_byte_level_pieces_join_to_the_full_decode_and_never_split_a_character(text):
    _, tok = tiny()
    prompt = tok("Once upon a time").input_ids
    generated = tok(text).input_ids
    pieces, tail = run(tok, prompt, [[t] for t in generated])
    reference = continuation(tok, prompt, generated)
    assert reference == text
    assert "".join(pieces) + tail == reference
    assert tail == ""  # every character was whole by the last token
    assert all(REPLACEMENT not in p for p in pieces)
    held = sum(decode(tok, generated[:k]).endswith(REPLACEMENT) for k in range(1, len(generated)))
    assert sum(p == "" for p in pieces) >= held  # a step that ends inside a character sends nothing
    if any(ord(c) > 0x7FF for c in text):
        assert held > 0  # the tokenizer does split this text's characters: the check has teeth


@settings(max_examples=60, deadline=None, database=None)  # a failure prints its example
@given(
    text=st.text(alphabet=st.sampled_from(list("ab ,.\n") + ["é", "ß", "你", "好", "🙂", "€", "\u0301"]), min_size=1,
                 max_size=40),
    cut=st.integers(min_value=0, max_value=40),
    seed=st.integers(min_value=0, max_value=2**16),
)
def test_any_text_cut_into_any_steps_joins_to_the_full_decode(text, cut, seed):
    """A prompt/generation boundary at any whole character, generated tokens arriving 1 to 4
    per step (speculative steps append several): every running total is a prefix of the
    reference, and with flush() it is the reference."""
    _, tok = tiny()
    ids = tok(text).input_ids
    boundaries = [k for k in range(len(ids)) if not decode(tok, ids[:k]).endswith(REPLACEMENT)]
    k = boundaries[cut % len(boundaries)]
    prompt, generated = ids[:k], ids[k:]
    rng = random.Random(seed)
    steps, i = [], 0
    while i < len(generated):
        n = rng.randint(1, 4)
        steps.append(generated[i:i + n])
        i += n
    pieces, tail = run(tok, prompt, steps)
    reference = continuation(tok, prompt, generated)
    so_far = ""
    for p in pieces:
        so_far += p
        assert reference.startswith(so_far), (so_far, reference)
    assert so_far + tail == reference


def test_sentencepiece_style_pieces_keep_their_leading_spaces():
    tok = sentencepiece_style_tokenizer()
    ids = tok("the round world 🙂 é, hello").input_ids
    prompt, generated = ids[:2], ids[2:]
    naive = "".join(decode(tok, [t]) for t in generated)
    reference = continuation(tok, prompt, generated)
    assert reference == " world 🙂 é, hello"
    assert naive != reference  # one token at a time loses the spaces and the bytes
    pieces, tail = run(tok, prompt, [[t] for t in generated])
    assert "".join(pieces) + tail == reference
    assert all(REPLACEMENT not in p for p in pieces)


def test_flush_sends_an_unfinished_character_as_the_tokenizer_decodes_it():
    """Generation that ends inside a character: the held bytes go out at the end, as the
    tokenizer's own decode shows them (replacement characters), not silently dropped."""
    _, tok = tiny()
    ids = tok(" smile 🙂").input_ids
    cut = next(k for k in range(len(ids), 0, -1) if decode(tok, ids[:k]).endswith(REPLACEMENT))
    pieces, tail = run(tok, [], [[t] for t in ids[:cut]])
    assert "".join(pieces) + tail == decode(tok, ids[:cut])
    assert REPLACEMENT in tail and REPLACEMENT not in "".join(pieces)


# ---------------------------------------------------------------------------- stop strings


def fed(tok, text: str, stop_words: tuple[str, ...]) -> tuple[IncrementalDetokenizer, list[str], list[int]]:
    """text's tokens fed one per step after a prompt, until the detokenizer stops."""
    prompt = tok("Once upon a time").input_ids
    history = list(prompt)
    detok = IncrementalDetokenizer(tok, history, stop_words)
    pieces, ids = [], tok(text).input_ids
    for t in ids:
        history.append(t)
        pieces.append(detok.update())
        if detok.stopped:
            break
    return detok, pieces, ids


def test_a_stop_string_across_tokens_ends_the_text_before_it_and_nothing_of_it_is_sent():
    _, tok = tiny()
    text = " the quick brown fox, 你好 world, the end"
    stop = "x, 你"
    assert not any(stop in decode(tok, [t]) for t in tok(text).input_ids)  # no single token holds it
    detok, pieces, ids = fed(tok, text, (stop,))
    assert detok.stopped and len(pieces) < len(ids)  # it stopped at the token that completed the stop string
    assert "".join(pieces) == text[: text.index(stop)] == detok.text
    assert stop not in detok.text
    detok.ids.extend(tok(" more").input_ids)
    assert detok.update() == "" and detok.flush() == ""  # nothing after a stop


def test_the_earliest_stop_string_in_the_text_wins():
    _, tok = tiny()
    text = " alpha beta gamma delta"
    detok, pieces, _ = fed(tok, text, ("delta", "beta g", "a b"))
    assert "".join(pieces) == text[: min(text.index(s) for s in ("delta", "beta g", "a b"))] == " alph"


def test_text_that_may_become_a_stop_string_is_held_until_it_cannot():
    """After each step the text sent is the text decoded so far less its longest tail that
    begins a stop string; at the end (no stop found) all of it."""
    _, tok = tiny()
    text = " the world is round, the world peace is near, the worm"
    stops = ("world peace.", "worms")

    def held_tail(s: str) -> int:
        return max((n for w in stops for n in range(1, len(w)) if s.endswith(w[:n])), default=0)

    prompt = tok("Once upon a time").input_ids
    history = list(prompt)
    detok = IncrementalDetokenizer(tok, history, stops)
    ids, sent = tok(text).input_ids, ""
    for k, t in enumerate(ids, start=1):
        history.append(t)
        sent += detok.update()
        so_far = decode(tok, ids[:k])
        assert sent == so_far[: len(so_far) - held_tail(so_far)], (sent, so_far)
    assert held_tail(text) > 0  # the text ends on a possible stop string: the end must release it
    assert sent + detok.flush() == text and not detok.stopped


def test_an_empty_stop_string_is_ignored():
    _, tok = tiny()
    text = " nothing stops this"
    detok, pieces, _ = fed(tok, text, ("",))
    assert not detok.stopped and "".join(pieces) + detok.flush() == text



# ---------------------------------------------------------------------------- through the engine


def test_streaming_pieces_concatenate_to_the_non_streaming_text():
    engine = make_engine()
    col = Collector()
    prompt = "Café naïve — 你好"
    s = col.request(engine, prompt, stream=True, max_tokens=60)
    n = col.request(engine, prompt, stream=False, max_tokens=60)
    drain(engine)
    assert len(col.events[n]) == 1  # non-streaming: one answer
    assert col.text(s) == col.text(n)
    pieces = [e.text for e in col.events[s]]
    assert len(pieces) > 10
    # each piece is whole characters: a piece that split a multi-byte character would carry
    # U+FFFD where the whole text has the real character, so every running prefix must be a
    # prefix of the text of all the tokens decoded at once
    _, tok = tiny()
    full = tok.decode(col.ids(s))
    assert col.text(s) == full
    assert any(ord(c) > 127 for c in full)  # the check has multi-byte characters to catch
    so_far = ""
    for piece in pieces:
        so_far += piece
        assert full.startswith(so_far), (piece, so_far[-20:])
    assert full.count("\ufffd") == sum(p.count("\ufffd") for p in pieces)


def test_stop_word_split_across_tokens_is_found_and_removed():
    _, tok = tiny()
    ref = hf_greedy_text(MIXED_PROMPTS[1], 40)
    text = tok.decode(ref)
    # a stop string that straddles the boundary between two generated tokens
    cut = len(tok.decode(ref[:10]))
    stop = text[cut - 2 : cut + 2]
    assert len(stop) == 4
    for stream in (True, False):
        engine = make_engine()
        col = Collector()
        rid = col.request(engine, MIXED_PROMPTS[1], stream=stream, max_tokens=40, stop_words=(stop,))
        drain(engine)
        out = col.text(rid)
        assert col.final(rid).finish_reason == "stop"
        assert out == text[: text.index(stop)]
        assert stop not in out
        if stream:  # one event per step without a dispatcher (nothing coalesces): it streamed,
            # and the pieces joined are the text before the stop, so no half of it went out early
            assert len(col.events[rid]) > 2
