"""tritonlm/openai/app.py in front of a fake backend (fake_backend.py), no tritonserver: the
framing OpenAI's API specifies and the official `openai` client parses (server-sent events
ending with `data: [DONE]`, n choices, usage, logprobs, tool-call deltas, error bodies and
statuses), what reaches the backend (prompts rendered by transformers' apply_chat_template,
sampling_parameters), and cancellation when the client goes away."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest

from tests.helpers.chat_templates import CHATML, TOOLS_TEMPLATE
from tests.unit.openai.fake_backend import HANG_GUARD_S, FakeBackend, Script
from tritonlm.models.builtin import tiny_tokenizer
from tritonlm.openai.app import create_app
from tritonlm.openai.errors import OpenAIError, from_triton
from tritonlm.supervise.health import HealthBoard

USER = [{"role": "user", "content": "Hi there"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                          "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
ERROR_KEYS = {"message", "type", "param", "code"}
API_KEY = "sk-test-key"


def sse(text: str) -> list[dict]:
    """The JSON events of a text/event-stream body, checked to be `data: <one line>` events
    separated by blank lines, the last one `data: [DONE]` and no other."""
    blocks = text.split("\n\n")
    assert blocks[-1] == "", f"the stream does not end with a blank line: {text[-80:]!r}"
    data = []
    for block in blocks[:-1]:
        assert block.startswith("data: ") and "\n" not in block, block
        data.append(block[len("data: "):])
    assert data and data[-1] == "[DONE]" and "[DONE]" not in data[:-1]
    return [json.loads(d) for d in data[:-1]]


def post_stream(served, path: str, body: dict) -> tuple[int, dict, list[dict]]:
    with served.http.stream("POST", path, json={**body, "stream": True}) as r:
        text = "".join(r.iter_text())
        return r.status_code, r.headers, sse(text) if r.status_code == 200 else json.loads(text)


def split(text: str, step: int) -> list[str]:
    return [text[i: i + step] for i in range(0, len(text), step)]


def error_of(response) -> dict:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS, body
    return body["error"]


# --- the seam ----------------------------------------------------------------------------------
def test_create_app_takes_a_backend_or_a_triton_url_not_both_nor_neither(backend):
    with pytest.raises(ValueError, match="exactly one of triton_url"):
        create_app()
    with pytest.raises(ValueError, match="exactly one of triton_url"):
        create_app("localhost:8001", backend=backend)
    app = create_app(backend=backend)
    assert app.state.backend is backend


def test_health_asks_the_backend(served):
    assert served.http.get("/health").json() == {"status": "ok"}
    served.backend.is_live = False
    r = served.http.get("/health")
    assert r.status_code == 503 and error_of(r)["code"] == "triton_unavailable" and "fake:0" in error_of(r)["message"]


# --- streaming framing -------------------------------------------------------------------------
def test_completion_stream_is_sse_ending_with_done_and_equals_the_whole_answer(served):
    status, headers, events = post_stream(served, "/v1/completions", {"model": "tiny", "prompt": "Say"})
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    assert headers["cache-control"] == "no-cache"  # no proxy may hold the events back
    assert {e["id"] for e in events} == {events[0]["id"]} and events[0]["id"].startswith("cmpl-")
    assert all(e["object"] == "text_completion" and e["model"] == "tiny" for e in events)
    assert "".join(e["choices"][0]["text"] for e in events) == "Hello, world"
    reasons = [e["choices"][0]["finish_reason"] for e in events]
    assert reasons[-1] == "stop" and set(reasons[:-1]) == {None}
    assert not any("usage" in e for e in events)  # only with stream_options.include_usage
    assert served.backend.calls[0].stream and served.backend.calls[0].prompt == "Say"
    whole = served.openai.completions.create(model="tiny", prompt="Say")
    assert whole.choices[0].text == "Hello, world" and whole.choices[0].finish_reason == "stop"
    assert whole.object == "text_completion" and not served.backend.calls[1].stream
    streamed = served.openai.completions.create(model="tiny", prompt="Say", stream=True)
    assert "".join(c.choices[0].text for c in streamed) == "Hello, world"


def test_chat_renders_the_models_template_and_streams_role_then_content(served):
    want = tiny_tokenizer().apply_chat_template(USER, tokenize=False, add_generation_prompt=True, chat_template=CHATML)
    chunks = list(served.openai.chat.completions.create(model="tiny", messages=USER, stream=True))
    assert served.backend.calls[0].prompt == want and served.backend.calls[0].chat
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Hello, world"
    assert [c.choices[0].finish_reason for c in chunks][-1] == "stop"
    whole = served.openai.chat.completions.create(model="tiny", messages=USER)
    assert whole.object == "chat.completion" and whole.id.startswith("chatcmpl-")
    assert whole.choices[0].message.role == "assistant" and whole.choices[0].message.content == "Hello, world"
    assert served.backend.calls[1].prompt == want


def test_a_model_without_a_chat_template_is_a_400_naming_messages(served):
    with pytest.raises(openai.BadRequestError) as e:
        served.openai.chat.completions.create(model="plain", messages=USER)
    assert e.value.body["param"] == "messages" and e.value.body["code"] == "no_chat_template"
    assert not served.backend.calls


# --- n and usage -------------------------------------------------------------------------------
def distinct(prompt: str, sampling: dict) -> Script:
    """An answer that tells which prompt and which choice (its seed) it is."""
    return Script([prompt[:2], f" s{sampling.get('seed')}"], prompt_tokens=len(prompt), cached_tokens=1)


def test_n_choices_per_prompt_each_its_own_request_and_usage_counts_prompts_once(backend, serve):
    backend.answer = distinct
    served = serve()
    r = served.openai.completions.create(model="tiny", prompt=["AAAA", "BBBBBB"], n=3, seed=10)
    # prompt-major: choices 0..2 answer the first prompt, each with seed + its number
    assert [c.text for c in r.choices] == ["AA s10", "AA s11", "AA s12", "BB s10", "BB s11", "BB s12"]
    assert [c.index for c in r.choices] == list(range(6))
    assert r.usage.prompt_tokens == 4 + 6 and r.usage.completion_tokens == 6 * 2 and r.usage.total_tokens == 22
    assert r.usage.prompt_tokens_details.cached_tokens == 2  # once per prompt, like prompt_tokens
    assert len(backend.calls) == 6


def test_streamed_n_choices_keep_their_index_and_each_finishes(backend, serve):
    backend.answer = distinct
    served = serve()
    stream = served.openai.chat.completions.create(model="tiny", messages=USER, n=3, seed=5, stream=True,
                                                   stream_options={"include_usage": True})
    texts, reasons, usage = {}, {}, []
    for chunk in stream:
        if chunk.usage is not None:
            assert chunk.choices == []
            usage.append(chunk.usage)
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason is not None:
                assert c.index not in reasons  # one finish per choice
                reasons[c.index] = c.finish_reason
    prompt = backend.calls[0].prompt
    assert texts == {j: f"{prompt[:2]} s{5 + j}" for j in range(3)} and reasons == {0: "stop", 1: "stop", 2: "stop"}
    assert len(usage) == 1 and usage[0].prompt_tokens == len(prompt) and usage[0].completion_tokens == 6


def test_include_usage_chunk_is_last_before_done_and_stream_options_need_stream(served):
    _, _, events = post_stream(served, "/v1/completions", {"model": "tiny", "prompt": "Say", "max_tokens": 2,
                                                           "stream_options": {"include_usage": True}})
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 2
    assert events[-1]["usage"]["prompt_tokens"] == 5 and events[-2]["choices"][0]["finish_reason"] == "length"
    r = served.http.post("/v1/completions", json={"model": "tiny", "prompt": "x", "stream_options": {"include_usage": True}})
    assert r.status_code == 400 and error_of(r)["param"] == "stream_options"


# --- priority ----------------------------------------------------------------------------------
def test_priority_from_extra_body_reaches_the_model_in_sampling_parameters(served):
    """vLLM's `priority` extension, as the official client sends it (extra_body), on both
    endpoints; absent, nothing is sent (the model's default, 0)."""
    served.openai.completions.create(model="tiny", prompt="Say", extra_body={"priority": -5})
    served.openai.chat.completions.create(model="tiny", messages=USER, extra_body={"priority": 7})
    served.openai.completions.create(model="tiny", prompt="Say")
    calls = served.backend.calls
    assert calls[0].sampling["priority"] == -5 and calls[1].sampling["priority"] == 7 and calls[1].chat
    assert "priority" not in calls[2].sampling


@pytest.mark.parametrize("value", [1001, -1001, 1.5, "high"])
def test_a_bad_priority_is_a_400_naming_it_before_any_generation(served, value):
    for path, body in (("/v1/completions", {"prompt": "Say"}), ("/v1/chat/completions", {"messages": USER})):
        r = served.http.post(path, json={"model": "tiny", **body, "priority": value})
        assert r.status_code == 400 and error_of(r)["param"] == "priority", r.text
    assert not served.backend.calls


# --- logprobs ----------------------------------------------------------------------------------
def test_completion_logprobs_name_the_most_likely_tokens_by_their_text(served):
    tok = tiny_tokenizer()
    r = served.openai.completions.create(model="tiny", prompt="Say", logprobs=2)
    lp = r.choices[0].logprobs
    assert served.backend.calls[0].sampling["logprobs"] == 2 and served.backend.calls[0].stream
    assert lp.tokens == ["Hello", ",", " world"] and lp.token_logprobs == [-0.1, -0.2, -0.3]
    assert lp.text_offset == [0, 5, 6]
    assert lp.top_logprobs[0] == {tok.decode([7]): -1.1, tok.decode([8]): -2.1}
    chunks = list(served.openai.completions.create(model="tiny", prompt="Say", logprobs=2, stream=True))
    streamed = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs is not None]
    assert sum((s.tokens for s in streamed), []) == lp.tokens
    assert sum((s.text_offset for s in streamed), []) == lp.text_offset
    assert sum((s.top_logprobs for s in streamed), []) == lp.top_logprobs


