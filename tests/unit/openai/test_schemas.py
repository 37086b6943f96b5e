"""tritonlm/openai/schemas.py: each bad body is a 400 whose `param` names the field and whose
message says what is allowed; a good one becomes the sampling_parameters of
tritonlm/protocol.py (every key one the model takes) and the chat template's messages."""

from __future__ import annotations

import re

import pytest

from tritonlm.openai.errors import OpenAIError
from tritonlm.openai.schemas import MAX_CHOICES, ChatCompletionRequest, CompletionRequest, parse_body
from tritonlm.protocol import SAMPLING_KEYS

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "m", "prompt": "hi"}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}


def refused(model, body) -> OpenAIError:
    with pytest.raises(OpenAIError) as e:
        parse_body(model, body)
    error = e.value
    assert set(error.body()["error"]) == {"message", "type", "param", "code"}
    return error


@pytest.mark.parametrize("fields, param, code, pattern", [
    ({"max_tokens": 0}, "max_tokens", "invalid_value", r"^max_tokens: .*greater than or equal to 1"),
    ({"max_tokens": "8"}, "max_tokens", "invalid_value", r"^max_tokens: .*integer.*got '8'"),  # strict: no coercion
    ({"temperature": 2.5}, "temperature", "invalid_value", r"^temperature: .*less than or equal to 2"),
    ({"top_p": 0}, "top_p", "invalid_value", r"^top_p: .*greater than 0"),
    ({"n": 17}, "n", "invalid_value", r"^n: .*less than or equal to 16"),
    ({"seed": -1}, "seed", "invalid_value", r"^seed: "),
    ({"stream": "yes"}, "stream", "invalid_value", r"^stream: .*boolean"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "invalid_value", r"only allowed when stream is true"),
    ({"stream": True, "stream_options": {"usage": True}}, "stream_options.usage", "unknown_parameter",
     r"unrecognized request argument"),
    ({"stop": 3}, "stop", "invalid_value", r"^stop: expected a string or a list of strings, got int"),
    ({"stop": ["a", None]}, "stop", "invalid_value", r"^stop: expected a string or a list of strings"),
    ({"logit_bias": {"5": "x"}}, "logit_bias.5", "invalid_value", r"^logit_bias\.5: "),
    ({"bogus": 1}, "bogus", "unknown_parameter", r"^bogus: unrecognized request argument"),
    ({"functions": [{"name": "f"}]}, "functions", "unsupported_parameter", r"send tools and tool_choice"),
    ({"audio": {}}, "audio", "unsupported_parameter", r"^audio: is not supported"),
    ({"modalities": ["text", "audio"]}, "modalities", "unsupported_parameter", r'only \["text"\]'),
    ({"response_format": {"type": "xml"}}, "response_format.type", "unsupported_parameter", r"'xml' is not supported"),
])
def test_a_bad_common_field_is_named_with_what_is_allowed(fields, param, code, pattern):
    for model, body in ((CompletionRequest, COMPLETION), (ChatCompletionRequest, CHAT)):
        error = refused(model, {**body, **fields})
        assert (error.status, error.param, error.code) == (400, param, code), error.body()
        assert re.search(pattern, error.message), error.message
        assert error.type == "invalid_request_error"


@pytest.mark.parametrize("fields, param, pattern", [
    ({"prompt": None}, "prompt", r"expected a string or a non-empty list of strings"),
    ({"prompt": []}, "prompt", r"expected a string or a non-empty list of strings"),
    ({"prompt": [1, 2]}, "prompt", r"token-id prompts are not supported"),
    ({"prompt": ""}, "prompt", r"empty prompt"),
    ({"prompt": ["a", ""]}, "prompt[1]", r"empty prompt"),
    ({"logprobs": 6}, "logprobs", r"less than or equal to 5"),
    ({"best_of": 2}, "best_of", r"only 1 is supported"),
    ({"suffix": "x"}, "suffix", r"no insertion"),
    ({"tools": [TOOL]}, "tools", r"is a chat field: use /v1/chat/completions"),
    ({"prompt": ["a"] * 8, "n": 9}, "n", rf"8 prompts x n=9 choices; at most {MAX_CHOICES}"),
])
def test_a_bad_completion_field_is_named(fields, param, pattern):
    error = refused(CompletionRequest, {**COMPLETION, **fields})
    assert (error.status, error.param) == (400, param) and re.search(pattern, error.message), error.body()


