"""`tritonlm serve` stopping under load, against the real tritonserver: SIGTERM drains
(readiness off, new requests refused, in-flight streams finish); at the drain deadline what
is left ends with finish_reason cancelled and its final response, and the process exits 0;
a model that fails to load makes serve exit non-zero with the model's error (so an
orchestrator restarts it)."""

from __future__ import annotations

import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.helpers.servers import (HANG_GUARD_S, Serve, add_generation_model, add_slow_model, requests_arrived,
                                   wait_for_requests, wait_until)
from tritonlm.client.generate import GenerateError, generate_grpc
from tritonlm.paths import REPO_ROOT
from tritonlm.server import free_ports

STREAMS = 8
TOKENS = 300  # per stream: 8 of them, two at a time, last seconds (a drain has something to wait for)
# A drain deadline no run reaches (a hang guard): the streams finish on their own, however slow
# the host, and the test sees the drain wait for them, not the deadline cut them.
NO_DEADLINE_S = "3600"
PROMPTS = [f"Story number {i}: once upon a time" for i in range(STREAMS)]


@pytest.fixture(scope="module")
def slow_repo(tmp_path_factory) -> Path:
    repo = tmp_path_factory.mktemp("drainrepo")
    add_slow_model(repo)
    return repo


def generated_tokens(metrics_port: int, model: str = "slow") -> float:
    """tritonlm_generated_tokens_total of the model (0 while the metrics endpoint does not answer)."""
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    except OSError:
        return 0.0
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("tritonlm_generated_tokens_total{") and f'model="{model}"' in line)


def run_streams(grpc_port: int, max_tokens: int, results: dict, timeout_s: float = HANG_GUARD_S) -> list[threading.Thread]:
    def one(i):
        t0 = time.monotonic()
        try:
            r = generate_grpc(f"127.0.0.1:{grpc_port}", "slow", PROMPTS[i], timeout_s=timeout_s, max_tokens=max_tokens,
                              min_tokens=max_tokens, exclude_input_in_output=True)
            results[i] = (r.finish_reason, r.num_output_tokens, r.text, time.monotonic() - t0)
        except GenerateError as e:
            results[i] = ("error", None, str(e), time.monotonic() - t0)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(STREAMS)]
    for t in threads:
        t.start()
    return threads


def test_sigterm_drains_in_flight_streams_then_exits_0(slow_repo):
    serve = Serve(slow_repo, "--drain-timeout", NO_DEADLINE_S)
    try:
        serve.wait_ready()
        assert serve.ready_status() == 200
        reference: dict = {}
        for t in run_streams(serve.grpc, TOKENS, reference):
            t.join(HANG_GUARD_S)
        assert all(reference[i][:2] == ("length", TOKENS) for i in range(STREAMS)), reference

        results: dict = {}
        served = requests_arrived(serve.metrics, "slow")  # the reference round's, already finished
        assert served >= STREAMS, serve.output
        threads = run_streams(serve.grpc, TOKENS, results)
        assert wait_for_requests(serve.metrics, "slow", STREAMS, since=served), serve.output  # all sent before the signal
        assert len(results) < STREAMS  # streams are in flight when the signal comes
        serve.proc.send_signal(signal.SIGTERM)
        # readiness goes off (tritonserver takes its HTTP endpoint down) ...
        assert wait_until(lambda: serve.ready_status() == "refused", HANG_GUARD_S), "still ready after SIGTERM"
        # ... the model starts unloading (Triton's drain; a request that slipped in before
        # that is admitted and served whole) and from then on a new request is refused
        import tritonclient.grpc as grpcclient

        from tritonclient.utils import InferenceServerException

        client = grpcclient.InferenceServerClient(f"127.0.0.1:{serve.grpc}")

        def model_ready() -> bool:
            try:
                return client.is_model_ready("slow")
            except InferenceServerException:  # UNAVAILABLE: Server not ready (it is stopping)
                return False

        assert wait_until(lambda: not model_ready(), HANG_GUARD_S)
        with pytest.raises(GenerateError, match="slow"):  # Request for unknown model: 'slow' ...
            generate_grpc(f"127.0.0.1:{serve.grpc}", "slow", "a late request", max_tokens=4, timeout_s=HANG_GUARD_S)
        client.close()
        for t in threads:
            t.join(HANG_GUARD_S)
        assert serve.proc.wait(HANG_GUARD_S) == 0, serve.output
        for i in range(STREAMS):  # every stream ends with its whole output, as without the signal
            assert results[i][:3] == reference[i][:3], (i, results[i][:2], serve.output)
        assert "draining" in serve.output and "tritonserver stopped" in serve.output
        assert "drain deadline" not in serve.output, serve.output  # the drain ended when the streams did
    finally:
        serve.kill()


def test_drain_deadline_cancels_what_is_left_with_a_final_response_and_exits_0(slow_repo):
    """Streams far longer than the drain timeout: at the deadline each one still running gets
    its final response with finish_reason cancelled (and the tokens it had), then exit 0."""
    serve = Serve(slow_repo, "--drain-timeout", "2")
    try:
        serve.wait_ready()
        results: dict = {}
        threads = run_streams(serve.grpc, 900, results)  # far longer than the deadline
        assert wait_for_requests(serve.metrics, "slow", STREAMS), serve.output  # all sent before the signal
        # and the running ones have generated tokens (however slow the host), so the cut has some to show
        assert wait_until(lambda: generated_tokens(serve.metrics) > 0, HANG_GUARD_S), serve.output
        serve.proc.send_signal(signal.SIGTERM)
        assert serve.proc.wait(HANG_GUARD_S) == 0, serve.output
        for t in threads:
            t.join(HANG_GUARD_S)
        assert len(results) == STREAMS
        # no error, no hang: every stream ended with a final response; those the deadline cut
        # say cancelled and carry the tokens generated before it
        assert all(r[0] in ("cancelled", "length") for r in results.values()), results
        cancelled = [r for r in results.values() if r[0] == "cancelled"]
        assert cancelled, results
        assert all(0 <= r[1] < 900 for r in cancelled), results
        assert any(r[1] > 0 and r[2] for r in cancelled), results  # streamed text before the cut
        assert "drain deadline (2 s) passed: requests still running end with finish_reason cancelled" in serve.output
        # the cancellation and unload came before tritonserver's own exit timeout (deadline + 5 s;
        # it would exit non-zero: "stopped with code") and serve's kill after it (+ 3 s)
        assert "stopping what still runs" not in serve.output and "stopped with code" not in serve.output, serve.output
    finally:
        serve.kill()


def test_model_that_fails_to_load_makes_serve_exit_nonzero(tmp_path):
    add_generation_model(tmp_path, "broken", runtime="no_such_runtime")
    http, grpc, metrics = free_ports(3)
    res = subprocess.run(
        [str(REPO_ROOT / ".venv" / "bin" / "tritonlm"), "serve", "--repo", str(tmp_path), "--http-port", str(http),
         "--grpc-port", str(grpc), "--metrics-port", str(metrics), "--openai-port", "0", "--health-port", "0"],
        capture_output=True, text=True, timeout=180,
    )
    assert res.returncode != 0
    assert "model 'broken' failed to load" in res.stderr and "runtime" in res.stderr, res.stderr
