"""Serving that survives real traffic, proven against a real tritonserver: stop words,
bad words, end_id/min_tokens, cancellation (client cancel and disconnect), a bounded
waiting queue with a per-request timeout, custom metrics, bad input next to good
traffic, and model configs that refuse to load with a message naming the field.

References are transformers' own generate() on the same seeded weights, or the same
request served alone. Every wait is bounded; all traffic stays on 127.0.0.1.
"""

from __future__ import annotations

import concurrent.futures as cf
import http.client
import json
import queue
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from tests.helpers.models import hf_greedy_text, tiny
from tests.helpers.servers import HANG_GUARD_S, add_generation_model, add_long_llama, metric, metrics_text
from tritonlm.client.generate import GenerateError, GenerateResult, _absorb, _grpc_inputs, generate_grpc, generate_http, generate_stream_http
from tritonlm.export.repository import write_generate_config
from tritonlm.models.builtin import tiny_tokenizer

LONG_CONTEXT = 1024  # the "long" model: generations that last seconds, so a test can act mid-stream
# the queue test's slot holder must outlast the queue timeout and the steps after it however fast
# the host: a fast host can use up GPT-2's 1024 positions first, so a Llama (RoPE, no position
# table) with room for this many tokens holds it instead
HOLD_CONTEXT = 8192
LONG_BYTES_PER_TOKEN = 2 * 2 * 128 * 4  # 2 layers x K,V x 128 wide x fp32
QUEUE_TIMEOUT_S = 0.8
BAD_MODELS = ["bad_runtime", "no_weights", "missing_onnx", "kv_too_small", "draft_other_tokenizer"]


# ---- the model repository ----------------------------------------------------------------


def add_long_model(repo: Path, name: str, weights_of: str | None = None, **parameters) -> Path:
    """A GPT-2 with 1024 positions and seeded weights (the tiny tokenizer); weights_of=NAME
    shares that model's weights instead of saving another copy."""
    if weights_of is None:
        from transformers import GPT2Config, GPT2LMHeadModel

        tok = tiny_tokenizer()
        config = GPT2Config(
            vocab_size=len(tok), n_positions=LONG_CONTEXT, n_embd=128, n_layer=2, n_head=4,
            bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
            tie_word_embeddings=False,
        )
        torch.manual_seed(99)
        model = GPT2LMHeadModel(config).eval()
        hf = repo / name / "1" / "hf"
        model.save_pretrained(hf)
        tok.save_pretrained(hf)
    (repo / name / "1").mkdir(parents=True, exist_ok=True)  # Triton wants a version folder
    hf_dir = "1/hf" if weights_of is None else f"../{weights_of}/1/hf"
    write_generate_config(
        repo / name, name, max_context=LONG_CONTEXT, hf_dir=hf_dir,
        extra_parameters={k: str(v) for k, v in parameters.items()},
    )
    return repo / name


def add_holder_model(repo: Path, name: str, **parameters) -> Path:
    """A tiny Llama with HOLD_CONTEXT tokens of context."""
    return add_long_llama(repo, name, HOLD_CONTEXT, seed=98, **parameters)


