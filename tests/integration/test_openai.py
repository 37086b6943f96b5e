"""The OpenAI-compatible API (tritonlm/openai/) against a real tritonserver, with the official
`openai` client: what `tritonlm serve` runs (Triton + the frontend on free loopback ports).

References: the gRPC path (tritonlm.client.generate_grpc) on the same server, and
transformers' own generate() (tests/helpers/models.py's hf_greedy_text). A last section replays the exact
tensors NVIDIA's OpenAI frontend sends to a vLLM-backend model (`--backend vllm`)."""

from __future__ import annotations

import concurrent.futures as cf
import http.client
import json
import re
import signal
import subprocess
import sys
import urllib.error
import urllib.request

import numpy as np
import openai
import pytest
import tritonclient.grpc as grpcclient

from tests.helpers.chat_templates import CHATML, TOOLS_TEMPLATE
from tests.helpers.models import hf_greedy_text, reference_greedy, tiny
from tests.helpers.servers import (
    HANG_GUARD_S,
    Output,
    add_generation_model,
    add_long_llama,
    metric,
    stream_responses,
    wait_until,
)
from tritonlm.client.generate import GenerateError, generate_grpc
from tritonlm.openai.server import EXIT_DEADLINE_S, OpenAIServer
from tritonlm.paths import REPO_ROOT
from tritonlm.server import free_ports

PROMPTS = ["The capital of France is", "Once upon a time there was a small robot who wanted", "Hi",
           "Café naïve — 你好，世界 🙂", "def main(): return"]
LONG_CONTEXT = 8192
LONG_TOKENS = LONG_CONTEXT - 100  # nearly the whole context: it outlasts whatever a test does mid-stream


def add_long_model(repo, name, **parameters):
    add_long_llama(repo, name, LONG_CONTEXT, seed=7, **parameters)


@pytest.fixture(scope="module")
def triton_repo(tmp_path_factory):
    import shutil

    repo = tmp_path_factory.mktemp("openairepo")
    add_generation_model(repo, "tiny")
    tok = tiny()[1]
    for name, template in (("tiny_chat", CHATML), ("tiny_tools", TOOLS_TEMPLATE)):
        folder = add_generation_model(repo, name)
        tok.chat_template = template  # the model's "own" template: saved with its tokenizer
        try:
            tok.save_pretrained(folder / "1" / "hf")
        finally:
            tok.chat_template = None
    # one running sequence, one waiting, the next is told "server busy"
    add_long_model(repo, "long", max_num_seqs=1, max_queue_size=1)
    shutil.copytree(REPO_ROOT / "model_repository" / "echo", repo / "echo")  # not a generation model
    return repo


@pytest.fixture(scope="module")
def frontend(triton_server, triton_repo):
    (port,) = free_ports(1)
    with OpenAIServer(triton_server.grpc_url, port=port, repo=triton_repo) as server:
        yield server


@pytest.fixture(scope="module")
def client(frontend):
    return openai.OpenAI(base_url=frontend.url + "/v1", api_key="unused", max_retries=0, timeout=HANG_GUARD_S)


def chat_template_prompt(messages) -> str:
    tok = tiny()[1]
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, chat_template=CHATML)


def grpc(server, prompt, model="tiny", **params):
    return generate_grpc(server.grpc_url, model, prompt, exclude_input_in_output=True, **params)


def text_of(ids) -> str:
    return tiny()[1].decode(ids)


def post(frontend, path: str, body) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(frontend.url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


# ---- sampling fields ---------------------------------------------------------------------------
def test_penalties_bias_stop_ids_and_min_p_through_openai_and_triton(client, triton_server):
    """OpenAI's fields, Triton's tensors and sampling_parameters all give the greedy text of a
    loop over transformers' logits with the fields' definitions applied."""
    prompt = PROMPTS[0]
    ids = tiny()[1](prompt).input_ids
    ref = text_of(reference_greedy(ids, 24, frequency_penalty=1.5, presence_penalty=0.3, logit_bias={17: 5.0}))
    assert ref != text_of(hf_greedy_text(prompt, 24))  # the fields change the answer
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0, frequency_penalty=1.5,
                                  presence_penalty=0.3, logit_bias={"17": 5.0})
    assert r.choices[0].text == ref
    tensors = grpc(triton_server, prompt, max_tokens=24, frequency_penalty=1.5, presence_penalty=0.3,
                     sampling_parameters=json.dumps({"logit_bias": {"17": 5.0}}))
    assert tensors.text == ref
    sp = grpc(triton_server, prompt, max_tokens=24, sampling_parameters=json.dumps(
        {"frequency_penalty": 1.5, "presence_penalty": 0.3, "logit_bias": {"17": 5.0}}))
    assert sp.text == ref
    # stop_token_ids: the answer ends before the 4th token of the free answer, finish_reason stop
    free = hf_greedy_text(prompt, 24)
    stop = free[3]
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0,
                                  extra_body={"stop_token_ids": [stop]})
    assert r.choices[0].text == text_of(reference_greedy(ids, 24, stop_token_ids=(stop,)))
    assert r.choices[0].finish_reason == "stop"
    # min_p 1 keeps only the most likely token: sampling at temperature 1 is greedy then
    sampled = grpc(triton_server, prompt, max_tokens=24, temperature=1.0, seed=3, min_p=1.0)
    assert sampled.text == text_of(free)


# ---- tokenize, metrics, API key ----------------------------------------------------------------
def test_tokenize_and_detokenize_in_vllms_shape(frontend, client):
    prompt = PROMPTS[1]
    status, body = post(frontend, "/tokenize", {"model": "tiny", "prompt": prompt})
    assert status == 200 and body["tokens"] == tiny()[1](prompt).input_ids and body["count"] == len(body["tokens"])
    assert isinstance(body["max_model_len"], int) and body["max_model_len"] > body["count"]
    assert body["count"] == client.completions.create(model="tiny", prompt=prompt, max_tokens=1).usage.prompt_tokens
    status, back = post(frontend, "/detokenize", {"model": "tiny", "tokens": body["tokens"]})
    assert (status, back) == (200, {"prompt": prompt})
    chat = [{"role": "user", "content": "Hello there"}]
    status, counted = post(frontend, "/tokenize", {"model": "tiny_chat", "messages": chat})
    assert status == 200
    assert counted["count"] == client.chat.completions.create(model="tiny_chat", messages=chat, max_tokens=1).usage.prompt_tokens
    status, err = post(frontend, "/detokenize", {"model": "tiny", "tokens": [10**9]})
    assert (status, err["error"]["param"]) == (400, "tokens") and "token ids must be in [0, " in err["error"]["message"]
    status, err = post(frontend, "/tokenize", {"model": "tiny"})
    assert (status, err["error"]["param"]) == (400, "prompt")
    assert post(frontend, "/tokenize", {"model": "nope", "prompt": "x"})[0] == 404


def test_metrics_on_the_api_port_count_requests(frontend, client):
    client.completions.create(model="tiny", prompt="x", max_tokens=2)
    text = urllib.request.urlopen(frontend.url + "/metrics", timeout=60).read().decode()
    assert re.search(r'tritonlm_openai_requests_total\{endpoint="/v1/completions",status="200"\} [1-9]', text)


