"""Talking to clients off the engine thread.

In Triton every `response_sender.send()` and every `request.is_cancelled()` is a round
trip to the server process (the Python backend releases the GIL while it waits). Made
from the engine thread, one per streaming sequence per step, they would stall the
forward passes; made from these two threads, they overlap with them.

EventDispatcher     delivers each step's events, in order, on its own thread
CancellationPoller  asks the running requests every sweep and the waiting ones a slice
                    at a time, and hands the cancelled ones to the engine
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Callable, Iterable

from tritonlm.engine.request import GenerationEvent
from tritonlm.engine.sequence import Sequence, SeqState

log = logging.getLogger(__name__)

Batch = list[tuple[Sequence, GenerationEvent]]


def deliver(batch: Batch) -> None:
    """Run each event's client callback; one that raises is logged, the rest still go out."""
    for seq, event in batch:
        try:
            seq.request.on_event(event)
        except Exception:  # a broken client callback must not take the loop down
            log.exception("event callback failed for request %s", seq.id)


class EventDispatcher:
    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Batch | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="tritonlm-events", daemon=True)
        self._thread.start()

    def submit(self, batch: Batch) -> None:
        if batch:
            self._queue.put(batch)

    def _run(self) -> None:
        while (batch := self._queue.get()) is not None:
            deliver(batch)

    def close(self, timeout_s: float = 10.0) -> None:
        """Deliver what is queued, then stop."""
        self._queue.put(None)
        self._thread.join(timeout_s)


class CancellationPoller:
    def __init__(
        self,
        live: Callable[[], tuple[list[Sequence], list[Sequence]]],
        cancel: Callable[[int], None],
        interval_s: float = 0.1,
        waiting_per_sweep: int = 64,
    ):
        """live() -> (running, waiting) sequences; cancel(request_id) tells the engine."""
        self._live, self._cancel = live, cancel
        self._interval_s, self._waiting_per_sweep = interval_s, waiting_per_sweep
        self._next_waiting = 0  # round-robin position in the waiting queue
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tritonlm-cancel-poll", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                running, waiting = self._live()
                self._ask(running)
                if waiting:
                    start = self._next_waiting % len(waiting)
                    chunk = (waiting[start:] + waiting[:start])[: self._waiting_per_sweep]
                    self._next_waiting = start + len(chunk)
                    self._ask(chunk)
            except Exception:  # keep polling whatever one sweep met
                log.exception("cancellation poll failed")

    def _ask(self, seqs: Iterable[Sequence]) -> None:
        for seq in seqs:
            hook = seq.request.is_cancelled
            if hook is not None and seq.state is not SeqState.FINISHED and hook():
                self._cancel(seq.id)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
