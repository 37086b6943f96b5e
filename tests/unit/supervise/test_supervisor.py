"""Recovery's order and limits, on a stand-in server: the board is told before the kill,
failed restarts back off and count, and past the cap it gives up."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.clock import FakeClock
from tritonlm.server import ServerStartError
from tritonlm.supervise import supervisor as supervisor_module
from tritonlm.supervise.health import HealthBoard
from tritonlm.supervise.recovery import RestartPolicy
from tritonlm.supervise.supervisor import EXIT_GAVE_UP, Supervisor
from tritonlm.supervise.watch import Fault


class StandInServer:
    """What Supervisor uses of TritonServer; `failures` starts fail before one succeeds."""

    def __init__(self, repo: Path, board: HealthBoard, failures: int = 0):
        self.repo, self.board, self.failures = repo, board, failures
        self.events: list[str] = []
        self.process = None
        self.http_url = "127.0.0.1:1"

    def kill(self):
        # what a client whose connection breaks now would be told
        self.events.append(f"kill (board says: {self.board.unavailable('m')})")

    def start(self, timeout_s: float, append_log: bool = False):
        assert append_log  # a restart keeps the log
        if self.failures:
            self.failures -= 1
            self.events.append("start failed")
            raise ServerStartError("tritonserver exited with code 1\nmodel 'm' failed to load: no weights")
        self.events.append("start")


@pytest.fixture
def repo(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.pbtxt").write_text('name: "m"')
    (tmp_path / "notes").mkdir()
    return tmp_path


def supervisor_for(repo, tmp_path, monkeypatch, failures=0, max_restarts=5):
    board = HealthBoard()
    board.set_models(["m"])
    server = StandInServer(repo, board, failures)
    sleeps: list[float] = []
    monkeypatch.setattr(supervisor_module.time, "sleep", sleeps.append)
    sup = Supervisor(server, board, tmp_path / "beats", RestartPolicy(max_restarts, 300, clock=FakeClock()),
                     say=lambda line: server.events.append(line))
    monkeypatch.setattr(sup, "started", lambda: (board.set_models(["m"]), server.events.append("watching")))
    return sup, server, board, sleeps


def test_the_board_knows_before_the_kill_and_ready_after(repo, tmp_path, monkeypatch):
    sup, server, board, sleeps = supervisor_for(repo, tmp_path, monkeypatch)
    assert sup.recover(Fault("m", "died", "its process (pid 7) died")) is None
    kill = next(e for e in server.events if e.startswith("kill"))
    assert "model m is restarting (model m: its process (pid 7) died)" in kill
    assert server.events.index(kill) < server.events.index("start") < server.events.index("watching")
    assert board.ready() and sleeps == []  # the first restart is immediate
    assert board.registry.get_sample_value("tritonlm_model_restarts_total", {"model": "m", "cause": "died"}) == 1.0


def test_failed_restarts_back_off_and_are_counted(repo, tmp_path, monkeypatch):
    sup, server, board, sleeps = supervisor_for(repo, tmp_path, monkeypatch, failures=2)
    assert sup.recover(Fault("m", "wedged", "its process (pid 7) has been stopped for 4.0 s")) is None
    assert server.events.count("start failed") == 2 and sleeps == [1.0, 2.0]
    assert board.registry.get_sample_value("tritonlm_model_restarts_total", {"model": "m", "cause": "load_failed"}) == 2.0
    assert any("the restart failed: tritonserver exited with code 1; model 'm' failed to load" in e for e in server.events)


def test_past_the_cap_it_gives_up(repo, tmp_path, monkeypatch):
    sup, server, board, _ = supervisor_for(repo, tmp_path, monkeypatch, failures=10, max_restarts=2)
    assert sup.recover(Fault("m", "died", "its process (pid 7) died")) == EXIT_GAVE_UP
    assert server.events.count("start failed") == 2
    assert not board.live() and "gave up after 2 restarts within 300 s" in board.status()["gave_up"]
    assert any("exiting with code 3" in e for e in server.events)


def test_no_restart_at_all_gives_up_before_the_kill(repo, tmp_path, monkeypatch):
    sup, server, board, _ = supervisor_for(repo, tmp_path, monkeypatch, max_restarts=0)
    assert sup.recover(Fault("m", "died", "its process (pid 7) died")) == EXIT_GAVE_UP
    assert server.events[1].startswith("kill (board says: model m is out of service: gave up")


def test_a_stop_signal_ends_recovery(repo, tmp_path, monkeypatch):
    sup, server, _, _ = supervisor_for(repo, tmp_path, monkeypatch)
    sup.stop_requested = lambda: True
    with pytest.raises(KeyboardInterrupt):
        sup.recover(Fault("m", "died", "its process (pid 7) died"))
    assert "start" not in server.events


def test_a_fault_of_the_first_scan_is_reported(repo, tmp_path, monkeypatch):
    """A stub that died while the server came up is found by started()'s first scan and is
    the next check()'s answer, not dropped."""
    import os
    from types import SimpleNamespace

    from tests.helpers.servers import HANG_GUARD_S, wait_until
    from tests.unit.supervise.test_watch import StandInTriton, start_stub
    from tritonlm.supervise.procs import find_stubs, process_state
    from tritonlm.supervise.served import READY

    board = HealthBoard()
    server = StandInServer(repo, board)
    server.process = SimpleNamespace(pid=os.getpid(), poll=lambda: None)  # the stand-in stubs are this process's
    monkeypatch.setattr(supervisor_module, "triton_models", lambda _: StandInTriton({"m": READY}))
    stub = start_stub(tmp_path, "m", named=True)
    try:
        assert wait_until(lambda: [s.pid for s in find_stubs(os.getpid())] == [stub.pid], HANG_GUARD_S)
        stub.kill()
        assert wait_until(lambda: process_state(stub.pid) == "zombie", HANG_GUARD_S)
        sup = Supervisor(server, board, tmp_path / "beats", RestartPolicy(5, 300, clock=FakeClock()))
        sup.started()
        assert not board.ready()
        fault = sup.check()
        assert fault is not None and (fault.model, fault.kind) == ("m", "died")
    finally:
        stub.wait()


def test_the_index_is_asked_with_the_model_control_header():
    """The repository index is a model-control request: with --restrict-model-control it
    needs the restriction's header, or Triton refuses it."""
    from types import SimpleNamespace

    from tritonlm.supervise.supervisor import triton_models

    restricted = triton_models(SimpleNamespace(restrict_model_control="x-admin=s3cret", http_url="127.0.0.1:1"))
    assert restricted.headers == {"x-admin": "s3cret"} and restricted.base == "http://127.0.0.1:1"
    assert triton_models(SimpleNamespace(restrict_model_control=None, http_url="127.0.0.1:1")).headers == {}