def test_api_key_is_asked_of_everything_but_health(triton_server, triton_repo):
    (port,) = free_ports(1)
    with OpenAIServer(triton_server.grpc_url, port=port, repo=triton_repo, api_key="s3cret",
                      metrics_url=triton_server.metrics_url) as keyed:
        wrong = openai.OpenAI(base_url=keyed.url + "/v1", api_key="s3crex", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as e:
            wrong.completions.create(model="tiny", prompt="x", max_tokens=2)
        assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
        assert "the API key is not valid" in e.value.body["message"]
        status, body = post(keyed, "/tokenize", {"model": "tiny", "prompt": "x"})  # no header at all
        assert status == 401 and body["error"]["message"].startswith("no API key given")
        right = openai.OpenAI(base_url=keyed.url + "/v1", api_key="s3cret", max_retries=0)
        assert right.completions.create(model="tiny", prompt="x", max_tokens=2).choices[0].finish_reason == "length"
        assert urllib.request.urlopen(keyed.url + "/health", timeout=60).status == 200  # probes need no key
        req = urllib.request.Request(keyed.url + "/metrics", headers={"Authorization": "Bearer s3cret"})
        text = urllib.request.urlopen(req, timeout=60).read().decode()
        assert 'status="401"' in text and "nv_inference_request_success" in text  # its own counts, then Triton's


# ---- models ----------------------------------------------------------------------------------
def test_models_lists_the_generation_models(client, frontend):
    assert sorted(m.id for m in client.models.list()) == ["long", "tiny", "tiny_chat", "tiny_tools"]  # not echo
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("echo")
    assert e.value.body["code"] == "model_not_found"


# ---- completions -----------------------------------------------------------------------------
def test_completions_greedy_equal_the_grpc_path_and_transformers(client, triton_server):
    for prompt in PROMPTS:
        ref = grpc(triton_server, prompt, max_tokens=16)
        assert ref.text == text_of(hf_greedy_text(prompt, 16))
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0)
        assert r.choices[0].text == ref.text and r.choices[0].finish_reason == "length"
        assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (
            ref.num_input_tokens, ref.num_output_tokens, ref.num_input_tokens + ref.num_output_tokens)
        chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=16, stream=True,
                                                stream_options={"include_usage": True}))
        assert len({c.id for c in chunks}) == 1
        assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.text
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == ref.num_output_tokens
        assert chunks[-1].usage.prompt_tokens == ref.num_input_tokens


def test_echo_prompt_lists_n_and_logprobs(client, triton_server):
    prompt = PROMPTS[0]
    ref = grpc(triton_server, prompt, max_tokens=6).text
    assert client.completions.create(model="tiny", prompt=prompt, max_tokens=6, echo=True).choices[0].text == prompt + ref
    streamed = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, echo=True, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == prompt + ref
    # a list of prompts: one choice each, in order; n: several per prompt (seeded: seed + choice)
    r = client.completions.create(model="tiny", prompt=PROMPTS[:2], max_tokens=6, n=2, temperature=1.0, seed=5)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    again = client.completions.create(model="tiny", prompt=PROMPTS[:2], max_tokens=6, n=2, temperature=1.0, seed=5)
    assert [c.text for c in r.choices] == [c.text for c in again.choices]  # same seed, same texts
    assert r.choices[0].text == grpc(triton_server, PROMPTS[0], max_tokens=6, temperature=1.0, seed=5).text
    assert r.choices[1].text == grpc(triton_server, PROMPTS[0], max_tokens=6, temperature=1.0, seed=6).text
    assert r.usage.completion_tokens == 4 * 6
    assert r.usage.prompt_tokens == sum(grpc(triton_server, p, max_tokens=1).num_input_tokens for p in PROMPTS[:2])
    # logprobs: the chosen token's, one per generated token; the tokens spell the text
    lp = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, logprobs=0).choices[0]
    assert len(lp.logprobs.token_logprobs) == 8 and all(v <= 0 for v in lp.logprobs.token_logprobs)
    assert "".join(lp.logprobs.tokens) == lp.text == grpc(triton_server, prompt, max_tokens=8).text
    ref_lp = grpc(triton_server, prompt, max_tokens=8, return_log_probs=True).log_probs
    assert np.allclose(lp.logprobs.token_logprobs, ref_lp, atol=1e-5)


def test_stop_sequences_across_token_boundaries(client, triton_server):
    tok = tiny()[1]
    prompt = PROMPTS[1]
    ids = hf_greedy_text(prompt, 40)
    pieces = [tok.decode(ids[:i]) for i in range(len(ids) + 1)]
    full = pieces[-1]
    # a stop string made of the end of one token and the start of the next
    k = next(i for i in range(3, len(ids) - 1)
             if len(pieces[i]) - len(pieces[i - 1]) >= 2 and len(pieces[i + 1]) - len(pieces[i]) >= 2
             and full.count(full[len(pieces[i]) - 1: len(pieces[i]) + 1]) == 1)
    cut = len(pieces[k])
    stop = full[cut - 1: cut + 1]
    expected = full[: full.index(stop)]
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=40, stop=[stop, "never appears, with a comma"])
    assert (r.choices[0].text, r.choices[0].finish_reason) == (expected, "stop")
    streamed = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=40, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == expected and streamed[-1].choices[0].finish_reason == "stop"
    ref = grpc(triton_server, prompt, max_tokens=40, stop_words=[stop])
    assert r.usage.completion_tokens == ref.num_output_tokens == k + 1


