"""After a step: append each sequence's new tokens to its history, check the stop
conditions, detokenize, report to the client, and retire finished sequences at once
(their cache goes back to the pool before the next step).

Overlapped (Engine's `overlap`): append() does the part the next step's schedule needs
(histories, EOS, max_tokens) right after sampling, complete() the text, stop strings and
events while the next forward pass runs on the GPU. A row that a stop string ends there
has already been scheduled once more: that step's token for it is dropped, so the tokens
and text are the same as process() gives.

Events go out through the request's callback on the engine thread; a callback must
not block, and one that raises is logged and ignored.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Protocol

from tritonlm.engine.client_io import deliver
from tritonlm.engine.executor import StepOutput
from tritonlm.engine.request import GenerationEvent
from tritonlm.engine.scheduler import Scheduler
from tritonlm.engine.sequence import Sequence, SeqState

log = logging.getLogger(__name__)


class EngineObserver(Protocol):
    """Hooks for metrics (bridged to Triton's metrics by the glue). Called on the engine
    thread, once per step rather than per token where they can be; they must not block
    (the glue only records in them, and publishes from other threads). An observer that
    raises is logged and ignored. An observer may also have before_delivery(batch): the
    engine's event dispatcher calls it on its thread before each batch goes out."""

    def on_step(self, batch_size: int, num_tokens: int, seconds: float, generated: int) -> None: ...
    def on_first_token(self, ttft_s: float) -> None: ...
    def on_finish(self, reason: str, time_per_output_token_s: float | None) -> None: ...
    def on_speculation(self, proposed: int, accepted: int) -> None: ...


@dataclass
class Deferred:
    """A row's token, already in its history, whose text and event are still to be made."""

    seq: Sequence
    token: int
    logprob: float
    top: list[tuple[int, float]] | None = None  # with top_log_probs
    rank: int | None = None  # with return_log_probs


@dataclass
class EngineStats:
    steps: int = 0
    tokens_generated: int = 0
    finished: dict[str, int] = field(default_factory=dict)
    max_kv_used_bytes: int = 0  # high-water mark of the cache accounting
    max_batch_size: int = 0


class OutputProcessor:
    def __init__(self, scheduler: Scheduler, max_context: int, observer: EngineObserver | None = None,
                 stream_interval: int = 1):
        self.scheduler = scheduler
        self.max_context = max_context
        self.observer = observer
        self.stream_interval = stream_interval
        self.stats = EngineStats()
        self._outbox: list[tuple[Sequence, GenerationEvent]] = []  # sent at the end of each call
        self.deliver = deliver  # the engine thread hands it to an EventDispatcher when it runs one

    def process(self, step: StepOutput) -> None:
        self.stats.steps += 1
        self.stats.max_batch_size = max(self.stats.max_batch_size, step.batch_size)
        self.stats.max_kv_used_bytes = max(self.stats.max_kv_used_bytes, self.scheduler.cache.used_bytes)
        generated_before = self.stats.tokens_generated
        now = time.monotonic()
        for out in step.rows:
            seq = out.seq
            if seq.state is SeqState.FINISHED:  # ended by a stop string while this step ran (overlap)
                continue
            if out.error is not None:
                self._fail(seq, out.error)
                continue
            used, finish_reason = self._append(seq, out.tokens, now, out.top_log_probs, out.ranks)
            if out.proposed:  # counted before the final event, which reports the totals
                accepted = min(out.accepted, used)  # guesses after the sequence ended do not count
                seq.draft_tokens += out.proposed
                seq.accepted_draft_tokens += accepted
                self._observe("on_speculation", out.proposed, accepted)
            if finish_reason is not None:
                self._finish(seq, finish_reason)
            elif seq.request.stream and seq.state is not SeqState.FINISHED:
                self._stream(seq)
        generated = self.stats.tokens_generated - generated_before
        self._observe("on_step", step.batch_size, step.num_tokens, step.seconds, generated)
        self._flush()  # after the metrics: a client that saw its response finds it counted

    # ---- overlapped: the step's bookkeeping now, its text and events while the next step runs
    def append(self, step: StepOutput, placed: bool = False) -> list[Deferred]:
        """The first half of process() for a step whose rows got one token each, right after
        sampling: histories, EOS and stop token ids, max_tokens and the context, so the next
        step is scheduled from them. Rows that end now are finished now (their text first);
        the others' detokenizing, stop strings and stream events are returned, for complete()
        while the next step's forward pass runs on the GPU.

        placed: each row's history already ends with a placeholder for its token (a step
        scheduled ahead, executor.AheadTokens), which the token replaces (an end token
        removes it, as it never enters a history)."""
        self.stats.steps += 1
        self.stats.max_batch_size = max(self.stats.max_batch_size, step.batch_size)
        self.stats.max_kv_used_bytes = max(self.stats.max_kv_used_bytes, self.scheduler.cache.used_bytes)
        generated_before = self.stats.tokens_generated
        now = time.monotonic()
        deferred: list[Deferred] = []
        for out in step.rows:
            seq = out.seq
            if seq.state is SeqState.FINISHED:  # ended by a stop string while this step ran
                continue
            if out.error is not None:
                if placed:
                    seq.token_ids.pop()
                self._fail(seq, out.error)
                continue
            (token, logprob), = out.tokens
            top = out.top_log_probs[0] if out.top_log_probs else None
            rank = out.ranks[0] if out.ranks else None
            if seq.first_token_time is None:
                self._first_token(seq, now)
            seq.last_token_time = now
            if seq.sampling.ends_on(token):
                if placed:
                    seq.token_ids.pop()
                self._finish(seq, "stop")
                continue
            if placed:
                seq.token_ids[-1] = token
            else:
                seq.token_ids.append(token)
            self.stats.tokens_generated += 1
            if self.full(seq):
                self._complete_row(Deferred(seq, token, logprob, top, rank), ends="length")
                continue
            deferred.append(Deferred(seq, token, logprob, top, rank))
        self._observe("on_step", step.batch_size, step.num_tokens, step.seconds,
                      self.stats.tokens_generated - generated_before)
        self._flush()
        return deferred

    def length_at(self, seq: Sequence) -> int:
        """The history's length at which the sequence ends: max_tokens, or the context."""
        return min(seq.num_prompt_tokens + seq.request.params.max_tokens, self.max_context)

    def full(self, seq: Sequence) -> bool:
        return len(seq.token_ids) >= self.length_at(seq)

    def complete(self, deferred: list[Deferred]) -> None:
        """The second half: each row's text, stop strings and stream event (in step order)."""
        for row in deferred:
            if row.seq.state is not SeqState.FINISHED:
                self._complete_row(row)
        self._flush()

    def _complete_row(self, row: Deferred, ends: str | None = None) -> None:
        """The row's text and event, as process() makes them; `ends`: it finishes with
        this reason unless a stop string ends it first."""
        seq = row.seq
        self._report(seq, seq.detok.update(), row.token, row.logprob, row.top, row.rank)
        if seq.detok.stopped or ends is not None:
            self._finish(seq, "stop" if seq.detok.stopped else ends)
        elif seq.request.stream:
            self._stream(seq)

    def _first_token(self, seq: Sequence, now: float) -> None:
        seq.first_token_time = now
        self._observe("on_first_token", now - seq.request.arrival)
        self.scheduler.first_token(seq)

    def _observe(self, hook: str, *args) -> None:
        if self.observer is None:
            return
        try:
            getattr(self.observer, hook)(*args)
        except Exception:  # metrics must never cost a client its response
            log.exception("metrics hook %s failed", hook)

    def _append(
        self, seq: Sequence, tokens: list[tuple[int, float]], now: float,
        tops: list[list[tuple[int, float]]] | None = None, ranks: list[int | None] | None = None,
    ) -> tuple[int, str | None]:
        """Add tokens in order until the sequence should finish; returns how many were used
        and the finish reason (None: it goes on). The caller finishes it."""
        if not tokens:
            return 0, None
        history, detok, params, sampling = seq.token_ids, seq.detok, seq.request.params, seq.sampling
        # max_tokens reached or the context full, as one history length (this runs per token)
        length_at = self.length_at(seq)
        if seq.first_token_time is None:
            self._first_token(seq, now)
        seq.last_token_time = now
        for used, (token, logprob) in enumerate(tokens, start=1):
            if sampling.ends_on(token):  # EOS or a stop token id: not part of the answer
                self.stats.tokens_generated += used - 1
                return used, "stop"
            history.append(token)
            seq.pending_text.append(detok.update())
            seq.pending_ids.append(token)
            if params.return_log_probs or params.top_log_probs:
                self._report_log_probs(seq, logprob, tops[used - 1] if tops else None, ranks[used - 1] if ranks else None)
            if detok.stopped:
                self.stats.tokens_generated += used
                return used, "stop"
            if len(history) >= length_at:
                self.stats.tokens_generated += used
                return used, "length"
        self.stats.tokens_generated += len(tokens)
        return len(tokens), None

    def _report(
        self, seq: Sequence, text: str, token: int, logprob: float, top: list[tuple[int, float]] | None = None,
        rank: int | None = None,
    ) -> None:
        """Accumulate until the stream's next event or the final one."""
        seq.pending_text.append(text)
        seq.pending_ids.append(token)
        self._report_log_probs(seq, logprob, top, rank)

    @staticmethod
    def _report_log_probs(seq: Sequence, logprob: float, top: list[tuple[int, float]] | None, rank: int | None) -> None:
        """The token's log-probability, rank and alternatives, where the request asked for them."""
        params = seq.request.params
        if params.return_log_probs:
            seq.pending_log_probs.append(logprob)
            seq.pending_ranks.append(rank)
        if params.top_log_probs:
            seq.pending_top_log_probs.append(top or [])

    def _stream(self, seq: Sequence) -> None:
        """A streaming sequence's event for this step's tokens: one per step that made tokens
        (several with speculative decoding), even when their text is empty (a special token
        such as an ignored end of text, or text held back while it could still become a stop
        string), so the client learns at once that a token was made, as llama-server's stream
        tells it. Tokens that end inside a multi-byte character ride with the next one. With
        stream_interval N, after the first event every N tokens."""
        pending = len(seq.pending_ids)
        if not pending or not (any(seq.pending_text) or not seq.detok.incomplete):
            return
        # the interval first: it decides at once for most tokens; else nothing of this sequence sent yet
        if pending >= self.stream_interval or pending == seq.num_output_tokens:
            self._emit(seq, self._take_pending(seq))

    @staticmethod
    def _take_pending(seq: Sequence, **final) -> GenerationEvent:
        """An event with what the sequence has pending (which it then no longer has), and
        `final`'s fields (the final event's)."""
        event = GenerationEvent(seq.id, "".join(seq.pending_text), seq.pending_ids, seq.pending_log_probs,
                                seq.pending_top_log_probs, seq.pending_ranks, **final)
        seq.pending_text, seq.pending_ids, seq.pending_log_probs, seq.pending_top_log_probs = [], [], [], []
        seq.pending_ranks = []
        if seq.prompt_log_probs is not None and not seq.prompt_log_probs_sent:  # the first event carries them
            event.prompt_log_probs, event.prompt_top_log_probs = seq.prompt_log_probs, seq.prompt_top_log_probs
            seq.prompt_log_probs_sent = True
        return event

    # ---- endings ----------------------------------------------------------------------------
    def finish(self, seq: Sequence, reason: str) -> None:
        """stop | length | cancelled: the rest of the text and the final event."""
        self._finish(seq, reason)
        self._flush()

    def fail(self, seq: Sequence, message: str) -> None:
        self._fail(seq, message)
        self._flush()

    def _finish(self, seq: Sequence, reason: str) -> None:
        if seq.state is SeqState.FINISHED:
            return
        tail = "" if reason == "cancelled" else seq.detok.flush()
        self._retire(seq, reason)
        seq.pending_text.append(tail)
        self._emit(seq, self._take_pending(
            seq,
            finished=True,
            finish_reason=reason,
            num_input_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            draft_tokens=seq.draft_tokens,
            accepted_draft_tokens=seq.accepted_draft_tokens,
        ))
        n = seq.num_output_tokens
        tpot = (seq.last_token_time - seq.first_token_time) / (n - 1) if n > 1 and seq.first_token_time else None
        self._observe("on_finish", reason, tpot)

    def _fail(self, seq: Sequence, message: str) -> None:
        if seq.state is SeqState.FINISHED:
            return
        self._retire(seq, "error")
        self._emit(seq, GenerationEvent(
            seq.id,
            finished=True,
            finish_reason="error",
            error=message,
            num_input_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens,
        ))
        self._observe("on_finish", "error", None)

    def _retire(self, seq: Sequence, reason: str) -> None:
        self.scheduler.finish(seq, reason)  # leaves the batch, cache back to the pool (the draft's too)
        self.stats.finished[reason] = self.stats.finished.get(reason, 0) + 1

    def _emit(self, seq: Sequence, event: GenerationEvent) -> None:
        self._outbox.append((seq, event))

    def _flush(self) -> None:
        outbox, self._outbox = self._outbox, []
        self.deliver(outbox)
