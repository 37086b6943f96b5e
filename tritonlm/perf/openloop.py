"""The open-loop sender of `tritonlm perf goodput`: every request goes out at its scheduled time,
however many are still waiting for their answers, and each one's responses are timed.

Closed-loop clients wait for an answer before sending again, so a slow server slows its own
load down and the queueing delay an SLO is about never shows; here the schedule decides.

Two targets, both streaming:
- OpenAI: POST /v1/completions through the official `openai` client (AsyncOpenAI), with
  `stream_options.include_usage` for the server's token counts and `ignore_eos` so the answer
  runs to max_tokens (tritonlm's frontend and llama-server both take it);
- Triton gRPC: tritonclient.grpc.aio's bidirectional stream to the decoupled generation model
  (tensor names from tritonlm/protocol.py), `end_id` -1 for the same forcing.

A refusal for load is `shed`: HTTP 503 (the SLO controller) or 429 (the queue is full) on the
OpenAI API, an `overloaded` error on Triton. Any other failure is `error`, with its message.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tritonlm.client.stream_end import read_to_end
from tritonlm.perf.llm import PROMPT_WORDS
from tritonlm.perf.target import PerfError
from tritonlm.perf.trace import ScheduledRequest
from tritonlm.protocol import NUMPY_TYPES, INPUTS

SHED_HTTP_STATUS = (503, 429)
SHED_TRITON_MARKERS = ("overloaded", "queue is full", "server busy")
_INPUT_TYPES = {t.name: t.dtype for t in INPUTS}


@dataclass
class RequestRecord:
    """What happened to one scheduled request; times in seconds from the run's start."""

    index: int
    scheduled_s: float
    prompt_tokens: int  # asked
    output_tokens: int  # asked (max_tokens, forced)
    sent_s: float = float("nan")
    status: str = "error"  # ok | shed | error
    error: str = ""
    served_prompt_tokens: int | None = None  # the server's count (usage / num_input_tokens)
    served_output_tokens: int | None = None
    chunk_s: list[float] = field(default_factory=list)  # arrival of each response that carried text
    end_s: float = float("nan")  # the answer's end, or the refusal's arrival


# --- prompts of a given length ------------------------------------------------------------------
class PromptMaker:
    """Prompts of about n tokens: n words of common English (about a token each in large
    vocabularies) without a tokenizer; with one, exactly n of its tokens (as it encodes them
    without special tokens). Each request's words are drawn from its own seed, so prompts
    differ from the first word on and no prefix cache serves them."""

    def __init__(self, tokenizer: str | None, seed: int):
        self.seed = seed
        self._encode: Callable[[str], list[int]] | None = None
        self._decode: Callable[[list[int]], str] | None = None
        if tokenizer:
            self._load(tokenizer)

    def _load(self, tokenizer: str) -> None:
        path = Path(tokenizer)
        try:
            if path.is_file():
                from tokenizers import Tokenizer

                tok = Tokenizer.from_file(str(path))
                self._encode = lambda text: tok.encode(text, add_special_tokens=False).ids
                self._decode = lambda ids: tok.decode(ids)
            else:
                from transformers import AutoTokenizer

                hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
                self._encode = lambda text: hf.encode(text, add_special_tokens=False)
                self._decode = lambda ids: hf.decode(ids)
        except Exception as e:
            raise PerfError(f"--tokenizer {tokenizer}: cannot load it ({e}); give a tokenizer.json or a Hugging Face folder") from None

    def make(self, index: int, tokens: int) -> str:
        rng = random.Random(f"{self.seed}:{index}")
        words = [rng.choice(PROMPT_WORDS) for _ in range(tokens)]
        if self._encode is None:
            return " ".join(words)
        ids = self._encode(" ".join(words))[:tokens]  # every word is at least one token
        return self._decode(ids)


# --- the targets ----------------------------------------------------------------------------------
class OpenAITarget:
    """Streaming /v1/completions at base_url (…/v1 added when missing)."""

    def __init__(self, url: str, model: str, api_key: str, timeout_s: float, extra_body: dict | None = None):
        """extra_body: fields added to every request beside `ignore_eos` (a server's own
        options, such as llama-server's `cache_prompt`)."""
        import openai

        base = url.rstrip("/")
        if not base.startswith(("http://", "https://")):
            base = "http://" + base
        if not base.endswith("/v1"):
            base += "/v1"
        self.url, self.model = base, model
        self.extra_body = {"ignore_eos": True, **(extra_body or {})}
        self._openai = openai
        self.client = openai.AsyncOpenAI(base_url=base, api_key=api_key, max_retries=0, timeout=timeout_s)

    async def send(self, record: RequestRecord, prompt: str, clock: Callable[[], float]) -> None:
        openai = self._openai
        try:
            stream = await self.client.completions.create(
                model=self.model, prompt=prompt, max_tokens=record.output_tokens, stream=True,
                stream_options={"include_usage": True}, temperature=0, extra_body=self.extra_body,
            )
            async for chunk in stream:
                now = clock()
                if chunk.choices and chunk.choices[0].text:
                    record.chunk_s.append(now)
                if chunk.usage is not None:
                    record.served_prompt_tokens = chunk.usage.prompt_tokens
                    record.served_output_tokens = chunk.usage.completion_tokens
            record.status = "ok"
        except openai.APIStatusError as e:
            record.status = "shed" if e.status_code in SHED_HTTP_STATUS else "error"
            record.error = f"HTTP {e.status_code}: {_message(e)}"
        except Exception as e:  # an error event in the stream, a broken connection, a timeout
            record.status = "shed" if _is_overload(str(e)) else "error"
            record.error = _message(e)
        finally:
            record.end_s = clock()

    async def close(self) -> None:
        await self.client.close()


