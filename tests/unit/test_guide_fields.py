"""tritonlm/guide_fields.py: guides as requests carry them (vLLM's structured-output object,
TensorRT-LLM's guide inputs) -> GuidedDecoding, and the errors that name the field."""

from __future__ import annotations

import json

import pytest

from tritonlm.engine.request import GuidedDecoding, InvalidRequestError
from tritonlm.guide_fields import ANY_JSON_SCHEMA, guide_from_fields, guide_from_trtllm


@pytest.mark.parametrize("obj, expected", [
    ({"json": {"type": "object"}}, GuidedDecoding("json_schema", '{"type": "object"}')),
    ({"json": '{"type": "array"}'}, GuidedDecoding("json_schema", '{"type": "array"}')),
    ({"json_object": True}, GuidedDecoding("json_object")),
    ({"regex": "[0-9]+", "disable_any_whitespace": True}, GuidedDecoding("regex", "[0-9]+")),
    ({"grammar": 'root ::= "a"'}, GuidedDecoding("grammar", 'root ::= "a"')),
    ({"choice": ["só", "no"]}, GuidedDecoding("choice", json.dumps(["só", "no"], ensure_ascii=False))),
    ({"regex": "a", "json": None, "json_object": False}, GuidedDecoding("regex", "a")),  # unset fields as vLLM sends them
    ({"json_object": True, "disable_any_whitespace": False}, GuidedDecoding("json_object")),  # vLLM's default
    # JSON without whitespace between tokens; the default takes bounded whitespace
    ({"json_object": True, "disable_any_whitespace": True}, GuidedDecoding("json_object", compact=True)),
    ({"json": {"type": "object"}, "disable_any_whitespace": True}, GuidedDecoding("json_schema", '{"type": "object"}', compact=True)),
    # asdict(StructuredOutputsParams(json=...)), as NVIDIA's OpenAI frontend sends it for a named tool_choice
    ({"json": '{"type": "object"}', "regex": None, "choice": None, "grammar": None, "json_object": None,
      "disable_fallback": False, "disable_any_whitespace": False, "disable_additional_properties": False,
      "whitespace_pattern": None, "structural_tag": None, "_backend": None, "_backend_was_auto": False},
     GuidedDecoding("json_schema", '{"type": "object"}')),
])
def test_vllm_fields(obj, expected):
    assert guide_from_fields(obj, "sp.guided_decoding") == expected


@pytest.mark.parametrize("obj, message", [
    ({"json": {}, "regex": "a"}, r"^sp.guided_decoding: exactly one of .* got json, regex"),
    ({}, r"got none"),
    ({"regx": "a"}, r"unknown key\(s\) \['regx'\]"),
    ({"regex": "a", "structural_tag": "{}"}, r"^sp.guided_decoding.structural_tag: not supported"),
    ({"json_object": True, "disable_any_whitespace": "no"}, r"disable_any_whitespace: expected true or false"),
    ({"choice": []}, r"^sp.guided_decoding.choice: expected a non-empty list"),
    ({"regex": 3}, r"^sp.guided_decoding.regex: expected a non-empty string"),
    ("regex", r"^sp.guided_decoding: expected an object"),
])
def test_vllm_fields_refused_by_name(obj, message):
    with pytest.raises(InvalidRequestError, match=message):
        guide_from_fields(obj, "sp.guided_decoding")


def test_trtllm_guide_types():
    assert guide_from_trtllm(None, None) is None
    assert guide_from_trtllm("json", None) == GuidedDecoding("json_schema", ANY_JSON_SCHEMA)
    assert guide_from_trtllm("json_schema", "{}") == GuidedDecoding("json_schema", "{}")
    assert guide_from_trtllm("regex", "a+") == GuidedDecoding("regex", "a+")
    assert guide_from_trtllm("ebnf_grammar", 'root ::= "a"') == GuidedDecoding("grammar", 'root ::= "a"')
    for guide_type, guide, message in (("lark", "x", "^guided_decoding_guide_type: must be one of"),
                                       (None, "x", "^guided_decoding_guide: sent without"),
                                       ("regex", None, "^guided_decoding_guide: missing"),
                                       ("json", "{}", "takes no guide")):
        with pytest.raises(InvalidRequestError, match=message):
            guide_from_trtllm(guide_type, guide)
