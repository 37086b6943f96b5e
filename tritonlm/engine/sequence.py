"""One request's life inside the engine."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from tritonlm.engine.detok import IncrementalDetokenizer
from tritonlm.engine.request import GenerationRequest
from tritonlm.engine.sampler import RowState


class SeqState(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    request: GenerationRequest
    detok: IncrementalDetokenizer
    sampler_row: RowState
    reserve_tokens: int  # KV cache tokens reserved at admission (prompt + max_tokens)
    state: SeqState = SeqState.WAITING
    output_ids: list[int] = field(default_factory=list)
    output_log_probs: list[float] = field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V are in the cache
    cancelled: bool = False
    first_token_time: float | None = None
    last_token_time: float | None = None
    # non-streaming requests: what accumulates until the single final report
    pending_text: list[str] = field(default_factory=list)
    pending_ids: list[int] = field(default_factory=list)
    pending_log_probs: list[float] = field(default_factory=list)
    # speculative decoding bookkeeping
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    spec_k: int = 0  # current adaptive draft length

    @property
    def id(self) -> int:
        return self.request.request_id

    @property
    def all_ids(self) -> list[int]:
        return self.request.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.request.prompt_ids) + len(self.output_ids)

    @property
    def pending_tokens(self) -> list[int]:
        """Tokens not yet in the KV cache: the prompt (prefill) or the last sampled token."""
        return self.all_ids[self.num_computed :]

    @property
    def in_prefill(self) -> bool:
        return self.num_computed < len(self.request.prompt_ids)

    def waited(self, now: float | None = None) -> float:
        return (now or time.monotonic()) - self.request.arrival
