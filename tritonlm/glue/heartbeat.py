"""The model process's heartbeat for `tritonlm serve`'s supervisor (tritonlm/supervise).

A process can be alive and still serve nobody: stopped (SIGSTOP), its Python wedged (a
native call holding the GIL), or its engine gone (the engine thread ended, a
tensor-parallel worker died). The supervisor sees the first two as a heartbeat that stops
and the third as a fault the heartbeat names. `tritonlm serve` sets HEALTH_DIR_ENV for
tritonserver (the stubs inherit it); without it (plain tritonserver, NVIDIA's container
without `tritonlm serve`) nothing is written.

Each beat rewrites <dir>/<pid>.json: {"pid", "model", "instance", "time", "fault"}. Written
beside, then renamed: the supervisor never reads half a beat.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Callable

from tritonlm.engine.threads import named_thread

log = logging.getLogger(__name__)

HEALTH_DIR_ENV = "TRITONLM_HEALTH_DIR"
BEAT_INTERVAL_S = 0.5  # the supervisor's wedge deadline is several beats long


def beat_path(directory: Path, pid: int) -> Path:
    return Path(directory) / f"{pid}.json"


def read_beat(path: Path) -> dict | None:
    """A beat, or None when there is none (or it cannot be read)."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


class Heartbeat:
    """A daemon thread that beats every interval_s while the process runs; `fault()` (None
    while the model can serve) goes into every beat."""

    def __init__(self, model: str, instance: str, fault: Callable[[], str | None],
                 directory: str | os.PathLike | None = None, interval_s: float = BEAT_INTERVAL_S):
        directory = directory if directory is not None else os.environ.get(HEALTH_DIR_ENV)
        self.path = beat_path(Path(directory), os.getpid()) if directory else None
        self.model, self.instance, self.fault, self.interval_s = model, instance, fault, interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> "Heartbeat":
        if self.path is None:
            return self
        self.beat()
        self._thread = named_thread(self._run, f"tritonlm-heartbeat-{self.model}")
        self._thread.start()
        return self

    def beat(self) -> None:
        assert self.path is not None
        try:
            fault = self.fault()
        except Exception as e:  # noqa: BLE001 - a failing check is a fault to report, not to raise
            fault = f"the health check failed: {type(e).__name__}: {e}"
        body = {"pid": os.getpid(), "model": self.model, "instance": self.instance, "time": time.time(), "fault": fault}
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            tmp.write_text(json.dumps(body))
            os.replace(tmp, self.path)
        except OSError as e:  # the folder went away (serve stopping): nothing to tell
            log.debug("heartbeat not written: %s", e)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.beat()

    def stop(self) -> None:
        """No more beats; the file goes too (an unloaded model is not a silent one)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self.path is not None:
            self.path.unlink(missing_ok=True)
