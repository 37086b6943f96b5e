"""tritonlm/protocol.py, no server needed. The generation model's contract (INPUTS/OUTPUTS)
is the one source of its config.pbtxt, the request parser, the client and the tables in
docs/protocol.md: these tests fail when any of them drifts from it. The parser refuses bad
input naming the field, as the engine's caller sends it (no Triton checks in front)."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from tritonlm.client.generate import INPUT_TYPES
from tritonlm.engine.request import GenerationEvent, InvalidRequestError
from tritonlm.export.repository import parse_config, write_generate_config
from tritonlm.paths import REPO_ROOT
from tritonlm.protocol import INPUTS, KNOWN_INPUTS, NUMPY_TYPES, OUTPUTS, event_outputs, markdown_table, parse_request

TEXT = np.array([b"hi"], dtype=object)


@pytest.fixture(scope="module")
def generate_config(tmp_path_factory):
    path = write_generate_config(tmp_path_factory.mktemp("repo") / "gen", max_context=64)
    return parse_config(path.read_text())


def _type_name(data_type: int) -> str:
    from tritonclient.grpc import model_config_pb2

    return model_config_pb2.DataType.Name(data_type)


def test_contract_rows_are_well_formed():
    for rows in (INPUTS, OUTPUTS):
        names = [t.name for t in rows]
        assert len(names) == len(set(names)), names
        for t in rows:
            assert t.dtype in NUMPY_TYPES, t
            assert t.dims in ((1,), (-1,)) or (rows is OUTPUTS and t.dims == (-1, -1)), t  # [tokens, N] alternatives
            assert t.meaning and "|" not in t.meaning and "\n" not in t.meaning, t
    assert [t.name for t in INPUTS if not t.optional] == ["text_input"]
    assert all(t.default is None for t in OUTPUTS)


def test_config_inputs_are_the_contract(generate_config):
    written = [(i.name, _type_name(i.data_type), list(i.dims), i.optional) for i in generate_config.input]
    assert written == [(t.name, t.config_type, list(t.dims), t.optional) for t in INPUTS]
    assert not any(list(i.reshape.shape) for i in generate_config.input)  # no reshape, as before


def test_config_outputs_are_the_contract(generate_config):
    written = [(o.name, _type_name(o.data_type), list(o.dims)) for o in generate_config.output]
    assert written == [(t.name, t.config_type, list(t.dims)) for t in OUTPUTS]
    assert generate_config.max_batch_size == 0  # dims carry no batch dimension
    assert generate_config.model_transaction_policy.decoupled


def test_client_sends_the_contract_types():
    assert INPUT_TYPES == {t.name: t.dtype for t in INPUTS if t.optional}


def test_doc_tables_are_the_contract():
    """docs/protocol.md holds the I/O tables (the README links there)."""
    page = (REPO_ROOT / "docs" / "protocol.md").read_text()
    for direction, rows in (("inputs", INPUTS), ("outputs", OUTPUTS)):
        table = markdown_table(direction)
        header = table.splitlines()[0]
        assert header in page, f"docs/protocol.md has no {direction} table ({header})"
        # the page's rows' names, in order: a clearer failure than the text comparison below
        block = page[page.index(header):].split("\n\n", 1)[0]
        names = re.findall(r"^\| `([^`]+)` \|", block, flags=re.M)
        assert names == [t.name for t in rows], f"docs/protocol.md's {direction} table"
        assert table in page, (
            f"docs/protocol.md's {direction} table differs from tritonlm.protocol.markdown_table({direction!r}); paste:\n{table}"
        )


def test_docstring_cites_only_files_in_the_repository():
    import tritonlm.protocol

    for cited in re.findall(r"[\w./-]+\.(?:md|py)\b", tritonlm.protocol.__doc__):
        assert (REPO_ROOT / cited).exists(), cited


def test_parser_knows_exactly_the_contract_inputs():
    assert set(KNOWN_INPUTS) == {t.name for t in INPUTS}
    with pytest.raises(InvalidRequestError, match=r"unknown input\(s\) \['pad_id'\]"):
        parse_request({"text_input": TEXT, "pad_id": np.array([0], np.int32)}, 4)
    with pytest.raises(InvalidRequestError, match=r"text_input: missing; send the prompt as a BYTES tensor of shape \[1\]"):
        parse_request({"max_tokens": np.array([4], np.int32)}, 4)


def _sample(t, wrong: bool = False) -> np.ndarray:
    """A valid value of contract row t; wrong=True: a value of another datatype."""
    good = {"INT32": np.array([1], np.int32), "UINT64": np.array([1], np.uint64), "FP32": np.array([0.5], np.float32),
            "BOOL": np.array([True]), "BYTES": np.array([b"x"], dtype=object)}
    if not wrong:
        valid = {"sampling_parameters": b'{"max_tokens": 2}', "guided_decoding_guide_type": b"json"}
        return np.array([valid[t.name]], dtype=object) if t.name in valid else good[t.dtype]
    return good["INT32"] if t.dtype in ("BOOL", "BYTES") else np.array([b"x"], dtype=object)


@pytest.mark.parametrize("t", [t for t in INPUTS if t.optional], ids=lambda t: t.name)
def test_parser_accepts_each_input_with_its_contract_type(t):
    # a guide comes with its type
    typed = {"guided_decoding_guide_type": np.array([b"regex"], dtype=object)} if t.name == "guided_decoding_guide" else {}
    parse_request({"text_input": TEXT, t.name: _sample(t), **typed}, 4)


@pytest.mark.parametrize("t", [t for t in INPUTS if t.optional], ids=lambda t: t.name)
def test_parser_refuses_each_input_with_another_type(t):
    with pytest.raises(InvalidRequestError, match=rf"^{t.name}: expected .*\({t.dtype}\)"):
        parse_request({"text_input": TEXT, t.name: _sample(t, wrong=True)}, 4)


def test_parser_defaults_are_the_contract_defaults():
    parsed = parse_request({"text_input": TEXT}, 7)
    got = {
        "max_tokens": parsed.params.max_tokens, "stream": parsed.stream,
        "exclude_input_in_output": parsed.exclude_input_in_output, "min_tokens": parsed.params.min_tokens,
        "end_id": parsed.params.end_id, "top_k": parsed.params.top_k, "num_draft_tokens": parsed.num_draft_tokens,
        "temperature": parsed.params.temperature, "top_p": parsed.params.top_p,
        "repetition_penalty": parsed.params.repetition_penalty, "seed": parsed.params.seed,
        "return_log_probs": parsed.params.return_log_probs,
    }
    expected = {t.name: t.default for t in INPUTS if t.name in got}
    expected["max_tokens"] = 7  # the model's default_max_tokens
    assert got == expected
    assert parsed.params.stop_words == () and parsed.bad_words_text == ()


def test_event_outputs_follow_the_contract():
    event = GenerationEvent(request_id=1, text="ok", log_probs=[-0.5], finished=True, finish_reason="stop",
                            num_input_tokens=2, num_output_tokens=1, draft_tokens=4, accepted_draft_tokens=3,
                            top_log_probs=[[(7, -0.5), (9, -1.5)]], ranks=[1], prompt_log_probs=[None, -2.0],
                            prompt_top_log_probs=[[], [(3, -1.0), (5, -2.0)]])
    out = event_outputs(event, with_log_probs=True, top_log_probs=2, token_text=lambda t: f"<{t}>", prompt_ids=[4, 5])
    assert out["output_top_token_ids"].tolist() == [[7, 9]] and out["output_top_log_probs"].tolist() == [[-0.5, -1.5]]
    assert out["prompt_token_ids"].tolist() == [4, 5] and np.isnan(out["prompt_log_probs"][0])
    assert out["prompt_log_probs"][1] == -2.0 and out["prompt_top_token_ids"].tolist() == [[-1, -1], [3, 5]]
    assert np.isnan(out["prompt_top_log_probs"][0]).all() and out["prompt_top_log_probs"][1].tolist() == [-1.0, -2.0]
    assert list(out) and set(out) == {t.name for t in OUTPUTS}  # a final response with log probs: all of them
    for t in OUTPUTS:
        assert out[t.name].dtype == np.dtype(NUMPY_TYPES[t.dtype]), t.name
        assert out[t.name].ndim == len(t.dims) and (t.dims[0] == -1 or out[t.name].shape == t.dims), t.name
    assert out["acceptance_rate"].tolist() == [0.75]
    partial = event_outputs(GenerationEvent(request_id=1, text="o"))
    assert set(partial) == {t.name for t in OUTPUTS if not t.optional}


def test_stop_word_holding_a_comma_is_one_word():
    """TensorRT-LLM's "a,b" form splits into two words, but ", " stays one word."""
    words = np.array([b"foo,bar", b", ", b","], dtype=object)
    parsed = parse_request({"text_input": np.array([b"hi"], dtype=object), "stop_words": words}, 4)
    assert parsed.params.stop_words == ("foo", "bar", ", ", ",")


