"""What a client asks for and what the engine reports back: plain data, no Triton types."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Callable

_ids = itertools.count(1)


MIN_TEMPERATURE = 1e-5  # below it: greedy
MAX_TOP_LOG_PROBS = 20  # OpenAI's limit for top_logprobs
REPETITION_PENALTY_RANGE = (0.01, 100.0)  # beyond it the penalised logits overflow or vanish
# a request's priority (vLLM's `priority`): lower is served earlier. An order needs only a few
# classes; a bound keeps the value well inside INT32 and the same on every path that takes it
PRIORITY_RANGE = (-1000, 1000)


class InvalidRequestError(ValueError):
    """Bad input from a client; the message names the input and what is allowed."""


class ServerBusyError(RuntimeError):
    """The waiting queue is full: the client should retry later."""


GUIDE_KINDS = ("json_schema", "json_object", "regex", "grammar", "choice")


@dataclass(frozen=True)
class GuidedDecoding:
    """A constraint on the answer's text (structured output): the sampler only lets through
    tokens that keep the text inside it.

    kind:
      - "json_schema": `spec` is a JSON Schema (a JSON string);
      - "json_object": any JSON object (`spec` is empty);
      - "regex": `spec` is a regular expression the whole answer must match;
      - "grammar": `spec` is a grammar (EBNF / GBNF, or Lark where the library takes it);
      - "choice": `spec` is a JSON list of strings; the answer is exactly one of them.
    """

    kind: str
    spec: str = ""
    # JSON kinds: no whitespace between JSON tokens (vLLM's disable_any_whitespace); otherwise
    # the bounded whitespace of tritonlm/engine/guided.py
    compact: bool = False

    def validate(self) -> None:
        if self.kind not in GUIDE_KINDS:
            raise InvalidRequestError(f"guided_decoding: kind must be one of {', '.join(GUIDE_KINDS)}, got {self.kind!r}")
        if self.kind != "json_object" and not self.spec:
            raise InvalidRequestError(f"guided_decoding: a {self.kind} guide needs its text, got an empty one")


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float | None = None  # None or 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    end_id: int | None = None  # None: the tokenizer's EOS; -1: never stop on a token
    stop_words: tuple[str, ...] = ()
    bad_words: tuple[tuple[int, ...], ...] = ()  # token id sequences that must never be produced
    return_log_probs: bool = False
    # with return_log_probs: also the this-many most likely tokens at each position, from the
    # model's raw logits (log_softmax), as OpenAI's top_logprobs and vLLM's logprobs=N
    top_log_probs: int = 0
    # OpenAI's penalties, counted over the answer so far (not the prompt): a token's logit
    # loses frequency_penalty x its count, and presence_penalty once it has appeared
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    min_p: float = 0.0  # drop tokens below min_p x the most likely one's probability; 0: off
    stop_token_ids: tuple[int, ...] = ()  # producing one ends the answer (finish_reason stop), like EOS
    guided: GuidedDecoding | None = None  # structured output: the answer stays inside this guide
    # the prompt's log-probabilities (vLLM's prompt_logprobs): None off; 0 each prompt token's
    # own; N also the N most likely tokens there. Such a prompt skips the prefix cache (a
    # cached position has no logits) and its prefill keeps every position's logits.
    prompt_log_probs: int | None = None

    @property
    def changes_logits(self) -> bool:
        """Something changes the raw logits before the choice (greedy may then differ from argmax)."""
        return (self.repetition_penalty != 1.0 or bool(self.frequency_penalty) or bool(self.presence_penalty)
                or bool(self.logit_bias))

    @property
    def greedy(self) -> bool:
        # a temperature this small is greedy in effect, and dividing by it would overflow
        return not self.temperature or self.temperature < MIN_TEMPERATURE or self.top_k == 1

    def validate(self) -> None:
        if self.max_tokens <= 0:
            raise InvalidRequestError(f"max_tokens: must be >= 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise InvalidRequestError(f"min_tokens: must be >= 0, got {self.min_tokens}")
        if self.temperature is not None and (self.temperature < 0 or self.temperature != self.temperature):
            raise InvalidRequestError(f"temperature: must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise InvalidRequestError(f"top_k: must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p: must be in (0, 1], got {self.top_p}")
        lo, hi = REPETITION_PENALTY_RANGE
        if not lo <= self.repetition_penalty <= hi:
            raise InvalidRequestError(f"repetition_penalty: must be in [{lo:g}, {hi:g}] (1 = off), got {self.repetition_penalty}")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise InvalidRequestError(f"{name}: must be in [-2, 2] (0 = off), got {value}")
        for token, bias in self.logit_bias:
            if token < 0 or not -100.0 <= bias <= 100.0:
                raise InvalidRequestError(f"logit_bias: token ids must be >= 0 and biases in [-100, 100], got {token}: {bias}")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError(f"min_p: must be in [0, 1] (0 = off), got {self.min_p}")
        if any(t < 0 for t in self.stop_token_ids):
            raise InvalidRequestError(f"stop_token_ids: token ids must be >= 0, got {list(self.stop_token_ids)}")
        if not 0 <= self.top_log_probs <= MAX_TOP_LOG_PROBS:
            raise InvalidRequestError(f"top_log_probs: must be in [0, {MAX_TOP_LOG_PROBS}], got {self.top_log_probs}")
        if self.guided is not None:
            self.guided.validate()
        if self.prompt_log_probs is not None and not 0 <= self.prompt_log_probs <= MAX_TOP_LOG_PROBS:
            raise InvalidRequestError(
                f"prompt_log_probs: must be in [0, {MAX_TOP_LOG_PROBS}] (alternatives per prompt token), got {self.prompt_log_probs}")
        if self.min_tokens > self.max_tokens:
            raise InvalidRequestError(f"min_tokens: {self.min_tokens} is more than max_tokens={self.max_tokens}")


def check_priority(value: object, name: str = "priority") -> int:
    """The priority as an int, or InvalidRequestError naming `name` (the field as sent)."""
    lo, hi = PRIORITY_RANGE
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(f"{name}: expected an integer in [{lo}, {hi}] (lower is served earlier), "
                                  f"got {type(value).__name__}")
    if not lo <= value <= hi:
        raise InvalidRequestError(f"{name}: must be in [{lo}, {hi}] (lower is served earlier, 0 the default), got {value}")
    return value


@dataclass
class GenerationEvent:
    """One report to the client: new text (maybe empty) and, at the end, why it finished."""

    request_id: int
    text: str = ""  # new text since the previous event
    token_ids: list[int] = field(default_factory=list)  # new token ids since the previous event
    log_probs: list[float] = field(default_factory=list)
    # with top_log_probs N: for each token, the N most likely (token id, log-probability)
    top_log_probs: list[list[tuple[int, float]]] = field(default_factory=list)
    # with return_log_probs: each token's rank in the vocabulary by raw log-probability (1: the
    # most likely, as vLLM's Logprob.rank); None for a token a speculative verify made (not ranked)
    ranks: list[int | None] = field(default_factory=list)
    # with prompt_log_probs, on the first event only: each prompt token's log-probability (None
    # for the first token, which nothing predicts) and, with N, the N most likely there
    prompt_log_probs: list[float | None] | None = None
    prompt_top_log_probs: list[list[tuple[int, float]]] | None = None
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "cancelled" | "error"
    error: str | None = None
    num_input_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    draft_tokens: int = 0  # speculative decoding: proposed so far
    accepted_draft_tokens: int = 0


EventCallback = Callable[[GenerationEvent], None]


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    params: SamplingParams
    on_event: EventCallback
    stream: bool = True  # False: the engine reports once, at the end
    request_id: int = field(default_factory=lambda: next(_ids))
    arrival: float = field(default_factory=time.monotonic)
    num_draft_tokens: int | None = None  # speculative decoding: None = model default, 0 = off
    is_cancelled: Callable[[], bool] | None = None  # asked by the CancellationPoller (client gone / cancelled)
    # the lora.LoraAdapter the request runs under, loaded for this engine's model; None: the base.
    # A lora.registry.PendingAdapter (still loading) parks the request in Engine.submit until it is
    # ready; the engine then puts the loaded adapter here
    lora: object | None = None
    # lower is admitted earlier (vLLM's `priority`); equal priorities keep their arrival order
    priority: int = 0
