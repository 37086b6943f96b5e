"""Latency SLOs through a real tritonserver and the OpenAI frontend: a request the SLO
controller sheds gets a clear error on Triton and a 503 with Retry-After on the OpenAI API,
and is counted on the metrics port.

No timing decides the outcome: the model's slo_ttft_ms is one microsecond, which no
prediction meets once the step-time model has seen its first steps (the warm-up at load
runs them: engine/slo_warmup.py). An idle engine admits whatever the prediction
(controller.admit), which the first request relies on, so the shed requests arrive behind
one the test holds in its step (the test-only stall file: helpers.servers.stall_env) until
they have been refused."""

from __future__ import annotations

import threading

import openai
import pytest

from tests.helpers.models import hf_greedy_text, tiny
from tests.helpers.servers import HANG_GUARD_S, add_generation_model, metric, wait_until
from tritonlm.client.generate import GenerateError, generate_grpc
from tritonlm.engine.slo.controller import COLD_STEPS
from tritonlm.engine.slo.step_time import StepTimeModel
from tritonlm.openai.server import OpenAIServer
from tritonlm.server import free_ports

# one prefill step and the decode steps: the model is ready after (the cold steps not fitted)
WARM_TOKENS = COLD_STEPS + StepTimeModel().min_steps + 2


@pytest.fixture(scope="module")
def triton_repo(tmp_path_factory, stall_file):
    repo = tmp_path_factory.mktemp("slorepo")
    add_generation_model(repo, "tiny_slo", slo_ttft_ms="0.001")
    return repo


@pytest.fixture(scope="module")
def frontend(triton_server, triton_repo):
    (port,) = free_ports(1)
    with OpenAIServer(triton_server.grpc_url, port=port, repo=triton_repo, metrics_url=triton_server.metrics_url) as server:
        yield server


def test_a_shed_request_is_a_clear_error_on_triton_and_a_503_with_retry_after_on_openai(triton_server, frontend,
                                                                                        stall_file):
    # the first request is admitted (the engine is idle) and served as usual
    first = generate_grpc(triton_server.grpc_url, "tiny_slo", "Hello there", max_tokens=WARM_TOKENS, end_id=-1,
                          exclude_input_in_output=True, timeout_s=HANG_GUARD_S)
    assert first.num_output_tokens == WARM_TOKENS
    tok = tiny()[1]
    assert "".join(first.pieces) == tok.decode(hf_greedy_text("Hello there", WARM_TOKENS, eos_token_id=None))
    assert metric(triton_server, "tritonlm_slo_requests_total", "tiny_slo", outcome="missed") == 1  # 1 us: missed
    # an idle engine admits (refusing protects no one there): this one is held in its step
    stall_file.touch()
    held: list = []
    holder = threading.Thread(target=lambda: held.append(generate_grpc(
        triton_server.grpc_url, "tiny_slo", "Hello there", max_tokens=4, end_id=-1, timeout_s=HANG_GUARD_S)))
    holder.start()
    try:
        assert wait_until(lambda: metric(triton_server, "tritonlm_requests_running", "tiny_slo", default=0) == 1,
                          HANG_GUARD_S)
        _shed_behind_a_running_request(triton_server, frontend)
    finally:
        stall_file.unlink(missing_ok=True)
        holder.join(HANG_GUARD_S)
    assert not holder.is_alive() and held[0].num_output_tokens == 4
    assert metric(triton_server, "tritonlm_slo_requests_total", "tiny_slo", default=0, outcome="met") == 0
    assert metric(triton_server, "tritonlm_slo_requests_total", "tiny_slo", outcome="missed") == 2


def _shed_behind_a_running_request(triton_server, frontend) -> None:
    # no prediction meets one microsecond: refused at once, on Triton with the reason
    with pytest.raises(GenerateError) as e:
        generate_grpc(triton_server.grpc_url, "tiny_slo", "Hello again", max_tokens=4, timeout_s=HANG_GUARD_S)
    assert "overloaded: predicted time to first token" in str(e.value)
    assert "slo_ttft_ms=0.001" in str(e.value) and "retry later" in str(e.value)
    # and on the OpenAI API: 503, Retry-After, a code a client can act on
    client = openai.OpenAI(base_url=frontend.url + "/v1", api_key="unused", max_retries=0, timeout=HANG_GUARD_S)
    with pytest.raises(openai.InternalServerError) as e:
        client.completions.create(model="tiny_slo", prompt="Hello again", max_tokens=4)
    assert e.value.status_code == 503 and e.value.response.headers["retry-after"] == "1"
    assert e.value.body["code"] == "slo_overloaded" and e.value.body["type"] == "service_unavailable_error"
    assert e.value.body["message"].startswith("overloaded: predicted time to first token")
    # each refusal is counted before its error goes out: both show at once
    assert metric(triton_server, "tritonlm_slo_requests_total", "tiny_slo", default=0, outcome="shed") == 2
    assert metric(triton_server, "tritonlm_slo_requests_total", "tiny_slo", default=0, outcome="met") == 0
    assert metric(triton_server, "tritonlm_inter_token_latency_seconds_count", "tiny_slo") == WARM_TOKENS - 1
    assert metric(triton_server, "tritonlm_slo_running_cap", "tiny_slo") >= 1
