"""Run the OpenAI frontend: OpenAIServer, uvicorn in a background thread (for `tritonlm serve`,
`tritonlm openai` in front of any running Triton, `tritonlm perf llm` and tests)."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from tritonlm.errors import CliError

log = logging.getLogger(__name__)
DEFAULT_OPENAI_PORT = 9000
EXIT_DEADLINE_S = 25.0  # after a stop signal: more than stop() can take (10 s + 10 s), less than a supervisor's patience


def _event_loop() -> str:
    """uvloop when installed (faster), else asyncio's own; grpc.aio runs on either."""
    try:
        import uvloop  # noqa: F401

        return "uvloop"
    except ImportError:
        return "asyncio"


def _http() -> str:
    try:
        import httptools  # noqa: F401

        return "httptools"
    except ImportError:
        return "h11"


class OpenAIServer:
    """The OpenAI app served by uvicorn on host:port from a background thread."""

    def __init__(self, triton_url: str, host: str = "127.0.0.1", port: int = DEFAULT_OPENAI_PORT,
                 repo: Path | None = None, tokenizers: dict[str, Path] | None = None, headers: dict[str, str] | None = None,
                 health=None, api_key: str | None = None, metrics_url: str | None = None,
                 allow_runtime_lora: bool = False):
        self.triton_url = triton_url
        self.host = host
        self.port = port
        self.repo = repo
        self.tokenizers = tokenizers
        self.headers = headers
        self.health = health  # tritonlm serve's HealthBoard: which models are restarting, and why
        self.api_key = api_key  # every request but /health must send it (Authorization: Bearer)
        self.metrics_url = metrics_url  # Triton's metrics page, shown on /metrics too
        self.allow_runtime_lora = allow_runtime_lora  # /v1/load_lora_adapter and /v1/unload_lora_adapter (lora_admin)
        self._server = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @property
    def url(self) -> str:
        from tritonlm.server import connect_host

        return f"http://{connect_host(self.host)}:{self.port}"

    def config(self):
        import uvicorn

        from tritonlm.openai.app import create_app
        from tritonlm.openai.chat import ChatTemplates

        app = create_app(self.triton_url, ChatTemplates(self.repo, self.tokenizers), headers=self.headers, health=self.health,
                         api_key=self.api_key, metrics_url=self.metrics_url, allow_runtime_lora=self.allow_runtime_lora)
        return uvicorn.Config(app, host=self.host, port=self.port, log_level="warning", access_log=False,
                              loop=_event_loop(), http=_http(), lifespan="on", timeout_graceful_shutdown=5)

    def start(self, timeout_s: float = 30.0) -> "OpenAIServer":
        import uvicorn

        from tritonlm.server import is_loopback, port_is_free

        if self.allow_runtime_lora and self.api_key is None and not is_loopback(self.host):
            raise CliError(f"--allow-runtime-lora on {self.host} without an API key lets any client that reaches the "
                           "port load, replace and unload the models' LoRA adapters; set --api-key (or "
                           "TRITONLM_API_KEY), or serve on 127.0.0.1")
        if not port_is_free(self.port, self.host):
            raise CliError(f"port {self.port} (--openai-port) is already in use: stop what holds it, choose another, "
                           "or 0 to turn the OpenAI API off")
        self._server = uvicorn.Server(self.config())

        def run():
            try:
                self._server.run()
            except BaseException as e:  # noqa: BLE001 - reported by start()
                self._error = e

        self._thread = threading.Thread(target=run, name="tritonlm-openai", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                why = f": {self._error}" if self._error else ""
                raise CliError(f"the OpenAI API did not start on {self.host}:{self.port}{why}")
            time.sleep(0.02)
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                self._server.force_exit = True
                self._thread.join(timeout_s)
        self._thread = None

    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def force_stop(self) -> None:
        """Stop without waiting for open responses to finish (what a second Ctrl-C asks)."""
        if self._server is not None:
            self._server.should_exit = self._server.force_exit = True

    def __enter__(self) -> "OpenAIServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
