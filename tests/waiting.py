"""Polling helper shared by the tests that watch processes and servers change state."""

from __future__ import annotations

import time


def wait_until(cond, timeout_s: float, step: float = 0.1) -> bool:
    """Poll cond() until it is true or timeout_s passes; returns its last value."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(step)
    return cond()


def wait_for_requests(metrics_port: int, model: str, count: int, timeout_s: float = 30) -> bool:
    """Wait until the model's engine holds `count` requests (waiting + running, from the
    server's metrics): a test that signals the server must know its requests are in."""
    from tritonlm.perf.serverstats import engine_gauges

    def inside() -> float:
        try:
            g = engine_gauges(f"http://127.0.0.1:{metrics_port}/metrics", model)
        except OSError:
            return -1
        return g.get("requests_waiting", 0) + g.get("requests_running", 0)

    return wait_until(lambda: inside() >= count, timeout_s)