@pytest.mark.parametrize("messages, param, pattern", [
    ([], "messages", r"at least 1 item"),
    (["hi"], "messages[0]", r"expected an object with role and content"),
    ([{"role": "robot", "content": "x"}], "messages[0].role", r"expected system, developer, user, assistant or tool"),
    ([{"role": "function", "content": "x"}], "messages[0].role", r"'function' messages are deprecated"),
    ([{"role": "user"}], "messages[0].content", r"required"),
    ([{"role": "user", "content": 5}], "messages[0].content", r"expected a string or a list of text parts"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "messages[0].content[0]",
     r"images are not supported"),
    ([{"role": "user", "content": [{"type": "txt"}]}], "messages[0].content[0]", r'expected \{"type": "text"'),
    ([{"role": "user", "content": "x", "tool_calls": []}], "messages[0].tool_calls", r"only allowed on assistant"),
    ([{"role": "user", "content": "x", "mood": "ok"}], "messages[0].mood", r"unrecognized field"),
    ([{"role": "tool", "content": "42"}], "messages[0].tool_call_id", r"required: the id of the call"),
    ([{"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {"name": "f",
       "arguments": "{no"}}]}], "messages[0].tool_calls[0].function.arguments", r"not valid JSON"),
])
def test_a_bad_message_is_named_by_its_place(messages, param, pattern):
    error = refused(ChatCompletionRequest, {**CHAT, "messages": messages})
    assert (error.status, error.param) == (400, param) and re.search(pattern, error.message), error.body()


@pytest.mark.parametrize("fields, param, pattern", [
    ({"top_logprobs": 2}, "top_logprobs", r"needs logprobs: true"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", r"less than or equal to 20"),
    ({"tool_choice": "required"}, "tool_choice", r"needs tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type", r'only "function" tools'),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice.function.name",
     r"'g' is not one of"),
])
def test_a_bad_chat_field_is_named(fields, param, pattern):
    error = refused(ChatCompletionRequest, {**CHAT, **fields})
    assert (error.status, error.param) == (400, param) and re.search(pattern, error.message), error.body()


def test_a_body_that_is_not_an_object_is_refused_as_such():
    for body in ([], "hi", None, 3):
        error = refused(CompletionRequest, body)
        assert error.code == "invalid_json" and "must be a JSON object" in error.message


def test_sampling_parameters_carry_every_field_under_the_models_names():
    req = parse_body(CompletionRequest, {**COMPLETION, "max_tokens": 7, "temperature": 0.5, "top_p": 0.9, "top_k": 4,
                                         "min_p": 0.1, "min_tokens": 2, "repetition_penalty": 1.1,
                                         "frequency_penalty": 0.5, "presence_penalty": -0.5, "logit_bias": {"3": 2.0},
                                         "stop_token_ids": [9], "seed": 40, "stop": "\n", "ignore_eos": True,
                                         "logprobs": 2, "n": 3, "user": "u", "store": False})
    assert req.sampling(2) == {"max_tokens": 7, "temperature": 0.5, "top_p": 0.9, "top_k": 4, "min_p": 0.1,
                               "min_tokens": 2, "repetition_penalty": 1.1, "frequency_penalty": 0.5,
                               "presence_penalty": -0.5, "logit_bias": {"3": 2.0}, "stop_token_ids": [9], "seed": 42,
                               "stop": ["\n"], "ignore_eos": True, "logprobs": 2}
    assert set(req.sampling(2)) <= set(SAMPLING_KEYS)  # every key is one the model reads
    assert parse_body(CompletionRequest, COMPLETION).sampling() == {}  # the model's defaults
    empty = parse_body(CompletionRequest, {**COMPLETION, "logit_bias": {}, "stop_token_ids": [], "stop": ""})
    assert empty.sampling() == {}


def test_chat_fields_max_completion_tokens_logprobs_and_usage():
    req = parse_body(ChatCompletionRequest, {**CHAT, "max_tokens": 5, "max_completion_tokens": 9, "logprobs": True,
                                             "top_logprobs": 3, "stream": True, "stream_options": {"include_usage": True}})
    assert req.sampling()["max_tokens"] == 9  # the newer field wins
    assert req.sampling()["logprobs"] == 3 and req.wants_logprobs() and req.include_usage
    plain = parse_body(ChatCompletionRequest, {**CHAT, "logprobs": False, "top_logprobs": 0})
    assert "logprobs" not in plain.sampling() and not plain.include_usage


def test_messages_become_the_templates_form():
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    req = parse_body(ChatCompletionRequest, {**CHAT, "messages": [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}], "name": "ann"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "42", "tool_call_id": "call_1"},
        {"role": "assistant", "content": None},
    ]})
    assert req.chat_messages() == [
        {"role": "system", "content": "be brief"},  # developer is the system turn for templates
        {"role": "user", "content": "one\ntwo", "name": "ann"},
        {"role": "assistant", "content": None,
         "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {"a": 1}}, "id": "call_1"}]},
        {"role": "tool", "content": "42", "tool_call_id": "call_1"},
        {"role": "assistant", "content": ""},
    ]
