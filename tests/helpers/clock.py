"""A clock a test moves by hand: code that takes `clock=` sees only the time the test sets."""

from __future__ import annotations


class FakeClock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now