# ---- chat ------------------------------------------------------------------------------------
def test_chat_uses_the_models_template_and_equals_the_grpc_path(client, triton_server):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]
    prompt = chat_template_prompt(messages)
    assert prompt.startswith("<|im_start|>system\nYou are terse.<|im_end|>\n") and prompt.endswith("<|im_start|>assistant\n")
    ref = grpc(triton_server, prompt, model="tiny_chat", max_tokens=12)
    assert ref.text == text_of(hf_greedy_text(prompt, 12))
    r = client.chat.completions.create(model="tiny_chat", messages=messages, max_completion_tokens=12)
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == ref.text
    assert r.choices[0].finish_reason == "length" and r.object == "chat.completion"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (
        ref.num_input_tokens, ref.num_output_tokens, ref.num_input_tokens + ref.num_output_tokens)
    # the same conversation again: its prompt's full blocks come from the prefix cache
    assert r.usage.prompt_tokens_details.cached_tokens == 16 * ((ref.num_input_tokens - 1) // 16) > 0
    # max_tokens works too; text parts are joined
    parts = [messages[0], {"role": "user", "content": [{"type": "text", "text": "Name a colour."}]}]
    assert client.chat.completions.create(model="tiny_chat", messages=parts, max_tokens=12).choices[0].message.content == ref.text
    chunks = list(client.chat.completions.create(model="tiny_chat", messages=messages, max_tokens=12, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.total_tokens == ref.num_input_tokens + ref.num_output_tokens
    lp = client.chat.completions.create(model="tiny_chat", messages=messages, max_tokens=5, logprobs=True)
    assert len(lp.choices[0].logprobs.content) == 5
    assert "".join(t.token for t in lp.choices[0].logprobs.content) == lp.choices[0].message.content


def hf_top(prompt: str, n: int, steps: int) -> list[list[tuple[str, float]]]:
    """transformers' reference: at each of the greedy answer's positions, its n most likely
    tokens (text alone, log_softmax of the logits)."""
    import torch

    from tests.helpers.models import hf_logits

    model, tok = tiny()
    ids, answer = list(tok(prompt).input_ids), hf_greedy_text(prompt, steps)
    out = []
    for i in range(len(answer)):
        values, order = torch.topk(torch.log_softmax(hf_logits(model, ids + answer[:i])[-1], -1), n)
        out.append([(tok.decode([t]), v) for t, v in zip(order.tolist(), values.tolist())])
    return out


def test_top_logprobs_equal_transformers(client):
    """Chat's top_logprobs and completions' logprobs N: the most likely tokens and their
    log-probabilities at every position equal log_softmax over transformers' logits, streamed
    or not."""
    messages = [{"role": "user", "content": "Name a colour."}]
    want = hf_top(chat_template_prompt(messages), 4, 6)
    r = client.chat.completions.create(model="tiny_chat", messages=messages, max_tokens=6, logprobs=True, top_logprobs=4)
    content = r.choices[0].logprobs.content
    assert len(content) == len(want) == 6
    for entry, top in zip(content, want):
        assert [a.token for a in entry.top_logprobs] == [t for t, _ in top]
        assert np.allclose([a.logprob for a in entry.top_logprobs], [v for _, v in top], atol=1e-3)
        assert entry.logprob == pytest.approx(top[0][1], abs=1e-3)  # greedy: the chosen token is the most likely
        assert all(a.bytes == list(a.token.encode()) for a in entry.top_logprobs)
    chunks = list(client.chat.completions.create(model="tiny_chat", messages=messages, max_tokens=6, logprobs=True,
                                                 top_logprobs=4, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [[a.token for a in e.top_logprobs] for e in streamed] == [[a.token for a in e.top_logprobs] for e in content]
    prompt = PROMPTS[0]
    want = hf_top(prompt, 5, 5)
    lp = client.completions.create(model="tiny", prompt=prompt, max_tokens=5, logprobs=5).choices[0].logprobs
    assert len(lp.top_logprobs) == 5
    for got, top in zip(lp.top_logprobs, want):
        assert set(got) == {t for t, _ in top}  # a {token text: log-probability} map per position
        assert all(got[t] == pytest.approx(v, abs=1e-3) for t, v in top if [x for x, _ in top].count(t) == 1)


def test_chat_without_a_template_is_a_clear_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["param"] == "messages" and "has no chat template" in e.value.body["message"]


# ---- errors ----------------------------------------------------------------------------------
USER = [{"role": "user", "content": "hi"}]
ERRORS = [
    # (path, body, status, param, message pattern)
    ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 0}, 400, "max_tokens", r"^max_tokens: "),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "temperature": 5}, 400, "temperature", r"^temperature: "),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "top_p": 0}, 400, "top_p", r"^top_p: "),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "frequency_penalty": 2.5}, 400, "frequency_penalty", r"^frequency_penalty: "),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "presence_penalty": -3}, 400, "presence_penalty", r"^presence_penalty: "),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "logit_bias": {"5": 101}}, 400, "logit_bias", r"biases in \[-100, 100\]"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "logit_bias": {"x5": 1}}, 400, "logit_bias", r"keys must be token ids"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "logit_bias": {"99999999": 1}}, 400, "logit_bias", r"token ids must be in \[0, "),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "min_p": 1.5}, 400, "min_p", r"^min_p: "),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "stop_token_ids": [-1]}, 400, "stop_token_ids", r"token ids must be >= 0"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "logprobs": 6}, 400, "logprobs", r"^logprobs: "),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "tools": [{"type": "function", "function": {"name": "f"}}]},
     400, "tools", r"^tools: is a chat field"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "best_of": 2}, 400, "best_of", r"only 1"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "suffix": "y"}, 400, "suffix", r"not supported"),
    ("/v1/completions", {"model": "tiny", "prompt": [1, 2, 3]}, 400, "prompt", r"token-id prompts"),
    ("/v1/completions", {"model": "tiny", "prompt": ""}, 400, "prompt", r"empty prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": "word " * 400}, 400, "prompt", r"^text_input: the prompt has"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "n": 0}, 400, "n", r"^n: "),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "stop": [3]}, 400, "stop", r"^stop: "),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options", r"stream is true"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "bogus": 1}, 400, "bogus", r"^bogus: unrecognized request argument"),
    ("/v1/completions", {"prompt": "x"}, 400, "model", r"^model: required"),
    ("/v1/completions", {"model": "nope", "prompt": "x"}, 404, "model", r"The model 'nope' does not exist"),
    ("/v1/chat/completions", {"model": "tiny_chat", "messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}]},
     400, "tools", r"^tools: "),
    ("/v1/chat/completions", {"model": "tiny_chat", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}]}]}, 400, "messages[0].content[0]", r"images"),
    ("/v1/chat/completions", {"model": "tiny_chat", "messages": [{"role": "function", "content": "x", "name": "f"}]},
     400, "messages[0].role", r"not supported"),
    ("/v1/chat/completions", {"model": "tiny_tools", "messages": USER, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}}]},
     400, "tools[0].function.parameters", r"not a valid JSON Schema"),
    ("/v1/chat/completions", {"model": "tiny_tools", "messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}],
     "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400, "tool_choice.function.name", r"'g' is not one of"),
    ("/v1/chat/completions", {"model": "tiny_tools", "messages": USER, "tool_choice": "required"}, 400, "tool_choice",
     r"needs tools"),
    ("/v1/chat/completions", {"model": "tiny_tools", "messages": USER, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {}}}}], "tool_choice": "required",
        "response_format": {"type": "json_object"}}, 400, "tool_choice", r"send it without response_format"),
    ("/v1/chat/completions", {"model": "tiny_tools", "messages": USER + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]}, 400,
     "messages[1].tool_calls[0].function.arguments", r"not valid JSON"),
    ("/v1/chat/completions", {"model": "tiny_tools", "messages": USER, "functions": [{"name": "f"}]}, 400, "functions",
     r"send tools"),
    ("/v1/chat/completions", {"model": "tiny_chat", "messages": []}, 400, "messages", r"^messages: "),
    ("/v1/chat/completions", {"model": "tiny_chat", "messages": USER, "top_logprobs": 2}, 400, "top_logprobs", r"needs logprobs: true"),
    ("/v1/chat/completions", {"model": "tiny_chat", "messages": USER, "logprobs": True, "top_logprobs": 21}, 400,
     "top_logprobs", r"^top_logprobs: "),
    ("/v1/chat/completions", {"model": "tiny_chat", "messages": USER, "max_completion_tokens": -1}, 400,
     "max_completion_tokens", r"^max_completion_tokens: "),
]


def test_each_bad_request_gets_openais_error_shape_and_the_server_keeps_serving(frontend, client):
    for path, body, status, param, pattern in ERRORS:
        code, answer = post(frontend, path, body)
        assert code == status, (body, answer)
        error = answer["error"]
        assert set(error) == {"message", "type", "param", "code"}, answer
        assert error["param"] == param and re.search(pattern, error["message"]), (body, error)
    assert post(frontend, "/v1/completions", b"{not json")[0] == 400
    code, answer = post(frontend, "/v1/nothing-here", {})
    assert code == 404 and "error" in answer
    # zero penalties, user, and an unsupported-but-empty logit_bias are fine
    ok = client.completions.create(model="tiny", prompt="still", max_tokens=3, frequency_penalty=0, presence_penalty=0,
                                   user="someone", logit_bias={})
    assert ok.usage.completion_tokens == 3


def test_a_full_queue_is_429_server_busy_and_a_disconnect_frees_the_kv_cache(frontend, client, triton_server):
    assert metric(triton_server, "tritonlm_kv_cache_used_bytes", "long", default=0.0) == 0
    cancelled = metric(triton_server, "tritonlm_requests_finished_total", "long", reason="cancelled", default=0.0)
    # the official client sends extensions (ignore_eos) through extra_body
    stream = client.completions.create(model="long", prompt="I hold the only slot", max_tokens=LONG_TOKENS, stream=True,
                                       extra_body={"ignore_eos": True})
    assert next(iter(stream)).choices[0].text is not None
    assert metric(triton_server, "tritonlm_kv_cache_used_bytes", "long", default=0.0) > 0
    with cf.ThreadPoolExecutor(1) as pool:
        queued = pool.submit(client.completions.create, model="long", prompt="I wait", max_tokens=4)
        assert wait_until(lambda: metric(triton_server, "tritonlm_requests_waiting", "long", default=0.0) == 1, HANG_GUARD_S)
        with pytest.raises(openai.RateLimitError) as busy:
            client.completions.create(model="long", prompt="no room", max_tokens=4)
        assert "server busy" in busy.value.body["message"] and busy.value.status_code == 429
        # the client of the running stream goes away: its request is cancelled (not run to its
        # end: the cancelled count below), its cache freed
        stream.close()
        assert queued.result(timeout=HANG_GUARD_S).usage.completion_tokens == 4  # it got the slot
    assert wait_until(lambda: metric(triton_server, "tritonlm_kv_cache_used_bytes", "long", default=0.0) == 0, HANG_GUARD_S)
    assert metric(triton_server, "tritonlm_requests_finished_total", "long", reason="cancelled", default=0.0) == cancelled + 1