class GrpcTarget:
    """The decoupled generation model over Triton's gRPC stream, one stream per request."""

    def __init__(self, url: str, model: str, timeout_s: float):
        import tritonclient.grpc.aio as grpcaio

        self.url, self.model, self.timeout_s = url, model, timeout_s
        self._grpcaio = grpcaio
        self.client = grpcaio.InferenceServerClient(url)

    def _inputs(self, prompt: str, max_tokens: int) -> list:
        values = {"text_input": [prompt.encode()], "max_tokens": [max_tokens], "stream": [True], "end_id": [-1]}
        inputs = []
        for name, value in values.items():
            dtype = _INPUT_TYPES[name]
            tensor = self._grpcaio.InferInput(name, [1], dtype)
            tensor.set_data_from_numpy(np.array(value, dtype=NUMPY_TYPES[dtype]))  # [1]
            inputs.append(tensor)
        return inputs

    async def send(self, record: RequestRecord, prompt: str, clock: Callable[[], float]) -> None:
        async def one_request():
            yield {"model_name": self.model, "inputs": self._inputs(prompt, record.output_tokens),
                   "request_id": str(record.index), "parameters": {"triton_enable_empty_final_response": True}}

        responses = self.client.stream_infer(one_request(), stream_timeout=self.timeout_s)
        ended = False  # the server closed the stream: nothing to cancel
        try:
            async for result, error in responses:
                now = clock()
                if error is not None:  # a refusal or an error: the request's last response
                    message = str(error.message() if hasattr(error, "message") else error)
                    record.status = "shed" if _is_overload(message) else "error"
                    record.error, record.end_s = message, now
                    break
                text = result.as_numpy("text_output")
                if text is not None and b"".join(text.reshape(-1)):
                    record.chunk_s.append(now)
                served = result.as_numpy("num_output_tokens")
                if served is not None:
                    record.served_output_tokens = int(served.reshape(-1)[0])
                    record.served_prompt_tokens = int(result.as_numpy("num_input_tokens").reshape(-1)[0])
                final = result.get_response().parameters.get("triton_final_response")
                if final is not None and final.bool_param:
                    record.status, record.end_s = "ok", now
                    break
            else:
                record.error, record.end_s = "the stream ended before the final response", clock()
            # to its end, not cancelled: a cancellation just after the last response can keep
            # the model from ever unloading (tritonlm/client/stream_end.py)
            ended = await read_to_end(responses)
        except Exception as e:  # the channel broke, the stream timed out
            if record.status == "error" and not record.error:
                record.status = "shed" if _is_overload(str(e)) else "error"
                record.error = _message(e)
        finally:
            if math.isnan(record.end_s):
                record.end_s = clock()
            if not ended:
                responses.cancel()

    async def close(self) -> None:
        await self.client.close()


def _message(e: BaseException) -> str:
    text = str(getattr(e, "message", "") or e).strip().splitlines()
    return text[0] if text else type(e).__name__


def _is_overload(message: str) -> bool:
    lower = message.lower()
    return any(m in lower for m in SHED_TRITON_MARKERS)


SendTarget = OpenAITarget | GrpcTarget


# --- the open loop ---------------------------------------------------------------------------------
async def run_schedule(target: SendTarget, schedule: Sequence[ScheduledRequest], prompts: PromptMaker,
                       on_sent: Callable[[RequestRecord], None] | None = None) -> list[RequestRecord]:
    """Send every request at its time (prompts made beforehand, so making them costs no send
    time) and wait for all answers; the records, in schedule order."""
    records = [RequestRecord(i, s.at_s, s.prompt_tokens, s.output_tokens) for i, s in enumerate(schedule)]
    texts = [prompts.make(r.index, r.prompt_tokens) for r in records]
    start = time.perf_counter()

    def clock() -> float:
        return time.perf_counter() - start

    async def send(record: RequestRecord, prompt: str) -> None:
        record.sent_s = clock()
        if on_sent:
            on_sent(record)
        await target.send(record, prompt, clock)

    tasks: list[Awaitable] = []
    for record, prompt in zip(records, texts):
        delay = record.scheduled_s - clock()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(send(record, prompt)))
    await asyncio.gather(*tasks)
    return records


async def warm_up(target: SendTarget, requests: Sequence[ScheduledRequest], prompts: PromptMaker) -> list[RequestRecord]:
    """Requests one after the other before the measured run (not part of it): the server's first
    steps (and the SLO controller's first fit) happen here."""
    out = []
    start = time.perf_counter()
    for i, s in enumerate(requests):
        record = RequestRecord(-1 - i, 0.0, s.prompt_tokens, s.output_tokens)
        record.sent_s = time.perf_counter() - start
        await target.send(record, prompts.make(-1 - i, s.prompt_tokens), lambda: time.perf_counter() - start)
        out.append(record)
    return out
