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
