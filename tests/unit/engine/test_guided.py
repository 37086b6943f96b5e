"""tritonlm/engine/guided.py and its place in the sampler, executor and verifier: guided
decoding (structured output) with the tiny model.

The references are independent of the engine: llguidance's own matcher answering token by
token (validate_tokens) for the masks, and `jsonschema` / `re.fullmatch` for the answers.
The schemas and regexes of the engine tests were written for these tests and not tuned
to the tiny model's text."""

from __future__ import annotations

import json
import re

import jsonschema
import llguidance
import pytest
import torch

from tests.helpers.models import Collector, drain, make_engine, make_prefix_caching_engine, make_speculative_engine, tiny
from tritonlm.engine.guided import GuideCompiler, guide_grammar
from tritonlm.engine.request import GuidedDecoding, InvalidRequestError, SamplingParams
from tritonlm.engine.sampler import RowState, process_logits, sample_row, sample_rows

ID_FLAG = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999}, "ok": {"type": "boolean"}},
           "required": ["id", "ok"], "additionalProperties": False}
COLOR_SIZES = {"type": "object",
               "properties": {"color": {"enum": ["red", "green", "blue"]},
                              "sizes": {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 9}, "maxItems": 3}},
               "required": ["color", "sizes"], "additionalProperties": False}
SHORT_WORDS = {"type": "array", "items": {"type": "string", "maxLength": 4}, "minItems": 1, "maxItems": 2}
SCHEMAS = [ID_FLAG, COLOR_SIZES, SHORT_WORDS]
REGEXES = [r"[A-Z]{2}-[0-9]{2}", r"(cat|dog)s? and (cat|dog)s?"]
CHOICES = ["alpha", "beta", "gamma delta"]


def json_guide(schema: dict) -> GuidedDecoding:
    return GuidedDecoding("json_schema", json.dumps(schema))


def check_answer(guide: GuidedDecoding, text: str) -> None:
    """The answer satisfies the guide, by the guide's own standard."""
    if guide.kind == "json_schema":
        jsonschema.validate(json.loads(text), json.loads(guide.spec))
    elif guide.kind == "json_object":
        assert isinstance(json.loads(text), dict)
    elif guide.kind == "regex":
        assert re.fullmatch(guide.spec, text), text
    elif guide.kind == "choice":
        assert text in json.loads(guide.spec)


# ---- masks ------------------------------------------------------------------------------

def test_masks_are_the_library_matchers_own_padding_ids_never_allowed():
    """At each position of a valid answer, the allowed tokens are those llguidance's own
    matcher (a separate one, fed the same tokens) lists (compute_logit_bias), each of which
    it accepts (validate_tokens); EOS only where the object is complete."""
    _, tok = tiny()
    vocab = len(tok) + 40  # logits wider than the tokenizer: padding ids
    compiler = GuideCompiler(tok, vocab)
    guide = json_guide(ID_FLAG)
    answer = tok('{"id":42,"ok":true}').input_ids  # compact: the JSON guides take no extra whitespace
    prompt = tok("Record:").input_ids
    row = RowState.make(SamplingParams(max_tokens=64, guided=guide), list(prompt), tok.eos_token_id, compiler.start(guide))
    reference = llguidance.LLMatcher(compiler.tokenizer, guide_grammar(guide))
    for step in range(len(answer) + 1):
        logits = process_logits(torch.zeros(vocab), row)  # [V]
        allowed = set(torch.nonzero(torch.isfinite(logits)).flatten().tolist())
        listed = {t for t, b in enumerate(reference.compute_logit_bias()) if b}
        assert allowed == {t for t in listed if t != tok.eos_token_id or reference.is_accepting()}, f"step {step}"
        assert allowed and all(reference.validate_tokens([t]) == 1 for t in allowed if t != tok.eos_token_id)
        assert (tok.eos_token_id in allowed) == (step == len(answer))
        assert not any(t >= len(tok) for t in allowed)
        if step < len(answer):
            row.token_ids.append(answer[step])
            assert reference.consume_token(answer[step])
    assert allowed == {tok.eos_token_id}  # the object is closed: only the end remains


