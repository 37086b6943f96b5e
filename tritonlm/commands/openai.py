"""`tritonlm openai`: the OpenAI-compatible API (tritonlm/openai) in front of an already
running Triton, until SIGINT or SIGTERM."""

from __future__ import annotations

import argparse
import faulthandler
import signal
import threading
from pathlib import Path

from tritonlm.commands.serve import host_arg
from tritonlm.errors import CliError
from tritonlm.openai.frontdoor import API_KEY_ENV, api_key_from
from tritonlm.openai.lora_admin import ALLOW_ENV, allow_runtime_lora_from
from tritonlm.openai.server import DEFAULT_OPENAI_PORT, EXIT_DEADLINE_S, OpenAIServer
from tritonlm.server import DEFAULT_HOST


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


def add_parser(sub) -> None:
    p = sub.add_parser("openai", help="serve the OpenAI-compatible API in front of a running Triton",
                       description="OpenAI-compatible API (chat, completions, models) in front of a running Triton server, "
                                   "e.g. NVIDIA's container serving tritonlm's generation models.")
    p.add_argument("--triton-url", default="127.0.0.1:8001", help="Triton's gRPC endpoint, host:port (default 127.0.0.1:8001)")
    p.add_argument("--host", type=host_arg, default=DEFAULT_HOST, help=f"address to bind (default {DEFAULT_HOST}; 0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=DEFAULT_OPENAI_PORT, help=f"port (default {DEFAULT_OPENAI_PORT})")
    p.add_argument("--repo", type=Path, default=None,
                   help="the model repository Triton serves, as this machine sees it: chat templates come from each "
                        "model's tokenizer there (<repo>/<model>/<hf_dir>)")
    p.add_argument("--tokenizer", action="append", default=[], metavar="[MODEL=]PATH",
                   help="a tokenizer folder for chat templates: for every model, or MODEL=PATH for one (repeatable)")
    p.add_argument("--api-key", default=None,
                   help=f"every request but /health must send 'Authorization: Bearer KEY' (default: ${API_KEY_ENV}; unset: none)")
    p.add_argument("--allow-runtime-lora", action="store_true",
                   help="serve /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's), which rewrite a model's "
                        f"multi_lora.json under --repo (default: ${ALLOW_ENV}; off)")
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
                          headers=headers or None, api_key=api_key_from(args.api_key), metrics_url=args.triton_metrics_url,
                          allow_runtime_lora=allow_runtime_lora_from(args.allow_runtime_lora))
    if server.allow_runtime_lora and args.repo is None:
        raise CliError("--allow-runtime-lora: loading adapters rewrites each model's multi_lora.json; give the model "
                       "repository with --repo")
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

