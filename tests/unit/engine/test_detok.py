"""tritonlm/engine/detok.py: incremental detokenization and stop strings.

The pieces sent one step at a time must join to the tokenizer's own decode of all the
tokens, and no piece may carry half a character: checked directly over the tiny model's
byte-level BPE (which splits multi-byte characters across tokens) and a SentencePiece-style
tokenizer (Metaspace, byte fallback: decoding one token at a time drops its leading space),
and through the engine. Stop strings are found in the text, also across tokens, and nothing
of one is sent. A byte-level tokenizer is decoded from its tokens' bytes: that sends the
same pieces as decoding windows of tokens (the way every other tokenizer is decoded), except
that text ending in an invalid byte goes out at once, and a character the prompt leaves
unfinished is finished by the answer."""

from __future__ import annotations

import random
import types

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from tests.helpers.models import (
    MIXED_PROMPTS,
    Collector,
    drain,
    hf_greedy_text,
    make_engine,
    sentencepiece_style_tokenizer,
    tiny,
)
from tritonlm.engine import token_bytes as token_bytes_module
from tritonlm.engine.detok import IncrementalDetokenizer
from tritonlm.engine.token_bytes import token_bytes
from tritonlm.models.builtin import tiny_tokenizer

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
    pieces, tail = run(tok, prompt, in_steps(generated, seed))
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


# ---------------------------------------------------------------------------- token bytes


def windows_only(tok):
    """tok as the detokenizer sees a tokenizer of no kind it knows (a decode and nothing else):
    it decodes windows of tokens. The reference for decoding a byte-level tokenizer's bytes."""
    return types.SimpleNamespace(decode=tok.decode)


def trace(tok, prompt: list[int], steps: list[list[int]], stop_words: tuple[str, ...] = ()):
    """After each step: the piece, `incomplete`, `stopped`; then flush()'s tail and `text`."""
    history = list(prompt)
    detok = IncrementalDetokenizer(tok, history, stop_words)
    pieces, incomplete, stopped = [], [], []
    for new in steps:
        history.extend(new)
        pieces.append(detok.update())
        incomplete.append(detok.incomplete)
        stopped.append(detok.stopped)
    tail = detok.flush()
    return pieces, incomplete, stopped, tail, detok.text


def in_steps(ids: list[int], seed: int) -> list[list[int]]:
    """ids 1 to 4 per step, as speculative steps append several."""
    rng = random.Random(seed)
    steps, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 4)
        steps.append(ids[i:i + n])
        i += n
    return steps


def stop_strings(reference: str, cuts: list[tuple[int, int]], made_up: list[str]) -> tuple[str, ...]:
    """Pieces of the text (so that they hit), and made-up ones (which mostly do not)."""
    taken = tuple(reference[a % (len(reference) + 1):][:n] for a, n in cuts)
    return taken + tuple(made_up)


def ends_at_a_stop(text: str, reference: str, stop_words: tuple[str, ...]) -> bool:
    """text is the reference where no stop string is in it, else the part before the one found
    first (the first to be complete), with none inside."""
    stop_words = tuple(s for s in stop_words if s)
    if not any(s in reference for s in stop_words):
        return text == reference
    return (reference.startswith(text) and any(reference.startswith(s, len(text)) for s in stop_words)
            and not any(s in text for s in stop_words))


ALPHABET = list("ab ,.\n") + ["é", "ß", "你", "好", "🙂", "€", "\u0301"]
CUTS = st.lists(st.tuples(st.integers(min_value=0, max_value=60), st.integers(min_value=1, max_value=4)), max_size=3)
MADE_UP = st.lists(st.text(alphabet=st.sampled_from(ALPHABET), min_size=1, max_size=3), max_size=2)


def test_byte_level_tokenizers_are_decoded_from_token_bytes_and_others_by_windows():
    _, tok = tiny()
    assert IncrementalDetokenizer(tok, [])._table is token_bytes(tok) is not None
    assert IncrementalDetokenizer(sentencepiece_style_tokenizer(), [])._table is None
    assert IncrementalDetokenizer(windows_only(tok), [])._table is None