def test_echo_with_logprobs_lists_the_prompts_tokens_first(backend, serve):
    tok = tiny_tokenizer()
    prompt = "Say hi"
    ids = tok(prompt).input_ids
    backend.answer = Script(["!"], prompt_ids=ids)
    served = serve()
    r = served.openai.completions.create(model="tiny", prompt=prompt, echo=True, logprobs=1, max_tokens=1)
    lp = r.choices[0].logprobs
    assert backend.calls[0].sampling["prompt_logprobs"] == 1
    assert r.choices[0].text == prompt + "!"
    assert lp.tokens == [tok.decode([i]) for i in ids] + ["!"]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing predicts the first token
    assert lp.text_offset == [len("".join(lp.tokens[:k])) for k in range(len(lp.tokens))]


def test_chat_logprobs_streamed_equal_the_whole_answers(served):
    whole = served.openai.chat.completions.create(model="tiny", messages=USER, logprobs=True, top_logprobs=2)
    content = whole.choices[0].logprobs.content
    assert [(c.token, c.logprob, c.bytes) for c in content] == [
        ("Hello", -0.1, list(b"Hello")), (",", -0.2, list(b",")), (" world", -0.3, list(b" world"))]
    assert [len(c.top_logprobs) for c in content] == [2, 2, 2]
    chunks = served.openai.chat.completions.create(model="tiny", messages=USER, logprobs=True, top_logprobs=2, stream=True)
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in content]
    r = served.http.post("/v1/chat/completions", json={"model": "tiny", "messages": USER, "top_logprobs": 2})
    assert r.status_code == 400 and error_of(r)["param"] == "top_logprobs"