def test_bad_input_is_refused_by_the_protocol_layer_too():
    """The rules tests/integration/test_robustness.py checks through a server, here for what
    the engine's caller sends (no Triton checks in front)."""
    text = np.array([b"hi"], dtype=object)
    with pytest.raises(InvalidRequestError, match=r"max_tokens: expected an integer \(INT32\), got float32"):
        parse_request({"text_input": text, "max_tokens": np.array([4.0], np.float32)}, 4)
    with pytest.raises(InvalidRequestError, match=r"text_input: expected one value \(shape \[1\]\), got 3 values"):
        parse_request({"text_input": np.array([b"a", b"b", b"c"], dtype=object)}, 4)
    with pytest.raises(InvalidRequestError, match=r"stop_words: expected a list of strings \(BYTES\), got int32"):
        parse_request({"text_input": text, "stop_words": np.array([1], np.int32)}, 4)
    with pytest.raises(InvalidRequestError, match=r"end_id: must be -1 .* got -2"):
        parse_request({"text_input": text, "end_id": np.array([-2], np.int32)}, 4)


@pytest.mark.parametrize("key, number", [
    pytest.param("frequency_penalty", "18446744073709551616", id="frequency_penalty-2**64"),  # past every integer input's range
    pytest.param("frequency_penalty", "1" + "0" * 400, id="frequency_penalty-10**400"),  # past float's range: float() overflows
    pytest.param("temperature", "1" + "0" * 400, id="temperature-10**400"),
])
def test_sampling_parameters_number_past_floats_range_is_refused_naming_the_field(key, number):
    """An invalid request, not an internal error: the glue answers InvalidRequestError with its
    text, anything else with "internal error"."""
    sampling = np.array([f'{{"{key}": {number}}}'.encode()], dtype=object)
    with pytest.raises(InvalidRequestError, match=rf"^sampling_parameters\.{key}: "):
        parse_request({"text_input": TEXT, "sampling_parameters": sampling}, 4)


