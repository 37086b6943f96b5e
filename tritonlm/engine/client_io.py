"""Talking to clients off the engine thread.

In Triton every `response_sender.send()` and every `request.is_cancelled()` is a round
trip to the server process (the Python backend releases the GIL while it waits). Made
from the engine thread, one per streaming sequence per step, they would stall the
forward passes; made from these two threads, they overlap with them.

EventDispatcher     delivers each step's events, in order, on its own thread; when it falls
                    behind the engine, a stream's waiting events go out as one (coalesce)
CancellationPoller  asks the running requests every sweep and the waiting ones a slice
                    at a time, and hands the cancelled ones to the engine
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
from typing import Callable, Iterable

from tritonlm.engine.request import GenerationEvent
from tritonlm.engine.sequence import Sequence, SeqState
from tritonlm.engine.threads import EVENTS_THREAD, named_thread

log = logging.getLogger(__name__)

Batch = list[tuple[Sequence, GenerationEvent]]


def deliver(batch: Batch) -> None:
    """Run each event's client callback; one that raises is logged, the rest still go out."""
    for seq, event in batch:
        try:
            seq.request.on_event(event)
        except Exception:  # a broken client callback must not take the loop down
            log.exception("event callback failed for request %s", seq.id)


def merge(first: GenerationEvent, then: GenerationEvent) -> GenerationEvent:
    """One event that says what `first` (not final) and `then`, in that order, say."""
    return dataclasses.replace(
        then,
        text=first.text + then.text,
        token_ids=first.token_ids + then.token_ids,
        log_probs=first.log_probs + then.log_probs,
        top_log_probs=first.top_log_probs + then.top_log_probs,
        ranks=first.ranks + then.ranks,
        prompt_log_probs=first.prompt_log_probs if first.prompt_log_probs is not None else then.prompt_log_probs,
        prompt_top_log_probs=(first.prompt_top_log_probs if first.prompt_top_log_probs is not None
                              else then.prompt_top_log_probs),
    )


def coalesce(batches: list[Batch]) -> Batch:
    """Several steps' events as one batch: each sequence's events in order, with those that
    carry only tokens merged into the next (a final one included); an error is never
    merged, so its client still gets the text before it. A sequence keeps the place of
    its first event."""
    out: Batch = []
    mergeable: dict[int, int] = {}  # seq id -> index in out of its event still open to merging
    for batch in batches:
        for seq, event in batch:
            at = mergeable.pop(seq.id, None)
            if at is not None and event.error is None:
                out[at] = (seq, merge(out[at][1], event))
            else:
                at = len(out)
                out.append((seq, event))
            if not event.finished and event.error is None:
                mergeable[seq.id] = at
    return out


class EventDispatcher:
    """Sends on its own thread. Every response is a round trip to tritonserver;
    when steps come faster than the responses go (many streams, short steps: a GPU, a small
    model), the batches that queued up while it sent go out coalesced, one event per
    stream for all its new tokens, instead of the clients falling further behind."""

    def __init__(self, before_delivery: Callable[[Batch], None] | None = None) -> None:
        """before_delivery(batch) runs on this thread before each batch goes out (the metrics
        publish there, so a client that has its response finds it counted); one that raises
        is logged and the batch still goes out."""
        self._before_delivery = before_delivery
        self._queue: queue.SimpleQueue[Batch | None] = queue.SimpleQueue()
        self._thread = named_thread(self._run, EVENTS_THREAD)
        self._thread.start()

    def submit(self, batch: Batch) -> None:
        if batch:
            self._queue.put(batch)

    def _run(self) -> None:
        while (batch := self._queue.get()) is not None:
            batches, stop = [batch], False
            while not stop:
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    stop = True
                else:
                    batches.append(more)
            batch = coalesce(batches) if len(batches) > 1 else batch
            if self._before_delivery is not None:
                try:
                    self._before_delivery(batch)
                except Exception:
                    log.exception("before_delivery hook failed")
            deliver(batch)
            if stop:
                return

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
        self._thread = named_thread(self._run, "tritonlm-cancel-poll")
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
