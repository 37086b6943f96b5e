"""The drain deadline inside the backend process.

On SIGTERM, Triton unloads the models but waits for open decoupled streams (the model
stays alive while responses are still being sent) until its own exit timeout, and then
aborts: streams still open lose their connection without a final response. Only the
backend process holds the response senders, so `tritonlm serve` tells it the deadline
through a file: it sets DRAIN_FILE_ENV for tritonserver (the Python backend stubs inherit
it) and, when the drain starts, writes the deadline there (seconds since the epoch). A
watcher thread per model instance waits for that file and, at the deadline, shuts the
engine down with finish_reason "cancelled": every stream still running gets its final
response, the model unloads and tritonserver exits 0 before its own (later) exit timeout.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

from tritonlm.engine.threads import named_thread

log = logging.getLogger(__name__)

DRAIN_FILE_ENV = "TRITONLM_DRAIN_FILE"
POLL_S = 0.2  # how often the watcher looks for the file: the cut comes at most this late


def read_deadline(path: Path) -> float | None:
    """The deadline written to path, or None while there is none (or it is half written)."""
    try:
        return float(path.read_text().strip())
    except (OSError, ValueError):
        return None


def write_deadline(path: Path, deadline: float) -> None:
    """Atomically (a reader never sees half a number): write beside, then rename."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(f"{deadline:.3f}\n")
    os.replace(tmp, path)


class DrainWatcher:
    """Waits for the drain deadline and then calls on_deadline() once (on its own thread)."""

    def __init__(self, path: Path, on_deadline, poll_s: float = POLL_S):
        self.path, self.on_deadline, self.poll_s = Path(path), on_deadline, poll_s
        self._stop = threading.Event()
        self._thread = named_thread(self._run, "tritonlm-drain")
        self._thread.start()

    def _run(self) -> None:
        deadline = None
        while deadline is None:
            if self._stop.wait(self.poll_s):
                return
            deadline = read_deadline(self.path)
        if self._stop.wait(max(0.0, deadline - time.time())):
            return  # everything finished (the model unloaded) before the deadline
        log.warning("drain deadline passed: cancelling the requests still running")
        try:
            self.on_deadline()
        except Exception:  # the watcher must never take the stub down
            log.exception("cancelling at the drain deadline failed")

    def close(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)


def watch_drain(handler) -> DrainWatcher | None:
    """A watcher for a generation handler when tritonlm serve asked for one (DRAIN_FILE_ENV)."""
    path = os.environ.get(DRAIN_FILE_ENV)
    engine = getattr(handler, "engine", None)
    if not path or engine is None:
        return None
    return DrainWatcher(
        Path(path),
        lambda: engine.shutdown("the server is shutting down (drain deadline passed)", finish_reason="cancelled"),
    )
