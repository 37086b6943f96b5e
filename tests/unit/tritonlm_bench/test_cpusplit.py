"""perf/tritonlm_bench/cpusplit.py: the CPU split read from /proc that bench_peer prints."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from tritonlm.engine.threads import named_thread
from tritonlm_bench.cpusplit import COMPUTE_THREAD, RESPONSE_THREAD, CpuSplit

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and prctl are Linux's")


def burn(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_the_split_puts_compute_response_and_other_threads_where_they_belong():
    """A compute thread that also runs torch's OpenMP team, a response thread and an
    unnamed thread of this process, each doing a fixed amount of CPU work and alive when
    the split is read; this process is the model's (in-process), so nothing counts as
    server or clients. CPU seconds are compared, not rates: a busy machine stretches the
    wall time, not the work."""
    release = threading.Event()
    done = [threading.Event() for _ in range(3)]

    team = len(os.sched_getaffinity(0))  # set here: a thread's first torch call takes the last count any thread set

    def compute() -> None:
        torch.set_num_threads(team)
        a = torch.randn(256, 256)
        while time.thread_time() < 0.5:  # this thread's own CPU, its OpenMP workers' on top
            a = torch.tanh(a @ a * 1e-3)

    def then_wait(work, i: int):
        def run() -> None:
            work()
            done[i].set()
            release.wait(60)
        return run

    threads = [named_thread(then_wait(compute, 0), COMPUTE_THREAD),
               named_thread(then_wait(lambda: burn(0.2), 1), RESPONSE_THREAD),
               threading.Thread(target=then_wait(lambda: burn(0.2), 2))]
    split = CpuSplit(os.getpid(), clients_here=False).start()
    for t in threads:
        t.start()
    for d in done:
        assert d.wait(60)
    got = split.stop()
    release.set()
    for t in threads:
        t.join()
    cpu_s = {k: got[k] * got["wall_s"] for k in ("compute_cores", "response_cores", "model_other_cores", "machine_cores")}
    assert 1 <= got["compute_threads"] <= team
    assert cpu_s["compute_cores"] >= 0.45
    assert 0.18 <= cpu_s["response_cores"] < 0.4
    assert cpu_s["model_other_cores"] >= 0.18
    assert got["server_cores"] == 0 and got["client_cores"] == 0
    assert cpu_s["machine_cores"] >= 0.9 * (cpu_s["compute_cores"] + cpu_s["response_cores"] + cpu_s["model_other_cores"]) - 0.05
    assert got["ctxt_per_s"] > 0


def test_a_server_tree_without_compute_threads_is_all_server_and_this_process_is_the_clients():
    """llama-server's case: its whole tree counts as server; the caller's CPU as clients."""
    code = ("import sys, time\nprint('up', flush=True)\nsys.stdin.readline()\n"
            "end = time.thread_time() + 0.4\nwhile time.thread_time() < end: pass\n"
            "print('done', flush=True)\ntime.sleep(60)\n")
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "up"
        split = CpuSplit(child.pid).start()
        child.stdin.write("go\n")
        child.stdin.flush()
        burn(0.2)
        assert child.stdout.readline().strip() == "done"
        got = split.stop()
    finally:
        child.kill()
        child.wait()
    assert got["compute_cores"] == 0 and got["compute_threads"] == 0 and got["response_cores"] == 0
    assert got["server_cores"] * got["wall_s"] >= 0.35  # its 0.4 s, counted in 10 ms ticks
    assert got["client_cores"] * got["wall_s"] >= 0.18
