"""Run the OpenAI frontend: OpenAIServer (uvicorn in a background thread: `tritonlm serve`,
tests, `tritonlm perf llm`) and the `tritonlm openai` command (in front of any running Triton)."""

from __future__ import annotations

import argparse
import faulthandler
import logging
import signal
import threading
import time
from pathlib import Path

from tritonlm.errors import CliError
from tritonlm.openai.frontdoor import API_KEY_ENV, api_key_from

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
                 health=None, api_key: str | None = None, metrics_url: str | None = None):
        self.triton_url = triton_url
        self.host = host
        self.port = port
        self.repo = repo
        self.tokenizers = tokenizers
        self.headers = headers
        self.health = health  # tritonlm serve's HealthBoard: which models are restarting, and why
        self.api_key = api_key  # every request but /health must send it (Authorization: Bearer)
        self.metrics_url = metrics_url  # Triton's metrics page, shown on /metrics too
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
                         api_key=self.api_key, metrics_url=self.metrics_url)
        return uvicorn.Config(app, host=self.host, port=self.port, log_level="warning", access_log=False,
                              loop=_event_loop(), http=_http(), lifespan="on", timeout_graceful_shutdown=5)

    def start(self, timeout_s: float = 30.0) -> "OpenAIServer":
        import uvicorn

        from tritonlm.server import port_is_free

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


# --- the `tritonlm openai` command -----------------------------------------------------------
def parse_tokenizers(values: list[str]) -> dict[str, Path]:
    """--tokenizer PATH (every model) or MODEL=PATH, repeated."""
    out: dict[str, Path] = {}
    for v in values:
        name, sep, path = v.partition("=")
        if sep and name and not Path(v).exists():
            out[name] = Path(path)
        else:
            out["*"] = Path(v)
    return out


def _host(text: str) -> str:
    from tritonlm.server import ServerStartError, check_host

    try:
        return check_host(text)
    except ServerStartError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_parser(sub) -> None:
    from tritonlm.server import DEFAULT_HOST

    p = sub.add_parser("openai", help="serve the OpenAI-compatible API in front of a running Triton",
                       description="OpenAI-compatible API (chat, completions, models) in front of a running Triton server, "
                                   "e.g. NVIDIA's container serving tritonlm's generation models.")
    p.add_argument("--triton-url", default="127.0.0.1:8001", help="Triton's gRPC endpoint, host:port (default 127.0.0.1:8001)")
    p.add_argument("--host", type=_host, default=DEFAULT_HOST, help=f"address to bind (default {DEFAULT_HOST}; 0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=DEFAULT_OPENAI_PORT, help=f"port (default {DEFAULT_OPENAI_PORT})")
    p.add_argument("--repo", type=Path, default=None,
                   help="the model repository Triton serves, as this machine sees it: chat templates come from each "
                        "model's tokenizer there (<repo>/<model>/<hf_dir>)")
    p.add_argument("--tokenizer", action="append", default=[], metavar="[MODEL=]PATH",
                   help="a tokenizer folder for chat templates: for every model, or MODEL=PATH for one (repeatable)")
    p.add_argument("--api-key", default=None,
                   help=f"every request but /health must send 'Authorization: Bearer KEY' (default: ${API_KEY_ENV}; unset: none)")
    p.add_argument("--triton-metrics-url", default=None, metavar="URL",
                   help="Triton's metrics page (e.g. http://127.0.0.1:8002/metrics), shown on /metrics after the API's own")
    p.add_argument("--header", action="append", default=[], metavar="KEY=VALUE",
                   help="gRPC metadata for Triton (e.g. the --restrict-model-control header: the model list uses the repository index)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    headers = {}
    for h in args.header:
        key, sep, value = h.partition("=")
        if not sep or not key:
            raise CliError(f"--header {h!r}: use KEY=VALUE")
        headers[key] = value
    server = OpenAIServer(args.triton_url, args.host, args.port, repo=args.repo, tokenizers=parse_tokenizers(args.tokenizer),
                          headers=headers or None, api_key=api_key_from(args.api_key), metrics_url=args.triton_metrics_url)
    stopping = threading.Event()

    def on_signal(signum, _frame):
        # SIGINT (Ctrl-C) and SIGTERM (docker stop, Kubernetes, deploy/entrypoint.sh) stop it
        # gracefully: open responses get uvicorn's graceful timeout. Installed here, not left to
        # Python's default: a script's background job (`tritonlm openai &`) starts with SIGINT
        # ignored, and SIGTERM would end it mid-response. A second signal does not wait.
        if stopping.is_set():
            server.force_stop()
        stopping.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}  # before "ready"
    try:
        server.start()
        print(f"OpenAI API ready on {server.url}/v1 (Triton at {args.triton_url}); Ctrl-C stops it.", flush=True)
        while server.running() and not stopping.wait(0.2):
            pass
        if stopping.is_set():
            # whatever hangs in the shutdown, a stop signal ends the process: past the deadline
            # every thread's stack goes to stderr, and it exits 1
            faulthandler.dump_traceback_later(EXIT_DEADLINE_S, exit=True)
    finally:
        server.stop()
        for s, handler in previous.items():
            signal.signal(s, handler)
    print("OpenAI API stopped", flush=True)
    return 0

