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
from tritonlm.engine.guided import JSON_INDENT_MAX, GuideCompiler, guide_grammar
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


def json_guide(schema: dict, compact: bool = False) -> GuidedDecoding:
    return GuidedDecoding("json_schema", json.dumps(schema), compact=compact)


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
    answer = tok('{"id":42,"ok": true}').input_ids
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
    (GuidedDecoding("json_schema", '{"type": "array", "contains": {"type": "integer"}}'), "contains"),  # not silently ignored
    (GuidedDecoding("json_schema", '{"type": "array", "uniqueItems": true, "items": {"not": {}}}'), '["not"]'),
    (GuidedDecoding("json_schema", '{"type": "object", "dependencies": {"a": ["b"]}}'), "not a keyword of the schema's draft"),
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


# ---- JSON whitespace ------------------------------------------------------------------------

PAIR = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "array", "items": {"type": "integer"}}},
        "required": ["a", "b"], "additionalProperties": False}
GAPS = ['{', '{"a"', '{"a":', '{"a":1', '{"a":1,', '{"a":1,"b":[', '{"a":1,"b":[2', '{"a":1,"b":[2]']  # between JSON tokens


def char_ids(tok, text: str) -> list[int]:
    """text as one token per character (the tiny tokenizer has each of these alone)."""
    ids = [tok(c).input_ids for c in text]
    assert all(len(i) == 1 for i in ids)
    return [i[0] for i in ids]


def test_json_whitespace_is_bounded_at_every_gap_and_compact_takes_none():
    """At every place between two JSON tokens the flexible guide takes at most one newline,
    then up to JSON_INDENT_MAX spaces or tabs; after the longest runs its mask allows no
    token that starts with whitespace, so whitespace cannot fill an answer. The compact
    guide takes none."""
    _, tok = tiny()
    compiler = GuideCompiler(tok, len(tok))
    flexible, compact = json_guide(PAIR), GuidedDecoding("json_schema", json.dumps(PAIR), compact=True)
    texts = [tok.decode([t]) for t in range(len(tok))]
    for prefix in GAPS:
        for run in (" " * JSON_INDENT_MAX, "\n" + " " * JSON_INDENT_MAX, "\n" + "\t" * JSON_INDENT_MAX):
            matcher = compiler.start(flexible).matcher
            assert matcher.consume_tokens(char_ids(tok, prefix + run)), (prefix, run)
            allowed = [t for t, b in enumerate(matcher.compute_logit_bias()) if b and t < len(tok)]
            assert allowed and not any(texts[t][:1].isspace() for t in allowed), (prefix, run)
        matcher = compiler.start(compact).matcher
        ids = char_ids(tok, prefix)
        for c in " \n\t":
            assert matcher.validate_tokens(ids + char_ids(tok, c)) == len(ids), (prefix, c)


def test_pretty_printed_json_is_taken_and_a_longer_indentation_is_not():
    _, tok = tiny()
    compiler = GuideCompiler(tok, len(tok))
    value = {"a": 1, "b": [2, 3]}

    def taken(guide: GuidedDecoding, text: str) -> bool:
        ids = tok(text).input_ids
        return compiler.start(guide).matcher.validate_tokens(ids) == len(ids)

    flexible, compact = json_guide(PAIR), json_guide(PAIR, compact=True)
    for text in (json.dumps(value, indent=2), json.dumps(value, indent="\t"), json.dumps(value)):
        assert taken(flexible, text) and not taken(compact, text), text
    assert taken(flexible, json.dumps(value, separators=(",", ":"))) and taken(compact, json.dumps(value, separators=(",", ":")))
    assert not taken(flexible, json.dumps(value, indent=JSON_INDENT_MAX + 1))


# ---- schemas the grammar enforces in part: the answer checked after ------------------------

ONE_OF_NUMBER = {"type": "object", "properties": {"x": {"oneOf": [{"type": "number"}, {"type": "integer"}]}},
                 "required": ["x"], "additionalProperties": False}  # an integer matches both branches