@settings(max_examples=80, deadline=None, database=None)  # a failure prints its example
@given(
    text=st.text(alphabet=st.sampled_from(ALPHABET), min_size=1, max_size=40),
    cut=st.integers(min_value=0, max_value=40),
    seed=st.integers(min_value=0, max_value=2**16),
    cuts=CUTS,
    made_up=MADE_UP,
)
def test_token_bytes_send_the_pieces_that_windows_send(text, cut, seed, cuts, made_up):
    """Text's tokens (so: no invalid bytes) after a prompt cut at a whole character, 1 to 4 per
    step, with stop strings: every piece, `incomplete` and `stopped` after each step, the
    tail and the text are those of decoding windows; the text is the whole decode less the
    prompt's, up to the stop string found first."""
    _, tok = tiny()
    ids = tok(text).input_ids
    boundaries = [k for k in range(len(ids)) if not decode(tok, ids[:k]).endswith(REPLACEMENT)]
    k = boundaries[cut % len(boundaries)]
    prompt, generated = ids[:k], ids[k:]
    reference = continuation(tok, prompt, generated)
    stop_words = stop_strings(reference, cuts, made_up)
    steps = in_steps(generated, seed)
    fast = trace(tok, prompt, steps, stop_words)
    assert fast == trace(windows_only(tok), prompt, steps, stop_words)
    assert ends_at_a_stop(fast[4], reference, stop_words)


@settings(max_examples=80, deadline=None, database=None)
@given(
    prompt=st.lists(st.integers(min_value=0, max_value=511), max_size=8),
    # any ids: bytes that start or make no character, the end of text (0, skipped), one past the vocabulary
    generated=st.lists(st.one_of(st.integers(min_value=0, max_value=511), st.sampled_from([0, 520])), min_size=1,
                       max_size=30),
    seed=st.integers(min_value=0, max_value=2**16),
    cuts=CUTS,
    made_up=MADE_UP,
)
def test_token_bytes_of_any_ids_send_what_windows_send_or_sooner(prompt, generated, seed, cuts, made_up):
    """Any ids after a prompt that ends on a whole character: the text is the whole decode less
    the prompt's, up to the stop string found first, as with windows. After a step that ends on a
    whole character by the windows' reckoning, both have sent the same text and both have
    stopped or not; otherwise the windows hold text that the token bytes may have sent (text
    that ends in an invalid byte), never the other way round."""
    _, tok = tiny()
    assume(not decode(tok, prompt).endswith(REPLACEMENT))
    reference = continuation(tok, prompt, generated)
    # none with U+FFFD in it: the token bytes may find one a step sooner than the windows, and
    # so one that holds it but started earlier and ends later, found by the windows, is not
    stop_words = tuple(s for s in stop_strings(reference, cuts, made_up) if REPLACEMENT not in s)
    steps = in_steps(generated, seed)
    pieces, incomplete, stopped, tail, text = trace(tok, prompt, steps, stop_words)
    w_pieces, w_incomplete, w_stopped, w_tail, w_text = trace(windows_only(tok), prompt, steps, stop_words)
    assert text == w_text and ends_at_a_stop(text, reference, stop_words)
    sent = w_sent = ""
    for k in range(len(steps)):
        sent, w_sent = sent + pieces[k], w_sent + w_pieces[k]
        assert text.startswith(sent) and sent.startswith(w_sent)
        assert w_incomplete[k] or not incomplete[k]  # an unfinished character: the windows hold it too
        if not w_incomplete[k]:
            assert (sent, stopped[k]) == (w_sent, w_stopped[k])