# --- tool calls --------------------------------------------------------------------------------
def streamed_calls(stream) -> tuple[str, list[dict], list[str]]:
    """(content, calls, finish reasons) reassembled from streamed deltas as OpenAI's docs say:
    a call's first delta has its id, type and name, later ones add to its arguments."""
    content, calls, reasons = "", [], []
    for chunk in stream:
        for c in chunk.choices:
            content += c.delta.content or ""
            for d in c.delta.tool_calls or []:
                if d.id is not None:
                    assert d.index == len(calls) and d.type == "function"
                    calls.append({"id": d.id, "name": d.function.name, "arguments": d.function.arguments or ""})
                else:
                    calls[d.index]["arguments"] += d.function.arguments or ""
            if c.finish_reason is not None:
                reasons.append(c.finish_reason)
    return content, calls, reasons


def whole_calls(message) -> list[dict]:
    return [{"name": c.function.name, "arguments": c.function.arguments} for c in message.tool_calls or []]


@pytest.mark.parametrize("model, choice, answer, want", [
    ("tiny", {"type": "function", "function": {"name": "get_weather"}}, '{"city": "Paris", "days": 3}',
     [("get_weather", {"city": "Paris", "days": 3})]),
    ("tiny", "required", '[{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "get_time", "arguments": {}}]',
     [("get_weather", {"city": "Oslo"}), ("get_time", {})]),
    ("tools", "auto", '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>', [("get_time", {})]),
])
def test_tool_call_deltas_reassemble_into_the_non_streamed_calls(backend, serve, model, choice, answer, want):
    backend.answer = Script(split(answer, 3))
    served = serve()
    ask = dict(model=model, messages=USER, tools=[WEATHER, TIME], tool_choice=choice, stop=["}"])
    whole = served.openai.chat.completions.create(**ask)
    content, calls, reasons = streamed_calls(served.openai.chat.completions.create(**ask, stream=True))
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == want
    assert [{"name": c["name"], "arguments": c["arguments"]} for c in calls] == whole_calls(whole.choices[0].message)
    assert reasons == ["tool_calls"] and whole.choices[0].finish_reason == "tool_calls"
    assert content == "" and whole.choices[0].message.content is None
    assert all(c.id.startswith("call_") for c in whole.choices[0].message.tool_calls)
    sampling = backend.calls[0].sampling
    if choice == "auto":  # the template shows the tools; the answer is free text, read for calls
        assert "guided_decoding" not in sampling and sampling["stop"] == ["}"]
        want_prompt = tiny_tokenizer().apply_chat_template(USER, tools=[WEATHER, TIME], tokenize=False,
                                                           add_generation_prompt=True, chat_template=TOOLS_TEMPLATE)
        assert backend.calls[0].prompt == want_prompt
    else:  # the guide keeps the answer a valid call, which a stop string would cut
        assert "json" in sampling["guided_decoding"] and "stop" not in sampling