@pytest.mark.parametrize("schema, valid, invalid, words", [
    (ONE_OF_NUMBER, '{"x": 1.5}', '{"x": 1}', r"1 is valid under each of .*at \$\.x, keyword oneOf"),
    ({"type": "array", "items": {"enum": ["a", "b"]}, "uniqueItems": True, "minItems": 2, "maxItems": 2},
     '["a","b"]', '["a","a"]', "has non-unique elements"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "maxProperties": 1},  # other keys allowed
     '{"a":1}', '{"a":1,"b":2}', "has too many properties"),
    ({"$schema": "http://json-schema.org/draft-07/schema#", "type": "object", "dependencies": {"a": ["b"]},
      "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "additionalProperties": False},
     '{"a":1,"b":2}', '{"a":1}', "'b' is a dependency of 'a'"),
])
def test_an_approximated_schema_ends_only_on_a_valid_answer_and_a_violation_fails_the_row(schema, valid, invalid, words):
    _, tok = tiny()
    compiler = GuideCompiler(tok, len(tok))
    guide, ends = json_guide(schema), [tok.eos_token_id]
    state = compiler.start(guide)
    state.sync(tok(valid).input_ids, ends)
    assert state.can_end() and state.violation is None
    jsonschema.validate(json.loads(valid), schema)  # the reference agrees
    state = compiler.start(guide)
    with pytest.raises(ValueError, match="guided_decoding: the answer violates the json_schema: .*" + words):
        state.sync(tok(invalid).input_ids, ends)  # complete, and nothing more can follow: the row fails
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(json.loads(invalid), schema)


def test_a_violating_answer_that_can_go_on_may_not_end_there():
    """A top-level number: "1" is complete but matches both branches; "1.5" matches one."""
    _, tok = tiny()
    compiler = GuideCompiler(tok, len(tok))
    state = compiler.start(json_guide({"oneOf": [{"type": "number"}, {"type": "integer"}]}))
    ends = [tok.eos_token_id]
    state.sync(char_ids(tok, "1"), ends)
    assert state.matcher.is_accepting() and not state.can_end() and "valid under each of" in state.violation
    state.sync(char_ids(tok, "1.5"), ends)
    assert state.can_end()


def test_a_disjoint_one_of_is_exact_and_not_checked_after():
    _, tok = tiny()
    kinds = {"oneOf": [{"type": "object", "properties": {"kind": {"const": "card"}}, "required": ["kind"]},
                       {"type": "object", "properties": {"kind": {"const": "bank"}}, "required": ["kind"]}]}
    assert GuideCompiler(tok, len(tok)).start(json_guide(kinds)).check is None


def test_guided_answers_of_a_one_of_schema_are_valid_or_fail_with_the_violation():
    """Sampled answers under ONE_OF_NUMBER: each that stops validates against the full
    schema (jsonschema); each that completes an integer fails, naming the violation."""
    engine = make_engine()
    col = Collector()
    guide = json_guide(ONE_OF_NUMBER)
    rids = [col.request(engine, "The value:", max_tokens=24, temperature=1.0, seed=s, guided=guide) for s in range(8)]
    always = json_guide({"oneOf": [{"type": "boolean"}, {"enum": [True, False]}]})  # every answer matches both
    failing = col.request(engine, "Yes or no:", max_tokens=8, guided=always)
    drain(engine)
    for rid in rids:
        final = col.final(rid)
        if final.finish_reason == "stop":
            jsonschema.validate(json.loads(col.text(rid)), ONE_OF_NUMBER)
        elif final.finish_reason == "error":
            assert "the answer violates the json_schema" in final.error and "keyword oneOf" in final.error
    final = col.final(failing)
    assert final.finish_reason == "error" and "the answer violates the json_schema" in final.error, final
    assert not final.error.startswith("internal error"), final.error  # the model's answer, not a server fault


@pytest.mark.parametrize("drafter", [None, "random"])
def test_a_violation_fails_its_row_alone(drafter):
    """With a draft model too, whose own guesses may complete the violating answer first."""
    engine = make_engine() if drafter is None else make_speculative_engine(drafter, k=4)
    col = Collector()
    always = json_guide({"oneOf": [{"type": "boolean"}, {"enum": [True, False]}]}, compact=True)
    failing = col.request(engine, "Yes or no:", max_tokens=8, guided=always)
    other = col.request(engine, "Pets", max_tokens=24, guided=GuidedDecoding("regex", REGEXES[1]))
    drain(engine)
    assert col.final(failing).finish_reason == "error" and "is valid under each of" in col.final(failing).error
    assert col.final(other).finish_reason == "stop" and re.fullmatch(REGEXES[1], col.text(other))


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
    # compact JSON: the random tiny model would spend the tokens these tests bound on whitespace
    guides = [json_guide(s, compact=True) for s in SCHEMAS] + [GuidedDecoding("regex", r) for r in REGEXES]
    guides += [GuidedDecoding("choice", json.dumps(CHOICES)), GuidedDecoding("json_object", compact=True)]
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
    guide = json_guide(COLOR_SIZES, compact=True)
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
