"""One request's life inside the engine."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from tritonlm.engine.detok import IncrementalDetokenizer
from tritonlm.engine.guided import GuideState
from tritonlm.engine.request import GenerationRequest
from tritonlm.engine.sampler import RowState


class SeqState(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    request: GenerationRequest
    token_ids: list[int]  # prompt + generated: THE token history (sampling and detok share this list)
    sampling: RowState  # sampler settings and the row's seed, over token_ids
    detok: IncrementalDetokenizer  # reads token_ids
    reserve_tokens: int  # KV cache tokens reserved at admission (prompt + max_tokens)
    spec_k_max: int = 0  # speculative decoding: this request's longest draft (0: off)
    spec_k: int = 0  # current adaptive draft length
    state: SeqState = SeqState.WAITING
    num_computed: int = 0  # tokens whose K/V are in the cache (moved only by the Scheduler)
    draft_computed: int = 0  # tokens whose K/V are in the draft model's cache (moved by its drafter)
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at admission
    block_digests: list[bytes] = field(default_factory=list)  # chain digests of its full blocks so far
    num_registered_blocks: int = 0  # leading blocks offered to the prefix cache
    # a length-dependent RoPE's length for this sequence's tables (runners.rope): its prompt's,
    # until a Phi-3 sequence passes its threshold and runs again whole (Scheduler.rotate_again)
    rope_len: int | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    # with an SLO: (seconds since its arrival when admitted, the planned seconds from then to
    # its first token), where admission planned it step by step (SloController.plan_kept)
    slo_plan: tuple[float, float] | None = None
    # what is generated but not yet sent: streaming requests send it as soon as it holds
    # text; the others keep it until the single final response
    pending_text: list[str] = field(default_factory=list)
    pending_ids: list[int] = field(default_factory=list)
    pending_log_probs: list[float] = field(default_factory=list)
    pending_top_log_probs: list[list[tuple[int, float]]] = field(default_factory=list)
    pending_ranks: list[int | None] = field(default_factory=list)
    # with prompt_log_probs: filled by the executor as the prefill chunks run (the first prompt
    # token's entry is None: nothing predicts it), sent with the first event
    prompt_log_probs: list[float | None] | None = None
    prompt_top_log_probs: list[list[tuple[int, float]]] | None = None
    prompt_log_probs_sent: bool = False
    # scheduled ahead (Engine's schedule_ahead): the token still on the device is its last
    # (max_tokens or the context), so it runs no more steps; it finishes once the token is read
    last_token_pending: bool = False
    draft_tokens: int = 0  # speculative decoding: guesses proposed / accepted so far
    accepted_draft_tokens: int = 0
    # the request's id and prompt length, read many times per row in every step: plain
    # attributes, set once (a request's prompt does not change)
    id: int = field(init=False)
    num_prompt_tokens: int = field(init=False)

    def __post_init__(self) -> None:
        self.id = self.request.request_id
        self.num_prompt_tokens = len(self.request.prompt_ids)

    @staticmethod
    def create(request: GenerationRequest, tokenizer, eos_id: int | None, spec_k_max: int = 0,
               guide: GuideState | None = None) -> "Sequence":
        history = list(request.prompt_ids)
        scored = request.params.prompt_log_probs is not None
        return Sequence(
            request=request,
            token_ids=history,
            sampling=RowState.make(request.params, history, eos_id, guide),
            detok=IncrementalDetokenizer(tokenizer, history, request.params.stop_words),
            reserve_tokens=len(history) + request.params.max_tokens,
            spec_k_max=spec_k_max,
            spec_k=spec_k_max,
            prompt_log_probs=[None] if scored else None,
            prompt_top_log_probs=[[]] if scored else None,
        )

    @property
    def rope_length(self) -> int:
        return self.num_prompt_tokens if self.rope_len is None else self.rope_len

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_pending(self) -> int:
        """len(pending_tokens), without the copy."""
        return max(len(self.token_ids) - self.num_computed, 0)

    @property
    def pending_tokens(self) -> list[int]:
        """Tokens not yet in the KV cache: the prompt (prefill) or the last sampled token."""
        return self.token_ids[self.num_computed :]

    @property
    def scores_prompt(self) -> bool:
        """Its prompt's log-probabilities are asked for and not all computed yet."""
        return self.prompt_log_probs is not None and len(self.prompt_log_probs) < self.num_prompt_tokens

    @property
    def in_prefill(self) -> bool:
        return self.num_computed < self.num_prompt_tokens

    def waited(self, now: float | None = None) -> float:
        return (now or time.monotonic()) - self.request.arrival
