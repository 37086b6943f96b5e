"""OpenAI's error shape, and which HTTP status a Triton or model error becomes.

Every error answer is `{"error": {"message", "type", "param", "code"}}` with a status:
400 a bad field (param names it), 404 an unknown model, 429 the model's queue is full
("server busy"), 503 the model cannot take requests now (queue timeout, shutting down,
Triton unreachable, or shed by the latency SLO controller: "overloaded"), 500 anything else.
"""

from __future__ import annotations

import re

from tritonlm.protocol import KNOWN_INPUTS, SAMPLING_KEYS

# contract input (tritonlm/protocol.py) -> the OpenAI field it comes from
_PARAMS = {
    "text_input": "prompt",
    "stop_words": "stop",
    "return_log_probs": "logprobs",
    "end_id": "ignore_eos",
    "min_length": "min_tokens",
    "guided_decoding": "response_format",  # a guide the model could not compile for its tokenizer
}
_TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable_error"}
_REQUEST_ID = re.compile(r"^\[request id: [^\]]*\]\s*")


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None, type: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_field(param: str, message: str) -> OpenAIError:
    """400 naming the field; the message starts with its name."""
    return OpenAIError(400, f"{param}: {message}", param=param, code="invalid_value")


def unsupported(param: str, what: str = "is not supported by this server") -> OpenAIError:
    return OpenAIError(400, f"{param}: {what}", param=param, code="unsupported_parameter")


def model_not_found(model: str, known: list[str]) -> OpenAIError:
    listed = ", ".join(known) or "none"
    return OpenAIError(404, f"The model '{model}' does not exist (generation models served: {listed})",
                       param="model", code="model_not_found")


def from_triton(message: str, chat: bool = False) -> OpenAIError:
    """The OpenAI error for an error a Triton request ended with (the model's own words kept)."""
    text = _REQUEST_ID.sub("", message.strip())
    lower = text.lower()
    if "server busy" in lower:
        return OpenAIError(429, text, code="server_busy")
    if "overloaded:" in lower:  # shed at arrival: its time-to-first-token SLO cannot be met now
        return OpenAIError(503, text, code="slo_overloaded")
    if "timed out after waiting" in lower or "shutting down" in lower or "being unloaded" in lower:
        return OpenAIError(503, text, code="unavailable")
    if "unknown model" in lower or ("model" in lower and "is not found" in lower) or "not ready" in lower:
        return OpenAIError(404, text, param="model", code="model_not_found")
    if "the answer violates the json_schema" in lower:  # a valid request; the model's answer broke the schema
        return OpenAIError(500, text, code="schema_violation")
    if lower.startswith("internal error"):
        return OpenAIError(500, text, code="internal_error")
    m = re.match(r"(sampling_parameters\.)?([a-z_]+): ", text)
    named = m is not None and (m.group(2) in SAMPLING_KEYS if m.group(1) else m.group(2) in (*KNOWN_INPUTS, "guided_decoding"))
    if named or lower.startswith(("unknown input", "request:", "sampling_parameters")):
        name = m.group(2) if named else None
        param = _PARAMS.get(name, name) if name else None
        if param == "prompt" and chat:
            param = "messages"
        return OpenAIError(400, text, param=param, code="invalid_value")
    return OpenAIError(500, text, code="internal_error")
