"""Tool calls' pieces without a server: the tools' checks, the guide of required calls (checked
with jsonschema's own validator) and the readers, on hand-written model answers in the
Hermes format (`<tool_call>{...}</tool_call>`, what SmolLM2-Instruct and Qwen templates teach)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tritonlm.openai.errors import OpenAIError
from tritonlm.openai.tools import (CallListReader, HermesReader, NamedReader, check_tool_choice, check_tools,
                                   required_schema)

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                          "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
NAMES = {"get_weather", "get_time"}


def read(reader, text: str, step: int | None = None):
    """The reader's message after the whole text, fed at once or `step` characters at a time,
    and what it streamed: (content pieces joined, calls from the deltas)."""
    pieces = [text] if step is None else [text[i: i + step] for i in range(0, len(text), step)]
    content, calls = "", []
    for piece in pieces + [None]:
        reading = reader.feed(piece) if piece is not None else reader.finish()
        content += reading.content
        for d in reading.calls:
            if d.id is not None:
                calls.append({"name": d.name, "arguments": d.arguments})
            else:
                calls[d.index]["arguments"] += d.arguments
    return reader.message(), (content, calls)


def plain(calls: list[dict]) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


HERMES_CASES = [
    # (model output, expected content, expected calls)
    ("The weather is nice.", "The weather is nice.", []),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', None,
     [("get_weather", {"city": "Paris"})]),
    ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>\n'
     '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>', "Let me check.\n\n",
     [("get_weather", {"city": "Oslo", "days": 2}), ("get_time", {})]),
    # arguments written as a JSON string, and "parameters" instead of "arguments"
    ('<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\"}"}</tool_call>', None,
     [("get_weather", {"city": "Rome"})]),
    ('<tool_call>{"name": "get_time", "parameters": {}}</tool_call>', None, [("get_time", {})]),
    # a block the answer never closed (max_tokens, or the model stopped there) is read at the end
    ('<tool_call>\n{"name": "get_time", "arguments": {}}\n', None, [("get_time", {})]),
    # not calls: unknown function, broken JSON, arguments not an object, a tag inside prose
    ('<tool_call>{"name": "launch", "arguments": {}}</tool_call>', '<tool_call>{"name": "launch", "arguments": {}}</tool_call>', []),
    ('<tool_call>{"name": "get_time", "arguments": {</tool_call>', '<tool_call>{"name": "get_time", "arguments": {</tool_call>', []),
    ('<tool_call>{"name": "get_time", "arguments": [1]}</tool_call>', '<tool_call>{"name": "get_time", "arguments": [1]}</tool_call>', []),
    ("a < b and <tool is not a call", "a < b and <tool is not a call", []),
]


@pytest.mark.parametrize("text, content, calls", HERMES_CASES)
@pytest.mark.parametrize("step", [None, 1, 3])
def test_hermes_reader_finds_the_calls_and_streams_what_it_returns(text, content, calls, step):
    (got_content, got_calls), (streamed_content, streamed_calls) = read(HermesReader(NAMES), text, step)
    assert got_content == content and plain(got_calls) == calls
    assert all(c["type"] == "function" and c["id"].startswith("call_") and len(c["id"]) > 10 for c in got_calls)
    assert len({c["id"] for c in got_calls}) == len(got_calls)
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed_calls] == calls
    assert streamed_content == "".join(got_content or "") or (got_content is None and not streamed_content.strip())


def test_hermes_reader_never_streams_a_possible_tag_as_content():
    reader = HermesReader(NAMES)
    assert reader.feed("Sure <tool").content == "Sure "  # "<tool" may start a block: held
    assert reader.feed("_ca").content == ""
    reading = reader.feed('ll>{"name": "get_time", "arguments": {}}</tool_call> done')
    assert [d.name for d in reading.calls] == ["get_time"] and reading.content == " done"


def test_hermes_reader_without_parallel_calls_keeps_the_first_call_only():
    text = ('<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
            '<tool_call>{"name": "get_weather", "arguments": {"city": "Lima"}}</tool_call>')
    (content, calls), _ = read(HermesReader(NAMES, parallel=False), text)
    assert plain(calls) == [("get_time", {})]
    assert content == '<tool_call>{"name": "get_weather", "arguments": {"city": "Lima"}}</tool_call>'


@pytest.mark.parametrize("step", [None, 1, 4])
def test_required_calls_are_read_as_each_object_closes(step):
    text = ' [ {"name": "get_weather", "arguments": {"city": "a}]{\\"b"}} ,{"name":"get_time","arguments":{}}]'
    (content, calls), (_, streamed) = read(CallListReader(), text, step)
    assert plain(calls) == [("get_weather", {"city": 'a}]{"b'}), ("get_time", {})] and content is None
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed] == plain(calls)


CUT_REQUIRED = [
    # (a required answer cut by max_tokens, the calls it ends with: a cut element with a complete name
    # is a call with the arguments' text so far)
    ('[{"name": "get_weather", "arguments": {"city": "Pa', [("get_weather", '{"city": "Pa')]),
    ('[{"name": "get_time", "arguments": {"zone": "UTC"}}, {"name": "get_weather", "arguments": ',
     [("get_time", '{"zone": "UTC"}'), ("get_weather", "")]),
    ('[{"name": "get_time"', [("get_time", "")]),
    ('[{"name": "get_ti', []),  # no complete name: no call
    ("[", []),
]


@pytest.mark.parametrize("text, calls", CUT_REQUIRED)
@pytest.mark.parametrize("step", [None, 1, 5])
def test_a_cut_required_call_ends_the_same_streamed_or_not(text, calls, step):
    reader = CallListReader()
    (content, got), (streamed_content, streamed) = read(reader, text, step)
    assert content is None and streamed_content == ""  # a forced answer is never content
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in got] == calls
    assert [(c["name"], c["arguments"]) for c in streamed] == calls
    assert reader.complete() == all(_parses(a) for _, a in calls)  # a cut call's arguments do not parse
    assert not reader.complete() or not calls


def _parses(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def test_finish_reason_is_tool_calls_only_when_every_call_parses():
    """The app's Choice: `tool_calls` for an answer that stopped on its own with calls whose
    arguments parse; a cut call (by max_tokens, or a stop) keeps the answer's own reason. The
    non-streamed message holds the calls a stream of the same text gives, content null."""
    from tritonlm.openai.app import Choice
    from tritonlm.openai.triton import Piece

    named = '{"city": "Paris", "days": 3}'
    cases = ((named, "stop", "tool_calls"), (named[:9], "length", "length"), (named[:9], "stop", "stop"),
             ('[{"name": "get_time", "arguments": {}}]', "stop", "tool_calls"),
             ('[{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {"ci', "length", "length"))
    for text, reason, want in cases:
        def new_reader():
            return NamedReader("get_weather") if text.startswith("{") else CallListReader()

        whole = Choice(0, 0, True, "", gen=None, reader=new_reader())
        whole.absorb(Piece(text=text, final=True, finish_reason=reason))
        message = whole.message()
        assert whole.final_reason() == want, (text, reason)
        _, (streamed_content, streamed) = read(new_reader(), text, step=4)
        assert message["content"] is None and streamed_content == ""
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == [
            (c["name"], c["arguments"]) for c in streamed]


def test_a_named_call_streams_its_arguments_as_they_come():
    (content, calls), (_, streamed) = read(NamedReader("get_weather"), '{"city": "Paris", "days": 3}', step=2)
    assert content is None and calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}
    assert streamed == [{"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}]


def test_the_required_guide_accepts_exactly_calls_of_the_tools():
    functions = check_tools([WEATHER, TIME])
    schema = required_schema(functions, parallel=True)
    jsonschema.Draft202012Validator.check_schema(schema)
    ok = [[{"name": "get_weather", "arguments": {"city": "Paris"}}], [{"name": "get_time", "arguments": {}}] * 2]
    bad = [[], [{"name": "get_weather", "arguments": {}}], [{"name": "other", "arguments": {}}],
           [{"name": "get_time", "arguments": {}, "extra": 1}], {"name": "get_time", "arguments": {}}]
    for value in ok:
        jsonschema.validate(value, schema)
    for value in bad:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(value, schema)
    with pytest.raises(jsonschema.ValidationError):  # parallel_tool_calls false: one call
        jsonschema.validate(ok[1], required_schema(functions, parallel=False))


@pytest.mark.parametrize("tools, param, pattern", [
    ([{"type": "retrieval"}], "tools[0].type", "only \"function\""),
    ([{"type": "function", "function": {"name": "bad name"}}], "tools[0].function.name", "letters, digits"),
    ([WEATHER, WEATHER], "tools[1].function.name", "defined twice"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}], "tools[0].function.parameters",
     "not a valid JSON Schema"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}], "tools[0].function.parameters",
     "must be an object"),
    ([{"type": "function", "function": {"name": "f", "colour": 1}}], "tools[0].function.colour", "unrecognized"),
    # valid JSON Schema, but a keyword the grammar library cannot guide: refused by name too
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "if": {}, "then": {}}}}],
     "tools[0].function.parameters", "Unimplemented keys"),
    ([], "tools", "non-empty list"),
])
def test_bad_tools_are_refused_by_name(tools, param, pattern):
    with pytest.raises(OpenAIError) as e:
        check_tools(tools)
    assert e.value.param == param and pattern in e.value.message


def test_tool_choice_names_one_of_the_tools():
    functions = check_tools([WEATHER, TIME])
    assert check_tool_choice(None, functions) == "auto" and check_tool_choice(None, []) == "none"
    assert check_tool_choice({"type": "function", "function": {"name": "get_time"}}, functions).name == "get_time"
    for choice, param in (({"type": "function", "function": {"name": "nope"}}, "tool_choice.function.name"),
                          ("sometimes", "tool_choice"), ("required", "tool_choice")):
        with pytest.raises(OpenAIError) as e:
            check_tool_choice(choice, functions if choice != "required" else [])
        assert e.value.param == param