def test_a_disconnect_while_queued_or_not_streaming_cancels_too(frontend, triton_server):
    cancelled = metric(triton_server, "tritonlm_requests_finished_total", "long", reason="cancelled", default=0.0)
    conn = http.client.HTTPConnection(frontend.url.removeprefix("http://"), timeout=30)
    body = {"model": "long", "prompt": "a long answer nobody reads", "max_tokens": LONG_TOKENS, "ignore_eos": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    assert wait_until(lambda: metric(triton_server, "tritonlm_kv_cache_used_bytes", "long", default=0.0) > 0, HANG_GUARD_S)
    conn.close()  # not streamed: the answer would come at the end; nobody waits for it
    assert wait_until(lambda: metric(triton_server, "tritonlm_kv_cache_used_bytes", "long", default=0.0) == 0, HANG_GUARD_S)
    assert metric(triton_server, "tritonlm_requests_finished_total", "long", reason="cancelled", default=0.0) == cancelled + 1


def test_32_concurrent_streams_all_complete_nothing_lost_or_duplicated(client, triton_server):
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} {i}" for i in range(32)]
    with cf.ThreadPoolExecutor(32) as pool:
        refs = list(pool.map(lambda p: grpc(triton_server, p, max_tokens=24).text, prompts))

    def stream(i):
        chunks = list(client.completions.create(model="tiny", prompt=prompts[i], max_tokens=24, stream=True,
                                                stream_options={"include_usage": True}))
        return chunks

    with cf.ThreadPoolExecutor(32) as pool:
        results = list(pool.map(stream, range(32)))
    for i, chunks in enumerate(results):
        assert len({c.id for c in chunks}) == 1
        assert "".join(c.choices[0].text for c in chunks if c.choices) == refs[i], i
        assert chunks[-1].usage.completion_tokens == 24
    assert len({r[0].id for r in results}) == 32


# ---- `tritonlm openai` in front of a running Triton -------------------------------------------
def stopped(proc: subprocess.Popen, out: Output, signal_name: str) -> None:
    """After a stop signal: the command exits 0 saying "OpenAI API stopped" (past its own
    EXIT_DEADLINE_S it exits by itself, non-zero; the wait here is only a hang guard)."""
    try:
        proc.wait(HANG_GUARD_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"still running {HANG_GUARD_S:.0f} s after {signal_name}; its output:\n{out.finish()}")
    text = out.finish()
    assert proc.returncode == 0 and "OpenAI API stopped" in text, (proc.returncode, EXIT_DEADLINE_S, text)


def test_openai_command_in_front_of_a_running_triton(triton_server, triton_repo):
    (port,) = free_ports(1)
    proc = subprocess.Popen(
        [sys.executable, "-m", "tritonlm.cli", "openai", "--triton-url", triton_server.grpc_url, "--port", str(port),
         "--tokenizer", f"tiny={triton_repo / 'tiny_chat' / '1' / 'hf'}"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    out = Output(proc.stdout)  # the ready line, whatever a library prints before it
    try:
        assert out.wait_for(f"OpenAI API ready on http://127.0.0.1:{port}/v1"), out.text
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=HANG_GUARD_S)
        # --tokenizer tiny=...: model tiny gets that folder's template; tiny_chat has no tokenizer here
        r = c.chat.completions.create(model="tiny", messages=USER, max_tokens=4)
        assert r.choices[0].message.content == grpc(triton_server, chat_template_prompt(USER), max_tokens=4).text
        with pytest.raises(openai.BadRequestError, match="--repo"):
            c.chat.completions.create(model="tiny_chat", messages=USER, max_tokens=4)
        proc.send_signal(signal.SIGINT)
        stopped(proc, out, "SIGINT")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT-inherited-ignored", "SIGTERM"])
def test_openai_command_stops_gracefully_on_sigint_and_sigterm(sig):
    """A script's background job (`tritonlm openai &`, as deploy/entrypoint.sh starts it) begins
    with SIGINT ignored, and SIGTERM's default would end it mid-response: the command handles
    both itself and stops as on Ctrl-C (exit 0, "OpenAI API stopped")."""
    port, unused = free_ports(2)  # nothing listens on `unused`: the frontend starts without Triton
    # SIGINT ignored from the start, as `&` in a script does: the shell ignores it and execs the
    # command (ignored signals stay ignored across exec). Not a preexec_fn: that forks this
    # process, whose gRPC threads (earlier tests' clients) make a fork unsafe (gRPC's fork
    # handlers skip, and the child can log poller errors or abort before its exec).
    proc = subprocess.Popen(
        ["sh", "-c", 'trap "" INT; exec "$0" "$@"',
         sys.executable, "-m", "tritonlm.cli", "openai", "--triton-url", f"127.0.0.1:{unused}", "--port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    out = Output(proc.stdout)  # the ready line, whatever a library prints before it
    try:
        assert out.wait_for("OpenAI API ready"), out.text
        proc.send_signal(sig)
        stopped(proc, out, sig.name)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ---- NVIDIA's OpenAI frontend, `--backend vllm`: the tensors it sends ---------------------------
# triton-inference-server/server r25.08, python/openai/openai_frontend/engine/utils/triton.py,
# _create_vllm_inference_request: text_input, stream, exclude_input_in_output (not echo),
# sampling_parameters (json.dumps of the request's model_dump(exclude=..., exclude_none=True)
# with max_tokens added last), return_num_input_tokens and return_num_output_tokens (both true).
# The sampling_parameters below are what its pydantic schemas dump for the requests named.
NVIDIA_COMPLETION = {  # {"model": "tiny", "prompt": ..., "max_tokens": 12, "temperature": 0}
    "best_of": 1, "frequency_penalty": 0, "ignore_eos": False, "n": 1, "presence_penalty": 0, "temperature": 0.0,
    "top_p": 1, "max_tokens": 12,
}
NVIDIA_CHAT = {  # {"model": "tiny", "messages": ..., "max_completion_tokens": 12, "temperature": 0, "stop": ["x, y"]}
    "frequency_penalty": 0, "ignore_eos": False, "logprobs": False, "n": 1, "presence_penalty": 0, "stop": ["x, y"],
    "temperature": 0.0, "top_p": 1, "max_tokens": 12,
}


def nvidia_inputs(prompt: str, sampling: dict, stream: bool, echo: bool = False, logprobs: bool | None = None):
    """logprobs: the current frontend's return_logprobs flag (main branch's
    _create_vllm_generate_request sends it with every request; r25.08 did not)."""
    def t(name, arr, dtype):
        i = grpcclient.InferInput(name, list(arr.shape), dtype)
        i.set_data_from_numpy(arr)
        return i

    flag = [] if logprobs is None else [t("return_logprobs", np.bool_([logprobs]), "BOOL")]
    return [
        t("text_input", np.array([prompt.encode()], dtype=object), "BYTES"),
        t("stream", np.bool_([stream]), "BOOL"),
        t("exclude_input_in_output", np.bool_([not echo]), "BOOL"),
        t("sampling_parameters", np.array([json.dumps(sampling).encode()], dtype=object), "BYTES"),
        *flag,
        t("return_num_input_tokens", np.bool_([True]), "BOOL"),
        t("return_num_output_tokens", np.bool_([True]), "BOOL"),
    ]


def replay(server, inputs, model="tiny"):
    """The responses of one request over a gRPC stream: (text pieces, final outputs) or the error."""
    responses = stream_responses(server.grpc_url, model, inputs)
    pieces = [b"".join(r["text_output"].reshape(-1)).decode() if r.get("text_output") is not None else ""
              for r in responses]
    names = ("finish_reason", "num_input_tokens", "num_output_tokens")
    return pieces, {n: responses[-1][n].reshape(-1)[0] for n in names if responses[-1].get(n) is not None}


def test_nvidia_frontend_tensors_are_served(triton_server):
    prompt = PROMPTS[1]
    ref = text_of(hf_greedy_text(prompt, 12))
    for stream in (False, True):
        pieces, final = replay(triton_server, nvidia_inputs(prompt, NVIDIA_COMPLETION, stream))
        assert "".join(pieces) == ref
        # non-streamed: one response, as the frontend checks; streamed: as many as the response
        # thread's sends kept up with the steps (events that queue behind a send go out as one), so
        # no count; one event per token is checked without the thread (tests/unit/engine/test_detok.py)
        assert len(pieces) == 1 if not stream else len(pieces) >= 1
        assert final["finish_reason"] == b"length" and int(final["num_output_tokens"]) == 12
        assert int(final["num_input_tokens"]) == len(tiny()[1](prompt).input_ids)
    pieces, _ = replay(triton_server, nvidia_inputs(prompt, NVIDIA_COMPLETION, False, echo=True))
    assert pieces == [prompt + ref]
    # the current frontend: logprobs and top_logprobs left out of the dump, return_logprobs false
    current = {k: v for k, v in NVIDIA_COMPLETION.items() if k != "best_of"}
    pieces, final = replay(triton_server, nvidia_inputs(prompt, current, True, logprobs=False))
    assert "".join(pieces) == ref and final["finish_reason"] == b"length"
    # the chat form: the stop string keeps its comma (a JSON list, not TensorRT-LLM's comma form)
    chat_prompt = chat_template_prompt(USER)
    full = text_of(hf_greedy_text(chat_prompt, 12))
    stop = full[3:5]
    pieces, final = replay(triton_server, nvidia_inputs(chat_prompt, {**NVIDIA_CHAT, "stop": ["x, y", stop]}, True))
    assert "".join(pieces) == full[: full.index(stop)] and final["finish_reason"] == b"stop"


def test_nvidia_frontends_named_tool_choice_is_guided(triton_server):
    """NVIDIA's current frontend turns a named tool_choice into sampling_parameters'
    `structured_outputs`: json.dumps(asdict(StructuredOutputsParams(json=<the tool's parameters
    as JSON text>))), every field of vLLM's dataclass included (engine/utils/triton.py,
    _create_vllm_generate_request and _get_guided_json_from_tool). The answer is the
    arguments: it parses and validates against the parameters."""
    import jsonschema

    params = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]}, "days": {"type": "boolean"}},
              "required": ["city", "days"], "additionalProperties": False}
    # disable_any_whitespace (compact JSON): the seeded weights would spend max_tokens on the
    # whitespace a JSON guide takes by default
    structured = {"json": json.dumps(params), "regex": None, "choice": None, "grammar": None, "json_object": None,
                  "disable_fallback": False, "disable_any_whitespace": True, "disable_additional_properties": False,
                  "whitespace_pattern": None, "structural_tag": None, "_backend": None, "_backend_was_auto": False}
    sampling = {**NVIDIA_CHAT, "max_tokens": 40, "structured_outputs": json.dumps(structured)}
    for stream in (False, True):
        pieces, final = replay(triton_server, nvidia_inputs(chat_template_prompt(USER), sampling, stream, logprobs=False))
        assert final["finish_reason"] == b"stop", pieces
        jsonschema.validate(json.loads("".join(pieces)), params)