@pytest.mark.parametrize("flag", [False, True])
def test_the_vllm_backends_return_logprobs_flag_asks_for_log_probs(flag: bool):
    """NVIDIA's current OpenAI frontend sends return_logprobs with every vLLM-backend request."""
    parsed = parse_request({"text_input": TEXT, "return_logprobs": np.array([flag])}, 4)
    assert parsed.params.return_log_probs is flag


def test_vllm_logprobs_n_asks_for_the_n_most_likely_tokens():
    """sampling_parameters.logprobs N (vLLM; NVIDIA's frontend sends chat's top_logprobs so)."""
    parsed = parse_request({"text_input": TEXT, "sampling_parameters": np.array([b'{"logprobs": 5}'], dtype=object)}, 4)
    assert parsed.params.return_log_probs and parsed.params.top_log_probs == 5
    parsed = parse_request({"text_input": TEXT, "top_log_probs": np.array([3], np.int32)}, 4)
    assert parsed.params.return_log_probs and parsed.params.top_log_probs == 3
    with pytest.raises(InvalidRequestError, match=r"^sampling_parameters\.logprobs: must be in \[0, 20\]"):
        parse_request({"text_input": TEXT, "sampling_parameters": np.array([b'{"logprobs": 21}'], dtype=object)}, 4)
    with pytest.raises(InvalidRequestError, match=r"^top_log_probs: must be in \[0, 20\]"):
        parse_request({"text_input": TEXT, "top_log_probs": np.array([21], np.int32)}, 4)


def test_prompt_logprobs_key_and_input_set_prompt_log_probs_and_are_bounded():
    sp = parse_request({"text_input": TEXT, "sampling_parameters": np.array([b'{"prompt_logprobs": 3}'], dtype=object)}, 4)
    assert sp.params.prompt_log_probs == 3
    assert parse_request({"text_input": TEXT, "prompt_log_probs": np.array([0], dtype=np.int32)}, 4).params.prompt_log_probs == 0
    assert parse_request({"text_input": TEXT}, 4).params.prompt_log_probs is None
    with pytest.raises(InvalidRequestError, match=r"^sampling_parameters\.prompt_logprobs: must be in \[0, 20\]"):
        parse_request({"text_input": TEXT, "sampling_parameters": np.array([b'{"prompt_logprobs": 21}'], dtype=object)}, 4)


