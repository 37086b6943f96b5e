"""Who runs in the next forward pass.

Continuous (iteration-level) batching: the waiting queue is FIFO and bounded;
a waiting request is admitted when the KV cache can reserve everything it may
need (prompt + max_tokens), so a running sequence never fails for lack of cache.
Each step every running sequence brings its pending tokens: decoding ones one
token each (they go first, so streams never stall), prefilling ones a chunk of
their prompt from what is left of the step's token budget (chunked prefill
keeps a long prompt from freezing everyone else's stream).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

from tritonlm.engine.kv_cache import KVCacheManager
from tritonlm.engine.request import ServerBusyError
from tritonlm.engine.sequence import Sequence, SeqState


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64  # sequences in one forward pass
    max_num_batched_tokens: int = 512  # new tokens in one forward pass (decode + prefill chunks)
    max_queue_size: int = 1024  # waiting requests; past it: "server busy"


class Scheduler:
    def __init__(self, config: SchedulerConfig, cache: KVCacheManager):
        self.config = config
        self.cache = cache
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []

    def queue_room(self, pending: int) -> bool:
        """May one more request wait? max_queue_size counts requests that must really wait:
        those the next admission round can start right away (free running slots) are extra."""
        free_slots = max(0, self.config.max_num_seqs - len(self.running))
        return pending < self.config.max_queue_size + free_slots

    def add(self, seq: Sequence) -> None:
        if not self.queue_room(len(self.waiting)):
            raise ServerBusyError(
                f"server busy: {len(self.waiting)} requests already waiting (max_queue_size={self.config.max_queue_size}); retry later"
            )
        self.waiting.append(seq)

    def admit(self) -> list[Sequence]:
        """Move waiting sequences to running, oldest first, while their cache reservation fits."""
        admitted = []
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if not self.cache.can_allocate(seq.reserve_tokens):
                break  # head-of-line waits: later, smaller requests must not starve it
            self.waiting.popleft()
            self.cache.allocate(seq.id, seq.reserve_tokens)
            seq.state = SeqState.RUNNING
            self.running.append(seq)
            admitted.append(seq)
        return admitted

    def schedule(self) -> list[tuple[Sequence, int]]:
        """(sequence, number of its pending tokens to run) for this step."""
        budget = self.config.max_num_batched_tokens
        plan: list[tuple[Sequence, int]] = []
        prefilling = []
        for seq in self.running:
            if seq.in_prefill:
                prefilling.append(seq)
            else:
                n = len(seq.pending_tokens)
                plan.append((seq, n))
                budget -= n
        for seq in prefilling:  # oldest first
            if budget <= 0:
                break
            n = min(len(seq.pending_tokens), budget)
            plan.append((seq, n))
            budget -= n
        if not plan and prefilling:  # budget smaller than one decode round: still make progress
            seq = prefilling[0]
            plan.append((seq, min(len(seq.pending_tokens), self.config.max_num_batched_tokens)))
        return plan

    def finish(self, seq: Sequence) -> None:
        """Leave the batch now and give the cache back."""
        if seq.state is SeqState.RUNNING:
            self.running.remove(seq)
            self.cache.free(seq.id)
        elif seq.state is SeqState.WAITING:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        seq.state = SeqState.FINISHED

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)
