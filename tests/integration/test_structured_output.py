"""Guided decoding (structured output) through a real tritonserver: the official `openai`
client against tritonlm's OpenAI frontend (response_format, vLLM's structured_outputs) and
tritonclient with the Triton inputs (sampling_parameters' guided_decoding, TensorRT-LLM's
guided_decoding_guide_type / guided_decoding_guide).

References: pydantic and `jsonschema` validating the answers, `re.fullmatch` for regexes;
the guides bound the answers' length, so every answer must end with finish_reason stop,
but for those max_tokens cuts on purpose (`length`) and those whose schema the grammar
enforces only in part (`oneOf` as `anyOf`), which end with the violation as an error."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.helpers.models import tiny
from tests.helpers.servers import HANG_GUARD_S, add_generation_model
from tritonlm.client.generate import GenerateError, generate_grpc
from tritonlm.openai.server import OpenAIServer
from tritonlm.server import free_ports

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class Pet(BaseModel):
    name: str = Field(max_length=6)
    legs: int = Field(ge=0, le=8)
    vaccinated: bool


@pytest.fixture(scope="module")
def triton_repo(tmp_path_factory):
    repo = tmp_path_factory.mktemp("guidedrepo")
    folder = add_generation_model(repo, "tiny_chat")
    tok = tiny()[1]
    tok.chat_template = CHATML  # the model's "own" template: saved with its tokenizer
    try:
        tok.save_pretrained(folder / "1" / "hf")
    finally:
        tok.chat_template = None
    return repo


@pytest.fixture(scope="module")
def client(triton_server, triton_repo):
    (port,) = free_ports(1)
    with OpenAIServer(triton_server.grpc_url, port=port, repo=triton_repo) as server:
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=HANG_GUARD_S)


# compact JSON (vLLM's option, with response_format's guide): the random tiny model would spend
# the tokens these tests bound on the whitespace a guide takes by default
COMPACT = {"structured_outputs": {"disable_any_whitespace": True}}


def test_chat_parse_with_a_pydantic_model_and_json_object(client):
    for temperature in (0, 1.2):
        completion = client.chat.completions.parse(
            model="tiny_chat", messages=[{"role": "user", "content": "Describe a pet."}], response_format=Pet,
            max_tokens=64, temperature=temperature, seed=5, extra_body=COMPACT)
        choice = completion.choices[0]
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, Pet)  # the openai client parsed and validated it
    # two sampled choices, each with its own matcher; and json_object
    r = client.chat.completions.parse(model="tiny_chat", messages=[{"role": "user", "content": "Two pets."}], n=2,
                                      response_format=Pet, max_tokens=64, temperature=1.0, seed=9, extra_body=COMPACT)
    assert len(r.choices) == 2
    for choice in r.choices:
        assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Pet)
    r = client.chat.completions.create(model="tiny_chat", messages=[{"role": "user", "content": "An object"}],
                                       response_format={"type": "json_object"}, max_tokens=48, temperature=0)
    if r.choices[0].finish_reason == "stop":  # unbounded: a random model may run to max_tokens
        assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_a_regex_and_a_choice_through_vllm_extra_fields_streamed_and_not(client):
    pattern = r"[0-9]{3}-[a-z]{2}"
    r = client.completions.create(model="tiny_chat", prompt="Code:", max_tokens=24, temperature=0,
                                  extra_body={"structured_outputs": {"regex": pattern}})
    assert r.choices[0].finish_reason == "stop" and re.fullmatch(pattern, r.choices[0].text)
    stream = client.completions.create(model="tiny_chat", prompt="Code:", max_tokens=24, temperature=0, stream=True,
                                       extra_body={"structured_outputs": {"regex": pattern}})
    assert "".join(c.choices[0].text for c in stream if c.choices) == r.choices[0].text
    r = client.chat.completions.create(model="tiny_chat", messages=[{"role": "user", "content": "Yes or no?"}],
                                       max_tokens=16, temperature=1.0, seed=2, extra_body={"guided_choice": ["yes", "no"]})
    assert r.choices[0].message.content in ("yes", "no") and r.choices[0].finish_reason == "stop"


def test_bad_guides_are_400s_naming_the_field(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model="tiny_chat", messages=[{"role": "user", "content": "Hi"}], max_tokens=8,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {
                "a": {"type": "strin"}}}}})
    assert err.value.body["param"] == "response_format.json_schema.schema" and "strin" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny_chat", prompt="Hi", max_tokens=8,
                                  extra_body={"structured_outputs": {"regex": "a(b"}})
    assert err.value.body["param"] == "structured_outputs.regex" and "unclosed group" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny_chat", prompt="Hi", max_tokens=8, extra_body={
            "response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}})
    assert err.value.body["param"] == "structured_outputs"


def test_triton_guided_decoding_in_sampling_parameters_and_trtllm_inputs(triton_server):
    schema = {**Pet.model_json_schema(), "additionalProperties": False}  # bounded: no further keys
    got = generate_grpc(triton_server.grpc_url, "tiny_chat", "Pet:", exclude_input_in_output=True, max_tokens=64,
                        sampling_parameters=json.dumps({"guided_decoding": {"json": schema, "disable_any_whitespace": True}}))
    assert got.finish_reason == "stop", got.text
    jsonschema.validate(json.loads(got.text), schema)
    got = generate_grpc(triton_server.grpc_url, "tiny_chat", "Date:", exclude_input_in_output=True, max_tokens=24,
                        temperature=1.0, seed=4, guided_decoding_guide_type="regex",
                        guided_decoding_guide=r"20[0-9]{2}-(0[1-9]|1[0-2])")
    assert got.finish_reason == "stop" and re.fullmatch(r"20[0-9]{2}-(0[1-9]|1[0-2])", got.text)
    got = generate_grpc(triton_server.grpc_url, "tiny_chat", "Answer:", exclude_input_in_output=True, max_tokens=24,
                        guided_decoding_guide_type="ebnf_grammar", guided_decoding_guide='root ::= "ok" | "fail" [0-9]')
    assert got.finish_reason == "stop" and re.fullmatch(r"ok|fail[0-9]", got.text)
    with pytest.raises(GenerateError, match=r"guided_decoding: invalid json_schema: .*contains"):
        generate_grpc(triton_server.grpc_url, "tiny_chat", "Hi", max_tokens=4, guided_decoding_guide_type="json_schema",
                      guided_decoding_guide='{"type": "array", "contains": {"type": "integer"}}')


LONG_LIST = {"type": "object", "properties": {"values": {"type": "array", "items": {"type": "integer"}, "minItems": 40}},
             "required": ["values"], "additionalProperties": False}
ONE_OF_NUMBER = {"type": "object", "properties": {"x": {"oneOf": [{"type": "number"}, {"type": "integer"}]}},
                 "required": ["x"], "additionalProperties": False}  # an integer matches both branches


def test_a_guided_answer_cut_by_max_tokens_ends_with_length(client):
    """The schema needs more than max_tokens allows: the answer is cut, and says so."""
    rf = {"type": "json_schema", "json_schema": {"name": "values", "schema": LONG_LIST}}
    messages = [{"role": "user", "content": "Forty numbers."}]
    r = client.chat.completions.create(model="tiny_chat", messages=messages, response_format=rf, max_tokens=12, temperature=0)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 12
    with pytest.raises(json.JSONDecodeError):
        json.loads(r.choices[0].message.content)  # incomplete
    stream = client.chat.completions.create(model="tiny_chat", messages=messages, response_format=rf, max_tokens=12,
                                            temperature=0, stream=True)
    chunks = [c for c in stream if c.choices]
    assert chunks[-1].choices[0].finish_reason == "length"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == r.choices[0].message.content
    r = client.completions.create(model="tiny_chat", prompt="{", max_tokens=6, temperature=0,
                                  extra_body={"structured_outputs": {"json": LONG_LIST, "disable_any_whitespace": True}})
    assert r.choices[0].finish_reason == "length" and not any(c.isspace() for c in r.choices[0].text)


def test_one_of_is_accepted_and_each_answer_validated_or_the_violation_reported(client):
    """oneOf with overlapping branches: the grammar enforces it as anyOf, and the finished
    answer is checked against the whole schema. One that stops is valid (jsonschema); one
    that violates it ends with an error naming the violation, never a silent stop."""
    rf = {"type": "json_schema", "json_schema": {"name": "value", "schema": ONE_OF_NUMBER}}
    outcomes = set()
    for seed in range(6):
        try:
            r = client.chat.completions.create(model="tiny_chat", messages=[{"role": "user", "content": "A value."}],
                                               response_format=rf, max_tokens=24, temperature=1.0, seed=seed)
        except openai.InternalServerError as e:
            assert "the answer violates the json_schema" in e.body["message"] and "keyword oneOf" in e.body["message"]
            outcomes.add("violation")
            continue
        outcomes.add(r.choices[0].finish_reason)
        if r.choices[0].finish_reason == "stop":
            jsonschema.validate(json.loads(r.choices[0].message.content), ONE_OF_NUMBER)
    assert outcomes <= {"stop", "length", "violation"}
    always = {"oneOf": [{"type": "boolean"}, {"enum": [True, False]}]}  # every answer matches both branches
    with pytest.raises(openai.InternalServerError) as err:
        client.completions.create(model="tiny_chat", prompt="Yes or no:", max_tokens=8, temperature=0,
                                  extra_body={"guided_json": always, **COMPACT})
    assert "the answer violates the json_schema" in err.value.body["message"]
    assert "is valid under each of" in err.value.body["message"]
    assert err.value.body["code"] == "schema_violation" and "internal error" not in err.value.body["message"]