def test_a_call_cut_by_max_tokens_ends_with_length_streamed_or_not(backend, serve):
    backend.answer = Script(split('{"city": "Paris", "days": 3}', 4))
    served = serve()
    ask = dict(model="tiny", messages=USER, tools=[WEATHER], tool_choice="required", max_tokens=3)
    whole = served.openai.chat.completions.create(**ask)
    _, calls, reasons = streamed_calls(served.openai.chat.completions.create(**ask, stream=True))
    assert whole.choices[0].finish_reason == "length" and reasons == ["length"]


def test_auto_tools_on_a_template_without_tools_is_a_400_naming_tools(served):
    with pytest.raises(openai.BadRequestError) as e:
        served.openai.chat.completions.create(model="tiny", messages=USER, tools=[WEATHER], tool_choice="auto")
    assert e.value.body["param"] == "tools" and e.value.body["code"] == "no_tool_support"


# --- structured output -------------------------------------------------------------------------
def test_an_invalid_json_schema_is_a_400_before_any_generation(served):
    bad = {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "strin"}}}
    with pytest.raises(openai.BadRequestError) as e:
        served.openai.chat.completions.create(model="tiny", messages=USER, response_format=bad)
    assert e.value.status_code == 400 and e.value.body["param"] == "response_format.json_schema.schema"
    assert "strin" in e.value.body["message"] and e.value.body["type"] == "invalid_request_error"
    assert not served.backend.calls
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    good = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}
    served.openai.chat.completions.create(model="tiny", messages=USER, response_format=good)
    assert served.backend.calls[0].sampling["guided_decoding"] == {"json": schema}


def test_a_schema_violation_is_a_500_with_its_code_streamed_or_not(backend, serve):
    violation = from_triton("guided_decoding: the answer violates the json_schema: $.a: 'x' is not of type 'integer'")
    backend.answer = Script(['{"a": ', '"x"}'], error=violation, error_at=2)
    served = serve()
    r = served.http.post("/v1/chat/completions", json={"model": "tiny", "messages": USER})
    assert r.status_code == 500 and error_of(r)["code"] == "schema_violation" and "violates" in error_of(r)["message"]
    # streamed: the status is sent; the error is the last event before [DONE]
    status, _, events = post_stream(served, "/v1/chat/completions", {"model": "tiny", "messages": USER})
    assert status == 200 and events[-1] == {"error": violation.body()["error"]}
    with pytest.raises(openai.APIError, match="violates the json_schema"):
        list(served.openai.chat.completions.create(model="tiny", messages=USER, stream=True))