def test_vllm_logprobs_output_is_the_vllm_backends_json():
    """The vLLM backend's form (its src/model.py): per token {id: {logprob, rank, decoded_token}},
    the chosen token with its rank and the most likely ones ranked 1..N."""
    from tritonlm.protocol import vllm_logprobs

    event = GenerationEvent(request_id=1, token_ids=[9, 7], log_probs=[-1.5, -0.2],
                            top_log_probs=[[(7, -0.5)], [(7, -0.2)]], ranks=[3, 1])
    got = json.loads(vllm_logprobs(event, lambda t: f"<{t}>"))
    assert got == [{"9": {"logprob": -1.5, "rank": 3, "decoded_token": "<9>"},
                    "7": {"logprob": -0.5, "rank": 1, "decoded_token": "<7>"}},
                   {"7": {"logprob": -0.2, "rank": 1, "decoded_token": "<7>"}}]
    unranked = GenerationEvent(request_id=1, token_ids=[9], log_probs=[-1.5], ranks=[None])
    assert json.loads(vllm_logprobs(unranked, str)) == [{"9": {"logprob": -1.5, "decoded_token": "9"}}]


def test_lora_name_as_an_input_or_in_sampling_parameters():
    """vLLM's Triton backend takes the adapter both ways; empty or absent is the base model."""
    assert parse_request({"text_input": TEXT}, 4).lora_name is None
    assert parse_request({"text_input": TEXT, "lora_name": np.array([b""], dtype=object)}, 4).lora_name is None
    assert parse_request({"text_input": TEXT, "lora_name": np.array([b"sql"], dtype=object)}, 4).lora_name == "sql"
    parsed = parse_request({"text_input": TEXT, "sampling_parameters": np.array([b'{"lora_name": "chat"}'], dtype=object)}, 4)
    assert parsed.lora_name == "chat" and parsed.renames["lora_name"] == "sampling_parameters.lora_name"
    with pytest.raises(InvalidRequestError, match=r"^sampling_parameters.lora_name: expected a string, got 3"):
        parse_request({"text_input": TEXT, "sampling_parameters": np.array([b'{"lora_name": 3}'], dtype=object)}, 4)
    with pytest.raises(InvalidRequestError, match=r"^lora_name: sent both as an input and in sampling_parameters"):
        parse_request({"text_input": TEXT, "lora_name": np.array([b"a"], dtype=object),
                       "sampling_parameters": np.array([b'{"lora_name": "b"}'], dtype=object)}, 4)


def _sampling(text: str) -> np.ndarray:
    return np.array([text.encode()], dtype=object)


def test_priority_as_an_input_or_in_sampling_parameters():
    """vLLM's `priority`: absent is 0; the input and the sampling_parameters key both set it."""
    assert parse_request({"text_input": TEXT}, 4).priority == 0
    assert parse_request({"text_input": TEXT, "priority": np.array([-7], dtype=np.int32)}, 4).priority == -7
    assert parse_request({"text_input": TEXT, "sampling_parameters": _sampling('{"priority": 1000}')}, 4).priority == 1000
    with pytest.raises(InvalidRequestError, match=r"^priority: sent both as an input and in sampling_parameters"):
        parse_request({"text_input": TEXT, "priority": np.array([1], dtype=np.int32),
                       "sampling_parameters": _sampling('{"priority": 2}')}, 4)


@pytest.mark.parametrize("inputs, error", [
    ({"priority": np.array([1001], dtype=np.int32)}, r"^priority: must be in \[-1000, 1000\].*got 1001"),
    ({"priority": np.array([-1001], dtype=np.int32)}, r"^priority: must be in \[-1000, 1000\].*got -1001"),
    ({"priority": np.array([1.5], dtype=np.float32)}, r"^priority: expected an integer \(INT32\), got float32"),
    ({"priority": np.array([1, 2], dtype=np.int32)}, r"^priority: expected one value"),
    ({"sampling_parameters": _sampling('{"priority": 5000}')}, r"^sampling_parameters\.priority: must be in \[-1000, 1000\]"),
    ({"sampling_parameters": _sampling('{"priority": "high"}')}, r"^sampling_parameters\.priority: expected an integer"),
    ({"sampling_parameters": _sampling('{"priority": 1.0}')}, r"^sampling_parameters\.priority: expected an integer"),
])
def test_a_bad_priority_is_refused_naming_the_field(inputs, error):
    with pytest.raises(InvalidRequestError, match=error):
        parse_request({"text_input": TEXT, **inputs}, 4)
