"""The step loop: continuous batching over a paged KV cache.

Each step: take in new requests and cancellations, admit what the cache can
hold, run ONE forward pass for every running sequence (decodes and prefill
chunks together), sample a token for each sequence whose pending tokens are all
in the cache, report new text, and retire finished sequences at once (their
cache goes back to the pool before the next step).

Callbacks run on the engine thread; they must not block.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Protocol

import torch

from tritonlm.engine.batch import StepBatch
from tritonlm.engine.detok import IncrementalDetokenizer
from tritonlm.engine.kv_cache import KVCacheManager
from tritonlm.engine.request import (
    GenerationEvent,
    GenerationRequest,
    InvalidRequestError,
    ServerBusyError,
)
from tritonlm.engine.sampler import RowState, sample
from tritonlm.engine.scheduler import Scheduler, SchedulerConfig
from tritonlm.engine.sequence import Sequence, SeqState
from tritonlm.engine.speculative import AdaptiveK, Drafter, Proposal, verify_row

log = logging.getLogger(__name__)


class EngineObserver(Protocol):
    """Hooks for metrics (bridged to Triton's metrics by the glue)."""

    def on_step(self, batch_size: int, num_tokens: int, seconds: float) -> None: ...
    def on_first_token(self, ttft_s: float) -> None: ...
    def on_token(self) -> None: ...
    def on_finish(self, reason: str, time_per_output_token_s: float | None) -> None: ...
    def on_speculation(self, proposed: int, accepted: int) -> None: ...


@dataclass
class EngineStats:
    steps: int = 0
    tokens_generated: int = 0
    finished: dict[str, int] = field(default_factory=dict)
    max_kv_used_bytes: int = 0  # high-water mark of the cache accounting
    max_batch_size: int = 0


class Engine:
    def __init__(
        self,
        runner,
        tokenizer,
        cache: KVCacheManager,
        scheduler_config: SchedulerConfig,
        max_context: int,
        use_kv_cache: bool = True,
        queue_timeout_s: float = 0.0,
        observer: EngineObserver | None = None,
        drafter: Drafter | None = None,
        num_draft_tokens: int = 4,
    ):
        self.runner = runner
        self.tokenizer = tokenizer
        self.cache = cache
        self.scheduler = Scheduler(scheduler_config, cache)
        self.max_context = max_context
        self.use_kv_cache = use_kv_cache
        self.queue_timeout_s = queue_timeout_s
        self.observer = observer
        self.drafter = drafter  # speculative decoding when set
        self.num_draft_tokens = num_draft_tokens  # maximum K
        self.eos_id = tokenizer.eos_token_id
        self.stats = EngineStats()
        self._inbox: list[Sequence] = []
        self._cancel: set[int] = set()
        self._by_id: dict[int, Sequence] = {}
        self._cond = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None

    # ---- client side (any thread) ------------------------------------------
    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text).input_ids)

    def validate(self, request: GenerationRequest) -> None:
        p = request.params
        p.validate()
        n = len(request.prompt_ids)
        if n == 0:
            raise InvalidRequestError("text_input: the prompt is empty (it encodes to no tokens); send some text")
        if n >= self.max_context:
            raise InvalidRequestError(
                f"text_input: the prompt has {n} tokens; the model's context is {self.max_context} tokens, "
                f"so prompts must have at most {self.max_context - 1}"
            )
        if n + p.max_tokens > self.max_context:
            raise InvalidRequestError(
                f"max_tokens: {p.max_tokens} new tokens after a {n}-token prompt exceed the context of "
                f"{self.max_context} tokens; ask for at most {self.max_context - n}"
            )
        vocab = self.runner.spec.vocab_size
        for seq in p.bad_words:
            if any(not 0 <= t < vocab for t in seq):
                raise InvalidRequestError(f"bad_words: token ids must be in [0, {vocab})")

    def submit(self, request: GenerationRequest) -> None:
        """Validate and queue. Raises InvalidRequestError / ServerBusyError (nothing queued then)."""
        self.validate(request)
        end_id = request.params.end_id
        eos = self.eos_id if end_id is None else (None if end_id < 0 else end_id)
        seq = Sequence(
            request=request,
            detok=IncrementalDetokenizer(self.tokenizer, request.prompt_ids, request.params.stop_words),
            sampler_row=RowState.make(request.params, list(request.prompt_ids), eos),
            reserve_tokens=len(request.prompt_ids) + request.params.max_tokens,
        )
        with self._cond:
            if self._stop:
                raise ServerBusyError("the model is shutting down; retry on another instance")
            pending = self.scheduler.num_waiting + len(self._inbox)
            if not self.scheduler.queue_room(pending):
                raise ServerBusyError(
                    f"server busy: {pending} requests already waiting "
                    f"(max_queue_size={self.scheduler.config.max_queue_size}); retry later"
                )
            self._inbox.append(seq)
            self._cond.notify()

    def cancel(self, request_id: int) -> None:
        with self._cond:
            self._cancel.add(request_id)
            self._cond.notify()

    # ---- the loop ------------------------------------------------------------
    def start(self) -> "Engine":
        self._thread = threading.Thread(target=self._loop, name="tritonlm-engine", daemon=True)
        self._thread.start()
        return self

    def shutdown(self, reason: str = "the model is being unloaded") -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout=30)
        for seq in list(self._by_id.values()) + self._inbox:
            self._fail(seq, reason)
        self._inbox.clear()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stop and not self._inbox and not self._cancel and not self.has_work():
                    self._cond.wait(timeout=0.5 if self.scheduler.num_waiting else None)
                if self._stop:
                    return
            try:
                self.step()
            except Exception:  # the loop must survive anything one step does
                log.exception("engine step failed")

    def has_work(self) -> bool:
        return bool(self.scheduler.running or self.scheduler.waiting)

    def step(self) -> None:
        """One iteration: intake, admission, forward pass(es), sampling, reports."""
        self._intake()
        self._check_cancelled_and_expired()
        for seq in self.scheduler.admit():
            seq.spec_k = self._k_max(seq)
            if self.drafter is not None and seq.spec_k > 0:
                self.drafter.on_admit(seq)
        plan = self.scheduler.schedule()
        if not plan:
            return
        if not self.use_kv_cache:  # benchmark baseline: forget the cache, recompute everything
            for seq, _ in plan:
                if not seq.in_prefill:
                    self.cache.truncate(seq.id, 0)
                    seq.num_computed = 0
            plan = [(seq, len(seq.pending_tokens)) for seq, _ in plan]
        t0 = time.perf_counter()
        speculating = self._speculation_plan(plan)
        plain = [(seq, n) for seq, n in plan if seq.id not in speculating]
        try:
            proposals = {}
            if speculating:
                seqs = [seq for seq, _ in plan if seq.id in speculating]
                for seq, prop in zip(seqs, self.drafter.propose(seqs, [speculating[s.id] for s in seqs])):
                    proposals[seq.id] = prop
            # speculating rows are verified together with the plain decoders (all logits);
            # prefill chunks go in a pass of their own so no prompt-long logits are made
            verify_rows = [(seq, seq.pending_tokens + proposals[seq.id].tokens) for seq, _ in plan if seq.id in proposals]
            decode_rows = [(seq, seq.pending_tokens[:n]) for seq, n in plain if not seq.in_prefill or not verify_rows]
            other_rows = [(seq, seq.pending_tokens[:n]) for seq, n in plain if seq.in_prefill and verify_rows]
            results: list[tuple[Sequence, list[int], torch.Tensor]] = []
            if verify_rows:
                len_before = {seq.id: seq.num_tokens for seq, _ in verify_rows}
                results += self._forward_rows(verify_rows + decode_rows, all_logits=True)
            else:
                results += self._forward_rows(decode_rows, all_logits=False)
            if other_rows:
                results += self._forward_rows(other_rows, all_logits=False)
        except Exception as e:  # a failed pass fails its sequences, not the server
            log.exception("forward pass failed")
            for seq, _ in plan:
                self._fail(seq, f"internal error in the forward pass: {e}")
            return
        elapsed = time.perf_counter() - t0
        self.stats.steps += 1
        self.stats.max_batch_size = max(self.stats.max_batch_size, len(plan))
        self.stats.max_kv_used_bytes = max(self.stats.max_kv_used_bytes, self.cache.used_bytes)
        if self.observer:
            self.observer.on_step(len(plan), sum(len(t) for _, t, _ in results), elapsed)
        now = time.monotonic()
        ready = [(seq, fed, logits) for seq, fed, logits in results if seq.num_computed == seq.num_tokens]
        plain_ready = [(seq, logits if logits.dim() == 1 else logits[len(fed) - 1]) for seq, fed, logits in ready if seq.id not in proposals]
        if plain_ready:
            choices = sample(torch.stack([lg for _, lg in plain_ready]), [seq.sampler_row for seq, _ in plain_ready])
            for (seq, _), (token, logprob) in zip(plain_ready, choices):
                self._append_token(seq, token, logprob, now, elapsed)
        for seq, fed, logits in results:
            if seq.id in proposals:
                self._verify(seq, proposals[seq.id], logits, len_before[seq.id], now, elapsed)

    def _k_max(self, seq: Sequence) -> int:
        if self.drafter is None or not self.use_kv_cache:
            return 0
        asked = seq.request.num_draft_tokens
        return self.num_draft_tokens if asked is None else min(asked, self.num_draft_tokens)

    def _speculation_plan(self, plan: list[tuple[Sequence, int]]) -> dict[int, int]:
        """seq id -> K for the decoding sequences that speculate this step."""
        if self.drafter is None:
            return {}
        out = {}
        for seq, _ in plan:
            if seq.in_prefill or seq.spec_k <= 0 or len(seq.pending_tokens) != 1:
                continue
            room = min(
                seq.request.params.max_tokens - len(seq.output_ids) - 1,  # no guesses past max_tokens
                seq.reserve_tokens - seq.num_computed - 1,  # the verify pass writes K+1 slots
            )
            k = min(seq.spec_k, room)
            if k > 0:
                out[seq.id] = k
        return out

    def _forward_rows(self, rows: list[tuple[Sequence, list[int]]], all_logits: bool) -> list[tuple[Sequence, list[int], torch.Tensor]]:
        """One forward pass; returns (seq, tokens fed, logits) per row: logits [V], or
        [T, V] with all_logits. The cache advances past every fed token."""
        if not rows:
            return []
        new_tokens, past_lens, slot_rows = [], [], []
        for seq, toks in rows:
            new_tokens.append(toks)
            past_lens.append(seq.num_computed)
            slot_rows.append(self.cache.slots(seq.id, seq.num_computed + len(toks)))
        batch = StepBatch.build(new_tokens, past_lens, slot_rows, all_logits=all_logits)
        logits = self.runner.forward(batch, self.cache.pool)
        for (seq, _), toks in zip(rows, new_tokens):
            self.cache.advance(seq.id, len(toks))
            seq.num_computed += len(toks)
        return [(seq, toks, logits[i]) for i, (seq, toks) in enumerate(zip([r[0] for r in rows], new_tokens))]

    def _verify(self, seq: Sequence, proposal: Proposal, logits: torch.Tensor, len_before: int, now: float, step_s: float) -> None:
        """Accept the longest agreeing run of guesses plus one target token; roll both caches
        back past what was rejected."""
        k = len(proposal.tokens)
        accepted = verify_row(
            logits[: k + 1],
            proposal,
            seq.sampler_row,
            lambda token, logprob: self._append_token(seq, token, logprob, now, step_s) and seq.state is SeqState.RUNNING,
        )
        seq.draft_tokens += k
        seq.accepted_draft_tokens += accepted
        if self.observer:
            self.observer.on_speculation(k, accepted)
        if seq.state is not SeqState.RUNNING:
            return
        # pending token + accepted guesses are valid cache; the rest is overwritten later
        keep = len_before + accepted
        self.cache.truncate(seq.id, keep)
        seq.num_computed = keep
        self.drafter.on_verified(seq, len_before, accepted)
        seq.spec_k = AdaptiveK.update(seq.spec_k, k, accepted, self._k_max(seq))

    # ---- pieces of a step ----------------------------------------------------
    def _intake(self) -> None:
        with self._cond:
            inbox, self._inbox = self._inbox, []
        for seq in inbox:
            try:
                self.scheduler.add(seq)
                self._by_id[seq.id] = seq
            except ServerBusyError as e:
                self._fail(seq, str(e))

    def _check_cancelled_and_expired(self) -> None:
        with self._cond:
            cancel, self._cancel = self._cancel, set()
        now = time.monotonic()
        for seq in list(self._by_id.values()):
            hook = seq.request.is_cancelled
            if seq.id in cancel or (hook is not None and hook()):
                self._finish(seq, "cancelled")
            elif (
                self.queue_timeout_s > 0
                and seq.state is SeqState.WAITING
                and seq.waited(now) > self.queue_timeout_s
            ):
                self._fail(seq, f"timed out after waiting {seq.waited(now):.1f} s for a free slot (queue_timeout_s={self.queue_timeout_s}); retry later")

    def _append_token(self, seq: Sequence, token: int, logprob: float, now: float, step_s: float) -> bool:
        """Add one generated token; False when the sequence finished with it."""
        if seq.first_token_time is None:
            seq.first_token_time = now
            if self.observer:
                self.observer.on_first_token(now - seq.request.arrival)
        seq.last_token_time = now
        row = seq.sampler_row
        if row.eos_id is not None and token == row.eos_id:
            self._finish(seq, "stop")
            return False
        seq.output_ids.append(token)
        row.token_ids.append(token)
        row.num_generated += 1
        self.stats.tokens_generated += 1
        if self.observer:
            self.observer.on_token()
        text = seq.detok.add([token])
        self._report(seq, text, [token], [logprob] if seq.request.params.return_log_probs else [])
        if seq.detok.stopped:
            self._finish(seq, "stop")
            return False
        if len(seq.output_ids) >= seq.request.params.max_tokens or seq.num_tokens >= self.max_context:
            self._finish(seq, "length")
            return False
        return True

    def _report(self, seq: Sequence, text: str, ids: list[int], logprobs: list[float]) -> None:
        """Accumulate; a streaming request gets an event as soon as there is text to show
        (tokens whose text is held back, an incomplete character, ride with the next one)."""
        seq.pending_text.append(text)
        seq.pending_ids.extend(ids)
        seq.pending_log_probs.extend(logprobs)
        if seq.request.stream and text:
            self._emit(seq, GenerationEvent(seq.id, **self._take_pending(seq)))

    @staticmethod
    def _take_pending(seq: Sequence) -> dict:
        out = {"text": "".join(seq.pending_text), "token_ids": seq.pending_ids, "log_probs": seq.pending_log_probs}
        seq.pending_text, seq.pending_ids, seq.pending_log_probs = [], [], []
        return out

    def _finish(self, seq: Sequence, reason: str) -> None:
        if seq.state is SeqState.FINISHED:
            return
        tail = "" if reason == "cancelled" else seq.detok.flush()
        self._release(seq)
        self._by_id.pop(seq.id, None)
        self.stats.finished[reason] = self.stats.finished.get(reason, 0) + 1
        if self.observer:
            n = len(seq.output_ids)
            tpot = (seq.last_token_time - seq.first_token_time) / (n - 1) if n > 1 and seq.first_token_time else None
            self.observer.on_finish(reason, tpot)
        seq.pending_text.append(tail)
        self._emit(
            seq,
            GenerationEvent(
                seq.id,
                **self._take_pending(seq),
                finished=True,
                finish_reason=reason,
                num_input_tokens=len(seq.request.prompt_ids),
                num_output_tokens=len(seq.output_ids),
                draft_tokens=seq.draft_tokens,
                accepted_draft_tokens=seq.accepted_draft_tokens,
            ),
        )

    def _release(self, seq: Sequence) -> None:
        """Leave the batch and give back the cache (the draft's too)."""
        self.scheduler.finish(seq)
        if self.drafter is not None:
            self.drafter.on_free(seq.id)

    def _fail(self, seq: Sequence, message: str) -> None:
        if seq.state is SeqState.FINISHED:
            return
        self._release(seq)
        self._by_id.pop(seq.id, None)
        self.stats.finished["error"] = self.stats.finished.get("error", 0) + 1
        if self.observer:
            self.observer.on_finish("error", None)
        self._emit(
            seq,
            GenerationEvent(
                seq.id,
                finished=True,
                finish_reason="error",
                error=message,
                num_input_tokens=len(seq.request.prompt_ids),
                num_output_tokens=len(seq.output_ids),
            ),
        )

    def _emit(self, seq: Sequence, event: GenerationEvent) -> None:
        try:
            seq.request.on_event(event)
        except Exception:  # a broken client callback must not take the loop down
            log.exception("event callback failed for request %s", seq.id)