# --- stop strings ------------------------------------------------------------------------------
def test_stop_strings_reach_the_model_as_a_list_and_its_reason_is_kept(served):
    served.openai.completions.create(model="tiny", prompt="Say", stop="a, b")
    served.openai.completions.create(model="tiny", prompt="Say", stop=["\n", "", "x,y"])
    assert served.backend.calls[0].sampling["stop"] == ["a, b"]  # a comma stays inside its string
    assert served.backend.calls[1].sampling["stop"] == ["\n", "x,y"]
    cut = served.openai.completions.create(model="tiny", prompt="Say", max_tokens=1)
    assert cut.choices[0].text == "Hello" and cut.choices[0].finish_reason == "length"
    r = served.http.post("/v1/completions", json={"model": "tiny", "prompt": "Say", "stop": [1]})
    assert r.status_code == 400 and error_of(r)["param"] == "stop" and len(served.backend.calls) == 3


# --- cancellation ------------------------------------------------------------------------------
async def _call(app, path: str, body: dict, leave) -> list[dict]:
    """One request straight through ASGI; the client goes away once `await leave(sent)`
    returns. The ASGI messages the app sent."""
    sent: list[dict] = []
    asked = False

    async def receive():
        nonlocal asked
        if not asked:
            asked = True
            return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}
        await leave(sent)
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "root_path": "", "query_string": b"",
             "headers": [(b"content-type", b"application/json"), (b"host", b"testserver")],
             "client": ("127.0.0.1", 1), "server": ("testserver", 80)}
    await asyncio.wait_for(app(scope, receive, send), HANG_GUARD_S)
    return sent


def held(backend: FakeBackend):
    async def leave(sent):
        await asyncio.to_thread(backend.started.wait, HANG_GUARD_S)
        await asyncio.to_thread(backend.calls[0].held.wait, HANG_GUARD_S)
    return leave


@pytest.mark.parametrize("stream, hold_at", [(True, 2), (True, 0), (False, 0)],
                         ids=["mid-stream", "streamed-while-queued", "not-streamed"])
def test_a_client_that_goes_away_cancels_its_requests(backend, stream, hold_at):
    """Mid-stream, before a streamed answer's first response (a request waiting in the
    model's queue) and while a whole answer is being made: the backend sees the cancel."""
    backend.answer = Script(["a", "b", "c", "d"], hold_at=hold_at)
    app = create_app(backend=backend)
    body = {"model": "tiny", "prompt": "Say", "n": 2, "stream": stream}
    sent = asyncio.run(_call(app, "/v1/completions", body, held(backend)))
    assert len(backend.calls) == 2 and all(g.cancelled.is_set() for g in backend.calls)
    bodies = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    assert b"[DONE]" not in bodies  # the stream was cut, not finished
    if stream and hold_at:
        assert sent[0]["status"] == 200 and b'"text":"a"' in bodies


def test_closing_a_stream_early_cancels_its_request(backend, serve):
    backend.answer = Script(["a", "b", "c"], hold_at=2)
    served = serve()
    stream = served.openai.completions.create(model="tiny", prompt="Say", stream=True)
    assert next(iter(stream)).choices[0].text == "a"
    stream.close()
    assert backend.calls[0].cancelled.wait(HANG_GUARD_S)