def test_state_follows_the_history_back_and_forth():
    """Rolled back to a shorter history (rejected guesses), then on along another."""
    _, tok = tiny()
    compiler = GuideCompiler(tok, len(tok))
    guide = GuidedDecoding("choice", json.dumps(CHOICES))
    state = compiler.start(guide)
    ids_a, ids_g = tok("alpha").input_ids, tok("gamma delta").input_ids
    ends = [tok.eos_token_id]
    state.sync(ids_a, ends)
    assert state.can_end()
    state.sync([], ends)
    assert not state.can_end()
    state.sync(ids_g + ends + ids_a, ends)  # a drafter's guesses past the end are left out
    assert state.can_end() and state.consumed == ids_g
    with pytest.raises(ValueError, match="does not continue the guide"):
        state.sync(ids_g + ids_a, ends)


def test_compiled_guides_are_kept_least_recently_used_first_out():
    _, tok = tiny()
    compiler = GuideCompiler(tok, len(tok), capacity=2)
    a, b, c = (GuidedDecoding("regex", r) for r in ("a+", "b+", "c+"))
    for guide in (a, b, a, c, a, b):
        compiler.start(guide)
    # a, b miss; a hits; c misses and drops b (a was used later); a hits; b misses again
    assert (compiler.hits, compiler.misses) == (2, 4)


@pytest.mark.parametrize("guide, words", [
    (GuidedDecoding("json_schema", '{"type": "strin"}'), "strin"),
    (GuidedDecoding("json_schema", '{"type": "array", "uniqueItems": true}'), "uniqueItems"),  # not silently ignored
    (GuidedDecoding("json_schema", '{"type": '), "not valid JSON"),
    (GuidedDecoding("regex", "a(b"), "unclosed group"),
    (GuidedDecoding("grammar", "start: foo"), "foo"),
    (GuidedDecoding("choice", '["a", 3]'), "list of non-empty strings"),
    (GuidedDecoding("lark", "x"), "kind must be one of"),
])
def test_a_bad_guide_is_refused_at_submit_with_the_library_message(guide, words):
    engine = make_engine()
    with pytest.raises(InvalidRequestError, match=r"guided_decoding") as err:
        Collector().request(engine, "Hi", max_tokens=8, guided=guide)
    assert words in str(err.value)
    assert not engine.has_work()


def test_a_guide_needs_an_end_token():
    with pytest.raises(InvalidRequestError, match="end_id is -1"):
        Collector().request(make_engine(), "Hi", max_tokens=8, end_id=-1, guided=GuidedDecoding("regex", "a"))


# ---- the engine ---------------------------------------------------------------------------

def run_guided(engine, requests: list[tuple[str, GuidedDecoding, dict]],
               drafts: list[int] | None = None) -> list[tuple[list[int], str, str]]:
    """All requests in one continuous batch -> (token ids, text, finish_reason) each;
    drafts, when given, gets each request's count of speculative guesses."""
    col = Collector()
    rids = [col.request(engine, prompt, guided=guide, **params) for prompt, guide, params in requests]
    drain(engine)
    out = []
    for rid in rids:
        final = col.final(rid)
        assert final.error is None, final.error
        out.append((col.ids(rid), col.text(rid), final.finish_reason))
        if drafts is not None:
            drafts.append(final.draft_tokens)
    return out


def guided_requests(temperature: float | None) -> list[tuple[str, GuidedDecoding, dict]]:
    guides = [json_guide(s) for s in SCHEMAS] + [GuidedDecoding("regex", r) for r in REGEXES]
    guides += [GuidedDecoding("choice", json.dumps(CHOICES)), GuidedDecoding("json_object")]
    prompts = ["The record:", "Colors and sizes", "Two words", "Plate", "Pets", "Pick one", "An object"]
    return [(p, g, dict(max_tokens=48, temperature=temperature, seed=11 + i, stream=i % 2 == 0))
            for i, (p, g) in enumerate(zip(prompts, guides))]


