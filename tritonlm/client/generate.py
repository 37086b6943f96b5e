"""Talk to a tritonlm generation model the way Triton users do.

gRPC: tritonclient's bidirectional stream (decoupled models need it); every
response is one piece of text, the last one flagged final.
HTTP: Triton's generate extension, /v2/models/NAME/generate (one JSON answer)
and /generate_stream (server-sent events).
"""

from __future__ import annotations

import json
import queue
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np

from tritonlm.protocol import INPUTS, NUMPY_TYPES

# name -> Triton datatype of the optional inputs a client may send (the contract in tritonlm/protocol.py)
INPUT_TYPES = {t.name: t.dtype for t in INPUTS if t.optional}


class GenerateError(RuntimeError):
    """The server answered with an error (its message is kept as is)."""


@dataclass
class GenerateResult:
    pieces: list[str] = field(default_factory=list)  # text of each response, in order
    finish_reason: str | None = None
    num_input_tokens: int | None = None
    num_output_tokens: int | None = None
    log_probs: list[float] = field(default_factory=list)
    extra: dict = field(default_factory=dict)  # other outputs of the final response

    @property
    def text(self) -> str:
        return "".join(self.pieces)


def _grpc_inputs(prompt: str, params: dict):
    import tritonclient.grpc as grpcclient

    inputs = []

    def add(name: str, arr: np.ndarray, dtype: str):
        inp = grpcclient.InferInput(name, list(arr.shape), dtype)
        inp.set_data_from_numpy(arr)
        inputs.append(inp)

    add("text_input", np.array([prompt.encode("utf-8")], dtype=object), "BYTES")
    for name, value in params.items():
        if value is None:
            continue
        dtype = INPUT_TYPES.get(name)
        if dtype is None:
            raise ValueError(f"unknown parameter {name!r}; known: {sorted(INPUT_TYPES)}")
        if dtype == "BYTES":
            values = [value] if isinstance(value, str) else list(value)
            add(name, np.array([v.encode("utf-8") for v in values], dtype=object), dtype)
        else:
            add(name, np.array([value], dtype=NUMPY_TYPES[dtype]), dtype)
    return inputs


def _absorb(result: GenerateResult, response) -> bool:
    """Add one gRPC response to result; True when it was the final one."""
    text = response.as_numpy("text_output")
    if text is not None:
        result.pieces.append(b"".join(text.reshape(-1)).decode("utf-8"))
    lp = response.as_numpy("output_log_probs")
    if lp is not None:
        result.log_probs.extend(lp.reshape(-1).tolist())
    reason = response.as_numpy("finish_reason")
    if reason is not None:
        result.finish_reason = reason.reshape(-1)[0].decode()
        result.num_input_tokens = int(response.as_numpy("num_input_tokens").reshape(-1)[0])
        result.num_output_tokens = int(response.as_numpy("num_output_tokens").reshape(-1)[0])
        for name in ("acceptance_rate", "total_draft_tokens", "total_accepted_draft_tokens", "num_cached_tokens"):
            value = response.as_numpy(name)
            if value is not None:
                result.extra[name] = value.reshape(-1)[0].item()
    final = response.get_response().parameters.get("triton_final_response")
    return bool(final and final.bool_param)


def generate_grpc(
    url: str,
    model: str,
    prompt: str,
    on_piece: Callable[[str], None] | None = None,
    timeout_s: float = 300.0,
    client=None,
    **params,
) -> GenerateResult:
    """One request over a gRPC stream; on_piece gets each piece of text as it arrives."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    own = client is None
    client = client or grpcclient.InferenceServerClient(url)
    responses: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    result = GenerateResult()
    try:
        try:
            client.async_stream_infer(model, _grpc_inputs(prompt, params), enable_empty_final_response=True)
        except InferenceServerException:
            # the stream broke before the request went out (nothing answers at url): tritonclient
            # hands why to the callback and raises a generic "not in valid state" here
            try:
                _, error = responses.get(timeout=timeout_s)
            except queue.Empty:
                raise GenerateError(f"the gRPC stream to {url} broke before the request was sent") from None
            raise GenerateError(str(error)) from None
        while True:
            try:
                response, error = responses.get(timeout=timeout_s)
            except queue.Empty:
                raise GenerateError(f"no response from {model} within {timeout_s:.0f} s") from None
            if error is not None:
                raise GenerateError(str(error))
            before = len(result.pieces)
            done = _absorb(result, response)
            if on_piece and len(result.pieces) > before and result.pieces[-1]:
                on_piece(result.pieces[-1])
            if done:
                return result
    finally:
        client.stop_stream()
        if own:
            client.close()


def _http_body(prompt: str, params: dict) -> bytes:
    body = {"text_input": prompt}
    body.update({k: v for k, v in params.items() if v is not None})
    return json.dumps(body).encode()


def generate_http(url: str, model: str, prompt: str, timeout_s: float = 300.0, **params) -> dict:
    """POST /v2/models/MODEL/generate: the whole answer as Triton's JSON."""
    req = urllib.request.Request(
        f"http://{url}/v2/models/{model}/generate", data=_http_body(prompt, params), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise GenerateError(json.loads(e.read() or b"{}").get("error", str(e))) from None


def generate_stream_http(url: str, model: str, prompt: str, timeout_s: float = 300.0, **params) -> Iterator[dict]:
    """POST /v2/models/MODEL/generate_stream: yields each server-sent event's JSON."""
    params = {"stream": True, **params}
    req = urllib.request.Request(
        f"http://{url}/v2/models/{model}/generate_stream", data=_http_body(prompt, params), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            for raw in r:
                line = raw.decode("utf-8").strip()
                if line.startswith("data:"):
                    event = json.loads(line[5:].strip())
                    if "error" in event:
                        raise GenerateError(event["error"])
                    yield event
    except urllib.error.HTTPError as e:
        raise GenerateError(json.loads(e.read() or b"{}").get("error", str(e))) from None
