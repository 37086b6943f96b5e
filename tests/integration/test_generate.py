"""The generation model through a real tritonserver: gRPC streaming, HTTP generate,
continuous batching across clients, KV budget, errors, metrics.
References are transformers' own generate() on the same weights."""

from __future__ import annotations

import concurrent.futures as cf
import re
import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from tests.helpers.models import hf_greedy_text, tiny
from tests.helpers.servers import HANG_GUARD_S, add_generation_model, histogram_peak, metric
from tritonlm.client.generate import GenerateError, generate_grpc, generate_http, generate_stream_http

PROMPTS = [
    "The capital of France is",
    "Once upon a time there was a small robot who wanted",
    "Hi",
    "Numbers: 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15",
    "Café naïve — 你好，世界 🙂",
    "def main(): return",
]
BYTES_PER_TOKEN = 2 * 2 * 64 * 4  # tiny-gpt2: 2 layers x 64 wide x fp32


@pytest.fixture(scope="module")
def triton_repo(tmp_path_factory):
    repo = tmp_path_factory.mktemp("genrepo")
    add_generation_model(repo, "tiny", max_num_batched_tokens=64)
    # the next step launched before the host reads this one's tokens (engine.py, step)
    add_generation_model(repo, "tiny_ahead", max_num_batched_tokens=64, schedule_ahead="true")
    # a budget that fits only two full-context (256-token) sequences
    add_generation_model(repo, "tiny_small_kv", kv_cache_bytes=2 * (256 + 16) * BYTES_PER_TOKEN + 16 * BYTES_PER_TOKEN)
    # the same engine over the exported ONNX decoder (ONNX Runtime runner)
    from tritonlm.export.onnx_export import export_decoder_onnx

    folder = add_generation_model(repo, "tiny_onnx", runtime="onnx", onnx_model="1/model.onnx")
    export_decoder_onnx(tiny()[0], folder / "1" / "model.onnx")
    return repo


def gen(server, prompt, model="tiny", **params):
    params.setdefault("exclude_input_in_output", True)
    return generate_grpc(server.grpc_url, model, prompt, **params)


def text_of(ids):
    return tiny()[1].decode(ids)


@pytest.mark.parametrize("model", ["tiny", "tiny_ahead"])
def test_greedy_over_grpc_equals_hf_generate(triton_server, model):
    for prompt in PROMPTS:
        ref = hf_greedy_text(prompt, 20)
        for stream in (False, True):
            result = gen(triton_server, prompt, model=model, max_tokens=20, stream=stream)
            assert result.text == text_of(ref), (prompt, stream)
            assert result.finish_reason == "length"
            assert result.num_output_tokens == 20
            assert result.num_input_tokens == len(tiny()[1](prompt).input_ids)


def test_what_each_model_resolved_at_load_is_in_the_server_log(triton_server):
    """tritonlm's load-time decisions go to Triton's own log (pb_utils.Logger), not nowhere."""
    log = triton_server.log_text()
    assert re.search(r'I\d{4} .*"tritonlm\.engine\.loader: precision: float32 on cpu \(set in the config\)"', log), log[-3000:]
    # the kernels' build: its ISA level and whether it was prebuilt (tritonlm/engine/kernels)
    assert re.search(r'"tritonlm\.engine\.loader: attention: paged \((avx512_vnni|avx512|avx2|portable|native), '
                     r'(prebuilt|compiled at load) ', log), log[-3000:]
    assert re.search(r'"tritonlm\.engine\.loader: KV cache: 1024 bytes/token, budget \d+ bytes', log), log[-3000:]


def test_onnx_runtime_gives_the_same_greedy_tokens(triton_server):
    prompts = PROMPTS[:4]
    with cf.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda p: gen(triton_server, p, model="tiny_onnx", max_tokens=20, stream=True), prompts))
    for prompt, result in zip(prompts, results):
        assert result.text == text_of(hf_greedy_text(prompt, 20)), prompt