@pytest.mark.parametrize("temperature", [None, 1.0], ids=["greedy", "sampled"])
def test_every_guided_answer_that_stops_satisfies_its_guide(temperature):
    requests = guided_requests(temperature)
    results = run_guided(make_engine(), requests)
    for (prompt, guide, _), (_, text, reason) in zip(requests, results):
        if guide.kind != "json_object":  # bounded guides: the answer must end, and inside max_tokens
            assert reason == "stop", (guide, text)
        if reason == "stop":
            check_answer(guide, text)


@pytest.mark.parametrize("drafter", ["lookup", "random"])
def test_speculation_gives_the_greedy_guided_text_of_plain_decoding(drafter):
    """Prompt lookup (guesses from the prompt, often outside the guide) and a random draft
    model (mostly rejected guesses: the matcher rolls back)."""
    requests = guided_requests(None)
    plain = run_guided(make_engine(), requests)
    drafts: list[int] = []
    speculative = run_guided(make_speculative_engine(drafter, k=4), requests, drafts)
    assert speculative == plain
    assert sum(drafts) > 0


def test_each_of_n_choices_has_its_own_matcher():
    guide = json_guide(COLOR_SIZES)
    requests = [("Colors and sizes", guide, dict(max_tokens=48, temperature=1.5, seed=s)) for s in range(4)]
    results = run_guided(make_engine(), requests)
    for _, text, reason in results:
        assert reason == "stop"
        check_answer(guide, text)
    assert len({text for _, text, _ in results}) > 1  # different draws, each valid on its own


def test_a_prompt_from_the_prefix_cache_gives_the_same_guided_answer():
    guide = GuidedDecoding("regex", REGEXES[1])
    prompt = "Pets of the house, listed in a line, for the record book: " * 3
    engine = make_prefix_caching_engine(True)
    col = Collector()
    first = col.request(engine, prompt, max_tokens=24, guided=guide)
    drain(engine)
    second = col.request(engine, prompt, max_tokens=24, guided=guide)
    drain(engine)
    assert col.final(second).num_cached_tokens > 0
    assert col.text(second) == col.text(first)
    check_answer(guide, col.text(first))


def test_min_tokens_does_not_hold_back_the_end_of_a_finished_guide():
    results = run_guided(make_engine(), [("Pick one", GuidedDecoding("choice", json.dumps(CHOICES)),
                                          dict(max_tokens=20, min_tokens=15))])
    _, text, reason = results[0]
    assert reason == "stop" and text in CHOICES


def test_a_batch_mixing_guided_and_other_rows_decides_each_as_alone():
    """sample_rows masks guided rows together or, with penalties of their own, one by one; a
    row's token is the one sample_row gives it alone, and inside its guide."""
    _, tok = tiny()
    compiler = GuideCompiler(tok, len(tok))
    prompt = tok("Pick one").input_ids
    guide = GuidedDecoding("choice", json.dumps(CHOICES))
    settings = [dict(guided=guide), dict(guided=guide, frequency_penalty=1.0, temperature=1.0, seed=3), dict(),
                dict(guided=json_guide(ID_FLAG), temperature=0.7, seed=5)]
    rows = [RowState.make(SamplingParams(max_tokens=8, **s), list(prompt), tok.eos_token_id,
                          compiler.start(s["guided"]) if "guided" in s else None) for s in settings]
    logits = torch.randn(len(rows), len(tok), generator=torch.Generator().manual_seed(0))  # [4, V]
    batched = sample_rows(logits, rows)
    for row, logit, (token, _) in zip(rows, logits, batched):
        assert sample_row(logit, row)[0] == token
        if row.guide is not None:
            assert torch.isfinite(process_logits(logit, row)[token])  # allowed by the guide
    assert any(c.startswith(tok.decode([batched[0][0]])) for c in CHOICES)  # the start of a choice