# --- errors and the API key --------------------------------------------------------------------
def test_the_api_key_is_asked_of_everything_but_health(serve):
    served = serve(api_key=API_KEY)
    for headers, why in (({}, "no API key given"), ({"Authorization": "Bearer wrong"}, "the API key is not valid")):
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions")):
            r = served.http.request(method, path, headers=headers, json={"model": "tiny", "prompt": "x"})
            assert r.status_code == 401 and error_of(r)["code"] == "invalid_api_key" and why in error_of(r)["message"]
    assert served.http.get("/health").status_code == 200
    bad = openai.OpenAI(base_url="http://testserver/v1", api_key="wrong", http_client=served.http, max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.completions.create(model="tiny", prompt="x")
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    assert not served.backend.calls  # refused at the door
    assert served.openai.completions.create(model="tiny", prompt="x").choices[0].text == "Hello, world"


@pytest.mark.parametrize("method, path, body, status, code, param", [
    ("POST", "/v1/completions", b"{not json", 400, "invalid_json", None),
    ("POST", "/v1/completions", b"[1]", 400, "invalid_json", None),
    ("POST", "/v1/completions", {"model": "tiny", "prompt": "x", "bogus": 1}, 400, "unknown_parameter", "bogus"),
    ("POST", "/v1/completions", {"prompt": "x"}, 400, "missing_required_parameter", "model"),
    ("POST", "/v1/completions", {"model": "nope", "prompt": "x"}, 404, "model_not_found", "model"),
    ("POST", "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "robot", "content": "x"}]}, 400,
     "invalid_value", "messages[0].role"),
    ("GET", "/v1/nothing-here", None, 404, "not_found", None),
    ("GET", "/v1/completions", None, 405, "method_not_allowed", None),
])
def test_every_error_has_openais_body(served, method, path, body, status, code, param):
    content = body if isinstance(body, bytes) else (None if body is None else json.dumps(body).encode())
    r = served.http.request(method, path, content=content, headers={"Content-Type": "application/json"})
    error = error_of(r)
    assert r.status_code == status and error["code"] == code and error["param"] == param, error
    assert error["type"] == "invalid_request_error" and error["message"]
    assert "retry-after" not in r.headers


def test_an_unexpected_failure_is_a_500_in_openais_shape(backend, serve):
    def broken(prompt, sampling):
        raise RuntimeError("the fake broke")

    backend.answer = broken
    r = serve().http.post("/v1/completions", json={"model": "tiny", "prompt": "x"})
    assert r.status_code == 500 and error_of(r)["code"] == "internal_error" and "the fake broke" in error_of(r)["message"]
    assert error_of(r)["type"] == "server_error"


@pytest.mark.parametrize("error, status, code", [
    (from_triton("[request id: 3] server busy: the queue is full"), 429, "server_busy"),
    (from_triton("[request id: 4] overloaded: predicted time to first token 2400 ms is past slo_ttft_ms=500 with 9 "
                 "requests queued and 4 running; retry later"), 503, "slo_overloaded"),
    (OpenAIError(503, "model tiny is restarting (its process died); retry shortly", code="model_unavailable"), 503,
     "model_unavailable"),
    (from_triton("sampling_parameters.top_k: must be >= -1"), 400, "invalid_value"),
])
def test_a_failed_generation_gets_its_status_streamed_or_not(backend, serve, error, status, code):
    backend.answer = Script(["a"], error=error)
    served = serve()
    for stream in (False, True):  # a streamed answer waits for its first response: the status is still open
        r = served.http.post("/v1/completions", json={"model": "tiny", "prompt": "x", "stream": stream})
        assert r.status_code == status and error_of(r)["code"] == code
        assert r.headers.get("retry-after") == ("1" if status == 503 else None)


def test_503_with_retry_after_while_the_model_recovers(backend, serve):
    board = HealthBoard()
    board.set_models(["tiny"])
    served = serve(health=board)
    board.recovering("tiny", "model tiny: its process (pid 7) died", "died")
    r = served.http.post("/v1/completions", json={"model": "tiny", "prompt": "x"})
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert error_of(r)["code"] == "model_unavailable" and "restarting" in error_of(r)["message"]
    assert error_of(r)["param"] == "model" and error_of(r)["type"] == "service_unavailable_error"
    with pytest.raises(openai.InternalServerError) as e:
        served.openai.chat.completions.create(model="tiny", messages=USER)
    assert e.value.status_code == 503 and e.value.response.headers["retry-after"] == "1"
    assert served.http.get("/health").status_code == 503 and not backend.calls
    board.set_models(["tiny"])  # back: it serves again
    assert served.openai.completions.create(model="tiny", prompt="x").choices[0].text == "Hello, world"


def test_the_openai_client_retries_a_503_and_gets_the_answer(backend, serve):
    answers = iter([Script([], error=OpenAIError(503, "model tiny is restarting", code="model_unavailable")),
                    Script(["back"])])
    backend.answer = lambda prompt, sampling: next(answers)
    served = serve()
    patient = served.openai.with_options(max_retries=1)
    assert patient.completions.create(model="tiny", prompt="x").choices[0].text == "back"
    assert len(backend.calls) == 2


# --- models ------------------------------------------------------------------------------------
def test_models_lists_and_retrieves_the_backends_models(served):
    listed = served.openai.models.list()
    assert [m.id for m in listed.data] == sorted(["tiny", "tools", "plain"])
    assert all(m.object == "model" and m.owned_by == "tritonlm" and m.created == 1700000000 for m in listed.data)
    assert served.openai.models.retrieve("tools").id == "tools"
    with pytest.raises(openai.NotFoundError) as e:
        served.openai.models.retrieve("nope")
    assert e.value.body["code"] == "model_not_found" and "tiny" in e.value.body["message"]


def test_metrics_count_requests_by_endpoint_and_status(served):
    served.openai.completions.create(model="tiny", prompt="x")
    served.http.post("/v1/completions", json={"model": "nope", "prompt": "x"})
    served.openai.models.retrieve("tiny")
    page = served.http.get("/metrics").text
    for endpoint, status in (("/v1/completions", 200), ("/v1/completions", 404), ("/v1/models/{id}", 200)):
        assert f'tritonlm_openai_requests_total{{endpoint="{endpoint}",status="{status}"}} 1.0' in page, page


# --- LoRA adapters -----------------------------------------------------------------------------
def test_an_adapter_is_a_model_whose_requests_run_on_its_parent_with_lora_name(tokenizers):
    """`lora_adapters` names adapters: /v1/models lists each with `parent` its base model, and a
    request naming one goes to the base model with sampling_parameters.lora_name (vLLM's form)."""
    from tests.unit.openai.conftest import Served

    backend = FakeBackend(models=("tiny",), parameters={"lora_adapters": "sql=adapters/sql, chat=adapters/chat"})
    served = Served(backend, tokenizers)
    try:
        cards = {m["id"]: m for m in served.http.get("/v1/models").json()["data"]}
        assert set(cards) == {"tiny", "sql", "chat"}
        assert cards["sql"]["parent"] == "tiny" and cards["chat"]["parent"] == "tiny" and "parent" not in cards["tiny"]
        assert served.openai.models.retrieve("sql").id == "sql"

        answer = served.openai.completions.create(model="sql", prompt="Say")
        assert answer.model == "sql" and answer.choices[0].text == "Hello, world"
        call = backend.calls[-1]
        assert call.model == "tiny" and call.sampling["lora_name"] == "sql"

        want = tiny_tokenizer().apply_chat_template(USER, tokenize=False, add_generation_prompt=True, chat_template=CHATML)
        chunks = list(served.openai.chat.completions.create(model="chat", messages=USER, stream=True))
        assert all(c.model == "chat" for c in chunks)
        call = backend.calls[-1]
        assert call.model == "tiny" and call.sampling["lora_name"] == "chat" and call.prompt == want  # the base's template

        served.openai.completions.create(model="tiny", prompt="Say")
        assert backend.calls[-1].model == "tiny" and "lora_name" not in backend.calls[-1].sampling

        with pytest.raises(openai.NotFoundError) as e:
            served.openai.completions.create(model="sqll", prompt="Say")
        assert e.value.body["code"] == "model_not_found" and "chat, sql, tiny" in e.value.body["message"], e.value.body
        assert len(backend.calls) == 3
    finally:
        served.close()


def test_a_models_own_name_wins_over_an_adapter_of_the_same_name():
    from tritonlm.openai.triton import ServedModel, with_adapters

    config = {"parameters": {"lora_adapters": {"string_value": '{"other": "a/1", "x": "a/2"}'}}}
    listed = with_adapters({"base": ServedModel("base", "1", config), "other": ServedModel("other", "1", {})})
    assert listed["other"].parent is None and listed["x"].parent == "base" and listed["x"].lora_name == "x"
    broken = {"parameters": {"lora_adapters": {"string_value": "no-equals-sign"}}}
    assert set(with_adapters({"b": ServedModel("b", "1", broken)})) == {"b"}  # it does not load: nothing listed


def test_multi_lora_json_adapters_are_listed_where_the_repository_is_readable(tmp_path):
    """A multi_lora.json beside a model's config.pbtxt adds its adapters to /v1/models when the
    frontend sees the repository; a broken one adds nothing (that model refuses it at load)."""
    from tritonlm.openai.triton import ServedModel, with_adapters

    config = {"parameters": {"lora_adapters": {"string_value": "sql=a/sql"}}}
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "multi_lora.json").write_text('{"chat": "a/chat"}')
    assert set(with_adapters({"base": ServedModel("base", "1", config)})) == {"base", "sql"}  # no repository
    listed = with_adapters({"base": ServedModel("base", "1", config)}, tmp_path)
    assert set(listed) == {"base", "sql", "chat"} and listed["chat"].parent == "base" and listed["chat"].lora_name == "chat"
    (tmp_path / "base" / "multi_lora.json").write_text('["not", "an", "object"]')
    assert set(with_adapters({"base": ServedModel("base", "1", config)}, tmp_path)) == {"base", "sql"}