@pytest.mark.parametrize("sampling, pattern", [
    ({"lora_int_id": 1}, r"sampling_parameters: unknown key\(s\) \['lora_int_id'\]"),
    ({"guided_decoding": "[0-9]+", "max_tokens": 4}, r"sampling_parameters\.guided_decoding: expected an object"),
    ({"structured_outputs": "{}"}, r"sampling_parameters\.structured_outputs: exactly one of json, "),
    ({"n": 2}, r"sampling_parameters\.n: only 1"),
    ({"presence_penalty": 2.5}, r"sampling_parameters\.presence_penalty: must be in \[-2, 2\]"),
    ({"logit_bias": [5, 1]}, r"sampling_parameters\.logit_bias: expected an object mapping token ids to biases"),
    ({"temperature": "hot"}, r"sampling_parameters\.temperature: expected a number"),
    ({"max_tokens": 0}, r"max_tokens: must be >= 1"),
])
def test_bad_sampling_parameters_are_named_and_the_server_keeps_serving(triton_server, sampling, pattern):
    with pytest.raises(GenerateError, match=pattern):
        replay(triton_server, nvidia_inputs("hello", sampling, False))
    assert replay(triton_server, nvidia_inputs("hello", {"max_tokens": 3}, False))[1]["num_output_tokens"] == 3


# ---- `tritonlm perf llm --openai URL` ----------------------------------------------------------
def test_perf_llm_measures_through_the_openai_api(triton_server, frontend, triton_repo, tmp_path):
    import csv

    host, port = triton_server.http_url.split(":")
    out = subprocess.run(
        [sys.executable, "-m", "tritonlm.cli", "perf", "llm", "--model", "tiny", "--repo", str(triton_repo),
         "--http-port", port, "--grpc-port", str(triton_server.grpc_port), "--metrics-port", str(triton_server.metrics_port),
         "--openai", frontend.url, "--compare-grpc", "--concurrency", "1,2", "--output-tokens", "8", "--fixed-output-length",
         "--prompt-tokens", "6", "--requests-per-concurrency", "5", "--results", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "OpenAI frontend overhead" in out.stdout and "CPU: " in out.stdout
    rows = list(csv.DictReader(open(tmp_path / "openai" / "llm.csv")))
    assert [int(r["concurrency"]) for r in rows] == [1, 2]
    for row in rows:
        assert int(row["requests"]) >= 10 and float(row["tokens_per_request"]) == 8.0  # the usage chunk's count
        assert 0 < float(row["ttft_p50_ms"]) <= float(row["latency_p50_ms"]) and float(row["output_tokens_per_s"]) > 0
    overhead = list(csv.DictReader(open(tmp_path / "overhead.csv")))
    assert [int(r["concurrency"]) for r in overhead] == [1, 2] and all(float(r["ratio"]) > 0 for r in overhead)


# ---- tool calls ----------------------------------------------------------------------------------
# enum-valued parameters: a guided answer is a few dozen tokens, whatever the seeded weights prefer
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]}, "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"], "additionalProperties": False}}}
TOOL_PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
MOST = 140  # the tiny model's context (256) less the tools' prompt: room for a guided call's whitespace
# compact JSON for a call's guide (vLLM's option): sampled, the seeded weights would spend
# max_tokens on the whitespace a JSON guide takes by default
COMPACT = {"structured_outputs": {"disable_any_whitespace": True}}


def assert_valid_calls(message, names: set[str]):
    import jsonschema

    assert message.tool_calls and message.content is None
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), TOOL_PARAMS[call.function.name])
    assert len({c.id for c in message.tool_calls}) == len(message.tool_calls)


