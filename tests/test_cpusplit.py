"""Thread names the OS sees, and the CPU split read from /proc that bench_peer prints."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from tritonlm.engine.threads import named_thread
from tritonlm.perf.cpusplit import COMPUTE_THREAD, RESPONSE_THREAD, CpuSplit

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and prctl are Linux's")


def os_name(tid: int) -> str:
    return Path(f"/proc/self/task/{tid}/comm").read_text().strip()


def burn(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_a_named_thread_is_named_for_the_os_and_its_own_threads_inherit_the_name():
    seen: dict[str, str] = {}

    def child() -> None:
        seen["child"] = os_name(threading.get_native_id())

    def parent() -> None:
        seen["parent"] = os_name(threading.get_native_id())
        t = threading.Thread(target=child)  # a plain thread, as OpenMP's workers are
        t.start()
        t.join()

    t = named_thread(parent, "tritonlm-cancel-poll")
    t.start()
    t.join()
    assert t.name == "tritonlm-cancel-poll"
    assert seen == {"parent": "tritonlm-cancel", "child": "tritonlm-cancel"}  # the OS keeps 15 bytes


def test_the_split_puts_compute_response_and_other_threads_where_they_belong():
    """A compute thread that also runs torch's OpenMP team, a response thread and an
    unnamed thread of this process, each busy for a known CPU time and alive when the
    split is read; this process is the model's (in-process), so nothing counts as server
    or clients."""
    release = threading.Event()
    done = [threading.Event() for _ in range(3)]

    def compute() -> None:
        a = torch.randn(256, 256)
        end = time.monotonic() + 0.6
        while time.monotonic() < end:
            a = torch.tanh(a @ a * 1e-3)  # parallel ops: the OpenMP team works too

    def then_wait(work, i: int):
        def run() -> None:
            work()
            done[i].set()
            release.wait(30)
        return run

    threads = [named_thread(then_wait(compute, 0), COMPUTE_THREAD),
               named_thread(then_wait(lambda: burn(0.2), 1), RESPONSE_THREAD),
               threading.Thread(target=then_wait(lambda: burn(0.2), 2))]
    split = CpuSplit(os.getpid(), clients_here=False).start()
    for t in threads:
        t.start()
    for d in done:
        assert d.wait(30)
    got = split.stop()
    release.set()
    for t in threads:
        t.join()
    assert 1 <= got["compute_threads"] <= torch.get_num_threads()
    assert got["compute_cores"] > 0.3
    assert got["response_cores"] > 0.1
    assert got["model_other_cores"] > 0.1
    assert got["server_cores"] == 0 and got["client_cores"] == 0
    assert got["machine_cores"] >= 0.9 * (got["compute_cores"] + got["response_cores"] + got["model_other_cores"]) - 0.05
    assert got["ctxt_per_s"] > 0


def test_a_server_tree_without_compute_threads_is_all_server_and_this_process_is_the_clients():
    """llama-server's case: its whole tree counts as server; the caller's CPU as clients."""
    child = subprocess.Popen([sys.executable, "-c", "import time\nend=time.thread_time()+0.5\n"
                              "while time.thread_time()<end: pass\ntime.sleep(30)"])
    try:
        split = CpuSplit(child.pid).start()
        burn(0.2)
        time.sleep(0.6)
        got = split.stop()
    finally:
        child.kill()
        child.wait()
    assert got["compute_cores"] == 0 and got["compute_threads"] == 0 and got["response_cores"] == 0
    assert got["server_cores"] > 0.2
    assert got["client_cores"] > 0.15
