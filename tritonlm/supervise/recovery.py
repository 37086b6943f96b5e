"""When to try again after a fault, and when to stop trying.

A model that dies at every load (or soon after each) must not loop forever: more than
max_restarts restarts within window_s means recovery gives up, and `tritonlm serve` exits
non-zero so that the orchestrator restarts the pod. Between attempts the wait doubles
(the first restart of a window is immediate).
"""

from __future__ import annotations

import time
from collections import deque
from typing import Callable

DEFAULT_MAX_RESTARTS = 5
DEFAULT_WINDOW_S = 300.0
BACKOFF_FIRST_S = 1.0
BACKOFF_CAP_S = 30.0


class RestartPolicy:
    def __init__(self, max_restarts: int = DEFAULT_MAX_RESTARTS, window_s: float = DEFAULT_WINDOW_S,
                 clock: Callable[[], float] = time.monotonic):
        if max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, not {max_restarts}")
        self.max_restarts, self.window_s, self.clock = max_restarts, window_s, clock
        self._recent: deque[float] = deque()

    def recent(self) -> int:
        """Restarts within the window up to now."""
        now = self.clock()
        while self._recent and now - self._recent[0] > self.window_s:
            self._recent.popleft()
        return len(self._recent)

    def next_delay(self) -> float | None:
        """Seconds to wait before the next restart (recording it), or None: give up."""
        done = self.recent()
        if done >= self.max_restarts:
            return None
        self._recent.append(self.clock())
        return 0.0 if done == 0 else min(BACKOFF_CAP_S, BACKOFF_FIRST_S * 2 ** (done - 1))