def test_named_and_required_tool_calls_always_parse_and_validate(client):
    """Guided decoding keeps the answer a valid call: each of n sampled choices is one, checked
    with jsonschema; streamed deltas re-assembled equal the non-streamed call for the same seed."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(model="tiny_tools", messages=ASK, tools=[WEATHER, TIME], tool_choice=named,
                                       max_tokens=MOST, temperature=1.0, seed=3, n=2, extra_body=COMPACT)
    for c in r.choices:
        assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1
        assert_valid_calls(c.message, {"get_weather"})
    r = client.chat.completions.create(model="tiny_tools", messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                       parallel_tool_calls=False, max_tokens=MOST, temperature=1.0, seed=4, n=2,
                                       extra_body=COMPACT)
    for c in r.choices:
        assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1
        assert_valid_calls(c.message, {"get_weather", "get_time"})
    for choice in (named, "required"):
        ask = dict(model="tiny_tools", messages=ASK, tools=[WEATHER, TIME], tool_choice=choice, max_tokens=MOST,
                   temperature=1.0, seed=5, extra_body=COMPACT)
        whole = client.chat.completions.create(**ask).choices[0]
        calls: list[dict] = []
        chunks = list(client.chat.completions.create(**ask, stream=True))
        for chunk in chunks:
            for d in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                if d.id is not None:  # a call's first delta: id, type and name
                    assert d.index == len(calls) and d.type == "function"
                    calls.append({"id": d.id, "name": d.function.name, "arguments": d.function.arguments or ""})
                else:
                    calls[d.index]["arguments"] += d.function.arguments
        assert [(c["name"], c["arguments"]) for c in calls] == [
            (c.function.name, c.function.arguments) for c in whole.message.tool_calls]
        # several calls may run into max_tokens: the last one is then cut, and so is the answer
        ended = "tool_calls" if all(parses(c["arguments"]) for c in calls) else "length"
        assert chunks[-1].choices[0].finish_reason == whole.finish_reason == ended


def test_auto_tool_choice_reads_hermes_calls_from_the_templates_prompt(client, triton_server):
    """auto: the template renders the tools (transformers' apply_chat_template is the reference
    prompt); the answer is that prompt's greedy text read by the Hermes reader: content, or
    tool calls naming the tools with JSON-object arguments. A template without tools is a 400."""
    from tritonlm.openai.tools import HermesReader

    tok = tiny()[1]
    prompt = tok.apply_chat_template(ASK, tools=[WEATHER, TIME], tokenize=False, add_generation_prompt=True,
                                     chat_template=TOOLS_TEMPLATE)
    assert "Tools: get_weather(city,unit) get_time(zone)" in prompt
    text = grpc(triton_server, prompt, model="tiny_tools", max_tokens=24).text
    reader = HermesReader({"get_weather", "get_time"})
    reader.feed(text)
    reader.finish()
    content, calls = reader.message()
    r = client.chat.completions.create(model="tiny_tools", messages=ASK, tools=[WEATHER, TIME], max_tokens=24)
    message = r.choices[0].message
    if calls:
        assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
            (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]
        assert message.content == content and r.choices[0].finish_reason in ("tool_calls", "length")
    else:
        assert message.content == text and not message.tool_calls
    streamed = list(client.chat.completions.create(model="tiny_tools", messages=ASK, tools=[WEATHER, TIME], max_tokens=24,
                                                   stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == (message.content or "")
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny_chat", messages=ASK, tools=[WEATHER], tool_choice="auto")
    assert e.value.body["param"] == "tools" and "does not render tools" in e.value.body["message"]


def test_tool_history_is_templated_as_transformers_does(client, triton_server):
    """An assistant turn with tool_calls (content null) and the tool's answer, rendered by the
    model's template as transformers renders the same conversation (arguments as objects)."""
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"},
    ]
    as_templates_take_it = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"},
    ]
    prompt = tiny()[1].apply_chat_template(as_templates_take_it, tokenize=False, add_generation_prompt=True,
                                           chat_template=TOOLS_TEMPLATE)
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}</tool_call>' in prompt
    assert "<tool_response>21 degrees</tool_response>" in prompt
    ref = grpc(triton_server, prompt, model="tiny_tools", max_tokens=8)
    r = client.chat.completions.create(model="tiny_tools", messages=history, max_tokens=8)
    assert r.choices[0].message.content == ref.text and r.usage.prompt_tokens == ref.num_input_tokens
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny_tools", messages=ASK + [{"role": "tool", "content": "x"}])
    assert e.value.body["param"] == "messages[1].tool_call_id"


def tools_prompt(messages=ASK, tools=(WEATHER, TIME)) -> str:
    """transformers' rendering of the conversation with the tools: the reference prompt."""
    return tiny()[1].apply_chat_template(messages, tools=list(tools), tokenize=False, add_generation_prompt=True,
                                         chat_template=TOOLS_TEMPLATE)


def guided(server, prompt: str, guide: dict, stream: bool = False, **params):
    """The gRPC path with the prompt and a guide, greedy unless told: the frontend's reference."""
    return grpc(server, prompt, model="tiny_tools", stream=stream,
                sampling_parameters=json.dumps({"guided_decoding": guide}), **params)


def tokens_until(server, prompt: str, guide: dict, pattern: str, most: int = MOST) -> int:
    """The fewest tokens of the guided greedy answer whose text holds the regex pattern (a
    search over max_tokens: a streamed piece may hold several tokens)."""
    lo, hi = 1, most
    while lo < hi:
        mid = (lo + hi) // 2
        if re.search(pattern, guided(server, prompt, guide, max_tokens=mid).text):
            hi = mid
        else:
            lo = mid + 1
    assert re.search(pattern, guided(server, prompt, guide, max_tokens=lo).text)
    return lo


