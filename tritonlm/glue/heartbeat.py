"""The model process's heartbeat for `tritonlm serve`'s supervisor (tritonlm/supervise).

A process can be alive and still serve nobody: stopped (SIGSTOP), its Python wedged (a
native call holding the GIL), its engine stuck in a step while the GIL is free (an OpenMP
barrier, a CUDA or C++ deadlock), or its engine gone (the engine thread ended, a
tensor-parallel worker died). The supervisor sees the first two as a heartbeat that stops,
the third as a beat whose engine has made no progress while requests wait, and the fourth
as a fault the heartbeat names. `tritonlm serve` sets HEALTH_DIR_ENV for tritonserver (the
stubs inherit it); without it (plain tritonserver, NVIDIA's container without `tritonlm
serve`) nothing is written. The file's format is tritonlm/health_beat.py's.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Callable

from tritonlm.engine.threads import named_thread
from tritonlm.health_beat import HEALTH_DIR_ENV, beat_path, read_beat, write_beat

__all__ = ["BEAT_INTERVAL_S", "HEALTH_DIR_ENV", "Heartbeat", "beat_path", "read_beat"]

log = logging.getLogger(__name__)

BEAT_INTERVAL_S = 0.5  # the supervisor's wedge deadline is several beats long

# Engine.progress: the step watchdog's fields of the beat (tritonlm/health_beat.py)
Progress = Callable[[], dict]


class Heartbeat:
    """A daemon thread that beats every interval_s while the process runs; `fault()` (None
    while the model can serve) goes into every beat, and so does `progress()` for a model
    with an engine loop (Engine.progress)."""

    def __init__(self, model: str, instance: str, fault: Callable[[], str | None],
                 directory: str | os.PathLike | None = None, interval_s: float = BEAT_INTERVAL_S,
                 progress: Progress | None = None):
        directory = directory if directory is not None else os.environ.get(HEALTH_DIR_ENV)
        self.path = beat_path(Path(directory), os.getpid()) if directory else None
        self.model, self.instance, self.fault, self.interval_s = model, instance, fault, interval_s
        self.progress = progress
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
        if self.progress is not None:
            try:
                body.update(self.progress())
            except Exception as e:  # noqa: BLE001 - as above
                body["fault"] = fault or f"the progress check failed: {type(e).__name__}: {e}"
        try:
            write_beat(self.path, body)
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
