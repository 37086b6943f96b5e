"""The Triton side of the OpenAI frontend: which models generate, and one generation as an
asyncio gRPC stream (tritonclient.grpc.aio).

Each generation is its own ModelStreamInfer call carrying one request: text_input, stream,
exclude_input_in_output and the sampling settings as `sampling_parameters` JSON (the
vLLM-backend form that tritonlm's generation model also takes, tritonlm/protocol.py). Stop
strings travel in that JSON as a list, so a stop string holding a comma stays whole. When the
consumer stops early (the HTTP client went away), the call is cancelled: Triton cancels the
request and the model sees request.is_cancelled(), which frees its KV cache.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tritonlm.client.stream_end import read_to_end
from tritonlm.openai.errors import OpenAIError, from_triton

MODEL_LIST_TTL_S = 2.0  # the repository index is asked again after this long
EXPLAIN_WAIT_S = 1.0  # how long a broken request waits for the health board to name the fault


@dataclass
class ServedModel:
    name: str
    version: str
    config: dict  # Triton's model config, as JSON
    created: int = field(default_factory=lambda: int(time.time()))
    # a LoRA adapter served as a model of its own: the generation model that runs it (its
    # config is that model's), and the name its requests send as `lora_name`
    parent: str | None = None
    lora_name: str | None = None

    @property
    def parameters(self) -> dict[str, str]:
        return {k: v.get("string_value", "") for k, v in self.config.get("parameters", {}).items()}

    @property
    def base(self) -> str:
        """The Triton model that serves it: its parent for an adapter, else itself."""
        return self.parent or self.name

    def adapter_names(self, repo: Path | None = None) -> list[str]:
        """The LoRA adapters a generation model serves: its `lora_adapters` parameter, and, where
        this process sees the model repository, the multi_lora.json beside its config.pbtxt
        (not in the config Triton reports; without the repository those are served by
        `lora_name` only)."""
        from tritonlm.engine.settings import MULTI_LORA_FILE, SettingsError, adapter_pairs

        try:
            names = [name for name, _ in adapter_pairs(self.parameters.get("lora_adapters", ""))]
        except SettingsError:
            return []  # such a model does not load: nothing to list
        json_file = Path(repo) / self.name / MULTI_LORA_FILE if repo is not None else None
        if json_file is not None and json_file.is_file():
            try:
                names += [name for name, _ in adapter_pairs(json_file.read_text(), MULTI_LORA_FILE)]
            except (OSError, UnicodeDecodeError, SettingsError):
                pass  # the model refuses such a file when it loads: it is not served
        return names


def with_adapters(models: dict[str, ServedModel], repo: Path | None = None) -> dict[str, ServedModel]:
    """The generation models and, as models of their own, the LoRA adapters each serves (its
    multi_lora.json's too where `repo`, the model repository, is readable here), with `parent`
    its model (as vLLM's /v1/models lists them). A model's own name wins over an adapter's, and
    of two models serving the same adapter name the first by name does."""
    out = dict(models)
    for name in sorted(models):
        base = models[name]
        for adapter in base.adapter_names(repo):
            if adapter not in out:
                out[adapter] = ServedModel(adapter, base.version, base.config, base.created, parent=name, lora_name=adapter)
    return out


def is_generation_model(config: dict) -> bool:
    """task=generate (tritonlm's generation model), or any decoupled model taking text_input."""
    task = config.get("parameters", {}).get("task", {}).get("string_value")
    if task is not None:
        return task == "generate"
    decoupled = config.get("model_transaction_policy", {}).get("decoupled", False)
    return bool(decoupled) and any(i.get("name") == "text_input" for i in config.get("input", []))


@dataclass
class Piece:
    """One Triton response: new text and, on the final one, why it ended and the counts."""

    text: str = ""
    log_probs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)  # per token: the most likely (id, log-prob)
    # the first response of a request that asked for prompt_logprobs: the prompt's token ids, each
    # one's log-probability (None for the first) and the most likely tokens there (None for the first)
    prompt_ids: list[int] | None = None
    prompt_log_probs: list[float | None] | None = None
    prompt_top: list[list[tuple[int, float]] | None] | None = None
    final: bool = False
    finish_reason: str | None = None
    num_input_tokens: int | None = None
    num_output_tokens: int | None = None
    num_cached_tokens: int | None = None


def _scalar(result, name: str):
    arr = result.as_numpy(name)
    return None if arr is None or arr.size == 0 else arr.reshape(-1)[0]


def parse_response(result) -> Piece:
    piece = Piece()
    text = result.as_numpy("text_output")
    if text is not None:
        piece.text = b"".join(text.reshape(-1)).decode("utf-8")
    lp = result.as_numpy("output_log_probs")
    if lp is not None:
        piece.log_probs = lp.reshape(-1).tolist()
    top_ids, top_lps = result.as_numpy("output_top_token_ids"), result.as_numpy("output_top_log_probs")
    if top_ids is not None and top_lps is not None:  # [tokens, N]
        piece.top = [list(zip(ids, lps)) for ids, lps in zip(top_ids.tolist(), top_lps.tolist())]
    prompt_ids, prompt_lps = result.as_numpy("prompt_token_ids"), result.as_numpy("prompt_log_probs")
    if prompt_ids is not None and prompt_lps is not None:
        piece.prompt_ids = prompt_ids.reshape(-1).tolist()
        piece.prompt_log_probs = [None if math.isnan(v) else v for v in prompt_lps.reshape(-1).tolist()]
        top_ids, top_lps = result.as_numpy("prompt_top_token_ids"), result.as_numpy("prompt_top_log_probs")
        piece.prompt_top = [None] * len(piece.prompt_ids)
        if top_ids is not None and top_lps is not None:  # [prompt tokens, N]; the first row has none
            piece.prompt_top = [None] + [list(zip(ids, lps)) for ids, lps in zip(top_ids.tolist()[1:], top_lps.tolist()[1:])]
    reason = _scalar(result, "finish_reason")
    if reason is not None:
        piece.finish_reason = reason.decode() if isinstance(reason, bytes) else str(reason)
    n_in, n_out = _scalar(result, "num_input_tokens"), _scalar(result, "num_output_tokens")
    piece.num_input_tokens = None if n_in is None else int(n_in)
    piece.num_output_tokens = None if n_out is None else int(n_out)
    n_cached = _scalar(result, "num_cached_tokens")
    piece.num_cached_tokens = None if n_cached is None else int(n_cached)
    final = result.get_response().parameters.get("triton_final_response")
    piece.final = bool(final and final.bool_param)
    return piece


class TritonBackend:
    """The frontend's view of one Triton server (gRPC), the app's Backend
    (tritonlm/openai/backend.py). Create and use inside one event loop."""

    def __init__(self, url: str, headers: dict[str, str] | None = None, health=None, repo: Path | None = None):
        self.url = url
        self.repo = repo  # the model repository, where this process sees it: each model's multi_lora.json
        self.headers = headers  # e.g. a --restrict-model-control header for the repository index
        # tritonlm serve's HealthBoard (or None): turns a lost connection into its reason,
        # e.g. "model tiny is restarting (model tiny: its process (pid 7) died)"
        self.health = health
        self._client = None
        self._models: dict[str, ServedModel] = {}
        self._listed_at = 0.0
        self._lock: asyncio.Lock | None = None

    @property
    def client(self):
        if self._client is None:
            import tritonclient.grpc.aio as grpcclient

            self._client = grpcclient.InferenceServerClient(self.url)
        return self._client

    async def live(self) -> bool:
        try:
            return bool(await self.client.is_server_live())
        except Exception:  # noqa: BLE001 - out of reach is not live
            return False

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None

    # --- models -----------------------------------------------------------------------------
    async def models(self, refresh: bool = False) -> dict[str, ServedModel]:
        """The READY generation models, from Triton's repository index (cached briefly)."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if refresh or time.monotonic() - self._listed_at > MODEL_LIST_TTL_S:
                self._models = await self._list()
                self._listed_at = time.monotonic()
            return self._models

    async def _list(self) -> dict[str, ServedModel]:
        try:
            index = await self.client.get_model_repository_index(headers=self.headers, as_json=True)
        except Exception as e:
            raise OpenAIError(503, f"cannot reach Triton at {self.url}: {_first_line(e)}", code="triton_unavailable") from None
        found: dict[str, ServedModel] = {}
        for entry in index.get("models", []):
            if entry.get("state") != "READY":
                continue
            name = entry["name"]
            old = self._models.get(name)
            old = old if old is not None and old.parent is None else None
            try:
                config = old.config if old else (await self.client.get_model_config(name, as_json=True))["config"]
            except Exception:
                continue  # unloaded between the two calls
            if is_generation_model(config):
                found[name] = ServedModel(name, entry.get("version", ""), config, old.created if old else int(time.time()))
        return with_adapters(found, self.repo)

    async def model(self, name: str) -> ServedModel:
        models = await self.models()
        if name not in models:
            models = await self.models(refresh=True)
        if name not in models:
            from tritonlm.openai.errors import model_not_found

            raise model_not_found(name, sorted(models))
        return models[name]

    # --- generation -------------------------------------------------------------------------
    def _inputs(self, prompt: str, sampling: dict, stream: bool):
        import tritonclient.grpc.aio as grpcclient

        def tensor(name, arr, dtype):
            t = grpcclient.InferInput(name, [1], dtype)
            t.set_data_from_numpy(arr)
            return t

        return [
            tensor("text_input", np.array([prompt.encode("utf-8")], dtype=object), "BYTES"),
            tensor("stream", np.array([stream], dtype=bool), "BOOL"),
            tensor("exclude_input_in_output", np.array([True], dtype=bool), "BOOL"),
            tensor("sampling_parameters", np.array([json.dumps(sampling).encode()], dtype=object), "BYTES"),
        ]

    def generate(self, model: str, prompt: str, sampling: dict, stream: bool, chat: bool = False) -> "Generation":
        """One generation: iterate it for its responses; cancel() it to end it early."""
        return Generation(self, model, prompt, sampling, stream, chat)


    def epoch(self) -> int:
        return self.health.epoch() if self.health is not None else 0

    async def reason(self, model: str, since_epoch: int) -> str | None:
        """Why a request begun at since_epoch lost its connection, when the health board knows.
        A connection can break a moment before the supervisor has marked the fault (it looks
        every 0.2 s): wait that long for the board before saying nothing."""
        if self.health is None:
            return None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + EXPLAIN_WAIT_S
        while True:
            found = self.health.explain(model, since_epoch)
            if found is not None:
                return found
            if loop.time() > deadline:  # no fault named in time: what the board says of the model now
                return self.health.unavailable(model)
            await asyncio.sleep(0.05)


class Generation:
    """One Triton request on its own gRPC stream. `async for piece in gen` yields each
    response (an error response raises OpenAIError); cancel() (synchronous, safe from a
    `finally` of a cancelled task) cancels the call, so Triton cancels the request."""

    def __init__(self, backend: TritonBackend, model: str, prompt: str, sampling: dict, stream: bool, chat: bool):
        self.backend = backend
        self.model = model
        self.chat = chat
        self.done = False
        self._epoch = backend.epoch()  # the health board's count of faults when this began
        self._finished = asyncio.Event()
        request = {
            "model_name": model,
            "inputs": backend._inputs(prompt, sampling, stream),
            "parameters": {"triton_enable_empty_final_response": True},
        }

        async def requests():
            yield request
            await self._finished.wait()  # keep our side open until the last response is in

        try:
            self._call = backend.client.stream_infer(requests())
        except Exception as e:
            raise OpenAIError(503, f"cannot reach Triton at {backend.url}: {_first_line(e)}", code="triton_unavailable") from None

    def __aiter__(self) -> "Generation":
        return self

    async def __anext__(self) -> Piece:
        if self.done:
            raise StopAsyncIteration
        try:
            result, error = await self._call.__anext__()
        except StopAsyncIteration:
            self._end()
            reason = await self.backend.reason(self.model, self._epoch)
            if reason is not None:
                raise OpenAIError(503, reason, code="model_unavailable") from None
            raise OpenAIError(500, f"Triton closed the stream of {self.model} before its final response") from None
        except asyncio.CancelledError:
            self.cancel()
            raise
        except Exception as e:  # grpc.aio.AioRpcError and friends: the connection, not the model
            self.cancel()
            reason = await self.backend.reason(self.model, self._epoch)
            if reason is not None:
                raise OpenAIError(503, reason, code="model_unavailable") from None
            raise OpenAIError(503, f"Triton at {self.backend.url}: {_first_line(e)}", code="triton_unavailable") from None
        if error is not None:
            self._end()  # an error response is the request's last
            self._close_later()
            raise from_triton(error.message(), chat=self.chat)
        piece = parse_response(result)
        if piece.final:
            self._end()
            self._close_later()
            if piece.finish_reason is None:
                # the model's last response always says why it ended; a final one without a reason
                # is Triton closing the request for a model process that went away, not an answer
                reason = await self.backend.reason(self.model, self._epoch)
                raise OpenAIError(503, reason, code="model_unavailable") if reason is not None else \
                    OpenAIError(500, f"Triton ended the stream of {self.model} without a finish reason")
        return piece

    def _end(self) -> None:
        self.done = True
        self._finished.set()

    def _close_later(self) -> None:
        """After the request's last response: the call is held until the server closes the
        stream, in a task of its own, not freed with this object (grpc.aio would cancel it,
        and a cancellation at that moment can keep the model from unloading:
        tritonlm/client/stream_end.py)."""
        task = asyncio.ensure_future(read_to_end(self._call))
        _CLOSING.add(task)
        task.add_done_callback(_CLOSING.discard)

    def cancel(self) -> None:
        """End the request now unless it has already finished (no-op then)."""
        if not self.done:
            self._call.cancel()
            self._end()


_CLOSING: set[asyncio.Task] = set()  # the streams read to their end (the loop holds tasks only weakly)


def _first_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__