def streamed_message(client, **ask) -> tuple[str, list[tuple[str, str]], str]:
    """A streamed chat answer re-assembled: (content, [(name, arguments)], finish_reason)."""
    content, calls, finish = "", [], None
    for chunk in client.chat.completions.create(**ask, stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for d in delta.tool_calls or []:
            if d.id is not None:
                assert d.index == len(calls)
                calls.append([d.function.name, d.function.arguments or ""])
            else:
                calls[d.index][1] += d.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return content, [tuple(c) for c in calls], finish


def whole_message(client, **ask) -> tuple[str | None, list[tuple[str, str]], str]:
    c = client.chat.completions.create(**ask).choices[0]
    return c.message.content, [(t.function.name, t.function.arguments) for t in c.message.tool_calls or []], c.finish_reason


def parses(arguments: str) -> bool:
    try:
        return isinstance(json.loads(arguments), dict)
    except ValueError:
        return False


def test_forced_calls_cut_by_max_tokens_end_with_length_the_same_streamed_or_not(client, triton_server):
    """A named or required call cut by max_tokens: finish_reason `length` (never `tool_calls`),
    content null, the call with the arguments made so far (the gRPC path's text for the same
    prompt, guide and max_tokens), the same streamed or not."""
    from tritonlm.openai.tools import check_tools, required_schema

    prompt = tools_prompt()
    named = {"type": "function", "function": {"name": "get_weather"}}
    cases = ((named, WEATHER["function"]["parameters"]),
             ("required", required_schema(check_tools([WEATHER, TIME]), parallel=False)))
    for choice, schema in cases:
        full = guided(triton_server, prompt, {"json": schema}, max_tokens=MOST)
        assert full.finish_reason == "stop" and parses(full.text) == (choice is named)
        # cut two tokens after the arguments' first key (named) or their opening (required): inside them
        k = tokens_until(triton_server, prompt, {"json": schema}, ":" if choice is named else r'"arguments"\s*:\s*\{') + 2
        cut = guided(triton_server, prompt, {"json": schema}, max_tokens=k)
        assert cut.finish_reason == "length" and full.text.startswith(cut.text) and cut.text != full.text
        ask = dict(model="tiny_tools", messages=ASK, tools=[WEATHER, TIME], tool_choice=choice, max_tokens=k,
                   parallel_tool_calls=False)
        content, calls, finish = whole_message(client, **ask)
        assert (content, finish) == (None, "length") and len(calls) == 1
        name, arguments = calls[0]
        if choice is named:
            assert (name, arguments) == ("get_weather", cut.text)
        else:  # the element's name, its arguments' text so far: the end of the gRPC path's text
            assert name in ("get_weather", "get_time") and re.search(rf'"name"\s*:\s*"{name}"', cut.text)
            assert arguments and cut.text.endswith(arguments) and '"arguments"' in cut.text[: -len(arguments)]
        assert not parses(arguments)
        assert streamed_message(client, **ask) == ("", calls, "length")


def test_stop_strings_do_not_cut_forced_calls_but_do_cut_the_others(client, triton_server):
    """Stop strings that the call's JSON holds (`"`, `:`) do not apply while a named or required
    call is generated: the answer equals the one without them, finish_reason `tool_calls`, the
    arguments parse; the gRPC path with the same stop strings shows they would have cut it. An
    answer that is not forced is still cut by them."""
    prompt = tools_prompt()
    named = {"type": "function", "function": {"name": "get_weather"}}
    stop = ['"', ":"]
    cut = guided(triton_server, prompt, {"json": WEATHER["function"]["parameters"]}, max_tokens=MOST, stop_words=stop)
    assert cut.finish_reason == "stop" and not parses(cut.text)  # what the stop strings do to a guided answer
    for choice in (named, "required"):
        ask = dict(model="tiny_tools", messages=ASK, tools=[WEATHER, TIME], tool_choice=choice, max_tokens=MOST,
                   parallel_tool_calls=False)
        free = whole_message(client, **ask)
        assert free[2] == "tool_calls", (choice, free)
        with_stop = whole_message(client, **ask, stop=stop)
        assert with_stop == free and all(parses(a) for _, a in with_stop[1])
        assert streamed_message(client, **ask, stop=stop) == ("", free[1], "tool_calls")
    plain = grpc(triton_server, prompt, model="tiny_tools", max_tokens=24)
    words = stop + ["e"]
    ends = [plain.text.index(w) for w in words if w in plain.text]
    assert ends, plain.text  # the greedy answer holds one of them
    r = client.chat.completions.create(model="tiny_tools", messages=ASK, tools=[WEATHER, TIME], tool_choice="none",
                                       max_tokens=24, stop=words).choices[0]
    assert (r.message.content, r.finish_reason) == (plain.text[: min(ends)], "stop")


# the tiny model, kept to the Hermes syntax by a regex guide: auto's reading of a real answer
AUTO_CALL = (r'Sure\. <tool_call>\{"name": "get_weather", "arguments": \{"city": "(Paris|Oslo|Lima)", '
             r'"unit": "(C|F)"\}\}</tool_call>')


def test_auto_reads_a_call_the_model_makes_and_a_cut_one_stays_content(client, triton_server):
    """tool_choice auto with a regex guide that makes the model write a Hermes block (the model
    picks the city and unit): the call is in tool_calls, the text before it content,
    finish_reason `tool_calls`, as the Hermes reader reads the gRPC path's greedy text of
    transformers' rendering; streamed the same. Cut by max_tokens or by a stop string inside the
    block: no call, the text as content, finish_reason `length` / `stop`, streamed the same."""
    from tritonlm.openai.tools import HermesReader

    prompt = tools_prompt()
    ref = guided(triton_server, prompt, {"regex": AUTO_CALL}, max_tokens=96)
    assert ref.finish_reason == "stop" and re.fullmatch(AUTO_CALL, ref.text)
    reader = HermesReader({"get_weather", "get_time"})
    reader.feed(ref.text)
    reader.finish()
    content, calls = reader.message()
    want = [(c["function"]["name"], c["function"]["arguments"]) for c in calls]
    assert content == "Sure. " and [n for n, _ in want] == ["get_weather"]
    ask = dict(model="tiny_tools", messages=ASK, tools=[WEATHER, TIME], max_tokens=96,
               extra_body={"structured_outputs": {"regex": AUTO_CALL}})
    assert whole_message(client, **ask) == ("Sure. ", want, "tool_calls")
    assert streamed_message(client, **ask) == ("Sure. ", want, "tool_calls")
    assert json.loads(want[0][1])["city"] in ref.text
    # cut inside the block by max_tokens: the fragment is content
    k = tokens_until(triton_server, prompt, {"regex": AUTO_CALL}, '"arguments"')  # inside the block
    cut = guided(triton_server, prompt, {"regex": AUTO_CALL}, max_tokens=k)
    assert "<tool_call>" in cut.text and cut.finish_reason == "length"
    ask["max_tokens"] = k
    assert whole_message(client, **ask) == (cut.text, [], "length")
    assert streamed_message(client, **ask) == (cut.text, [], "length")
    # cut by a stop string inside the block (auto is not forced: stop strings apply)
    ask["max_tokens"] = 96
    stopped = ref.text[: ref.text.index('"unit"')]
    assert whole_message(client, **ask, stop=['"unit"']) == (stopped, [], "stop")
    assert streamed_message(client, **ask, stop=['"unit"']) == (stopped, [], "stop")


def test_chat_logprobs_with_sampling_and_penalties_agree_with_themselves_and_transformers(client, triton_server):
    """Chat at temperature 1.3 with frequency and repetition penalties and a logit bias, logprobs
    with 5 alternatives: each chosen token's value is its entry among the alternatives when
    listed, and both are log_softmax of transformers' logits over the sampled sequence (raw: the
    settings do not change them); streamed, the same values. The vLLM backend's `logprobs` output
    for the same request (its ids tell the chosen tokens) gives the chosen token the same value
    with 0 or 5 alternatives, listed among them or not."""
    import torch

    from tests.helpers.models import hf_logits

    model, tok = tiny()
    messages = [{"role": "user", "content": "Name a colour."}]
    prompt = chat_template_prompt(messages)
    settings = {"max_tokens": 10, "temperature": 1.3, "seed": 5, "frequency_penalty": 1.0, "repetition_penalty": 1.3,
                "logit_bias": {"17": 4.0}, "ignore_eos": True}

    def vllm_form(n: int) -> list[dict[int, tuple[float, int]]]:
        responses = replay_responses(triton_server, nvidia_inputs(prompt, {**settings, "logprobs": n}, False, logprobs=True),
                                     model="tiny_chat")
        texts = [r["logprobs"].reshape(-1)[0].decode() for r in responses if "logprobs" in r]
        return [{int(t): (e["logprob"], e["rank"]) for t, e in per.items()} for text in texts if text != "null"
                for per in json.loads(text)]

    chosen_only, with_top = vllm_form(0), vllm_form(5)
    assert len(chosen_only) == len(with_top) == 10 and all(len(d) == 1 for d in chosen_only)
    ids = [next(iter(d)) for d in chosen_only]
    for token, alone, listed in zip(ids, chosen_only, with_top):
        # among the 5 most likely or added to them: one value (two requests: the second one's prompt
        # comes from the prefix cache, whose kernels may round the logits' last bits differently)
        assert listed[token][0] == pytest.approx(alone[token][0], abs=1e-5)
        assert len(listed) == (5 if alone[token][1] <= 5 else 6)  # the chosen one's rank says which

    ask = dict(model="tiny_chat", messages=messages, max_tokens=10, temperature=1.3, seed=5, frequency_penalty=1.0,
               logit_bias={"17": 4.0}, logprobs=True, top_logprobs=5,
               extra_body={"repetition_penalty": 1.3, "ignore_eos": True})
    r = client.chat.completions.create(**ask).choices[0]
    content = r.logprobs.content
    assert tok.decode(ids) == r.message.content and len(content) == 10  # the same sampled tokens
    assert [e.logprob for e in content] == pytest.approx([d[t][0] for t, d in zip(ids, chosen_only)], abs=1e-5)
    assert ids != hf_greedy_text(prompt, 10)  # sampled: not the greedy answer
    history = list(tok(prompt).input_ids)
    listed = 0
    for token, entry in zip(ids, content):
        with torch.no_grad():
            want = torch.log_softmax(hf_logits(model, history)[-1], -1)  # [V]
        assert entry.logprob == pytest.approx(want[token].item(), abs=1e-3)
        values, order = torch.topk(want, 5)
        assert [a.token for a in entry.top_logprobs] == [tok.decode([t]) for t in order.tolist()]
        assert np.allclose([a.logprob for a in entry.top_logprobs], values.tolist(), atol=1e-3)
        if token in order.tolist():
            assert entry.top_logprobs[order.tolist().index(token)].logprob == entry.logprob  # one source: one value
            listed += 1
        history.append(token)
    assert 0 < listed < 10  # some chosen tokens among the 5 most likely, some not
    streamed = [e for c in client.chat.completions.create(**ask, stream=True) if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    assert [(e.logprob, [a.logprob for a in e.top_logprobs]) for e in streamed] == [
        (e.logprob, [a.logprob for a in e.top_logprobs]) for e in content]


# ---- echo with the prompt's log-probabilities ----------------------------------------------------
def test_echo_logprobs_are_the_prompts_then_the_answers_and_equal_transformers(client):
    """echo + logprobs N: every prompt token (the first with null) then every answer token, each
    log_softmax of transformers' logits over the whole text (within 1e-3), its N most likely
    tokens too; streamed, the same lists."""
    import torch

    from tests.helpers.models import hf_logits

    model, tok = tiny()
    prompt = PROMPTS[1]
    ids, answer = list(tok(prompt).input_ids), hf_greedy_text(prompt, 4)
    with torch.no_grad():
        want = torch.log_softmax(hf_logits(model, ids + answer), -1)  # [P + A, V]: position j predicts token j + 1
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=4, echo=True, logprobs=2).choices[0]
    lp = r.logprobs
    assert r.text == prompt + text_of(answer)
    # the prompt's tokens one by one; the answer's spell its text (a response holding several
    # tokens gives its text to the last of them, as without echo)
    assert lp.tokens[: len(ids)] == [tok.decode([t]) for t in ids] and len(lp.tokens) == len(ids) + len(answer)
    assert "".join(lp.tokens[len(ids):]) == text_of(answer)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    every = ids + answer
    assert np.allclose(lp.token_logprobs[1:], [want[j - 1, every[j]].item() for j in range(1, len(every))], atol=1e-3)
    for j in range(1, len(every)):
        values, order = torch.topk(want[j - 1], 2)
        assert set(lp.top_logprobs[j]) == {tok.decode([t]) for t in order.tolist()}
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:j]) for j in range(len(lp.tokens))]
    chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=4, echo=True, logprobs=2, stream=True))
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    tokens = [t for s in streamed for t in s.tokens]
    assert tokens[: len(ids)] == lp.tokens[: len(ids)] and "".join(tokens[len(ids):]) == text_of(answer)
    values = [v for s in streamed for v in s.token_logprobs]
    assert values[0] is None and np.allclose(values[1:], lp.token_logprobs[1:], atol=1e-5)
    assert [o for s in streamed for o in s.text_offset] == [sum(len(t) for t in tokens[:j]) for j in range(len(tokens))]


