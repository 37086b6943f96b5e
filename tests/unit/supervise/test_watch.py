"""Faults the supervisor finds in a server's model processes: dead, stopped, silent, failed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.servers import HANG_GUARD_S, wait_until
from tritonlm.glue.heartbeat import Heartbeat
from tests.helpers.clock import FakeClock
from tritonlm.supervise.procs import STOPPED, process_state
from tritonlm.supervise.watch import WORKER_MODULE, ModelWatch


def start_stub(tmp_path: Path, model: str, worker: bool = False) -> subprocess.Popen:
    """A stand-in stub of `model` (a child of this process, as stubs are of tritonserver),
    with a stand-in model-parallel worker of its own when asked."""
    model_py = tmp_path / model / "1" / "model.py"
    model_py.parent.mkdir(parents=True, exist_ok=True)
    body = "import time\n"
    if worker:
        # (its sys.executable is the stub's name: the interpreter is named here)
        body += (f"import subprocess\nsubprocess.Popen([{sys.executable!r}, '-c', 'import time; time.sleep(600)', "
                 f"'{WORKER_MODULE}'])\n")
    model_py.write_text(body + "time.sleep(600)\n")
    return subprocess.Popen(["/b/triton_python_backend_stub", str(model_py), "s", "1", "1", "1", "/b", "1",
                             f"{model}_0_0", "/b/t"], executable=sys.executable)


@pytest.fixture
def stubs():
    started: list[subprocess.Popen] = []
    yield started
    for p in started:
        for pid in _tree(p.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        p.kill()
        p.wait()


def _tree(pid: int) -> list[int]:
    from tritonlm.supervise.procs import descendants

    return descendants(pid)


def watch_for(tmp_path: Path, served: set[str], clock=None, wall=None, deadline_s: float = 4.0) -> ModelWatch:
    beats = tmp_path / "beats"
    beats.mkdir(exist_ok=True)
    return ModelWatch(os.getpid(), beats, lambda m: m in served, deadline_s=deadline_s,
                      clock=clock or FakeClock(), wall_clock=wall or FakeClock())


def test_a_killed_stub_of_a_served_model_died(tmp_path, stubs):
    stubs.append(start_stub(tmp_path, "m"))
    watch = watch_for(tmp_path, {"m"})
    assert wait_until(lambda: watch.check() is None and watch.models() == ["m"], HANG_GUARD_S)
    stubs[0].kill()  # a zombie until reaped: how Triton leaves a decoupled model's stub
    assert wait_until(lambda: watch.check() is not None, HANG_GUARD_S)
    fault = watch.check()
    assert (fault.model, fault.kind) == ("m", "died")
    assert f"pid {stubs[0].pid}" in fault.cause


def test_a_stub_gone_with_its_model_unloaded_is_no_fault(tmp_path, stubs):
    stubs.append(start_stub(tmp_path, "m"))
    watch = watch_for(tmp_path, set())  # the model is no longer served: an unload
    assert wait_until(lambda: watch.models() == ["m"] or watch.check() is not None, HANG_GUARD_S)
    stubs[0].kill()
    stubs[0].wait()
    assert watch.check() is None
    assert watch.models() == []


def test_a_dead_worker_is_its_models_death(tmp_path, stubs):
    stubs.append(start_stub(tmp_path, "m", worker=True))

    def worker_seen() -> bool:
        watch.watched.clear()  # rescan until the worker is there
        watch.check()
        return any(w.workers for w in watch.watched.values())

    watch = watch_for(tmp_path, {"m"})
    assert wait_until(worker_seen, HANG_GUARD_S)
    (worker,) = next(iter(watch.watched.values())).workers
    os.kill(worker, signal.SIGKILL)
    assert wait_until(lambda: watch.check() is not None, HANG_GUARD_S)
    fault = watch.check()
    assert (fault.model, fault.kind) == ("m", "worker_died") and f"worker process (pid {worker})" in fault.cause


def test_stopped_for_the_deadline_is_wedged(tmp_path, stubs):
    stubs.append(start_stub(tmp_path, "m"))
    clock = FakeClock()
    watch = watch_for(tmp_path, {"m"}, clock=clock)
    assert wait_until(lambda: watch.check() is None and watch.models() == ["m"], HANG_GUARD_S)
    os.kill(stubs[0].pid, signal.SIGSTOP)
    assert wait_until(lambda: process_state(stubs[0].pid) == STOPPED, HANG_GUARD_S)
    assert watch.check() is None  # stopped, not yet for the deadline
    clock.now += 3.9
    assert watch.check() is None
    clock.now += 0.2
    fault = watch.check()
    assert (fault.kind, fault.model) == ("wedged", "m") and "stopped for 4.1 s" in fault.cause
    os.kill(stubs[0].pid, signal.SIGCONT)


def test_heartbeat_silence_and_named_faults(tmp_path, stubs):
    stubs.append(start_stub(tmp_path, "m"))
    wall = FakeClock(5000.0)
    watch = watch_for(tmp_path, {"m"}, wall=wall)
    assert wait_until(lambda: watch.check() is None and watch.models() == ["m"], HANG_GUARD_S)
    pid = stubs[0].pid
    fault: list[str | None] = [None]
    beat = Heartbeat("m", "m_0_0", lambda: fault[0], directory=tmp_path / "beats")
    beat.path = beat.path.with_name(f"{pid}.json")  # beating for the stand-in stub
    beat.beat()
    body = beat.path.read_text()
    beat.path.write_text(body.replace(body.split('"time": ')[1].split(",")[0], "5000.0"))
    assert watch.check() is None
    wall.now += 4.5  # no beat since: silent past the deadline
    found = watch.check()
    assert found.kind == "wedged" and "has not answered for 4.5 s" in found.cause
    fault[0] = "the engine thread stopped"
    beat.beat()
    found = watch.check()
    assert (found.kind, found.cause) == ("failed", "the engine thread stopped")
