"""The supervisor follows the server, against the real tritonserver under `tritonlm serve`:
models unloaded, loaded and reloaded through the model-control API, or reloaded by poll
mode after a configuration change, while another model streams; and an engine step that
hangs with the GIL free (the heartbeat thread still beats), which the step watchdog finds.

What an operator sees is checked: readiness says ready again once every served model has
its processes (a 503 in between only while a served model lacks one, never a recovery),
no fault is logged, no restart is counted, and the other model's streams are never cut;
for the hang, a wedged fault, a restart, and the model answering as before.

Every wait is for the thing itself (a probe's answer, a process, a log line); the bounds
are hang guards only."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.helpers.servers import HANG_GUARD_S, Serve, add_generation_model, add_slow_model, wait_until
from tests.integration.test_self_healing import PROMPT, greedy, stubs
from tritonlm.client.generate import GenerateError, generate_grpc
from tritonlm.engine.engine import STALL_FILE_ENV
from tritonlm.supervise.served import READY, UNAVAILABLE, TritonModels

STREAM_TOKENS = 200  # per stream; the streams follow one another until the test is done
# model control restricted to a header (--restrict-model-control): the supervisor's reads of
# the repository index need it too
ADMIN_HEADER, ADMIN_KEY = "x-tritonlm-admin", "test-key"
RELOADED = 'parameters { key: "cancellation_check_period_ms" value: { string_value: "%d" } }\n'


@pytest.fixture
def two_models(tmp_path) -> Path:
    """`slow` streams throughout; `tiny` is unloaded, loaded and reloaded."""
    repo = tmp_path / "repo"
    add_slow_model(repo)
    add_generation_model(repo, "tiny")
    return repo


class Streamer:
    """Streams on `model`, one after another, until stop(); every outcome is kept. `pieces`
    counts the text that has arrived: a test that waits for it to grow knows a stream is
    being served at that moment."""

    def __init__(self, serve: Serve, model: str):
        self.serve, self.model = serve, model
        self.pieces = 0
        self.results: list[tuple[str, str | None]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _on_piece(self, _) -> None:
        self.pieces += 1

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                r = generate_grpc(f"127.0.0.1:{self.serve.grpc}", self.model, PROMPT, on_piece=self._on_piece,
                                  stream=True, timeout_s=HANG_GUARD_S, max_tokens=STREAM_TOKENS,
                                  min_tokens=STREAM_TOKENS)
                self.results.append(("finished", r.finish_reason))
            except GenerateError as e:
                self.results.append(("error", str(e)))

    def wait_streaming(self) -> None:
        seen = self.pieces
        assert wait_until(lambda: self.pieces > seen, HANG_GUARD_S), "no stream is being served"

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(HANG_GUARD_S)
        assert not self._thread.is_alive(), "a stream never ended"


class Readiness:
    """Polls /health/ready on a thread, keeping every answer with the board's state."""

    def __init__(self, serve: Serve):
        self.serve = serve
        self.answers: list[tuple[int, dict]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            answer = health(self.serve, "/health/ready")
            if answer is not None:
                self.answers.append(answer)
            self._stop.wait(0.05)

    def stop(self) -> list[tuple[int, dict]]:
        self._stop.set()
        self._thread.join(HANG_GUARD_S)
        return self.answers


def health(serve: Serve, path: str) -> tuple[int, dict] | None:
    """(status, JSON body) of the probes' endpoint; None when it does not answer in time."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{serve.health}{path}", timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
    except (urllib.error.URLError, OSError):
        return None


def board_models(serve: Serve) -> dict[str, str]:
    answer = health(serve, "/health")
    return {name: m["state"] for name, m in answer[1]["models"].items()} if answer else {}


def ready_with(serve: Serve, models: list[str]) -> bool:
    """Readiness says 200 and the board holds exactly these models, each ready."""
    answer = health(serve, "/health/ready")
    return (answer is not None and answer[0] == 200
            and {n: m["state"] for n, m in answer[1]["models"].items()} == {m: "ready" for m in models})


def model_control(serve: Serve, model: str, action: str) -> None:
    """POST /v2/repository/models/MODEL/{load,unload}: Triton answers once it is done."""
    url = f"http://127.0.0.1:{serve.http}/v2/repository/models/{model}/{action}"
    request = urllib.request.Request(url, data=b"{}", method="POST", headers={ADMIN_HEADER: ADMIN_KEY})
    with urllib.request.urlopen(request, timeout=HANG_GUARD_S) as r:
        assert r.status == 200


def change_config(repo: Path, model: str, value: int) -> None:
    """A parameter the model reads: Triton sees a changed configuration and reloads."""
    config = repo / model / "config.pbtxt"
    config.write_text(config.read_text() + RELOADED % value)


def replaced(serve: Serve, model: str, old: list[int]) -> bool:
    """The model's stubs are all new ones (a reload's) and none of the old lives."""
    now = stubs(serve, model)
    return bool(now) and not set(now) & set(old)


def assert_no_fault(serve: Serve, streamer: Streamer, answers: list[tuple[int, dict]]) -> None:
    assert serve.restarts() == {}, serve.restarts()
    assert not serve.faults() and "recovered:" not in serve.output, serve.output
    assert streamer.results and all(kind == "finished" for kind, _ in streamer.results), streamer.results
    for status, body in answers:  # not ready only while a served model lacks a process
        if status != 200:
            states = [m["state"] for m in body["models"].values()]
            assert "loading" in states and "recovering" not in states, body


def finish_without_fault(serve: Serve, streamer: Streamer, readiness: Readiness) -> None:
    """The other model still streams; stop both watchers: no fault, and ready at the end."""
    streamer.wait_streaming()
    streamer.stop()
    answers = readiness.stop()
    assert_no_fault(serve, streamer, answers)
    assert answers[-1][0] == 200


def test_unload_load_and_reload_while_another_model_streams(two_models):
    serve = Serve(two_models, "--model-control", "explicit", "--restrict-model-control", f"{ADMIN_HEADER}={ADMIN_KEY}")
    try:
        serve.wait_ready()
        assert wait_until(lambda: ready_with(serve, ["slow", "tiny"]), HANG_GUARD_S), board_models(serve)
        reference = greedy(serve, "tiny")
        streamer = Streamer(serve, "slow")
        readiness = Readiness(serve)
        triton = TritonModels(f"127.0.0.1:{serve.http}", {ADMIN_HEADER: ADMIN_KEY})

        streamer.wait_streaming()
        (first,) = stubs(serve, "tiny")
        model_control(serve, "tiny", "unload")
        assert wait_until(lambda: (triton.index() or {}).get("tiny") == UNAVAILABLE, HANG_GUARD_S)
        # the unloaded model leaves the board; readiness answers for the one still served
        assert wait_until(lambda: ready_with(serve, ["slow"]), HANG_GUARD_S), board_models(serve)
        assert wait_until(lambda: not stubs(serve, "tiny"), HANG_GUARD_S)

        streamer.wait_streaming()
        model_control(serve, "tiny", "load")
        assert wait_until(lambda: (triton.index() or {}).get("tiny") == READY, HANG_GUARD_S)
        assert wait_until(lambda: ready_with(serve, ["slow", "tiny"]), HANG_GUARD_S), board_models(serve)
        (loaded,) = stubs(serve, "tiny")
        assert loaded != first
        assert greedy(serve, "tiny") == reference

        streamer.wait_streaming()
        change_config(two_models, "tiny", 77)
        model_control(serve, "tiny", "load")  # loaded already: a reload, the old stub ends after
        assert wait_until(lambda: replaced(serve, "tiny", [loaded]), HANG_GUARD_S)
        assert wait_until(lambda: ready_with(serve, ["slow", "tiny"]), HANG_GUARD_S), board_models(serve)
        assert greedy(serve, "tiny") == reference

        finish_without_fault(serve, streamer, readiness)
    finally:
        serve.kill()


def test_poll_mode_reloads_a_changed_model_without_a_fault(two_models):
    serve = Serve(two_models, "--model-control", "poll")
    try:
        serve.wait_ready()
        assert wait_until(lambda: ready_with(serve, ["slow", "tiny"]), HANG_GUARD_S), board_models(serve)
        reference = greedy(serve, "tiny")
        streamer = Streamer(serve, "slow")
        readiness = Readiness(serve)
        streamer.wait_streaming()
        old = stubs(serve, "tiny")
        change_config(two_models, "tiny", 78)  # Triton's next poll of the repository reloads it
        assert wait_until(lambda: replaced(serve, "tiny", old), HANG_GUARD_S)
        assert wait_until(lambda: ready_with(serve, ["slow", "tiny"]), HANG_GUARD_S), board_models(serve)
        assert greedy(serve, "tiny") == reference
        finish_without_fault(serve, streamer, readiness)
    finally:
        serve.kill()


def test_a_step_that_hangs_with_the_gil_free_is_wedged_and_recovered(tmp_path, monkeypatch):
    """The test-only stall (STALL_FILE_ENV) holds the engine in a step, sleeping with the
    GIL free: the heartbeat keeps beating, so only the step watchdog can tell. The fault
    comes no sooner than --health-deadline, the server restarts, the model answers again."""
    repo = tmp_path / "repo"
    add_generation_model(repo, "tiny")
    stall = tmp_path / "stall"
    monkeypatch.setenv(STALL_FILE_ENV, str(stall))  # serve, tritonserver and the stub inherit it
    serve = Serve(repo, "--health-deadline", "2")
    try:
        serve.wait_ready()
        reference = greedy(serve, "tiny")
        stall.touch()
        outcome: list = []

        def request() -> None:
            try:
                outcome.append(generate_grpc(f"127.0.0.1:{serve.grpc}", "tiny", PROMPT, max_tokens=8,
                                             timeout_s=HANG_GUARD_S).text)
            except GenerateError as e:
                outcome.append(e)

        client = threading.Thread(target=request)
        client.start()
        assert wait_until(lambda: serve.faults() or serve.proc.poll() is not None, HANG_GUARD_S), serve.output
        stall.unlink()  # before the restarted model takes a request
        fault = serve.faults()[0]
        assert "model tiny: its engine (pid" in fault and "while 1 request(s) wait" in fault, fault
        stuck_s = float(fault.split("has been in one step for ")[1].split(" s")[0])
        assert stuck_s >= 2.0  # never sooner than the deadline
        client.join(HANG_GUARD_S)
        assert not client.is_alive() and isinstance(outcome[0], GenerateError), outcome
        assert wait_until(lambda: "recovered:" in serve.output or serve.proc.poll() is not None, HANG_GUARD_S), \
            serve.output
        assert serve.restarts("tiny") == {"wedged": 1.0}
        assert greedy(serve, "tiny") == reference
        assert wait_until(lambda: ready_with(serve, ["tiny"]), HANG_GUARD_S), board_models(serve)
    finally:
        stall.unlink(missing_ok=True)
        serve.kill()
