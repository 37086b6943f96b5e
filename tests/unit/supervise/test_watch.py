"""Faults the supervisor finds in a server's model processes: dead, stopped, silent, stuck,
failed; and the deaths that are not faults (an unload, a reload, a configuration stub)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.clock import FakeClock
from tests.helpers.servers import HANG_GUARD_S, wait_until
from tritonlm.glue.heartbeat import Heartbeat
from tritonlm.health_beat import beat_path, write_beat
from tritonlm.supervise.procs import STOPPED, STUB_BINARY, find_stubs, process_state, start_time
from tritonlm.supervise.served import READY, UNAVAILABLE, UNLOADING
from tritonlm.supervise.watch import FIRST_STEPS_S, STEP_MARGIN, WARM_STEPS, WORKER_MODULE, ModelWatch, step_limit


def start_stub(tmp_path: Path, model: str, worker: bool = False, instance: str | None = None,
               named: bool = False) -> subprocess.Popen:
    """A stand-in stub of `model` (a child of this process, as stubs are of tritonserver),
    with a stand-in model-parallel worker of its own when asked. named: run through a link
    called like the stub's binary, so that its program name (what a zombie keeps) is the
    stub's too."""
    model_py = tmp_path / model / "1" / "model.py"
    model_py.parent.mkdir(parents=True, exist_ok=True)
    body = "import time\n"
    if worker:
        # (its sys.executable is the stub's name: the interpreter is named here)
        body += (f"import subprocess\nsubprocess.Popen([{sys.executable!r}, '-c', 'import time; time.sleep(600)', "
                 f"'{WORKER_MODULE}'])\n")
    model_py.write_text(body + "time.sleep(600)\n")
    argv = ["/b/triton_python_backend_stub", str(model_py), "s", "1", "1", "1", "/b", "1",
            instance if instance is not None else f"{model}_0_0", "/b/t"]
    if named:
        link = tmp_path / "bin" / STUB_BINARY
        link.parent.mkdir(exist_ok=True)
        if not link.exists():
            link.symlink_to(sys.executable)
        argv[0] = str(link)
        return subprocess.Popen(argv)
    return subprocess.Popen(argv, executable=sys.executable)


class StandInTriton:
    """What the watch asks tritonserver: each model's state, and the stubs it asks for."""

    def __init__(self, states: dict[str, str] | None, asked: dict[str, int] | None = None):
        self.states, self.asked = states, asked or {}

    def index(self) -> dict[str, str] | None:
        return dict(self.states) if self.states is not None else None

    def stubs_asked(self, model: str) -> int | None:
        return self.asked.get(model, 1)


def clock_ticks() -> float:
    """Now, in the clock ticks of a process's start time."""
    return float(Path("/proc/uptime").read_text().split()[0]) * os.sysconf("SC_CLK_TCK")


def start_later(tmp_path: Path, after: subprocess.Popen, model: str, **kwargs) -> subprocess.Popen:
    """A stub that starts after `after` did (as a reload's stubs start after the old ones)."""
    began = start_time(after.pid)
    assert wait_until(lambda: clock_ticks() > began + 1, HANG_GUARD_S)
    return start_stub(tmp_path, model, **kwargs)


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


def watch_for(tmp_path: Path, served: set[str] | StandInTriton, clock=None, wall=None,
              deadline_s: float = 4.0) -> ModelWatch:
    """A watch of this process's stand-in stubs; served: the models Triton serves (READY)."""
    beats = tmp_path / "beats"
    beats.mkdir(exist_ok=True)
    triton = served if isinstance(served, StandInTriton) else StandInTriton({m: READY for m in served})
    return ModelWatch(os.getpid(), beats, triton, deadline_s=deadline_s,
                      clock=clock or FakeClock(), wall_clock=wall or FakeClock())


def kill_and_reap(p: subprocess.Popen) -> None:
    p.kill()
    p.wait()


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
    triton = StandInTriton({"m": READY})
    watch = watch_for(tmp_path, triton)
    assert wait_until(lambda: watch.check() is None and watch.models() == ["m"], HANG_GUARD_S)
    assert list(watch.views()) == ["m"]
    triton.states = {"m": UNLOADING}  # the model-control API unloads it: Triton ends its stub
    stubs[0].kill()  # a zombie for a moment, then reaped
    assert wait_until(lambda: process_state(stubs[0].pid) in ("zombie", "gone"), HANG_GUARD_S)
    assert watch.check() is None
    assert watch.models() == [] and watch.views() == {}
    triton.states = {"m": UNAVAILABLE}
    stubs[0].wait()
    assert watch.check() is None


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


