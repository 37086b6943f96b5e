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