def replay_responses(server, inputs, model="tiny") -> list[dict[str, np.ndarray]]:
    """Every response's outputs (name -> array) of one request over a gRPC stream."""
    return stream_responses(server.grpc_url, model, inputs)


def frontend_completion_logprobs(responses: list[dict[str, np.ndarray]]) -> dict:
    """What NVIDIA's current OpenAI frontend makes of the responses' `logprobs` output, read as
    its python/openai/openai_frontend/engine/utils/triton.py does (_get_logprobs_from_response:
    one string, "null" or JSON; _get_openai_completion_format_logprobs_from_vllm_response: per
    token the entry of lowest rank is the chosen one, every entry goes to top_logprobs)."""
    import sys

    tokens, token_logprobs, top_logprobs = [], [], []
    for response in responses:
        if "logprobs" not in response:
            continue
        tensor = response["logprobs"]
        assert tensor.size == 1  # its _to_string reads exactly one string
        text = tensor.reshape(-1)[0].decode()
        if text == "null":
            continue
        for per_token in json.loads(text):
            if not per_token:
                continue
            ranked = sorted(per_token.items(), key=lambda x: x[1].get("rank", sys.maxsize))
            tokens.append(ranked[0][1]["decoded_token"])
            token_logprobs.append(ranked[0][1]["logprob"])
            top_logprobs.append({d["decoded_token"]: d["logprob"] for _, d in ranked})
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs}


def test_nvidia_frontends_logprobs_and_prompt_log_probs_decode_as_transformers(triton_server):
    """The current frontend sends return_logprobs and sampling_parameters' logprobs N; its reading
    of the `logprobs` output gives the greedy tokens, their log-probabilities and the N most likely,
    equal to transformers' (within 1e-3), streamed or not. The `prompt_log_probs` input gives the
    prompt's tokens and theirs on the first response (the first NaN)."""
    import torch

    from tests.helpers.models import hf_logits

    model, tok = tiny()
    prompt = PROMPTS[0]
    ids, answer = list(tok(prompt).input_ids), hf_greedy_text(prompt, 6)
    with torch.no_grad():
        want = torch.log_softmax(hf_logits(model, ids + answer), -1)  # [P + A, V]
    sampling = {"frequency_penalty": 0, "ignore_eos": False, "n": 1, "presence_penalty": 0, "temperature": 0.0, "top_p": 1,
                "max_tokens": 6, "logprobs": 2}
    for stream in (False, True):
        responses = replay_responses(triton_server, nvidia_inputs(prompt, sampling, stream, logprobs=True))
        got = frontend_completion_logprobs(responses)
        assert got["tokens"] == [tok.decode([t]) for t in answer]
        chosen = [want[len(ids) - 1 + i, t].item() for i, t in enumerate(answer)]
        assert np.allclose(got["token_logprobs"], chosen, atol=1e-3)
        for i, top in enumerate(got["top_logprobs"]):
            values, order = torch.topk(want[len(ids) - 1 + i], 2)
            assert sorted(top) == sorted(tok.decode([t]) for t in order.tolist())
            assert np.allclose(sorted(top.values()), sorted(values.tolist()), atol=1e-3)
    inputs = nvidia_inputs(prompt, {"max_tokens": 2}, True)
    scored = grpcclient.InferInput("prompt_log_probs", [1], "INT32")
    scored.set_data_from_numpy(np.array([2], dtype=np.int32))
    first = replay_responses(triton_server, inputs + [scored])[0]
    assert first["prompt_token_ids"].tolist() == ids and np.isnan(first["prompt_log_probs"][0])
    assert np.allclose(first["prompt_log_probs"][1:], [want[j - 1, ids[j]].item() for j in range(1, len(ids))], atol=1e-3)
    assert first["prompt_top_token_ids"].shape == (len(ids), 2)
    assert first["prompt_top_token_ids"][1:].tolist() == [torch.topk(want[j - 1], 2).indices.tolist() for j in range(1, len(ids))]
