"""A CPU the server does not have to itself: a tritonserver whose affinity is cut to one core
serves with one compute thread (num_threads auto) and finishes every stream, also with
another process spinning on that core; the engine lowers its OpenMP team while a neighbour
takes a core. References are transformers' own generate() on the same weights; every wait
is for completion, never a deadline."""

from __future__ import annotations

import concurrent.futures as cf
import os
import subprocess
import sys
import threading

import pytest

from tests.helpers.models import hf_greedy_text, tiny
from tests.helpers.servers import HANG_GUARD_S, add_generation_model, wait_until
from tritonlm.client.generate import generate_grpc
from tritonlm.server import TritonServer, free_ports

pytestmark = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores to cut the affinity to one")

PROMPTS = ["The capital of France is", "Once upon a time there was", "Numbers: 1 2 3 4 5", "def main(): return",
           "Hi", "A long time ago", "The quick brown fox", "Café naïve"]
ONE_CORE = min(os.sched_getaffinity(0))


class Spinner:
    """Another process busy on one core for the block (its own session, as a neighbour's)."""

    def __init__(self, core: int):
        self.core = core

    def __enter__(self):
        self.proc = subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
        os.sched_setaffinity(self.proc.pid, {self.core})
        return self

    def __exit__(self, *exc):
        self.proc.kill()
        self.proc.wait()


@pytest.fixture(scope="module")
def one_core_server(tmp_path_factory, request):
    """tritonserver and its model's process on one core: a child takes the affinity of the
    thread that starts it, so this thread holds one core while it starts the server."""
    repo = tmp_path_factory.mktemp("onecore")
    add_generation_model(repo, "tiny")  # num_threads: auto, the default
    log = tmp_path_factory.mktemp("serverlog") / "tritonserver.log"
    server = TritonServer(repo, *free_ports(3), log_path=log)
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {ONE_CORE})
    try:
        server.start(timeout_s=HANG_GUARD_S)
    finally:
        os.sched_setaffinity(0, before)
    try:
        yield server
    finally:
        server.stop()
        if getattr(request.node, "_tritonlm_failed", False):
            print(f"\n----- tritonserver log ({log}) -----\n" + server.log_text()[-20000:])


def streams_equal_hf(server) -> None:
    """Eight concurrent streams, each the same tokens as transformers' greedy generate()."""
    tok = tiny()[1]
    with cf.ThreadPoolExecutor(len(PROMPTS)) as pool:
        results = list(pool.map(
            lambda p: generate_grpc(server.grpc_url, "tiny", p, max_tokens=24, stream=True,
                                    exclude_input_in_output=True, timeout_s=HANG_GUARD_S), PROMPTS))
    for prompt, result in zip(PROMPTS, results):
        assert result.text == tok.decode(hf_greedy_text(prompt, 24)), prompt


def test_auto_threads_follow_the_affinity_mask(one_core_server):
    host = os.cpu_count()
    assert wait_until(lambda: "compute threads: 1 (auto: affinity: 1 of the host's" in one_core_server.log_text(),
                      HANG_GUARD_S), one_core_server.log_text()[-3000:]
    assert f"1 of the host's {host} CPUs" in one_core_server.log_text()


def test_streams_finish_on_one_core(one_core_server):
    streams_equal_hf(one_core_server)


def test_streams_finish_with_a_neighbour_spinning_on_that_core(one_core_server):
    with Spinner(ONE_CORE):
        streams_equal_hf(one_core_server)


def test_the_engine_lowers_its_team_while_a_neighbour_takes_a_core(tmp_path):
    """An in-process engine on two cores (num_threads auto) with a process spinning on one of
    them: the governor drops the compute thread's team to one thread while requests run."""
    import torch

    from tritonlm.engine.loader import build_engine
    from tritonlm.engine.request import GenerationRequest, SamplingParams
    from tritonlm.engine.settings import EngineSettings

    two = sorted(os.sched_getaffinity(0))[:2]
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, set(two))  # the engine's threads start here: they keep these two cores
    try:
        model, tok = tiny()
        model.save_pretrained(tmp_path / "1" / "hf")
        tok.save_pretrained(tmp_path / "1" / "hf")
        engine = build_engine(EngineSettings.from_params({"task": "generate", "hf_dir": "1/hf"}, tmp_path))
    finally:
        os.sched_setaffinity(0, before)
    assert engine.threads is not None and engine.threads.most == 2
    applied: list[tuple[str, int]] = []

    def set_threads(n: int) -> None:
        applied.append((threading.current_thread().name, n))
        torch.set_num_threads(n)

    engine.threads.set_threads = set_threads
    engine.start()
    stop = threading.Event()

    def keep_busy() -> None:
        """Back-to-back requests, so the loop keeps stepping (and ticking) until told."""
        while not stop.is_set():
            done = threading.Event()
            engine.submit(GenerationRequest(list(range(5, 40)), SamplingParams(max_tokens=64, end_id=-1),
                                            lambda ev: ev.finished and done.set()))
            done.wait(HANG_GUARD_S)

    load = threading.Thread(target=keep_busy)
    try:
        with Spinner(two[1]):
            load.start()
            assert wait_until(lambda: engine.threads.current == 1, HANG_GUARD_S)
        assert applied[0] == (engine.compute.thread.name, 1)  # on the thread that runs the steps: the team is its
    finally:
        stop.set()
        load.join()
        engine.shutdown()