def test_a_reload_ends_the_old_stub_after_its_replacement_starts(tmp_path, stubs):
    """A reload (model control, or poll mode) starts the new instance's stub, then ends the
    old one while Triton still serves the model: no fault, and the new one is watched."""
    stubs.append(start_stub(tmp_path, "m"))
    watch = watch_for(tmp_path, {"m"})
    assert wait_until(lambda: watch.check() is None and watch.models() == ["m"], HANG_GUARD_S)
    stubs.append(start_later(tmp_path, stubs[0], "m"))
    assert wait_until(lambda: watch.check() is None and len(watch.watched) == 2, HANG_GUARD_S)
    kill_and_reap(stubs[0])
    assert watch.check() is None
    assert list(watch.watched) == [stubs[1].pid]
    assert watch.views()["m"].stubs == (stubs[1].pid,)


def test_a_reload_that_renames_its_instances_is_no_fault(tmp_path, stubs):
    """New instance names (a changed instance_group): the old stub has no namesake, but the
    new set is as large as the configuration asks."""
    stubs.append(start_stub(tmp_path, "m", instance="m_0_1"))
    watch = watch_for(tmp_path, StandInTriton({"m": READY}, {"m": 1}))
    assert wait_until(lambda: watch.check() is None and watch.models() == ["m"], HANG_GUARD_S)
    stubs.append(start_later(tmp_path, stubs[0], "m", instance="m_1_0"))
    assert wait_until(lambda: watch.check() is None and len(watch.watched) == 2, HANG_GUARD_S)
    kill_and_reap(stubs[0])
    assert watch.check() is None


def test_a_killed_instance_beside_a_live_sibling_is_a_fault(tmp_path, stubs):
    """Two instances of a model, one killed: the other is no replacement, whether it started
    before the victim (a) or after it (b)."""
    for model in ("a", "b"):
        stubs.append(start_stub(tmp_path, model, instance=f"{model}_0_0"))
        stubs.append(start_later(tmp_path, stubs[-1], model, instance=f"{model}_0_1"))
    triton = StandInTriton({"a": READY, "b": READY}, {"a": 2, "b": 2})
    watch = watch_for(tmp_path, triton)
    assert wait_until(lambda: watch.check() is None and len(watch.watched) == 4, HANG_GUARD_S)
    younger_a = stubs[1]
    younger_a.kill()
    assert wait_until(lambda: watch.check() is not None, HANG_GUARD_S)
    fault = watch.check()
    assert (fault.model, fault.kind) == ("a", "died") and f"pid {younger_a.pid}" in fault.cause
    younger_a.wait()  # reaped: model a now lacks a stub (not ready), and has no dead one to judge
    watch = watch_for(tmp_path, triton)
    assert wait_until(lambda: watch.check() is None and len(watch.watched) == 3, HANG_GUARD_S)
    assert watch.views()["a"].asked == 2 and len(watch.views()["a"].stubs) == 1
    older_b = stubs[2]
    older_b.kill()
    assert wait_until(lambda: watch.check() is not None, HANG_GUARD_S)
    fault = watch.check()
    assert (fault.model, fault.kind) == ("b", "died") and f"pid {older_b.pid}" in fault.cause


def test_the_configuration_stub_ends_on_its_own(tmp_path, stubs):
    """While a model loads, the Python backend runs a stub named after the model only to read
    its configuration; it ends while the model is served (a reload): no fault."""
    stubs.append(start_stub(tmp_path, "m", instance="m"))
    watch = watch_for(tmp_path, {"m"})
    assert wait_until(lambda: watch.check() is None and watch.models() == ["m"], HANG_GUARD_S)
    assert watch.views()["m"].stubs == ()  # not an instance: readiness does not count it
    kill_and_reap(stubs[0])
    assert watch.check() is None


def test_a_death_is_judged_only_once_triton_can_say(tmp_path, stubs):
    """The index cannot be read (a busy server): no verdict until it can (or, failing that,
    for the deadline: then it is a fault)."""
    stubs.append(start_stub(tmp_path, "m"))
    triton = StandInTriton({"m": READY})
    clock = FakeClock()
    watch = watch_for(tmp_path, triton, clock=clock)
    assert wait_until(lambda: watch.check() is None and watch.models() == ["m"], HANG_GUARD_S)
    triton.states = None
    stubs[0].kill()
    assert wait_until(lambda: process_state(stubs[0].pid) in ("zombie", "gone"), HANG_GUARD_S)
    assert watch.check() is None
    clock.now += 3.9
    assert watch.check() is None
    triton.states = {"m": UNAVAILABLE}  # then Triton answers: it was an unload
    assert watch.check() is None and watch.models() == []
    stubs.append(start_stub(tmp_path, "m"))
    triton.states = {"m": READY}
    watch = watch_for(tmp_path, triton, clock=clock)
    assert wait_until(lambda: watch.check() is None and watch.models() == ["m"], HANG_GUARD_S)
    triton.states = None
    stubs[1].kill()
    assert wait_until(lambda: process_state(stubs[1].pid) in ("zombie", "gone"), HANG_GUARD_S)
    assert watch.check() is None
    clock.now += 4.0  # no answer for the deadline: the death counts
    fault = watch.check()
    assert (fault.model, fault.kind) == ("m", "died")


