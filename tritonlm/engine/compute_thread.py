"""The one thread that runs a model's torch work: loading, warm-up, then every step.

PyTorch's CPU kernels parallelize with OpenMP, and an OpenMP thread team belongs to the
thread that started it: once the main thread has run one parallel op, forward passes on a
second thread leave cores idle and run slower, while a model loaded and run on the same
thread runs at full speed (docs/performance-notes.md). A server loads the model on the
thread that calls initialize() and steps on an engine thread, so the engine does both on
this thread instead. torch.set_num_threads on the second thread, a passive OpenMP wait
policy and one malloc arena do not fix it (docs/performance-notes.md).
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable

from tritonlm.engine.threads import ENGINE_THREAD, named_thread


class ComputeThread:
    """Runs callables one after another on a single long-lived daemon thread."""

    def __init__(self, name: str = ENGINE_THREAD):
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self.thread = named_thread(self._run, name)
        self.thread.start()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            job()

    def call(self, fn: Callable[..., Any], *args, **kwargs) -> Any:
        """fn(*args, **kwargs) on this thread; waits, returns its result or raises its error."""
        done = threading.Event()
        box: dict[str, Any] = {}

        def job() -> None:
            try:
                box["value"] = fn(*args, **kwargs)
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                box["error"] = e
            finally:
                done.set()

        self._jobs.put(job)
        done.wait()
        if "error" in box:
            raise box["error"]
        return box["value"]

    def run_last(self, fn: Callable[[], None]) -> None:
        """fn on this thread without waiting (the engine loop); the thread ends when it returns."""
        self._jobs.put(fn)
        self._jobs.put(None)

    def stop(self) -> None:
        """End the thread once queued work is done (when no loop was ever started)."""
        self._jobs.put(None)