def test_text_that_ends_in_an_invalid_byte_goes_out_at_once():
    """A lone continuation byte can start no character: its U+FFFD is in the whole decode
    whatever follows, so it is sent with its step (the windows hold it for one more step)."""
    from tritonlm.engine.token_bytes import bytes_to_unicode

    _, tok = tiny()
    orphan = tok.convert_tokens_to_ids(bytes_to_unicode()[0x80])
    steps = [tok(" a").input_ids + [orphan], tok(" b").input_ids]
    prompt = tok("Once").input_ids
    pieces, incomplete, _, tail, text = trace(tok, prompt, steps)
    assert (pieces, incomplete, tail) == ([" a" + REPLACEMENT, " b"], [False, False], "")
    w_pieces, w_incomplete, _, _, w_text = trace(windows_only(tok), prompt, steps)
    assert (w_pieces, w_incomplete) == (["", " a" + REPLACEMENT + " b"], [True, False])
    assert text == w_text == continuation(tok, prompt, steps[0] + steps[1])


def test_a_character_the_prompt_leaves_unfinished_is_finished_by_the_answer():
    """The prompt's text shows U+FFFD for the bytes it ends on; the answer's first tokens finish
    that character, and the answer starts with it. Where they do not, that U+FFFD is the
    prompt's: the answer is the whole decode less the prompt's."""
    _, tok = tiny()
    ids = tok(" 🙂 ok").input_ids
    k = next(k for k in range(1, len(ids)) if decode(tok, ids[:k]).endswith(REPLACEMENT))
    prompt = tok("Once").input_ids + ids[:k]
    pieces, tail = run(tok, prompt, [[t] for t in ids[k:]])
    assert "".join(pieces) + tail == "🙂 ok"
    assert pieces[0] == "" or pieces[0].startswith("🙂")  # never a U+FFFD that the prompt's text showed
    left = tok(" left").input_ids
    pieces, tail = run(tok, prompt, [left])
    whole, before = decode(tok, prompt + left), decode(tok, prompt)
    assert "".join(pieces) + tail == whole[len(before):] == " left"
    # nothing generated: the unfinished bytes were the prompt's, nothing to send
    assert run(tok, prompt, [])[1] == ""


def test_special_added_and_unknown_tokens_are_decoded_as_the_tokenizer_decodes_them():
    """End of text and an added special token are skipped (also between a character's bytes),
    added tokens read as the tokenizer reads them (one spells an unfinished character), an id
    past the vocabulary is nothing."""
    tok = tiny_tokenizer()  # its own object: tokens are added
    tok.add_tokens(["<extra>", "Ġhey", "x y", "ðŁĻ"])
    tok.add_special_tokens({"additional_special_tokens": ["<|tool|>"]})
    assert token_bytes(tok) is not None
    smile = tok("🙂").input_ids
    assert len(smile) == 3
    extra, hey, xy, partial, tool = tok.convert_tokens_to_ids(["<extra>", "Ġhey", "x y", "ðŁĻ", "<|tool|>"])
    prompt = tok("Once").input_ids
    # the last four: an added token ends the unfinished character before it, as in the tokenizer
    generated = ([smile[0], tok.eos_token_id, smile[1], tool, smile[2], hey, partial, smile[2], xy, len(tok) + 3]
                 + [smile[0], extra, smile[1], smile[2]])
    reference = continuation(tok, prompt, generated)
    assert reference.startswith("🙂 hey🙂x y") and "<extra>" in reference
    for steps in ([[t] for t in generated], in_steps(generated, 5)):
        pieces, tail = run(tok, prompt, steps)
        assert "".join(pieces) + tail == reference
        w_pieces, w_tail = run(windows_only(tok), prompt, steps)
        assert "".join(w_pieces) + w_tail == reference


def test_a_tokenizer_whose_table_fails_its_check_is_decoded_by_windows(monkeypatch):
    tok = tiny_tokenizer()  # its own object: no table made for it yet
    spelled = token_bytes_module.byte_level_bytes
    monkeypatch.setattr(token_bytes_module, "byte_level_bytes", lambda s: spelled(s).upper())
    detok = IncrementalDetokenizer(tok, tok("Once").input_ids)
    assert detok._table is None
    ids = tok(" upper and lower, é").input_ids
    detok.ids.extend(ids)
    assert detok.update() + detok.flush() == " upper and lower, é"


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