def test_an_index_never_readable_falls_back_to_the_model_processes(tmp_path, stubs, caplog):
    """Readiness must not stay off for good when the index cannot be read at all: after the
    deadline, the models whose stubs run count as served (logged once), until it can be read."""
    stubs.append(start_stub(tmp_path, "m"))
    triton = StandInTriton(None)
    clock = FakeClock()
    watch = watch_for(tmp_path, triton, clock=clock)
    assert wait_until(lambda: watch.check() is None and watch.models() == ["m"], HANG_GUARD_S)
    assert watch.views() == {}  # not yet: a server still starting may answer in a moment
    clock.now += 4.0
    with caplog.at_level("WARNING", logger="tritonlm.supervise.watch"):
        assert watch.check() is None
    assert [r for r in caplog.records if "repository index" in r.getMessage()]
    view = watch.views()["m"]
    assert view.stubs == (stubs[0].pid,) and view.asked == 1
    triton.states = {"m": UNAVAILABLE}  # readable again: the index rules
    assert watch.check() is None and watch.views() == {}


def test_a_stub_that_died_before_the_first_scan_is_caught(tmp_path, stubs):
    """Its zombie's command line is empty: the heartbeat file names it; without one, the
    served model that lacks a stub is charged; a lone zombie no model misses is no fault."""
    stubs.append(start_stub(tmp_path, "m", named=True))
    assert wait_until(lambda: any(s.pid == stubs[0].pid for s in find_stubs_now()), HANG_GUARD_S)
    (tmp_path / "beats").mkdir()
    write_beat(beat_path(tmp_path / "beats", stubs[0].pid),
               {"pid": stubs[0].pid, "model": "m", "instance": "m_0_0", "time": 0.0, "fault": None})
    stubs[0].kill()  # a zombie (not reaped) before any watch looked
    assert wait_until(lambda: process_state(stubs[0].pid) == "zombie", HANG_GUARD_S)
    fault = watch_for(tmp_path, {"m"}).check()
    assert (fault.model, fault.kind) == ("m", "died") and f"pid {stubs[0].pid}, instance m_0_0" in fault.cause
    beat_path(tmp_path / "beats", stubs[0].pid).unlink()
    fault = watch_for(tmp_path, {"m"}).check()
    assert (fault.model, fault.kind) == ("m", "died") and f"pid {stubs[0].pid}" in fault.cause
    assert watch_for(tmp_path, StandInTriton({"m": READY}, {"m": 0})).check() is None


def find_stubs_now():
    return find_stubs(os.getpid())


# the step watchdog's fields of an engine warmed up on fast steps (one token each)
WARM_FAST = {"step_tokens": 1, "sec_per_token": 0.01, "longest_step": 0.01, "steps_done": WARM_STEPS}


def test_a_step_stuck_while_requests_wait_is_wedged(tmp_path, stubs):
    """The heartbeat still beats (the hang frees the GIL) but the engine has been in one step
    for the deadline while requests wait; the same step with nothing owed is idleness."""
    stubs.append(start_stub(tmp_path, "m"))
    wall = FakeClock(5000.0)
    watch = watch_for(tmp_path, {"m"}, wall=wall)
    assert wait_until(lambda: watch.check() is None and watch.models() == ["m"], HANG_GUARD_S)
    path = beat_path(tmp_path / "beats", stubs[0].pid)

    def beat(step_at: float, waiting: int) -> None:
        write_beat(path, {"pid": stubs[0].pid, "model": "m", "instance": "m_0_0", "time": wall.now, "fault": None,
                          "step_at": step_at, "waiting": waiting, **WARM_FAST})

    beat(step_at=wall.now - 3.9, waiting=2)  # a long step, not yet the deadline's length
    assert watch.check() is None
    beat(step_at=wall.now - 60.0, waiting=0)  # idle for a minute: owes nothing
    assert watch.check() is None
    beat(step_at=wall.now - 4.2, waiting=2)
    fault = watch.check()
    assert fault.kind == "wedged" and "has been in one step for 4.2 s (limit 4.0 s) while 2 request(s) wait" in fault.cause


