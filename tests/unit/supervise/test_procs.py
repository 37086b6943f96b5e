"""The process table as the supervisor reads it: states, zombies, stubs' command lines."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from tests.helpers.servers import HANG_GUARD_S, wait_until
from tritonlm.supervise.procs import (
    GONE, STOPPED, ZOMBIE, children, descendants, find_stubs, is_dead, parse_stub, process_state,
)


def test_states_of_a_child_through_stop_continue_and_death():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        assert not is_dead(process_state(child.pid))
        os.kill(child.pid, signal.SIGSTOP)
        assert wait_until(lambda: process_state(child.pid) == STOPPED, HANG_GUARD_S)
        os.kill(child.pid, signal.SIGCONT)
        assert wait_until(lambda: process_state(child.pid) != STOPPED, HANG_GUARD_S)
        os.kill(child.pid, signal.SIGKILL)
        # not reaped yet: a zombie, which is dead for the supervisor (Triton leaves its stubs so)
        assert wait_until(lambda: process_state(child.pid) == ZOMBIE, HANG_GUARD_S)
        assert is_dead(ZOMBIE)
    finally:
        child.kill()
        child.wait()
    assert process_state(child.pid) == GONE


def test_children_and_descendants_follow_the_tree():
    script = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); time.sleep(600)"
    parent = subprocess.Popen([sys.executable, "-c", script])
    try:
        assert wait_until(lambda: len(descendants(parent.pid)) == 1, HANG_GUARD_S)
        (grandchild,) = descendants(parent.pid)
        assert children(parent.pid) == [grandchild]
        assert parent.pid in children(os.getpid())
        assert grandchild in descendants(os.getpid())
    finally:
        for pid in descendants(parent.pid):
            os.kill(pid, signal.SIGKILL)
        parent.kill()
        parent.wait()


def test_stub_command_line_names_model_and_instance():
    argv = ["/b/python/triton_python_backend_stub", "/repo/my_model/1/model.py", "triton_shm_region_x", "1048576",
            "1048576", "2543", "/b/python", "336", "my_model_0_1", "/b/tritonlm", ""]
    stub = parse_stub(7, argv)
    assert (stub.pid, stub.model, stub.instance) == (7, "my_model", "my_model_0_1")
    assert parse_stub(7, ["/usr/bin/python3", "-m", "x"]) is None
    assert parse_stub(7, []) is None


def test_find_stubs_sees_only_stub_children(tmp_path):
    # a stand-in stub: Python running <repo>/m1/3/model.py (a sleep) under the stub's name
    model_py = tmp_path / "m1" / "3" / "model.py"
    model_py.parent.mkdir(parents=True)
    model_py.write_text("import time\ntime.sleep(600)\n")
    stub = subprocess.Popen(["/b/python/triton_python_backend_stub", str(model_py), "shm", "1", "1", "1", "/b", "1",
                             "m1_0_0", "/b/t"], executable=sys.executable)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        assert wait_until(lambda: [(s.model, s.instance) for s in find_stubs(os.getpid())] == [("m1", "m1_0_0")],
                          HANG_GUARD_S)
    finally:
        for p in (stub, other):
            p.kill()
            p.wait()
