"""Self-healing under `tritonlm serve`, against the real tritonserver: a model's process
killed (SIGKILL, SIGSEGV) or stopped (SIGSTOP) mid-stream, a tensor-parallel worker killed,
and a model that fails its load after a kill.

Each checks what an operator and a client see: every in-flight request ends with an error
(none waits out its own timeout, which is a hang guard here), the probes' readiness never
says ready while the model's process is dead and liveness stays up during a recovery, the
model comes back answering exactly what it answered before (greedy), the metrics count the
restart, and no process or memory is left behind; or, when the model cannot come back,
serve exits non-zero for the orchestrator."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import openai
import pytest

from tests.helpers.servers import (
    HANG_GUARD_S, Serve, add_long_llama, add_slow_model, http_status, wait_until,
)
from tritonlm.client.generate import GenerateError, generate_grpc
from tritonlm.perf.serverstats import wait_idle
from tritonlm.supervise.procs import command_line, descendants, is_dead, parse_stub, process_state
from tritonlm.supervise.supervisor import EXIT_GAVE_UP
from tritonlm.supervise.watch import WORKER_MODULE

STREAM_TOKENS = 900  # per stream: in flight when the fault comes, however fast the host
PROMPT = "The lighthouse keeper wrote"


@pytest.fixture(scope="module")
def slow_repo(tmp_path_factory) -> Path:
    repo = tmp_path_factory.mktemp("healrepo")
    add_slow_model(repo, max_num_seqs=4)
    return repo


def stubs(serve: Serve, model: str) -> list[int]:
    """The live Python backend stubs of `model` under this serve."""
    out = []
    for pid in descendants(serve.proc.pid):
        stub = parse_stub(pid, command_line(pid))
        if stub is not None and stub.model == model and not is_dead(process_state(pid)):
            out.append(pid)
    return out


def workers(serve: Serve) -> list[int]:
    return [p for p in descendants(serve.proc.pid) if WORKER_MODULE in command_line(p)]


def greedy(serve: Serve, model: str, tokens: int = 24) -> str:
    return generate_grpc(f"127.0.0.1:{serve.grpc}", model, PROMPT, max_tokens=tokens, exclude_input_in_output=True).text


def restarts(serve: Serve, model: str) -> dict[str, float]:
    return serve.restarts(model)


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


class Probes:
    """Polls the probes' readiness and liveness on a thread, as a kubelet would (but often).
    Every "ready" answer is checked against the process table around it: one given while no
    live process served the model, neither just before the question nor just after the
    answer (a restart completing in between may rightly be ready), is a lie."""

    def __init__(self, serve: Serve, model: str):
        self.serve, self.model = serve, model
        self.ready: list = []
        self.live: list = []
        self.lies: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            alive_before = self._alive()
            status = self.serve.probe("/health/ready")
            self.ready.append(status)
            if status == 200 and not alive_before and not self._alive():
                tree = {p: (command_line(p)[:2], process_state(p)) for p in descendants(self.serve.proc.pid)}
                self.lies.append(f"ready while no live process served {self.model}: {tree}")
            self.live.append(self.serve.probe("/health/live"))
            self._stop.wait(0.05)

    def _alive(self) -> list[int]:
        return stubs(self.serve, self.model)  # a killed one is a zombie or gone: not among them

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(HANG_GUARD_S)


def start_streams(serve: Serve, model: str, n: int, openai_client=None) -> tuple[list[threading.Thread], dict, threading.Semaphore]:
    """n gRPC streams (and one OpenAI stream when a client is given), each long; the
    semaphore is released once per stream when its first text arrives."""
    results: dict = {}
    started = threading.Semaphore(0)

    def grpc_stream(i: int) -> None:
        first = [True]

        def on_piece(_):
            if first[0]:
                first[0] = False
                started.release()

        try:
            r = generate_grpc(f"127.0.0.1:{serve.grpc}", model, f"Stream {i}: {PROMPT}", on_piece=on_piece, stream=True,
                              timeout_s=HANG_GUARD_S, max_tokens=STREAM_TOKENS, min_tokens=STREAM_TOKENS)
            results[i] = ("finished", (r.finish_reason, r.num_output_tokens))
        except GenerateError as e:
            results[i] = ("error", str(e))

    def openai_stream() -> None:
        try:
            stream = openai_client.completions.create(model=model, prompt=PROMPT, max_tokens=STREAM_TOKENS,
                                                      extra_body={"min_tokens": STREAM_TOKENS}, stream=True,
                                                      stream_options={"include_usage": True})
            finish, tokens = None, None
            for i, chunk in enumerate(stream):
                if i == 1:  # the role-less first chunk is text already; the second proves generation runs
                    started.release()
                if chunk.choices:
                    finish = chunk.choices[0].finish_reason or finish
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
            results["openai"] = ("finished", (finish, tokens))
        except openai.APIError as e:
            results["openai"] = ("error", str(e))

    threads = [threading.Thread(target=grpc_stream, args=(i,)) for i in range(n)]
    if openai_client is not None:
        threads.append(threading.Thread(target=openai_stream))
    for t in threads:
        t.start()
    return threads, results, started


def freeze_then_signal(pid: int, sig: int, results: dict) -> set:
    """Stop pid, note which streams had already ended, then deliver sig (SIGKILL acts on a
    stopped process; any other signal is delivered when SIGCONT resumes it, before it runs
    anything). The streams not noted were in flight at the fault, however fast the host."""
    os.kill(pid, signal.SIGSTOP)
    assert wait_until(lambda: process_state(pid) in ("stopped", "zombie", "gone"), HANG_GUARD_S)
    ended = set(results)
    os.kill(pid, sig)
    os.kill(pid, signal.SIGCONT)
    return ended


def complete(outcome: tuple) -> bool:
    """A stream that ended with all its tokens: a stopped process sends nothing, so its
    last response left before the fault even where its client thread noted it after."""
    kind, detail = outcome
    return kind == "finished" and detail == ("length", STREAM_TOKENS)


def assert_ended_with_errors(results: dict, ended_before: set) -> set:
    """Every stream in flight at the fault ended with an error; returns those streams.
    The last stream to start was some 900 tokens from its end at the fault, so one is."""
    in_flight = {k: v for k, v in results.items() if k not in ended_before and not complete(v)}
    assert in_flight, f"no stream was in flight at the fault: {results}"
    assert all(kind == "error" for kind, _ in in_flight.values()), results
    return set(in_flight)


def wait_streaming(started: threading.Semaphore, count: int) -> None:
    for _ in range(count):
        assert started.acquire(timeout=HANG_GUARD_S), "a stream never started"


def join_all(threads: list[threading.Thread]) -> None:
    for t in threads:
        t.join(HANG_GUARD_S)
        assert not t.is_alive(), "a client still waits: its request never ended"


def test_killed_model_process_ends_its_streams_and_comes_back(slow_repo):
    """Five kills mid-stream (SIGKILL, SIGSEGV, then SIGKILL): every stream ends with an
    error, the model returns with the same greedy text, restarts are counted, and neither
    processes nor memory pile up."""
    serve = Serve(slow_repo, "--max-restarts", "10", openai=True)
    try:
        serve.wait_ready()
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{serve.openai}/v1", api_key="none", max_retries=0,
                               timeout=HANG_GUARD_S)
        reference = greedy(serve, "slow")
        probes = Probes(serve, "slow")
        rss_first = None
        kills = [signal.SIGKILL, signal.SIGSEGV, signal.SIGKILL, signal.SIGKILL, signal.SIGKILL]
        for cycle, sig in enumerate(kills, start=1):
            threads, results, started = start_streams(serve, "slow", 3, client)
            wait_streaming(started, 4)
            (victim,) = stubs(serve, "slow")
            ended = freeze_then_signal(victim, sig, results)
            join_all(threads)
            in_flight = assert_ended_with_errors(results, ended)
            kind, message = results["openai"]
            if "openai" in in_flight:  # the frontend names the model, the process and what happened
                assert f"its process (pid {victim}" in message and "died" in message, results
            assert wait_until(lambda: serve.output.count("recovered:") == cycle or serve.proc.poll() is not None,
                              HANG_GUARD_S), serve.output
            assert serve.probe("/health/ready") == 200
            assert greedy(serve, "slow") == reference
            # the new engine holds nothing once idle: no KV cache left to anyone
            assert wait_idle(serve.metrics_url, "slow", timeout_s=HANG_GUARD_S)[0]["kv_cache_used_bytes"] == 0
            assert restarts(serve, "slow") == {"died": float(cycle)}
            (new_stub,) = stubs(serve, "slow")  # one stub: the old one went with the old server
            assert new_stub != victim and process_state(victim) == "gone"
            if cycle == 1:
                rss_first = rss_kib(serve.proc.pid)
        probes.stop()
        assert not probes.lies, probes.lies
        assert 503 in probes.ready  # readiness went off during the recoveries
        assert set(probes.live) == {200}, probes.live  # a recovery never fails liveness
        # the supervisor and the OpenAI frontend keep no memory per restart (a bound, not a timing)
        assert rss_kib(serve.proc.pid) <= rss_first * 1.2 + 16 * 1024, (rss_first, rss_kib(serve.proc.pid))
        assert f"FAULT model slow: its process (pid {victim}" in serve.output
    finally:
        serve.kill()


def test_stopped_model_process_is_wedged_and_replaced(slow_repo):
    """SIGSTOP for longer than --health-deadline: the stream ends with an error, the model
    restarts (cause wedged) and answers as before."""
    serve = Serve(slow_repo, "--health-deadline", "2")
    try:
        serve.wait_ready()
        reference = greedy(serve, "slow")
        threads, results, started = start_streams(serve, "slow", 2)
        wait_streaming(started, 2)
        (victim,) = stubs(serve, "slow")
        os.kill(victim, signal.SIGSTOP)
        assert wait_until(lambda: process_state(victim) == "stopped", HANG_GUARD_S)
        ended = set(results)
        join_all(threads)
        assert_ended_with_errors(results, ended)
        assert wait_until(lambda: "recovered:" in serve.output or serve.proc.poll() is not None, HANG_GUARD_S), serve.output
        assert f"its process (pid {victim}) has been stopped for" in serve.output
        assert restarts(serve, "slow") == {"wedged": 1.0}
        assert greedy(serve, "slow") == reference
        assert process_state(victim) == "gone"  # SIGKILL reaches a stopped process too
    finally:
        serve.kill()


def test_killed_tensor_parallel_worker_brings_the_model_back(tmp_path):
    repo = tmp_path / "tp"
    add_long_llama(repo, "tp", context=4096, seed=3, tensor_parallel_size=2)
    serve = Serve(repo)
    try:
        serve.wait_ready()
        reference = greedy(serve, "tp")
        threads, results, started = start_streams(serve, "tp", 1)
        wait_streaming(started, 1)
        (victim,) = workers(serve)
        ended = freeze_then_signal(victim, signal.SIGKILL, results)
        join_all(threads)
        assert_ended_with_errors(results, ended)
        assert wait_until(lambda: "recovered:" in serve.output or serve.proc.poll() is not None, HANG_GUARD_S), serve.output
        assert sum(restarts(serve, "tp").values()) == 1.0
        assert greedy(serve, "tp") == reference
        assert len(workers(serve)) == 1 and victim not in workers(serve)
    finally:
        serve.kill()


def test_model_that_fails_its_reload_is_retried_until_it_loads(tmp_path):
    """After the kill the model's files are broken: restarts fail (backing off), clients get
    503 with Retry-After, readiness is off and liveness on; once fixed, it comes back."""
    repo = tmp_path / "repo"
    add_slow_model(repo)
    serve = Serve(repo, "--max-restarts", "20", openai=True)
    config = repo / "slow" / "1" / "hf" / "config.json"
    try:
        serve.wait_ready()
        reference = greedy(serve, "slow")
        config.rename(config.with_suffix(".broken"))
        (victim,) = stubs(serve, "slow")
        os.kill(victim, signal.SIGKILL)
        assert wait_until(lambda: "the restart failed" in serve.output or serve.proc.poll() is not None,
                          HANG_GUARD_S), serve.output
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{serve.openai}/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.APIStatusError) as refused:
            client.completions.create(model="slow", prompt=PROMPT, max_tokens=4)
        assert refused.value.status_code == 503
        assert refused.value.response.headers.get("retry-after") == "1"
        assert "model slow is restarting" in refused.value.message
        assert serve.probe("/health/ready") == 503 and serve.probe("/health/live") == 200
        config.with_suffix(".broken").rename(config)
        assert wait_until(lambda: "recovered:" in serve.output or serve.proc.poll() is not None, HANG_GUARD_S), serve.output
        assert greedy(serve, "slow") == reference
        counted = restarts(serve, "slow")
        assert counted["died"] == 1.0 and counted["load_failed"] >= 1.0, counted
    finally:
        serve.kill()


def test_recovery_gives_up_and_exits_non_zero(tmp_path):
    """A model that cannot load again: after --max-restarts restarts serve exits 3, and its
    readiness never said ready after the kill."""
    repo = tmp_path / "repo"
    add_slow_model(repo)
    serve = Serve(repo, "--max-restarts", "1")
    try:
        serve.wait_ready()
        (repo / "slow" / "1" / "hf" / "config.json").unlink()
        (victim,) = stubs(serve, "slow")
        probes = Probes(serve, "slow")
        os.kill(victim, signal.SIGKILL)
        assert serve.proc.wait(HANG_GUARD_S) == EXIT_GAVE_UP, serve.output
        probes.stop()
        assert not probes.lies and 200 not in probes.ready[1:], probes.ready
        assert "gave up after 1 restarts" in serve.output
        assert not [p for p in descendants(serve.proc.pid)], "processes left behind"
        assert http_status(f"http://127.0.0.1:{serve.http}/v2/health/ready") == "refused"
    finally:
        serve.kill()