def test_a_model_whose_steps_are_long_by_nature_gets_longer(tmp_path, stubs):
    """A step of 3 s finished before: one of 10 s is within STEP_MARGIN of it; 12.5 s is not."""
    stubs.append(start_stub(tmp_path, "m"))
    wall = FakeClock(5000.0)
    watch = watch_for(tmp_path, {"m"}, wall=wall)
    assert wait_until(lambda: watch.check() is None and watch.models() == ["m"], HANG_GUARD_S)
    path = beat_path(tmp_path / "beats", stubs[0].pid)

    def beat(in_step: float) -> None:
        write_beat(path, {"pid": stubs[0].pid, "model": "m", "instance": "m_0_0", "time": wall.now, "fault": None,
                          "step_at": wall.now - in_step, "waiting": 1, **WARM_FAST, "longest_step": 3.0})

    beat(10.0)
    assert watch.check() is None
    beat(12.5)
    fault = watch.check()
    assert fault.kind == "wedged" and "(limit 12.0 s)" in fault.cause


def test_step_limit_follows_what_the_finished_steps_say_is_normal():
    assert step_limit(4.0, WARM_FAST) == 4.0  # fast steps: the deadline
    assert step_limit(4.0, {**WARM_FAST, "longest_step": 2.0}) == 2.0 * STEP_MARGIN
    # a first full prefill chunk after decode steps of 0.1 s a token: 512 tokens' worth
    assert step_limit(4.0, {**WARM_FAST, "sec_per_token": 0.1, "step_tokens": 512}) == 0.1 * 512 * STEP_MARGIN
    for done in range(WARM_STEPS):  # no yardstick yet (a first prefill, a first kernel compile)
        assert step_limit(4.0, {**WARM_FAST, "steps_done": done}) == FIRST_STEPS_S
    assert step_limit(4.0, {}) == FIRST_STEPS_S  # a beat from an engine that has not stepped


def test_a_worker_ended_by_its_models_unload_is_no_fault(tmp_path, stubs):
    """finalize removes the heartbeat file, then ends the workers: not a fault; a worker that
    dies while the file is there is."""
    stubs.append(start_stub(tmp_path, "m", worker=True))
    watch = watch_for(tmp_path, {"m"}, wall=FakeClock(5000.0))

    def worker_seen() -> bool:
        watch.watched.clear()
        watch.check()
        return any(w.workers for w in watch.watched.values())

    assert wait_until(worker_seen, HANG_GUARD_S)
    path = beat_path(tmp_path / "beats", stubs[0].pid)
    write_beat(path, {"pid": stubs[0].pid, "model": "m", "instance": "m_0_0", "time": 5000.0, "fault": None})
    assert watch.check() is None
    path.unlink()
    (worker,) = next(iter(watch.watched.values())).workers
    os.kill(worker, signal.SIGKILL)
    assert wait_until(lambda: process_state(worker) in ("zombie", "gone"), HANG_GUARD_S)
    assert watch.check() is None


def test_an_instance_removed_by_a_reload_is_no_fault(tmp_path, stubs):
    """A reload that lowers instance_group's count ends a stub and starts none: the live
    stubs are as many as the configuration now asks for."""
    stubs.append(start_stub(tmp_path, "m", instance="m_0_0"))
    stubs.append(start_later(tmp_path, stubs[-1], "m", instance="m_0_1"))
    triton = StandInTriton({"m": READY}, {"m": 2})
    watch = watch_for(tmp_path, triton)
    assert wait_until(lambda: watch.check() is None and len(watch.watched) == 2, HANG_GUARD_S)
    triton.asked = {"m": 1}
    stubs[1].kill()
    assert wait_until(lambda: process_state(stubs[1].pid) in ("zombie", "gone"), HANG_GUARD_S)
    assert watch.check() is None and [w.stub.instance for w in watch.watched.values()] == ["m_0_0"]


def test_a_stub_that_unloaded_cleanly_is_no_fault_while_triton_cannot_answer(tmp_path, stubs):
    """finalize removed its heartbeat file and its last beat named no fault: an unload,
    whatever the index says (a server too busy to answer in time)."""
    stubs.append(start_stub(tmp_path, "m"))
    triton = StandInTriton({"m": READY})
    clock = FakeClock()
    watch = watch_for(tmp_path, triton, clock=clock, wall=FakeClock(5000.0))
    path = beat_path(tmp_path / "beats", stubs[0].pid)
    write_beat(path, {"pid": stubs[0].pid, "model": "m", "instance": "m_0_0", "time": 5000.0, "fault": None})
    assert wait_until(lambda: watch.check() is None and watch.models() == ["m"], HANG_GUARD_S)
    triton.states = None
    path.unlink()
    stubs[0].kill()
    assert wait_until(lambda: process_state(stubs[0].pid) in ("zombie", "gone"), HANG_GUARD_S)
    clock.now += 10.0
    assert watch.check() is None and watch.models() == []
