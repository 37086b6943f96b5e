"""tritonlm/openai/structured.py: response_format and vLLM's extra fields -> the guided_decoding
object of sampling_parameters; a bad guide is a 400 naming the field (llguidance's message)."""

from __future__ import annotations

import pytest

from tritonlm.openai.errors import OpenAIError
from tritonlm.openai.schemas import ChatCompletionRequest, CompletionRequest, parse_body

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
ONE_OF = {"type": "object", "properties": {"x": {"oneOf": [{"type": "number"}, {"type": "integer"}]}}, "required": ["x"]}
UNIQUE = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}


@pytest.mark.parametrize("fields, guide", [
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, {"json_object": True}),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA, "strict": True}}}, {"json": SCHEMA}),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n"}}}, {"json_object": True}),
    ({"structured_outputs": {"regex": "[0-9]+"}}, {"regex": "[0-9]+"}),
    ({"guided_json": SCHEMA}, {"json": SCHEMA}),
    ({"guided_choice": ["a", "b"]}, {"choice": ["a", "b"]}),
    ({"guided_grammar": 'root ::= "x"'}, {"grammar": 'root ::= "x"'}),
    ({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}}, {"json": SCHEMA, "disable_any_whitespace": True}),
    # enforced in part by the grammar, the answer checked after against the whole schema
    ({"guided_json": ONE_OF}, {"json": ONE_OF}),
    ({"guided_json": UNIQUE}, {"json": UNIQUE}),
    # structured_outputs' options alone go with the guide of another field (vLLM's way)
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"disable_any_whitespace": True}},
     {"json_object": True, "disable_any_whitespace": True}),
    ({"guided_json": SCHEMA, "structured_outputs": {"disable_any_whitespace": False, "regex": None}},
     {"json": SCHEMA, "disable_any_whitespace": False}),
])
def test_guides_reach_sampling_parameters(fields, guide):
    for model, body in ((ChatCompletionRequest, CHAT), (CompletionRequest, {"model": "m", "prompt": "hi"})):
        assert parse_body(model, {**body, **fields}).sampling().get("guided_decoding") == guide


@pytest.mark.parametrize("fields, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "strin"}}}},
     "response_format.json_schema.schema", "strin"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"not": {}}}}},
     "response_format.json_schema.schema", "not"),  # unsupported keyword: refused, not ignored
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {**UNIQUE, "contains": {}}}}},
     "response_format.json_schema.schema", 'Unimplemented keys: ["contains"]'),  # only uniqueItems is checked after
    ({"guided_json": {"type": "object", "dependencies": {"a": ["b"]}}}, "guided_json", "not a keyword of the schema's draft"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"whitespace_pattern": " *"}},
     "structured_outputs.whitespace_pattern", "not supported by this server"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"disable_any_whitespace": "yes"}},
     "structured_outputs.disable_any_whitespace", "expected true or false"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}}, "response_format.json_schema.name", "required"),
    ({"response_format": {"type": "structural_tag"}}, "response_format.type", "not supported"),
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex", "unclosed group"),
    ({"structured_outputs": {"grammar": "start: nope"}}, "structured_outputs.grammar", "nope"),
    ({"structured_outputs": {"choice": ["a"], "regex": "a"}}, "structured_outputs", "exactly one"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_regex", "sent with guided_choice"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex", "sent with response_format"),
])
def test_bad_guides_are_400s_naming_the_field(fields, param, words):
    with pytest.raises(OpenAIError) as err:
        parse_body(ChatCompletionRequest, {**CHAT, **fields})
    assert err.value.status == 400 and err.value.param == param and words in err.value.message