def test_non_streaming_answer_is_one_response_and_echoes_the_prompt_by_default(triton_server):
    prompt = PROMPTS[0]
    result = generate_grpc(triton_server.grpc_url, "tiny", prompt, max_tokens=8)
    assert len(result.pieces) == 1
    assert result.text == prompt + text_of(hf_greedy_text(prompt, 8))


def test_streaming_pieces_concatenate_to_the_whole_text_with_multibyte_characters(triton_server):
    prompt = PROMPTS[4]
    whole = gen(triton_server, prompt, max_tokens=48, stream=False)
    streamed = gen(triton_server, prompt, max_tokens=48, stream=True)
    # how many responses depends on whether the response thread kept up with the steps
    # (responses that queue behind a send go out coalesced, all of them on a host busy enough),
    # so no count; one event per token is checked without the thread (tests/unit/engine/test_detok.py)
    assert len(streamed.pieces) >= 1
    assert "".join(streamed.pieces) == whole.text == text_of(hf_greedy_text(prompt, 48))
    assert any(len(p.encode()) != len(p) for p in streamed.pieces)  # multi-byte characters did stream


def test_http_generate_and_generate_stream(triton_server):
    prompt = PROMPTS[1]
    ref = text_of(hf_greedy_text(prompt, 16))
    answer = generate_http(triton_server.http_url, "tiny", prompt, max_tokens=16, exclude_input_in_output=True)
    assert answer["text_output"] == ref and answer["finish_reason"] == "length"
    events = list(generate_stream_http(triton_server.http_url, "tiny", prompt, max_tokens=16, exclude_input_in_output=True))
    assert len(events) >= 1 and "".join(e["text_output"] for e in events) == ref  # no count: as above


def test_priority_input_is_taken_and_leaves_the_greedy_answer_alone(triton_server):
    prompt = PROMPTS[2]
    assert gen(triton_server, prompt, max_tokens=12, priority=-7).text == text_of(hf_greedy_text(prompt, 12))


@pytest.mark.parametrize("model", ["tiny", "tiny_ahead"])
def test_sixteen_concurrent_mixed_requests_get_their_solo_answers(triton_server, model):
    prompts = [PROMPTS[i % len(PROMPTS)] + "!" * (i // len(PROMPTS)) for i in range(16)]
    lengths = [8 + 3 * i for i in range(16)]
    expected = [text_of(hf_greedy_text(p, n)) for p, n in zip(prompts, lengths)]
    with cf.ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(gen, triton_server, p, model=model, max_tokens=n, stream=bool(i % 2))
                   for i, (p, n) in enumerate(zip(prompts, lengths))]
        results = [f.result(timeout=300) for f in futures]
    assert [r.text for r in results] == expected
    assert [r.num_output_tokens for r in results] == lengths
    assert histogram_peak(triton_server, "tritonlm_batch_size_bucket", model=model) > 1


def test_kv_budget_of_two_sequences_serves_twelve_concurrent_requests(triton_server):
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(12)]
    expected = [text_of(hf_greedy_text(p, 200)) for p in prompts]
    total = metric(triton_server, "tritonlm_kv_cache_total_bytes", "tiny_small_kv")
    with cf.ThreadPoolExecutor(12) as pool:
        futures = [pool.submit(gen, triton_server, p, model="tiny_small_kv", max_tokens=200, stream=True) for p in prompts]
        peak_used = peak_waiting = 0.0
        while not all(f.done() for f in futures):
            peak_used = max(peak_used, metric(triton_server, "tritonlm_kv_cache_used_bytes", "tiny_small_kv"))
            peak_waiting = max(peak_waiting, metric(triton_server, "tritonlm_requests_waiting", "tiny_small_kv"))
            assert metric(triton_server, "tritonlm_requests_running", "tiny_small_kv") <= 2
            time.sleep(0.02)  # poll, do not spin: the server shares the CPU with this loop
        results = [f.result() for f in futures]
    assert [r.text for r in results] == expected
    assert 0 < peak_used <= total
    assert peak_waiting > 0  # the budget really made requests queue


