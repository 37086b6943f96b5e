"""What the probes, the metrics and the OpenAI frontend read from the health board."""

from __future__ import annotations

import subprocess
import sys

from prometheus_client import generate_latest

from tritonlm.supervise.health import HealthBoard
from tritonlm.supervise.watch import ModelView


def sample(board: HealthBoard, name: str, **labels) -> float | None:
    return board.registry.get_sample_value(name, labels)


def test_ready_only_when_every_model_serves():
    board = HealthBoard(["a", "b"])
    assert not board.ready() and board.live()  # loading
    assert board.unavailable("a") == "model a is not ready yet (loading); retry shortly"
    board.set_models(["a", "b"])
    assert board.ready() and board.unavailable("a") is None
    assert board.unavailable("unknown") is None  # not ours to refuse: the frontend's 404 says it
    assert sample(board, "tritonlm_model_healthy", model="a") == 1.0


def test_recovery_is_not_ready_but_live_and_counted():
    board = HealthBoard()
    board.set_models(["a", "b"])
    board.recovering("a", "model a: its process (pid 9) died", "died")
    assert not board.ready() and board.live()
    assert board.unavailable("b") == "model b is restarting (model a: its process (pid 9) died); retry shortly"
    assert sample(board, "tritonlm_model_restarts_total", model="a", cause="died") == 1.0
    assert sample(board, "tritonlm_model_healthy", model="b") == 0.0
    assert sample(board, "tritonlm_recovery_in_progress") == 1.0
    board.set_models(["a", "b"])
    assert board.ready()
    assert sample(board, "tritonlm_recovery_in_progress") == 0.0
    assert b'tritonlm_model_restarts_total{cause="died",model="a"} 1.0' in generate_latest(board.registry)


def test_giving_up_fails_liveness_and_draining_only_readiness():
    board = HealthBoard()
    board.set_models(["a"])
    board.draining()
    assert not board.ready() and board.live()
    assert "shutting down" in board.unavailable("a")
    board.give_up("gave up after 5 restarts")
    assert not board.live()
    assert board.status()["gave_up"] == "gave up after 5 restarts"
    assert board.unavailable("a") == "model a is out of service: gave up after 5 restarts"


def test_a_watched_process_that_died_is_never_ready():
    """The probe checks the processes itself: no window between a death and the next check."""
    board = HealthBoard()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        board.follow({"a": ModelView("a", (child.pid,), (), 1)})
        assert board.ready()
        child.kill()
        child.wait()
        assert not board.ready()
        assert board.status()["ready"] is False
    finally:
        child.kill()
        child.wait()


def test_the_board_follows_loads_and_unloads_without_counting_faults():
    """A model short of the stubs it asks for is loading (not ready, no fault); an unloaded
    one leaves the board and readiness answers for the models still served."""
    board = HealthBoard()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        board.follow({"a": ModelView("a", (child.pid,), (), 1), "b": ModelView("b", (), (), 1)})
        assert not board.ready()
        assert board.status()["models"]["b"]["state"] == "loading"
        assert board.status()["models"]["b"]["cause"] == "0 of its 1 instance processes run"
        board.follow({"a": ModelView("a", (child.pid,), (), 1)})  # b unloaded
        assert board.ready() and list(board.status()["models"]) == ["a"]
        assert sample(board, "tritonlm_model_healthy", model="b") is None
        board.follow({"a": ModelView("a", (child.pid,), (), 1), "b": ModelView("b", (child.pid,), (), 1)})
        assert board.ready()
        assert b"tritonlm_model_restarts_total" not in generate_latest(board.registry).replace(
            b"# HELP tritonlm_model_restarts_total", b"").replace(b"# TYPE tritonlm_model_restarts_total", b"")
        board.draining()
        board.follow({"a": ModelView("a", (child.pid,), (), 1)})  # a drain's state is not undone
        assert not board.ready() and "shutting down" in board.unavailable("a")
    finally:
        child.kill()
        child.wait()


def test_a_request_that_lived_through_a_restart_is_told_why():
    """The OpenAI frontend asks with the epoch its request began at: a connection lost in a
    restart that has already finished is still explained."""
    board = HealthBoard()
    board.set_models(["a"])
    began = board.epoch()
    assert board.explain("a", began) is None
    board.recovering("a", "model a: its process (pid 9) died", "died")
    assert board.explain("a", began).startswith("model a is restarting (model a: its process (pid 9) died)")
    # the server is back but the model's process is still starting: the fault is still named
    board.follow({"a": ModelView("a", (), (), 1)})
    assert board.unavailable("a").startswith("model a is not ready yet")
    assert board.explain("a", began) == ("model a was restarted while this request ran "
                                         "(model a: its process (pid 9) died); retry")
    board.set_models(["a"])
    assert board.explain("a", began) == ("model a was restarted while this request ran "
                                         "(model a: its process (pid 9) died); retry")
    assert board.explain("a", board.epoch()) is None  # a request begun after it: nothing to explain


def test_a_process_seen_gone_before_its_fault_is_named_explains_nothing_yet():
    """A check can see a model's process gone (the model loading: fewer live processes than
    it asks for) before the supervisor names the fault. A request that lost its connection
    then gets no explanation yet, not "not ready yet", which would hide the fault; once the
    fault is marked it is named."""
    board = HealthBoard()
    board.set_models(["a"])
    began = board.epoch()
    board.follow({"a": ModelView("a", (), (), 1)})
    assert board.unavailable("a").startswith("model a is not ready yet")
    assert board.explain("a", began) is None
    board.recovering("a", "model a: its process (pid 9) died", "died")
    assert board.explain("a", began).startswith("model a is restarting (model a: its process (pid 9) died)")
