"""A stand-in for the Triton bridge (tritonlm/openai/triton.py) behind the OpenAI app: it has
the Backend interface (tritonlm/openai/backend.py) and answers each generation from a
Script, in the form the bridge gives Triton's responses:

- stream (asked when the client streams, or wants log-probabilities): one Piece per token,
  the last one final, carrying finish_reason and the token counts (the model puts the final
  flag on its last token's response, tritonlm/glue/generate.py);
- not stream: one final Piece with the whole text;
- log-probabilities when sampling_parameters asks (`logprobs`: the chosen token's, and that
  many most likely (id, log-probability)); the prompt's when it asks `prompt_logprobs`;
- max_tokens cuts the answer, finish_reason length.

Every generation is recorded (prompt, sampling, stream) with whether it was cancelled; the
flags are threading.Events, so a test on another thread than the app's (starlette's
TestClient runs the app on its own) can wait for them.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from typing import Callable

from tritonlm.openai.errors import OpenAIError, model_not_found
from tritonlm.openai.triton import Piece, ServedModel, with_adapters

HANG_GUARD_S = 30.0  # reached only by a hang: every wait is for something that does happen


@dataclass
class Script:
    """One generation's answer."""

    tokens: list[str]  # the answer's token texts, in order
    finish_reason: str = "stop"  # when it is not cut by max_tokens
    prompt_tokens: int = 5
    cached_tokens: int = 0
    # token i's log-probability (default -(i + 1) / 10) and its most likely alternatives (ids)
    log_probs: list[float] | None = None
    top_ids: list[int] = field(default_factory=lambda: [7, 8, 9, 10, 11])
    prompt_ids: list[int] = field(default_factory=lambda: [1, 2, 3])  # for prompt_logprobs
    # raised instead of the piece at error_at (the final one when the answer has fewer: an
    # error response is a request's last)
    error: OpenAIError | None = None
    error_at: int = 0
    hold_at: int | None = None  # wait here (for release() or a cancel) before this piece

    def log_prob(self, i: int) -> float:
        return self.log_probs[i] if self.log_probs is not None else -(i + 1) / 10

    def top(self, i: int, n: int) -> list[tuple[int, float]]:
        return [(t, self.log_prob(i) - k - 1) for k, t in enumerate(self.top_ids[:n])]


class FakeGeneration:
    def __init__(self, script: Script, model: str, prompt: str, sampling: dict, stream: bool, chat: bool):
        self.script, self.model, self.prompt, self.sampling, self.stream, self.chat = \
            script, model, prompt, sampling, stream, chat
        self.pieces = self._pieces()
        self.at = 0  # pieces handed out
        self.cancelled = threading.Event()
        self.finished = threading.Event()  # the final piece (or an error) was handed out
        self.held = threading.Event()  # it reached hold_at and waits
        self._release = threading.Event()
        self._wake: asyncio.Event | None = None

    def _pieces(self) -> list[Piece]:
        s, sp = self.script, self.sampling
        tokens, reason = list(s.tokens), s.finish_reason
        if sp.get("max_tokens") is not None and len(tokens) > sp["max_tokens"]:
            tokens, reason = tokens[: sp["max_tokens"]], "length"
        counts = dict(final=True, finish_reason=reason, num_input_tokens=s.prompt_tokens,
                      num_output_tokens=len(tokens), num_cached_tokens=s.cached_tokens)
        logprobs, top_n = "logprobs" in sp, sp.get("logprobs") or 0
        if not self.stream:
            return [Piece(text="".join(tokens), **counts)]
        pieces = [Piece(text=t, log_probs=[s.log_prob(i)] if logprobs else [],
                        top=[s.top(i, top_n)] if top_n else []) for i, t in enumerate(tokens)]
        if not pieces:
            pieces = [Piece()]
        pieces[-1] = Piece(**{**pieces[-1].__dict__, **counts})
        if sp.get("prompt_logprobs") is not None:
            n = sp["prompt_logprobs"]
            ids = s.prompt_ids
            pieces[0].prompt_ids = list(ids)
            pieces[0].prompt_log_probs = [None] + [-0.5 * k for k in range(1, len(ids))]
            pieces[0].prompt_top = [None] + [[(t, -0.5 * k - j - 1) for j, t in enumerate(s.top_ids[:n])]
                                             for k in range(1, len(ids))] if n else [None] * len(ids)
        return pieces

    def release(self) -> None:
        """Let a held generation go on (from any thread)."""
        self._release.set()
        if self._wake is not None:
            self._loop.call_soon_threadsafe(self._wake.set)

    def __aiter__(self) -> "FakeGeneration":
        return self

    async def __anext__(self) -> Piece:
        if self.cancelled.is_set() or self.finished.is_set():
            raise StopAsyncIteration
        if self.at == self.script.hold_at and not self._release.is_set():
            self._loop, self._wake = asyncio.get_running_loop(), asyncio.Event()
            self.held.set()
            await self._wake.wait()  # release() or cancel() sets it
            if self.cancelled.is_set():
                raise StopAsyncIteration
        if self.script.error is not None and self.at == min(self.script.error_at, len(self.pieces) - 1):
            self.finished.set()
            raise self.script.error
        piece = self.pieces[self.at]
        self.at += 1
        if piece.final:
            self.finished.set()
        return piece

    def cancel(self) -> None:
        if self.finished.is_set():
            return  # like the bridge: nothing to cancel after the final response
        self.cancelled.set()
        if self._wake is not None:
            self._loop.call_soon_threadsafe(self._wake.set)


class FakeBackend:
    """answer: the Script of each generation, from (prompt, sampling), or one Script for all."""

    url = "fake:0"

    def __init__(self, answer: Script | Callable[[str, dict], Script] | None = None, models: tuple[str, ...] = ("tiny",),
                 parameters: dict[str, str] | None = None):
        self.answer = answer or Script(["Hello", ",", " world"])
        # the LoRA adapters a `lora_adapters` parameter names are models too, as the bridge lists them
        self.served = with_adapters({name: ServedModel(name, "1", {"parameters": {k: {"string_value": v} for k, v in
                                                                                 (parameters or {}).items()}},
                                                       created=1700000000) for name in models})
        self.calls: list[FakeGeneration] = []
        self.refuse: OpenAIError | None = None  # raised by generate (Triton out of reach)
        self.is_live = True
        self.closed = False
        self.started = threading.Event()  # a generation began

    async def models(self, refresh: bool = False) -> dict[str, ServedModel]:
        return dict(self.served)

    async def model(self, name: str) -> ServedModel:
        if name not in self.served:
            raise model_not_found(name, sorted(self.served))
        return self.served[name]

    def generate(self, model: str, prompt: str, sampling: dict, stream: bool, chat: bool = False) -> FakeGeneration:
        if self.refuse is not None:
            raise self.refuse
        script = self.answer(prompt, sampling) if callable(self.answer) else self.answer
        gen = FakeGeneration(script, model, prompt, sampling, stream, chat)
        self.calls.append(gen)
        self.started.set()
        return gen

    async def live(self) -> bool:
        return self.is_live

    async def close(self) -> None:
        self.closed = True
