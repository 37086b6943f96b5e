"""The drain's deadline without a server (tritonlm/glue/drain.py): the watcher fires once at the
deadline and never after the model unloaded, and the engine shutdown it triggers ends every
pending request with one final event, finish_reason cancelled. `tritonlm serve` draining
under load: tests/integration/test_drain.py."""

from __future__ import annotations

import threading
import time

import pytest

from tests.helpers.models import Collector, make_engine
from tests.helpers.servers import HANG_GUARD_S, wait_until
from tritonlm.glue.drain import DrainWatcher, read_deadline, write_deadline


def test_engine_shutdown_at_the_deadline_ends_pending_requests_as_cancelled():
    """What the backend's drain watcher calls: every request still running or queued gets
    one final event with finish_reason cancelled (no error); a second shutdown is a no-op.
    The engine's fifth forward pass waits at a gate until the shutdown has begun, so the
    running request is mid-stream then however fast the host makes tokens."""
    engine = make_engine(kv_sequences=1)  # room for one sequence: the second one waits
    forward, passes = engine.runner.forward, [0]
    at_gate, gate = threading.Event(), threading.Event()

    def gated(batch, pool):
        passes[0] += 1
        if passes[0] == 5:  # the prefill and three decode steps are done
            at_gate.set()
            gate.wait(HANG_GUARD_S)
        return forward(batch, pool)

    engine.runner.forward = gated
    engine.start()
    col = Collector()
    running = col.request(engine, "Once upon a time", max_tokens=200, min_tokens=200)
    waiting = col.request(engine, "Hello there", max_tokens=200, min_tokens=200)
    assert at_gate.wait(HANG_GUARD_S)
    assert wait_until(lambda: len(col.ids(running)) >= 2, HANG_GUARD_S)  # it has streamed some text
    stopping = threading.Thread(
        target=engine.shutdown, args=("the server is shutting down (drain deadline passed)",),
        kwargs={"finish_reason": "cancelled"})
    stopping.start()
    assert wait_until(lambda: engine._stop, HANG_GUARD_S)
    gate.set()
    stopping.join(HANG_GUARD_S)
    assert not stopping.is_alive()
    engine.shutdown()  # finalize afterwards: nothing more is sent
    for rid in (running, waiting):
        finals = [e for e in col.events[rid] if e.finished]
        assert len(finals) == 1, col.events[rid]
        assert finals[0].finish_reason == "cancelled" and finals[0].error is None
    assert 0 < col.final(running).num_output_tokens < 200
    assert col.final(waiting).num_output_tokens == 0


def test_drain_watcher_fires_once_at_the_deadline_and_not_after_close(tmp_path):
    calls: list[float] = []
    path = tmp_path / "deadline"
    watcher = DrainWatcher(path, lambda: calls.append(time.time()), poll_s=0.02)
    time.sleep(0.1)  # a chance to fire wrongly (a slow host only makes it smaller)
    assert calls == [] and read_deadline(path) is None  # no drain yet
    deadline = time.time() + 0.3
    write_deadline(path, deadline)
    assert read_deadline(path) == pytest.approx(deadline, abs=1e-3)
    assert wait_until(lambda: calls, HANG_GUARD_S)
    assert calls[0] >= deadline - 0.01
    time.sleep(0.1)  # a chance to fire a second time
    assert len(calls) == 1
    watcher.close()

    # the model unloaded before the deadline (finalize closed the watcher): no call, even
    # once the deadline has passed. The close must come before the deadline: when a busy host
    # delays it past one, that try shows nothing and the next gives the watcher longer.
    for wait_s in (0.3, 3, 30):
        calls.clear()
        path2 = tmp_path / f"deadline-{wait_s}"
        deadline = time.time() + wait_s
        write_deadline(path2, deadline)
        watcher = DrainWatcher(path2, lambda: calls.append(time.time()), poll_s=0.02)
        time.sleep(0.1)  # it reads the deadline and waits for it
        watcher.close()
        closed_in_time = time.time() < deadline
        time.sleep(max(0.0, deadline - time.time()) + 0.1)
        if closed_in_time:
            break
    assert closed_in_time, "the host never let the watcher close before its deadline"
    assert calls == []