def add_draft_with_other_tokenizer(repo: Path, name: str) -> Path:
    """A target whose draft has as many tokens as the target's tokenizer, but other ids
    (the same vocabulary, ids reversed): a vocabulary-size check alone would accept it."""
    folder = add_generation_model(repo, name, draft_model="1/draft_hf")
    draft = folder / "1" / "draft_hf"
    model, tok = tiny("tiny-gpt2-draft")
    model.save_pretrained(draft)
    tok.save_pretrained(draft)
    spec = json.loads((draft / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    ids = sorted(i for i in vocab.values() if i != tok.eos_token_id)
    reverse = dict(zip(ids, reversed(ids)))
    spec["model"]["vocab"] = {t: reverse.get(i, i) for t, i in vocab.items()}
    (draft / "tokenizer.json").write_text(json.dumps(spec))
    return folder


@pytest.fixture(scope="module")
def triton_repo(tmp_path_factory):
    repo = tmp_path_factory.mktemp("robustrepo")
    add_generation_model(repo, "tiny", max_num_batched_tokens=64)
    add_long_model(repo, "long", cancellation_check_period_ms=20)  # asked every 20 ms (the default is 100)
    # the cancel and disconnect tests' model: their victims (nearly HOLD_CONTEXT tokens) run
    # until cancelled, however slow the test is next to the model
    add_holder_model(repo, "long_hold", cancellation_check_period_ms=20)
    # one running sequence, one waiting, the next is told "busy" (no queue timeout: the waiting
    # one stays however slow the host) ...
    add_holder_model(repo, "long_busy", max_num_seqs=1, max_queue_size=1)
    # ... and waiting too long ends a request
    add_holder_model(repo, "long_queue", max_num_seqs=1, max_queue_size=1, queue_timeout_s=QUEUE_TIMEOUT_S)
    # models that must refuse to load (loaded one by one through the model-control API)
    add_generation_model(repo, "bad_runtime", runtime="tensorflow")
    (add_generation_model(repo, "no_weights") / "1" / "hf" / "model.safetensors").unlink()
    add_generation_model(repo, "missing_onnx", runtime="onnx", onnx_model="1/model.onnx")
    add_generation_model(repo, "kv_too_small", kv_cache_bytes=100_000)
    add_draft_with_other_tokenizer(repo, "draft_other_tokenizer")
    return repo


@pytest.fixture(scope="module")
def triton_server_options():
    return {"model_control": "explicit", "load_models": ["tiny", "long", "long_hold", "long_busy", "long_queue"]}


# ---- helpers -----------------------------------------------------------------------------


def decode(ids: list[int]) -> str:
    """Text of token ids the way the engine writes it."""
    return tiny()[1].decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def hf_new_ids(prompt: str, max_tokens: int, **kwargs) -> list[int]:
    """transformers' greedy generate(): the new token ids, as generated (nothing removed)."""
    model, tok = tiny()
    ids = tok(prompt, return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=max_tokens, do_sample=False, pad_token_id=tok.eos_token_id, **kwargs)
    return out[0, ids.input_ids.shape[1]:].tolist()


def gen(server, prompt, model="tiny", **params):
    params.setdefault("exclude_input_in_output", True)
    return generate_grpc(server.grpc_url, model, prompt, timeout_s=HANG_GUARD_S, **params)


def wait_for(condition, timeout_s: float, what: str, interval_s: float = 0.02):
    """Poll until condition() is truthy; returns its value and the seconds it took."""
    t0 = time.monotonic()
    while True:
        value = condition()
        if value:
            return value, time.monotonic() - t0
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError(f"{what}: not within {timeout_s} s")
        time.sleep(interval_s)


class Stream:
    """One gRPC client with an open stream; responses and errors land in a queue."""

    def __init__(self, server):
        self.client = grpcclient.InferenceServerClient(server.grpc_url)
        self.responses: queue.Queue = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self.responses.put((result, error)))
        self.open = True

    def send(self, model: str, inputs, request_id: str = "") -> None:
        self.client.async_stream_infer(model, inputs, request_id=request_id, enable_empty_final_response=True)

    def next(self, timeout_s: float = HANG_GUARD_S):
        return self.responses.get(timeout=timeout_s)

    def error_of_next(self, timeout_s: float = HANG_GUARD_S) -> str:
        result, error = self.next(timeout_s)
        assert error is not None, "expected an error response"
        return str(error)

    def cancel(self) -> None:
        """Close the stream, cancelling whatever it still has in flight."""
        if self.open:
            self.client.stop_stream(cancel_requests=True)
            self.open = False

    def close(self) -> None:
        self.cancel()
        self.client.close()


def tensor(name: str, values, dtype: str) -> grpcclient.InferInput:
    np_type = {"BYTES": object, "INT32": np.int32, "FP32": np.float32, "BOOL": bool, "UINT64": np.uint64}[dtype]
    if dtype == "BYTES":
        values = [v.encode() if isinstance(v, str) else v for v in values]
    arr = np.array(values, dtype=np_type)
    inp = grpcclient.InferInput(name, list(arr.shape), dtype)
    inp.set_data_from_numpy(arr)
    return inp


# ---- stop words, bad words, end_id, min_tokens ---------------------------------------------

STOP_PROMPT = "Once upon a time there was a small robot who wanted"


def stop_across_two_tokens(prompt: str, max_tokens: int) -> tuple[str, str, int]:
    """(stop string, expected text, tokens generated) for a 4-character stop string whose first
    two characters end one generated token and whose last two begin the next."""
    ref = hf_greedy_text(prompt, max_tokens)
    text = decode(ref)
    for i in range(3, len(ref) - 1):
        left, right, cut = decode(ref[i - 1 : i]), decode(ref[i : i + 1]), len(decode(ref[:i]))
        stop = text[cut - 2 : cut + 2]
        if (
            decode(ref[:i]) == text[:cut] and len(left) >= 2 and len(right) >= 2
            and stop.isascii() and stop.isprintable() and text.find(stop) == cut - 2
        ):
            return stop, text[: cut - 2], i + 1
    raise AssertionError("no token boundary with a clean 4-character stop string")


def test_stop_word_split_across_two_tokens_stops_and_is_removed(triton_server):
    stop, expected, tokens = stop_across_two_tokens(STOP_PROMPT, 40)
    words = ["never appears §", stop]
    for stream in (False, True):
        r = gen(triton_server, STOP_PROMPT, max_tokens=40, stream=stream, stop_words=words)
        assert (r.text, r.finish_reason, r.num_output_tokens) == (expected, "stop", tokens), stream
        assert stop not in r.text
    # how many pieces a stream arrives in is timing: the tiny model's steps can come
    # faster than responses go, and then they are coalesced (docs/architecture.md, Threads);
    # the pieces together are the text before the stop string: none sent before it was found
    # held its first half
    streamed = gen(triton_server, STOP_PROMPT, max_tokens=40, stream=True, stop_words=words)
    assert "".join(streamed.pieces) == expected and not any(stop in p for p in streamed.pieces)
    # the prompt is echoed, the stop string still removed
    echoed = generate_grpc(triton_server.grpc_url, "tiny", STOP_PROMPT, max_tokens=40, stop_words=words)
    assert echoed.text == STOP_PROMPT + expected
    # HTTP: generate and generate_stream
    answer = generate_http(triton_server.http_url, "tiny", STOP_PROMPT, max_tokens=40, stop_words=words, exclude_input_in_output=True)
    assert (answer["text_output"], answer["finish_reason"]) == (expected, "stop")
    events = list(generate_stream_http(triton_server.http_url, "tiny", STOP_PROMPT, max_tokens=40, stop_words=words))
    assert "".join(e["text_output"] for e in events) == expected and events[-1]["finish_reason"] == "stop"


def test_bad_words_are_never_produced(triton_server):
    _, tok = tiny()
    prompt = "The capital of France is"
    ref = hf_greedy_text(prompt, 30)

    def variants(word):
        return {tuple(tok(v, add_special_tokens=False).input_ids) for v in (word, " " + word)}

    # a word greedy decoding does produce, as one token of its own
    at, word = next((i, decode(ref[i : i + 1]).strip()) for i in range(1, 30) if (ref[i],) in variants(decode(ref[i : i + 1]).strip()))
    banned = [list(ids) for ids in sorted(variants(word))]
    expected = hf_new_ids(prompt, 30, bad_words_ids=banned)
    if tok.eos_token_id in expected:
        expected = expected[: expected.index(tok.eos_token_id)]
    assert expected[:at] == ref[:at] and expected[at] != ref[at] and ref[at] not in expected
    for stream in (False, True):
        r = gen(triton_server, prompt, max_tokens=30, stream=stream, bad_words=[word])
        assert r.text == decode(expected), stream


def test_end_id_stops_and_min_tokens_or_min_length_defer_it(triton_server):
    prompt = "Hi"
    ref = hf_greedy_text(prompt, 30)
    end = ref[5]
    first = ref.index(end)
    r = gen(triton_server, prompt, max_tokens=30, end_id=end)
    assert (r.text, r.finish_reason, r.num_output_tokens) == (decode(ref[:first]), "stop", first)
    deferred = hf_new_ids(prompt, 30, eos_token_id=end, min_new_tokens=first + 3)
    expected = deferred[: deferred.index(end)] if end in deferred[first + 3 :] else deferred
    for name in ("min_tokens", "min_length"):  # min_length: genai-perf's name
        r = gen(triton_server, prompt, max_tokens=30, end_id=end, **{name: first + 3})
        assert r.text == decode(expected) and r.num_output_tokens == len(expected), name
        assert r.num_output_tokens >= first + 3
    # end_id -1: no token stops it, it runs to max_tokens
    r = gen(triton_server, prompt, max_tokens=30, end_id=-1)
    assert (r.finish_reason, r.num_output_tokens) == ("length", 30)


# ---- cancellation --------------------------------------------------------------------------

# long enough to be still running when the victims leave, however slowly the cancel travels
OTHERS = [("The capital of France is", 2000, True), ("def main(): return", 1800, False), ("Hi", 1600, True)]


def test_cancel_mid_stream_frees_the_cache_and_other_streams_keep_their_text(triton_server):
    alone = {p: gen(triton_server, p, model="long_hold", max_tokens=n, stream=s, end_id=-1).text for p, n, s in OTHERS}
    assert metric(triton_server, "tritonlm_kv_cache_used_bytes", "long_hold") == 0  # the idle value
    # The victims start first and the others join them, so the cancel comes a few metric reads
    # after the others start, however fast this machine runs them.
    victim = Stream(triton_server)
    try:
        common = {"max_tokens": HOLD_CONTEXT - 100, "end_id": -1}
        victim.send("long_hold", _grpc_inputs("Cancel me mid-stream", {**common, "stream": True}), "victim-stream")
        victim.send("long_hold", _grpc_inputs("Cancel me too", {**common, "stream": False}), "victim-whole")
        for _ in range(5):  # five pieces of text in: the victim is mid-stream
            result, error = victim.next()
            assert error is None and result.get_response().id == "victim-stream"
        wait_for(lambda: metric(triton_server, "tritonlm_requests_running", "long_hold") == 2, HANG_GUARD_S, "victims running")
        kv_victims = metric(triton_server, "tritonlm_kv_cache_used_bytes", "long_hold")
        with cf.ThreadPoolExecutor(len(OTHERS)) as pool:
            others = [pool.submit(gen, triton_server, p, model="long_hold", max_tokens=n, stream=s, end_id=-1) for p, n, s in OTHERS]
            wait_for(lambda: metric(triton_server, "tritonlm_requests_running", "long_hold") == len(OTHERS) + 2, HANG_GUARD_S,
                     "others running")
            kv_all = metric(triton_server, "tritonlm_kv_cache_used_bytes", "long_hold")
            cancelled = metric(triton_server, "tritonlm_requests_finished_total", "long_hold", reason="cancelled")
            steps = metric(triton_server, "tritonlm_batch_size_count", "long_hold")
            victim.cancel()
            _, seconds = wait_for(
                lambda: metric(triton_server, "tritonlm_requests_finished_total", "long_hold", reason="cancelled") == cancelled + 2,
                HANG_GUARD_S, "both cancelled requests to leave the batch",
            )
            kv_after = metric(triton_server, "tritonlm_kv_cache_used_bytes", "long_hold")
            steps_taken = metric(triton_server, "tritonlm_batch_size_count", "long_hold") - steps
            still_running = sum(not f.done() for f in others)
            results = [f.result(timeout=HANG_GUARD_S) for f in others]
    finally:
        victim.close()
    print(f"\ncancel: left the batch after {seconds * 1000:.0f} ms / {steps_taken:.0f} steps (this includes the metric polling); "
          f"KV used {kv_all:.0f} -> {kv_after:.0f} bytes with {still_running} other streams running")
    assert 0 < kv_victims < kv_all
    assert kv_after <= kv_all - kv_victims  # both victims' reservations are back in the pool at once
    # promptly, in the engine's own steps (not seconds: the host may be slow): the victims left
    # while the others were still mid-stream
    assert still_running > 0
    assert [r.text for r in results] == [alone[p] for p, _, _ in OTHERS]
    assert all(r.finish_reason == "length" and r.num_output_tokens == n for r, (_, n, _) in zip(results, OTHERS))
    wait_for(lambda: metric(triton_server, "tritonlm_kv_cache_used_bytes", "long_hold") == 0, HANG_GUARD_S, "KV cache back to idle")
    assert metric(triton_server, "tritonlm_requests_running", "long_hold") == 0


VANISHING_CLIENT = """
import queue, sys
import numpy as np
import tritonclient.grpc as grpcclient
client = grpcclient.InferenceServerClient(sys.argv[1])
responses = queue.Queue()
client.start_stream(callback=lambda result, error: responses.put(error))
inputs = []
for name, value, dtype in [("text_input", np.array([b"I will vanish"], dtype=object), "BYTES"),
                           ("max_tokens", np.array([{max_tokens}], np.int32), "INT32"),
                           ("end_id", np.array([-1], np.int32), "INT32"), ("stream", np.array([True]), "BOOL")]:
    inp = grpcclient.InferInput(name, list(value.shape), dtype)
    inp.set_data_from_numpy(value)
    inputs.append(inp)
client.async_stream_infer("long_hold", inputs)
for _ in range(3):
    assert responses.get(timeout=600) is None
print("streaming", flush=True)
responses.get(timeout=600)
"""


def test_clients_that_disconnect_mid_stream_are_cancelled(triton_server, tmp_path):
    def kv():
        return metric(triton_server, "tritonlm_kv_cache_used_bytes", "long_hold")

    def cancelled():
        return metric(triton_server, "tritonlm_requests_finished_total", "long_hold", reason="cancelled")

    # a gRPC client process killed mid-stream
    script = tmp_path / "vanishing_client.py"
    script.write_text(VANISHING_CLIENT.replace("{max_tokens}", str(HOLD_CONTEXT - 100)))
    before = cancelled()
    proc = subprocess.Popen([sys.executable, str(script), triton_server.grpc_url], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()  # "streaming" (or "" if it died: the assertion shows it)
        assert line.strip() == "streaming" and kv() > 0
    finally:
        proc.kill()
        proc.wait(timeout=10)
    _, grpc_s = wait_for(lambda: kv() == 0 and cancelled() == before + 1, HANG_GUARD_S, "the killed client's request to be cancelled")
    # an HTTP generate_stream client that closes its connection mid-stream
    conn = http.client.HTTPConnection(triton_server.http_url, timeout=30)
    body = {"text_input": "I will hang up", "max_tokens": HOLD_CONTEXT - 100, "end_id": -1, "stream": True}
    conn.request("POST", "/v2/models/long_hold/generate_stream", body=json.dumps(body), headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    events = 0
    while events < 3:
        line = response.fp.readline()
        assert line, "the stream ended early"
        events += line.startswith(b"data:")
    assert kv() > 0
    response.close()
    conn.close()
    _, http_s = wait_for(lambda: kv() == 0 and cancelled() == before + 2, HANG_GUARD_S, "the hung-up HTTP request to be cancelled")
    print(f"\ndisconnect -> KV idle: gRPC {grpc_s * 1000:.0f} ms, HTTP {http_s * 1000:.0f} ms")
    assert gen(triton_server, "still serving", model="long_hold", max_tokens=5).num_output_tokens == 5


# ---- the waiting queue ---------------------------------------------------------------------


def test_full_queue_is_refused_at_once_and_a_request_waiting_too_long_times_out(triton_server):
    def waiting(model):
        return metric(triton_server, "tritonlm_requests_waiting", model)

    def running(model):
        return metric(triton_server, "tritonlm_requests_running", model)

    def cancelled(model):
        return metric(triton_server, "tritonlm_requests_finished_total", model, reason="cancelled")

    def hold(stream, model):
        stream.send(model, _grpc_inputs("I hold the only slot", {"max_tokens": HOLD_CONTEXT - 100, "end_id": -1, "stream": True}))
        assert stream.next()[1] is None  # streaming: it holds the one running slot (max_num_seqs=1)

    # A full queue (long_busy, no queue timeout: nothing changes while the test looks)
    holder, queued, refused = (Stream(triton_server) for _ in range(3))
    try:
        hold(holder, "long_busy")
        queued.send("long_busy", _grpc_inputs("I wait", {"max_tokens": 4}))
        wait_for(lambda: waiting("long_busy") == 1, HANG_GUARD_S, "the second request to wait")
        refused.send("long_busy", _grpc_inputs("no room", {"max_tokens": 4}))
        busy = refused.error_of_next()
        # at once, not after a wait for room: the holder still runs and the other still waits
        busy_at_once = (running("long_busy"), waiting("long_busy")) == (1, 1)
        # a waiting request whose client cancels leaves the queue (and frees its place) at once
        before = cancelled("long_busy")
        queued.cancel()
        wait_for(lambda: waiting("long_busy") == 0 and cancelled("long_busy") == before + 1, HANG_GUARD_S,
                 "the waiting request to be cancelled")
    finally:
        for s in (holder, queued, refused):
            s.close()
    assert re.search(r"server busy: 1 requests already waiting \(max_queue_size=1\); retry later", busy), busy
    assert busy_at_once

    # The queue timeout (long_queue)
    errors = metric(triton_server, "tritonlm_requests_finished_total", "long_queue", reason="error")
    holder, queued = (Stream(triton_server) for _ in range(2))
    try:
        hold(holder, "long_queue")
        t_queued = time.monotonic()
        queued.send("long_queue", _grpc_inputs("I wait", {"max_tokens": 4}))
        timeout = queued.error_of_next()
        waited_s = time.monotonic() - t_queued
        holder_running = running("long_queue") == 1
    finally:
        for s in (holder, queued):
            s.close()
    assert re.search(rf"timed out after waiting \d+\.\d s for a free slot \(queue_timeout_s={QUEUE_TIMEOUT_S}\); retry later", timeout), timeout
    assert QUEUE_TIMEOUT_S <= waited_s  # not before its timeout (after it: however slow the host)
    assert holder_running  # it timed out in the queue, it did not get the slot late
    assert metric(triton_server, "tritonlm_requests_finished_total", "long_queue", reason="error") == errors + 1
    for model in ("long_busy", "long_queue"):
        wait_for(lambda: metric(triton_server, "tritonlm_kv_cache_used_bytes", model) == 0, HANG_GUARD_S, "the holder to be cancelled")
        assert gen(triton_server, "room again", model=model, max_tokens=4).num_output_tokens == 4


# ---- metrics -------------------------------------------------------------------------------


def test_metrics_count_exactly_what_was_served(triton_server):
    jobs = [("metrics one", 7), ("metrics two", 12), ("metrics three", 3)]

    def snapshot():
        def m(name, **labels):
            return metric(triton_server, name, "tiny", **labels)

        return {
            "tokens": m("tritonlm_generated_tokens_total"),
            "length": m("tritonlm_requests_finished_total", reason="length"),
            "ttft": m("tritonlm_time_to_first_token_seconds_count"),
            "tpot": m("tritonlm_time_per_output_token_seconds_count"),
            "steps": m("tritonlm_batch_size_count"),
            "batch_sum": m("tritonlm_batch_size_sum"),
        }

    before = snapshot()
    for prompt, n in jobs:
        assert gen(triton_server, prompt, max_tokens=n, end_id=-1, stream=True).num_output_tokens == n
    after = snapshot()
    delta = {k: after[k] - before[k] for k in before}
    assert delta["tokens"] == sum(n for _, n in jobs)
    assert delta["length"] == delta["ttft"] == delta["tpot"] == len(jobs)
    # one request at a time: one step per token plus at least one prefill step each
    assert sum(n for _, n in jobs) <= delta["steps"] == delta["batch_sum"]
    text = metrics_text(triton_server)
    for family in ("tritonlm_time_to_first_token_seconds", "tritonlm_time_per_output_token_seconds", "tritonlm_batch_size"):
        assert re.search(rf'^{family}_bucket{{instance="tiny_[0-9_]+",model="tiny",version="1",le="\+Inf"}} ', text, re.M), family
    for reason in ("stop", "length", "cancelled", "error"):
        metric(triton_server, "tritonlm_requests_finished_total", "tiny", reason=reason)
    spec_bytes_per_token = 2 * 2 * 64 * 4
    assert metric(triton_server, "tritonlm_kv_cache_bytes_per_token", "tiny") == spec_bytes_per_token
    total = metric(triton_server, "tritonlm_kv_cache_total_bytes", "tiny")
    assert total >= 8 * 256 * spec_bytes_per_token  # the default budget: 8 full contexts
    assert metric(triton_server, "tritonlm_kv_cache_total_bytes", "long") >= 8 * LONG_CONTEXT * LONG_BYTES_PER_TOKEN
    idle = [metric(triton_server, g, "tiny") for g in ("tritonlm_kv_cache_used_bytes", "tritonlm_requests_running", "tritonlm_requests_waiting")]
    assert idle == [0, 0, 0]


# ---- bad input next to good traffic --------------------------------------------------------
# On the "long" model: its good streams last seconds (1000 tokens), so the bad request is
# answered while they are surely mid-stream, however fast the engine or slow the machine.

GOOD = ["Hi", "The capital of France is"]
GOOD_TOKENS = 1000
CTX = LONG_CONTEXT
PROMPT_BYTES = 32 * LONG_CONTEXT  # max_prompt_bytes' default: 32 bytes per token of context


@pytest.fixture(scope="module")
def good_expected(triton_repo):
    """transformers' greedy text of the long model's weights, never stopping on EOS (end_id -1)."""
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel.from_pretrained(triton_repo / "long" / "1" / "hf").eval()
    model.generation_config.eos_token_id = None
    tok = tiny_tokenizer()
    expected = {}
    for p in GOOD:
        ids = tok(p, return_tensors="pt")
        out = model.generate(**ids, max_new_tokens=GOOD_TOKENS, do_sample=False, pad_token_id=tok.eos_token_id)
        expected[p] = decode(out[0, ids.input_ids.shape[1]:].tolist())
    return expected


def T(name, values, dtype):
    return (name, values, dtype)


TEXT = T("text_input", ["hello"], "BYTES")
BAD_INPUTS = {
    "missing_text_input": ([T("max_tokens", [4], "INT32")], r"text_input: missing; send the prompt as a BYTES tensor of shape \[1\]"),
    "empty_text_input": ([T("text_input", [""], "BYTES")], r"text_input: empty prompt; send some text"),
    "non_utf8_text_input": ([T("text_input", [b"ok \xff\xfe"], "BYTES")], r"text_input: not valid UTF-8 .*; send UTF-8 text"),
    "prompt_longer_than_context": ([T("text_input", ["word " * (CTX + 100)], "BYTES")], rf"text_input: the prompt has \d+ tokens; the model's context is {CTX} tokens, so prompts must have at most {CTX - 1}"),
    "max_tokens_zero": ([TEXT, T("max_tokens", [0], "INT32")], r"max_tokens: must be >= 1, got 0"),
    "max_tokens_negative": ([TEXT, T("max_tokens", [-5], "INT32")], r"max_tokens: must be >= 1, got -5"),
    "max_tokens_beyond_context": ([TEXT, T("max_tokens", [CTX + 50], "INT32")], rf"max_tokens: {CTX + 50} new tokens after a \d+-token prompt exceed the context of {CTX} tokens; ask for at most \d+"),
    "temperature_negative": ([TEXT, T("temperature", [-0.5], "FP32")], r"temperature: must be >= 0 \(0 = greedy\), got -0.5"),
    "top_p_zero": ([TEXT, T("top_p", [0.0], "FP32")], r"top_p: must be in \(0, 1\], got 0.0"),
    "top_p_above_one": ([TEXT, T("top_p", [1.5], "FP32")], r"top_p: must be in \(0, 1\], got 1.5"),
    "top_p_nan": ([TEXT, T("top_p", [float("nan")], "FP32")], r"top_p: must be a finite number, got nan"),
    "top_k_negative": ([TEXT, T("top_k", [-2], "INT32")], r"top_k: must be >= 0 \(0 = off\), got -2"),
    "min_tokens_negative": ([TEXT, T("min_tokens", [-1], "INT32")], r"min_tokens: must be >= 0, got -1"),
    "end_id_outside_vocabulary": ([TEXT, T("end_id", [99_999], "INT32")], r"end_id: must be -1 \(never stop on a token\) or a token id in \[0, 512\), got 99999"),
    # bounds (RequestLimits from the model's settings: max_context 1024 -> 32768 prompt bytes)
    "prompt_over_max_prompt_bytes": ([T("text_input", ["x" * (PROMPT_BYTES + 100)], "BYTES")], rf"text_input: {PROMPT_BYTES + 100} bytes; the limit is {PROMPT_BYTES} \(max_prompt_bytes\)"),
    "too_many_stop_words": ([TEXT, T("stop_words", [f"w{i}" for i in range(65)], "BYTES")], r"stop_words: 65 entries; the limit is 64 \(max_words\)"),
    "stop_words_packed_with_commas": ([TEXT, T("stop_words", [",".join(f"w{i}" for i in range(65))], "BYTES")], r"stop_words: 65 words; the limit is 64 \(max_words\)"),
    "bad_word_too_long": ([TEXT, T("bad_words", ["b" * 300], "BYTES")], r"bad_words: an entry of 300 bytes; the limit is 256 \(max_word_bytes\)"),
    "min_tokens_over_max_tokens": ([TEXT, T("max_tokens", [4], "INT32"), T("min_tokens", [5], "INT32")], r"min_tokens: 5 is more than max_tokens=4"),
    "repetition_penalty_that_overflows": ([TEXT, T("repetition_penalty", [1e-30], "FP32"), T("temperature", [1.0], "FP32")], r"repetition_penalty: must be in \[0\.01, 100\] \(1 = off\)"),
    # datatypes and shapes that contradict config.pbtxt: Triton refuses them before the model
    # runs, and its message names the input and the datatype/shape the model expects
    "max_tokens_as_fp32": ([TEXT, T("max_tokens", [4.0], "FP32")], r"input 'max_tokens' data-type is 'FP32', but model 'long' expects 'INT32'"),
    "max_tokens_as_bytes": ([TEXT, T("max_tokens", ["4"], "BYTES")], r"input 'max_tokens' data-type is 'BYTES', but model 'long' expects 'INT32'"),
    "stop_words_as_int32": ([TEXT, T("stop_words", [1, 2], "INT32")], r"input 'stop_words' data-type is 'INT32', but model 'long' expects 'BYTES'"),
    "stop_words_not_utf8": ([TEXT, T("stop_words", [b"\xff"], "BYTES")], r"stop_words: not valid UTF-8 .*; send UTF-8 text"),
    "stream_as_int32": ([TEXT, T("stream", [1], "INT32")], r"input 'stream' data-type is 'INT32', but model 'long' expects 'BOOL'"),
    "text_input_two_elements": ([T("text_input", ["a", "b"], "BYTES")], r"unexpected shape for input 'text_input' for model 'long'\. Expected \[1\], got \[2\]"),
    "batch_of_three_prompts": ([T("text_input", ["a", "b", "c"], "BYTES")], r"unexpected shape for input 'text_input' for model 'long'\. Expected \[1\], got \[3\]"),
    "max_tokens_two_values": ([TEXT, T("max_tokens", [4, 5], "INT32")], r"unexpected shape for input 'max_tokens' for model 'long'\. Expected \[1\], got \[2\]"),
    "unknown_input": ([TEXT, T("max_token", [4], "INT32")], r"unexpected inference input 'max_token' for model 'long'"),
}


def pieces_of(stream: Stream, into: GenerateResult) -> bool:
    """Move the pieces a good stream has received so far into `into`; True once it has finished."""
    while True:
        try:
            result, error = stream.responses.get_nowait()
        except queue.Empty:
            return False
        assert error is None, error
        if _absorb(into, result):
            return True


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_refused_naming_it_while_good_requests_run(triton_server, good_expected, case):
    inputs, pattern = BAD_INPUTS[case]
    good = [Stream(triton_server) for _ in GOOD]
    got = [GenerateResult() for _ in GOOD]
    bad = Stream(triton_server)
    try:
        for s, p in zip(good, GOOD):
            s.send("long", _grpc_inputs(p, {"max_tokens": GOOD_TOKENS, "end_id": -1, "stream": True}))
        for s, r in zip(good, got):  # both good requests are streaming
            result, error = s.next()
            assert error is None and not _absorb(r, result)
        bad.send("long", [tensor(*t) for t in inputs])
        message = bad.error_of_next(timeout_s=30)
        finished = [pieces_of(s, r) for s, r in zip(good, got)]
        assert finished == [False, False], "a good request ended before the bad one was answered"
        before = [len(r.pieces) for r in got]
        for s, r in zip(good, got):  # and they go on after the error: one more piece each
            result, error = s.next()
            assert error is None
            _absorb(r, result)
    finally:
        for s in good + [bad]:
            s.close()
    assert re.search(pattern, message), message
    assert all(len(r.pieces) > n for r, n in zip(got, before))
    for p, r in zip(GOOD, got):  # what they had streamed until cancelled is transformers' text
        assert r.text and good_expected[p].startswith(r.text), (p, r.text[:80])


# ---- configs that must not load --------------------------------------------------------------

REFUSALS = {
    "bad_runtime": r"runtime: 'tensorflow' is not supported; use 'torch' or 'onnx'",
    "no_weights": r"hf_dir: cannot load the torch model from \S+no_weights/1/hf \(OSError: .*model\.safetensors.*\); re-export the model",
    "missing_onnx": r"onnx_model: '1/model\.onnx' does not exist \(looked at \S+\); re-export the model",
    "kv_too_small": r"kv_cache_bytes: 100000 bytes hold 80 tokens, less than one full-context sequence \(256 tokens at 1024 bytes/token\); give at least \d+ bytes or lower max_context",
    "draft_other_tokenizer": r"draft_model: the draft's tokenizer \(\S+draft_hf\) differs from the target's: \d+ of 512 tokens map to other ids .*a draft model must use the target's tokenizer",
}
assert set(REFUSALS) == set(BAD_MODELS)


@pytest.mark.parametrize("model", BAD_MODELS)
def test_a_wrong_config_refuses_to_load_naming_the_field_and_the_fix(triton_server, model):
    client = grpcclient.InferenceServerClient(triton_server.grpc_url)
    try:
        with pytest.raises(InferenceServerException) as refused:
            client.load_model(model)
        assert not client.is_model_ready(model)
        assert client.is_model_ready("tiny")
    finally:
        client.close()
    assert re.search(REFUSALS[model], str(refused.value)), str(refused.value)


def test_the_server_still_serves_after_everything(triton_server):
    r = gen(triton_server, "Hi", max_tokens=6)
    assert r.text == decode(hf_greedy_text("Hi", 6)) and r.finish_reason == "length"
    with pytest.raises(GenerateError, match="max_tokens"):
        gen(triton_server, "Hi", max_tokens=0)
