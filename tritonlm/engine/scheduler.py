"""Who runs in the next forward pass, and the one owner of the KV cache accounting.

Continuous (iteration-level) batching: the waiting queue is bounded and ordered by
each request's priority (lower first), FIFO among equal priorities; its head is admitted
when the KV cache can reserve everything it may need (prompt + max_tokens), so a running
sequence never fails for lack of cache.
Each step every running sequence brings its pending tokens: decoding ones one
token each (they go first, so streams never stall), prefilling ones a chunk of
their prompt from what is left of the step's token budget (chunked prefill
keeps a long prompt from freezing everyone else's stream).

With latency SLOs set (slo_ttft_ms / slo_tpot_ms), an SloController (slo/) chooses the
step's token budget and the running cap within those two limits, and sheds at arrival a
request that would miss its time to first token behind the work queued ahead of it (of better
or equal priority); the engine reports each finished step.

The scheduler is the only component that allocates, frees, advances or rolls back
a sequence's cache: the engine, the executor and the drafter ask it for batches
(slot tables built from its block tables) and report what a pass wrote.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass
from typing import Callable

from tritonlm.engine.batch import StepBatch
from tritonlm.engine.host_tensors import int64_tensor
from tritonlm.engine.kv_cache import KVCacheManager, block_digest
from tritonlm.engine.request import ServerBusyError
from tritonlm.engine.sequence import Sequence, SeqState
from tritonlm.engine.slo import InFlightStep, LatencyLedger, SloController, SloShedError, SloTargets


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64  # sequences in one forward pass
    max_num_batched_tokens: int = 512  # new tokens in one forward pass (decode + prefill chunks)
    max_queue_size: int = 1024  # waiting requests; past it: "server busy"
    # latency SLOs (slo/); None: not set. With either set, the two limits above become
    # ceilings that the SLO controller sizes each step under
    slo_ttft_s: float | None = None
    slo_tpot_s: float | None = None
    # distinct LoRA adapters among the running sequences, so in any one step (0: no limit);
    # a request under another adapter waits at the head of the queue until one leaves
    max_loras: int = 0


ScheduledBatch = list[tuple[Sequence, int]]  # (sequence, how many of its pending tokens run this step)


class Scheduler:
    def __init__(self, config: SchedulerConfig, cache: KVCacheManager, recompute: bool = False):
        """recompute=True (benchmark baseline, use_kv_cache=false): every step forgets the
        cache and runs each sequence's whole history again."""
        self.config = config
        self.cache = cache
        self.recompute = recompute
        self.clock: Callable[[], float] = time.monotonic  # the clock of requests' arrival times
        # the step in flight, with an SLO: (its plan, when it was scheduled by clock, its
        # predicted seconds, each prompt's cached positions after it); None between steps. A
        # request that arrives during it joins a later one (read off the engine thread by check_slo)
        self.step_in_flight: tuple[ScheduledBatch, float, float, dict[int, int]] | None = None
        if recompute:
            cache.prefix_caching = False  # recomputing rewrites every block: nothing may be shared
        # priority order, arrival order among equals (add keeps it sorted, stably)
        self.waiting: collections.deque[Sequence] = collections.deque()
        # prompt tokens -> which tables of the model's length-dependent RoPE rotate such a
        # sequence's keys (None: a short sequence's); set by the Engine from its runner
        self.rope_key: Callable[[int], bytes | None] | None = None
        # Phi-3's longrope threshold, where a sequence that passes it runs again whole (rotate_again)
        self.rope_recompute_at: int | None = None
        self.running: list[Sequence] = []
        self._live: dict[int, Sequence] = {}  # waiting + running, by request id
        targets = SloTargets(config.slo_ttft_s, config.slo_tpot_s)
        self.ledger = LatencyLedger(targets)  # what each request got, for the metrics
        self.slo = SloController(targets, config.max_num_seqs, config.max_num_batched_tokens) if targets.active else None

    def forget_steps(self) -> None:
        """Forget the steps run so far (Engine.forget_steps): the SLO ledger, the prefix
        cache's hit counts and the step in flight (a step that failed never ended it); the
        SLO controller keeps its step-time model (SloController.forget_load)."""
        self.ledger = LatencyLedger(self.ledger.targets)
        self.cache.hit_tokens = self.cache.query_tokens = 0
        self.step_in_flight = None
        if self.slo is not None:
            self.slo.forget_load()

    # ---- the queue -------------------------------------------------------------------
    def check_room(self, pending: int) -> None:
        """ServerBusyError unless one more request may wait behind `pending` others.

        max_queue_size counts requests that must really wait: those the next admission
        round can start right away (free running slots) are extra."""
        free_slots = max(0, self.config.max_num_seqs - len(self.running))
        if pending >= self.config.max_queue_size + free_slots:
            raise ServerBusyError(
                f"server busy: {pending} requests already waiting "
                f"(max_queue_size={self.config.max_queue_size}); retry later"
            )

    def check_slo(self, seq: Sequence, queued: list[Sequence]) -> None:
        """SloShedError when the request would miss slo_ttft behind the waiting queue and
        `queued` (accepted, not yet in it); the controller counts only those that will run
        before it (its priority decides). Called off the engine thread: the lists are
        copied; read while a step runs, the sequences' counts are those before it, so the
        plan counts that step's work as still to come, less the part of it already run, and
        the request joins the step after it. The time since its arrival counts too (a
        request judged after it waited)."""
        if self.slo is None:
            return
        now, record = self.clock(), self.step_in_flight
        gone = max(0.0, now - seq.request.arrival)
        in_flight = None
        if record is not None:
            _, at, step_s, after = record
            in_flight = InFlightStep(step_s, max(0.0, step_s - (now - at)), after)
        try:
            planned = self.slo.admit(seq.num_prompt_tokens, list(self.running), list(self.waiting) + list(queued),
                                     priority=seq.request.priority, elapsed_s=gone, in_flight=in_flight, now=now)
        except SloShedError:
            self.ledger.shed += 1
            raise
        seq.slo_plan = (gone, planned) if planned is not None else None

    def add(self, seq: Sequence) -> None:
        """Queue a request the caller let in with check_room: behind every waiting request of
        better or equal priority, ahead of those of worse."""
        at = len(self.waiting)
        # from the tail: with equal priorities (the usual case) this is an append
        while at > 0 and self.waiting[at - 1].request.priority > seq.request.priority:
            at -= 1
        self.waiting.insert(at, seq)
        self._live[seq.id] = seq

    def get(self, request_id: int) -> Sequence | None:
        return self._live.get(request_id)

    def sequences(self) -> list[Sequence]:
        """Every live sequence, waiting or running."""
        return list(self._live.values())

    # ---- each step ---------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        """Admit what fits, then (sequence, number of its pending tokens to run) for this step."""
        if self.cache.prefix_caching:
            for seq in self.running:
                self._register_full_blocks(seq)
        # the SLO's budget and running cap, from the batch before this step's admissions
        budget = self.slo.decide(self.running).budget if self.slo is not None else self.config.max_num_batched_tokens
        self.rotate_again()
        self._admit()
        if self.recompute:
            for seq in self.running:
                if not seq.in_prefill:
                    seq.num_computed = 0
        plan: ScheduledBatch = []
        prefilling = []
        for seq in self.running:
            if seq.in_prefill and not self.recompute:
                prefilling.append(seq)
            elif seq.last_token_pending:  # it finishes when its token is read: nothing to run
                continue
            else:
                n = seq.num_pending
                plan.append((seq, n))
                budget -= n
        # no first token pushed past slo_ttft, no chunk that pays mostly for its pass
        if prefilling and self.slo is not None and budget > 0:
            context = sum(seq.num_computed + n for seq, n in plan)  # the decoding rows' positions after the step
            budget = self.slo.deadline_tokens(prefilling, budget, len(plan), context, self.clock())
            budget = self.slo.pass_tokens(prefilling, budget, len(plan), context)
        for seq in prefilling:  # oldest first
            if budget <= 0:
                break
            n = min(seq.num_pending, budget)
            plan.append((seq, n))
            budget -= n
        if not plan and prefilling:  # budget smaller than one decode round: still make progress
            seq = prefilling[0]
            plan.append((seq, min(seq.num_pending, self.config.max_num_batched_tokens)))
        if self.slo is not None and plan:  # an empty plan leaves a step still on the device in flight
            after = {seq.id: seq.num_computed + n for seq, n in plan if seq.in_prefill}
            self.step_in_flight = (plan, self.clock(), self.slo.plan_s(plan), after)
        return plan

    def step_ended(self, plan: ScheduledBatch) -> None:
        """`plan` has run (or failed): it is no longer the step in flight, unless a later
        one has taken its place (schedule_ahead launches the next before this one ends)."""
        record = self.step_in_flight
        if record is not None and record[0] is plan:
            self.step_in_flight = None

    def rotate_again(self) -> None:
        """Phi-3 with longrope: transformers' generate() drops its cache and runs the whole
        sequence again, with the long factors, when a sequence first passes
        original_max_position_embeddings; so does this. Such a sequence leaves the batch,
        gives its blocks back (shared or cached ones stay as they were: rotated by the short
        factors) and waits at the head of the queue to run again from position 0 with the
        tables of its length (rope_len), its prefix-cache chain that of the long factors."""
        at = self.rope_recompute_at
        if at is None:
            return
        for seq in [s for s in self.running if s.rope_length <= at < s.num_tokens and s.num_computed <= at]:
            self.running.remove(seq)
            self.cache.free(seq.id)
            seq.rope_len = seq.num_tokens
            seq.num_computed = seq.draft_computed = seq.num_registered_blocks = 0
            seq.block_digests = []
            seq.state = SeqState.WAITING
            self.waiting.appendleft(seq)

    def step_done(self, plan: ScheduledBatch, seconds: float, computed: list[int] | None = None,
                  passes: int | None = None) -> None:
        """The engine ran `plan` in `seconds` (its outputs processed): the step-time model
        learns from it and the ledger takes each row's gap since its previous token.
        computed: each row's cached positions right after the step's passes (a step whose
        tokens were read a step later, when later passes have moved them); None: as now.
        passes: the forward passes the executor ran it in (None: not known)."""
        self.step_ended(plan)
        self.ledger.step_done([seq for seq, _ in plan if seq.state is not SeqState.FINISHED])
        if self.slo is not None:
            if computed is None:
                computed = [seq.num_computed for seq, _ in plan]
            # a row that started the pass past its prompt decodes (a speculative verify row
            # counts as one: its guesses run in the decode pass); each row's cached positions
            # after the pass are what its attention read
            decoding = [c for (seq, n), c in zip(plan, computed) if c - n >= seq.num_prompt_tokens]
            tokens = sum(n for _, n in plan)
            self.slo.observe_step(tokens - len(decoding), len(decoding), sum(computed), seconds,
                                  decode_context=sum(decoding), second_pass=None if passes is None else passes > 1)

    def _admit(self) -> None:
        """Move waiting sequences to running, in queue order (priority, then arrival), while
        their cache reservation fits.
        With prefix caching, the prompt's cached leading blocks are shared and count only once."""
        cap = self.slo.cap if self.slo is not None else self.config.max_num_seqs
        while self.waiting and len(self.running) < cap:
            seq = self.waiting[0]
            if not self._adapter_fits(seq):
                break  # head-of-line waits, as for cache room: another adapter's request leaves first
            prompt = seq.request.prompt_ids
            if self.cache.prefix_caching and not seq.block_digests:
                seq.block_digests = self.cache.prompt_digests(prompt, self._chain_root(seq))
            # a prompt whose log-probabilities are asked runs whole: cached positions have no logits
            hits = [] if seq.request.params.prompt_log_probs is not None else self.cache.find_prefix(seq.block_digests, prompt)
            if not self.cache.can_allocate(seq.reserve_tokens, hits):
                break  # head-of-line waits: later, smaller requests must not starve it
            self.waiting.popleft()
            self.cache.allocate(seq.id, seq.reserve_tokens, hits)
            seq.num_computed = seq.num_cached_tokens = len(hits) * self.cache.block_size  # prefill starts after them
            if self.cache.prefix_caching:
                self.cache.query_tokens += len(prompt)
                self.cache.hit_tokens += seq.num_cached_tokens
            seq.state = SeqState.RUNNING
            self.running.append(seq)

    def _adapter_fits(self, seq: Sequence) -> bool:
        """Running `seq` keeps the running sequences' distinct LoRA adapters within max_loras."""
        adapter, limit = seq.request.lora, self.config.max_loras
        if adapter is None or limit <= 0:
            return True
        running = {s.request.lora.digest for s in self.running if s.request.lora is not None}  # by content
        return adapter.digest in running or len(running) < limit

    def _register_full_blocks(self, seq: Sequence) -> None:
        """Offer the sequence's newly completed blocks to the prefix cache: those whose K/V
        are final (computed, and the token ids there accepted, not speculative guesses)."""
        bs = self.cache.block_size
        final = min(seq.num_computed, seq.num_tokens)
        for i in range(seq.num_registered_blocks, final // bs):
            if i >= len(seq.block_digests):
                parent = seq.block_digests[-1] if seq.block_digests else self._chain_root(seq)
                seq.block_digests.append(block_digest(parent, seq.token_ids[i * bs : (i + 1) * bs]))
            self.cache.register(seq.id, i, seq.block_digests[i], seq.token_ids[i * bs : (i + 1) * bs])
        seq.num_registered_blocks = max(seq.num_registered_blocks, final // bs)

    def _chain_root(self, seq: Sequence) -> bytes:
        """Where the sequence's prefix-cache chain starts: its LoRA adapter's content keys it,
        and under a length-dependent RoPE the tables its prompt's length chose (rope_key)."""
        rope = None if self.rope_key is None else self.rope_key(seq.rope_length)
        return self.cache.chain_root(getattr(seq.request.lora, "digest", None), rope)

    def batch(self, rows: list[tuple[Sequence, list[int]]], past: list[int], all_logits: bool = False) -> StepBatch:
        """A forward pass's batch: rows[b] = (sequence, new tokens) on top of past[b] cached
        tokens (the target's num_computed, or a drafter's own count); each row under its
        request's LoRA adapter, if any (StepBatch.adapters)."""
        ids = [seq.id for seq, _ in rows]
        lengths = [p + len(toks) for (_, toks), p in zip(rows, past)]
        if self.cache.device_table is not None:  # the runner maps slots on its device
            blocks = self.cache.device_table.gather(ids)  # [B, M] int32
            batch = StepBatch.from_block_table([toks for _, toks in rows], past, blocks, self.cache.block_size, all_logits)
        else:
            table = self.cache.slot_table(ids, lengths)  # [B, L]
            batch = StepBatch.from_slot_table([toks for _, toks in rows], past, table, all_logits)
        window = self.cache.window_group  # the windowed layers' rings (window_kv.py), when kept apart
        if window is not None and window.device_table is not None:
            batch.window_block_table = window.device_table.gather(ids)  # [B, M'] int32
        elif window is not None:
            batch.window_slot_table = window.slot_table(ids, lengths)  # [B, L]
        batch.prompt_lens = int64_tensor([seq.rope_length for seq, _ in rows])
        adapters = [seq.request.lora for seq, _ in rows]
        if any(a is not None for a in adapters):
            batch.adapters = adapters
        return batch

    def advance(self, seq: Sequence, num_tokens: int) -> None:
        """A pass wrote num_tokens more positions of the sequence's cache."""
        seq.num_computed += num_tokens
        if seq.num_computed > self.cache.capacity(seq.id):
            raise AssertionError(f"sequence {seq.id} wrote past its reservation")

    def rollback(self, seq: Sequence, keep: int) -> None:
        """Keep the first `keep` cached tokens (speculative rejection); later writes overwrite."""
        if not 0 <= keep <= seq.num_computed:
            raise ValueError(f"cannot roll sequence {seq.id} back from {seq.num_computed} to {keep} tokens")
        seq.num_computed = keep

    def first_token(self, seq: Sequence) -> None:
        """The sequence's first token came (seq.first_token_time is set): where admission
        planned it step by step, the controller learns at once how its plan held, so that
        plans stretch within a few first tokens of a change of pace."""
        if self.slo is not None and seq.slo_plan is not None:
            gone, planned = seq.slo_plan
            seq.slo_plan = None
            self.slo.plan_kept(planned, seq.first_token_time - seq.request.arrival - gone)

    def finish(self, seq: Sequence, reason: str | None = None) -> None:
        """Leave the batch or the queue now and give the cache back; `reason` (stop, length,
        cancelled, error) decides whether the ledger judges it against the SLOs."""
        self.ledger.finished(seq, reason)
        if self.slo is not None and reason in ("stop", "length"):
            self.slo.request_finished(seq.num_output_tokens, seq.request.params.max_tokens)
        if seq.state is SeqState.RUNNING:
            if self.cache.prefix_caching:
                self._register_full_blocks(seq)  # what its last step completed: a next turn may reuse it
            self.running.remove(seq)
            self.cache.free(seq.id)
        elif seq.state is SeqState.WAITING:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        self._live.pop(seq.id, None)
        seq.state = SeqState.FINISHED

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)
