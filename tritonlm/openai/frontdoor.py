"""What every request of the OpenAI API passes first: the API key, and the request counts
that /metrics shows. A plain ASGI wrapper (not Starlette's BaseHTTPMiddleware), so streamed
responses and the client-disconnect watch (app.SSEResponse) see the connection as it is."""

from __future__ import annotations

import hmac
import os

from prometheus_client import CollectorRegistry, Counter

from tritonlm.openai.errors import OpenAIError

API_KEY_ENV = "TRITONLM_API_KEY"
OPEN_PATHS = frozenset({"/health"})  # a load balancer's or a probe's check needs no key
COUNTED = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize", "/detokenize", "/v1/load_lora_adapter",
           "/v1/unload_lora_adapter")


def api_key_from(value: str | None) -> str | None:
    """--api-key, else the environment's TRITONLM_API_KEY; None (or empty): no key asked."""
    key = value if value is not None else os.environ.get(API_KEY_ENV)
    return key or None


def _endpoint(path: str) -> str | None:
    """The metrics label of a path (None: not counted; a model's id is not a label)."""
    if path in COUNTED:
        return path
    return "/v1/models/{id}" if path.startswith("/v1/models/") else None


class FrontDoor:
    def __init__(self, app, api_key: str | None, registry: CollectorRegistry, refuse):
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.refuse = refuse  # OpenAIError -> an ASGI response in OpenAI's error shape
        self.requests = Counter("tritonlm_openai_requests", "OpenAI API requests by endpoint and HTTP status",
                                ["endpoint", "status"], registry=registry)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        endpoint = _endpoint(path)
        status = [0]

        async def counting_send(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            if self.expected is not None and path not in OPEN_PATHS:
                given = b""
                for name, value in scope["headers"]:
                    if name == b"authorization":
                        given = value
                # constant time: how much of a guess matched must not show in the answer's timing
                if not hmac.compare_digest(given, self.expected):
                    why = "no API key given" if not given else "the API key is not valid"
                    error = OpenAIError(401, f"{why}: send the header 'Authorization: Bearer <key>'",
                                        code="invalid_api_key", type="invalid_request_error")
                    return await self.refuse(error)(scope, receive, counting_send)
            await self.app(scope, receive, counting_send)
        finally:
            if endpoint is not None and status[0]:
                self.requests.labels(endpoint, str(status[0])).inc()
