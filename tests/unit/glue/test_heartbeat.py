"""The model process's heartbeat: a beat file while it runs, the fault in it, none after."""

from __future__ import annotations

import json
import os

from tests.helpers.servers import HANG_GUARD_S, wait_until
from tritonlm.glue.heartbeat import HEALTH_DIR_ENV, Heartbeat, beat_path, read_beat


def test_beats_carry_the_fault_and_stop_removes_the_file(tmp_path):
    fault = [None]
    hb = Heartbeat("m", "m_0_0", lambda: fault[0], directory=tmp_path, interval_s=0.01).start()
    try:
        path = beat_path(tmp_path, os.getpid())
        first = read_beat(path)
        assert (first["pid"], first["model"], first["instance"], first["fault"]) == (os.getpid(), "m", "m_0_0", None)
        assert wait_until(lambda: (read_beat(path) or {}).get("time", 0) > first["time"], HANG_GUARD_S)
        fault[0] = "a worker died"
        assert wait_until(lambda: (read_beat(path) or {}).get("fault") == "a worker died", HANG_GUARD_S)
    finally:
        hb.stop()
    assert not path.exists()


def test_a_failing_check_is_reported_not_raised(tmp_path):
    def broken():
        raise RuntimeError("boom")

    hb = Heartbeat("m", "", broken, directory=tmp_path)
    hb.beat()
    assert json.loads(hb.path.read_text())["fault"] == "the health check failed: RuntimeError: boom"


def test_without_a_health_folder_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.delenv(HEALTH_DIR_ENV, raising=False)
    hb = Heartbeat("m", "", lambda: None).start()
    assert hb.path is None
    hb.stop()
    monkeypatch.setenv(HEALTH_DIR_ENV, str(tmp_path))
    hb = Heartbeat("m", "", lambda: None).start()
    try:
        assert hb.path == beat_path(tmp_path, os.getpid()) and hb.path.exists()
    finally:
        hb.stop()


def test_beats_carry_the_engines_progress(tmp_path):
    fields = {"step_at": 1000.0, "waiting": 0, "step_tokens": 0, "sec_per_token": 0.0, "longest_step": 0.0,
              "steps_done": 0}
    progress = [fields]
    hb = Heartbeat("m", "m_0_0", lambda: None, directory=tmp_path, progress=lambda: progress[0])
    hb.beat()
    beat = read_beat(hb.path)
    assert {k: beat[k] for k in fields} == fields
    progress[0] = {**fields, "step_at": 1001.5, "waiting": 3, "longest_step": 0.25, "steps_done": 2}
    hb.beat()
    beat = read_beat(hb.path)
    assert {k: beat[k] for k in fields} == progress[0]
    without = Heartbeat("f", "", lambda: None, directory=tmp_path / "f")
    (tmp_path / "f").mkdir()
    without.beat()  # a model with no engine loop (a forward-pass model): no progress to tell
    assert "waiting" not in read_beat(without.path) and "step_at" not in read_beat(without.path)


def test_an_engine_owes_a_step_from_when_work_came_and_a_stalled_step_shows(tmp_path, monkeypatch):
    """Engine.progress: an idle engine's request is owed a step from its arrival (not from the
    last step before the idle time); a step that hangs, the GIL free (the test-only stall),
    keeps its start while requests wait; once it ends nothing is owed."""
    import time

    from tests.helpers.models import Collector, make_engine
    from tritonlm.engine.engine import STALL_FILE_ENV

    stall = tmp_path / "stall"
    stall.touch()
    monkeypatch.setenv(STALL_FILE_ENV, str(stall))
    engine = make_engine().start()
    try:
        idle = engine.progress()
        idle_since = idle["step_at"]
        assert idle["waiting"] == 0 and idle["steps_done"] == 0
        assert wait_until(lambda: time.time() > idle_since, HANG_GUARD_S)  # the clock moves past the idle mark
        submitted = time.time()
        collector = Collector()
        rid = collector.request(engine, "The lighthouse keeper wrote", max_tokens=4)
        assert wait_until(lambda: in_function(engine._thread, "_stall_while"), HANG_GUARD_S)
        stalled = engine.progress()
        began = stalled["step_at"]
        assert began >= submitted and stalled["waiting"] == 1
        prompt_tokens = len(engine.encode("The lighthouse keeper wrote"))
        assert stalled["step_tokens"] == prompt_tokens  # the prefill, scheduled before the stall
        assert wait_until(lambda: time.time() > began + 0.2, HANG_GUARD_S)
        again = engine.progress()
        assert (again["step_at"], again["waiting"]) == (began, 1)  # stalled: the same step, the request still owed
        assert engine.fault() is None  # the engine thread lives: only the step watchdog sees this
        stall.unlink()
        assert wait_until(lambda: collector.events[rid] and collector.events[rid][-1].finished, HANG_GUARD_S)
        assert wait_until(lambda: engine.progress()["waiting"] == 0, HANG_GUARD_S)
        done = engine.progress()
        assert done["longest_step"] >= 0.2 and done["steps_done"] >= 1  # the stalled step is the longest finished
        assert done["sec_per_token"] >= 0.2 / prompt_tokens and done["step_tokens"] == 0
    finally:
        stall.unlink(missing_ok=True)
        engine.shutdown()


def in_function(thread, name: str) -> bool:
    """Whether thread is now inside a call of the function called name."""
    import sys

    frame = sys._current_frames().get(thread.ident)
    while frame is not None:
        if frame.f_code.co_name == name:
            return True
        frame = frame.f_back
    return False