@pytest.mark.parametrize(
    "params, named",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"max_tokens": 10_000}, "max_tokens"),
        ({"max_tokens": 4, "temperature": -1.0}, "temperature"),
        ({"max_tokens": 4, "top_p": 0.0}, "top_p"),
        ({"max_tokens": 4, "top_k": -2}, "top_k"),
        ({"max_tokens": 4, "priority": 5000}, r"priority: must be in \[-1000, 1000\]"),
    ],
)
def test_bad_parameters_get_an_error_naming_the_input(triton_server, params, named):
    with pytest.raises(GenerateError, match=named):
        gen(triton_server, "hello", **params)
    assert gen(triton_server, "hello", max_tokens=3).num_output_tokens == 3


def test_prompt_longer_than_the_context_is_refused_and_the_server_keeps_serving(triton_server):
    with pytest.raises(GenerateError, match="text_input: the prompt has .* tokens"):
        gen(triton_server, "word " * 400, max_tokens=4)
    with pytest.raises(GenerateError, match="not valid UTF-8"):
        client = grpcclient.InferenceServerClient(triton_server.grpc_url)
        inp = grpcclient.InferInput("text_input", [1], "BYTES")
        inp.set_data_from_numpy(np.array([b"\xff\xfe"], dtype=object))
        import queue

        q = queue.Queue()
        client.start_stream(callback=lambda result, error: q.put(error))
        client.async_stream_infer("tiny", [inp])
        err = q.get(timeout=30)
        client.stop_stream()
        raise GenerateError(str(err))
    assert gen(triton_server, PROMPTS[0], max_tokens=5).text == text_of(hf_greedy_text(PROMPTS[0], 5))


def test_metrics_report_cache_and_tokens(triton_server):
    """Each counter moves by exactly what one 4-token request adds (before/after, not cumulative)."""
    counters = [("tritonlm_generated_tokens_total", {}, 4), ("tritonlm_requests_finished_total", {"reason": "length"}, 1),
                ("tritonlm_time_to_first_token_seconds_count", {}, 1)]

    def read(name, labels):
        try:
            return metric(triton_server, name, "tiny", **labels)
        except AssertionError:  # a labelled counter appears with its first sample
            return 0.0

    before = [read(name, labels) for name, labels, _ in counters]
    gen(triton_server, "metrics please", max_tokens=4)
    assert metric(triton_server, "tritonlm_kv_cache_bytes_per_token", "tiny") == BYTES_PER_TOKEN
    # the last counters may be written just after the final response: wait until every one has
    # moved at least that far (however late), then check it moved exactly that far
    deadline = time.monotonic() + HANG_GUARD_S
    while True:
        deltas = [read(name, labels) - b for (name, labels, _), b in zip(counters, before)]
        if all(got >= d for got, (_, _, d) in zip(deltas, counters)) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert deltas == [d for _, _, d in counters], list(zip([c[0] for c in counters], deltas))


def test_a_shared_prefix_is_served_from_the_cache_with_the_same_text(triton_server):
    system = "You are a helpful assistant. Answer in one short sentence, please. " * 3
    hits = metric(triton_server, "tritonlm_prefix_cache_hits_total", "tiny")
    queries = metric(triton_server, "tritonlm_prefix_cache_queries_total", "tiny")
    first = gen(triton_server, system + "Who are you?", max_tokens=8, stream=True)
    second = gen(triton_server, system + "Where are you?", max_tokens=8, stream=True)
    assert first.extra["num_cached_tokens"] == 0  # nothing before it shared this prefix
    prompt_ids = tiny()[1](system + "Where are you?").input_ids
    assert second.extra["num_cached_tokens"] >= 16 * ((len(tiny()[1](system).input_ids) - 16) // 16)
    assert second.text == text_of(hf_greedy_text(system + "Where are you?", 8))
    assert metric(triton_server, "tritonlm_prefix_cache_hits_total", "tiny") - hits >= second.extra["num_cached_tokens"]
    assert metric(triton_server, "tritonlm_prefix_cache_queries_total", "tiny") - queries >= 2 * len(prompt_ids) - 2
    assert metric(triton_server, "tritonlm_prefix_cache_blocks", "tiny") > 0
