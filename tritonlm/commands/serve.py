"""`tritonlm serve`: run the real tritonserver on a model repository until Ctrl-C."""

from __future__ import annotations

import argparse
import ipaddress
import math
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

from tritonlm.errors import CliError
from tritonlm.glue.drain import DRAIN_FILE_ENV, write_deadline
from tritonlm.paths import StackError
from tritonlm.server import (
    DEFAULT_HOST, ServerStartError, TritonServer, check_exposure, check_host, parse_restriction, port_is_free,
)


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="start tritonserver on a model repository")
    add_server_args(p)
    p.set_defaults(func=run)
    sub.add_parser("setup-backend", help="prepare the backend directory (Python backend stub)").set_defaults(
        func=run_setup_backend
    )


def _host(text: str) -> str:
    try:
        return check_host(text)
    except ServerStartError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _restriction(text: str) -> str:
    try:
        parse_restriction(text)
    except ServerStartError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def add_server_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--repo", default="model_repository", help="model repository (default: model_repository)")
    p.add_argument("--host", type=_host, default=DEFAULT_HOST,
                   help=f"address HTTP, gRPC and metrics bind to (default: {DEFAULT_HOST}, this machine only; "
                   "0.0.0.0: every interface)")
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=8001)
    p.add_argument("--metrics-port", type=int, default=8002)
    p.add_argument("--openai-port", type=int, default=9000,
                   help="port of the OpenAI-compatible API (/v1/chat/completions, /v1/completions, /v1/models) on the same "
                   "--host, in front of this server (default 9000; 0: off)")
    p.add_argument("--model-control", choices=["none", "explicit", "poll"], default="none",
                   help="none (default): load the repository at start, no load/unload API; explicit: the "
                   "load/unload API is on (refused on a non-loopback --host without --restrict-model-control)")
    p.add_argument("--restrict-model-control", type=_restriction, metavar="KEY=VALUE", default=None,
                   help="model-control (load/unload/index) requests over HTTP and gRPC must send header KEY: VALUE")
    p.add_argument("--log-file", default=None,
                   help="tritonserver's log (default: a temporary file, removed after a clean stop, kept on failure)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for readiness")
    p.add_argument("--drain-timeout", type=_drain_timeout, default=DEFAULT_DRAIN_TIMEOUT_S, metavar="S",
                   help="on SIGTERM or Ctrl-C: readiness goes off, new requests are refused, in-flight requests "
                   f"get up to S seconds to finish; what still runs then ends with finish_reason cancelled "
                   f"and the exit is 0 (default {DEFAULT_DRAIN_TIMEOUT_S:.0f})")


DEFAULT_DRAIN_TIMEOUT_S = 30.0
# After the drain deadline the backend cancels what still runs (final responses, finish_reason
# cancelled) and the models unload: tritonserver's own exit timeout comes this much later, so
# it does not abort first.
CANCEL_GRACE_S = 5.0
KILL_GRACE_S = 3.0  # after that: tritonserver aborts on its own exit timeout and can hang there; then SIGKILL


def _drain_timeout(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not (1 <= value <= 3600):
        raise argparse.ArgumentTypeError(f"--drain-timeout takes seconds between 1 and 3600, not {text!r}")
    return value


def check_server_args(args: argparse.Namespace) -> None:
    """The host / model-control combination (each option's format is checked while parsing):
    explicit model control off loopback needs --restrict-model-control."""
    try:
        check_exposure(args.host, args.model_control, args.restrict_model_control)
    except ServerStartError as e:
        raise CliError(str(e)) from None


def _openai_frontend(server: TritonServer, repo: Path, args: argparse.Namespace):
    """The OpenAI API in front of the server (None with --openai-port 0). Its chat templates
    come from the repository's tokenizers; the model list needs the model-control header."""
    port = getattr(args, "openai_port", 0)
    if not port:
        return None
    from tritonlm.openai.server import OpenAIServer

    headers = None
    if args.restrict_model_control:
        key, value = parse_restriction(args.restrict_model_control)
        headers = {f"triton-grpc-protocol-{key}": value}
    return OpenAIServer(server.grpc_url, host=server.host, port=port, repo=repo, headers=headers)


def serve(repo: Path, args: argparse.Namespace) -> int:
    check_server_args(args)
    drain_s = float(getattr(args, "drain_timeout", DEFAULT_DRAIN_TIMEOUT_S))
    openai_port = getattr(args, "openai_port", 0)
    if openai_port and not port_is_free(openai_port, check_host(args.host)):
        raise CliError(f"port {openai_port} (--openai-port) is already in use: stop what holds it or choose another port "
                       "(0 turns the OpenAI API off)")
    server = TritonServer(
        repo,
        args.http_port,
        args.grpc_port,
        args.metrics_port,
        host=args.host,
        model_control=args.model_control,
        load_models=["*"] if args.model_control == "explicit" else [],
        restrict_model_control=args.restrict_model_control,
        log_path=Path(args.log_file) if args.log_file else None,
        # Triton's own drain: on SIGINT it refuses new requests and waits this long for in-flight
        # ones; longer than ours, so the backend's cancellation at our deadline comes first
        exit_timeout_s=max(1, math.ceil(drain_s + CANCEL_GRACE_S)),
    )
    stopping = False
    drain_deadline: float | None = None
    # where the drain deadline goes for the backend (tritonlm/glue/drain.py); the stubs inherit
    # the variable from tritonserver, which inherits it from us
    control_dir = Path(tempfile.mkdtemp(prefix="tritonlm-drain-"))
    drain_file = control_dir / "deadline"
    old_env = os.environ.get(DRAIN_FILE_ENV)
    os.environ[DRAIN_FILE_ENV] = str(drain_file)

    # Installed before the start: tritonserver runs in its own session, so a Ctrl-C or a
    # SIGTERM reaches only us. While it starts, the handler raises KeyboardInterrupt, and
    # TritonServer.start stops the server before passing it on. Once it is ready the handler
    # only signals (waiting inside it would deadlock with the main thread's own wait on the
    # same process); a second Ctrl-C kills the server outright.
    #
    # The first signal starts the drain: SIGINT to tritonserver, which takes its HTTP endpoint
    # (readiness) down, refuses new inferences and lets in-flight streams finish, then exits 0.
    # The deadline goes to the backend (drain_file): there, what still runs at the deadline
    # ends with finish_reason "cancelled" and its final response. tritonserver's own exit
    # timeout is CANCEL_GRACE_S later; the main loop below kills what is left KILL_GRACE_S
    # after that.
    def on_signal(signum, frame):
        nonlocal stopping, drain_deadline
        if not server.started:
            raise KeyboardInterrupt
        sig = signal.SIGKILL if stopping else signal.SIGINT
        if not stopping:
            name = signal.Signals(signum).name
            print(f"\n{name}: draining (readiness off, new requests refused, in-flight requests get up to "
                  f"{drain_s:g} s) ...", flush=True)
            drain_deadline = time.monotonic() + drain_s
            try:
                write_deadline(drain_file, time.time() + drain_s)
            except OSError as e:  # the drain still works; only the cut at the deadline is rougher
                print(f"warning: cannot pass the drain deadline to the backend: {e}", file=sys.stderr, flush=True)
        stopping = True
        server.interrupt(sig)

    old_handlers = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        print(f"starting tritonserver on {repo} ...", flush=True)
        try:
            server.start(timeout_s=args.timeout)
        except (ServerStartError, StackError) as e:
            raise CliError(str(e)) from None
        except KeyboardInterrupt:
            kept = f" (log: {server.log_path})" if server.log_path and Path(server.log_path).exists() else ""
            print(f"\ninterrupted while starting; tritonserver stopped{kept}", file=sys.stderr, flush=True)
            return 130
        frontend = _openai_frontend(server, repo, args)
        if frontend is not None:
            try:
                frontend.start()
            except CliError:
                server.stop()
                raise
        lines = [f"tritonserver ready (log: {server.log_path}{'' if args.log_file else ', removed after a clean stop'})"]
        lines += [f"  {name:<8} {url}" for name, url in server.listen_addresses().items()]
        if frontend is not None:
            lines.append(f"  {'OpenAI':<8} http://{server.host}:{frontend.port}/v1")
        if ipaddress.IPv4Address(server.host).is_unspecified:
            lines.append(f"  (every interface: other machines reach it too; from this one: http://{server.http_url})")
        if args.restrict_model_control:
            key = args.restrict_model_control.partition("=")[0]
            lines.append(f"  model control needs header {key} (gRPC metadata: triton-grpc-protocol-{key})")
        lines.append("Ctrl-C stops it.")
        print("\n".join(lines), flush=True)
        announced = False
        try:
            while server.process.poll() is None:
                if drain_deadline is not None and not announced and time.monotonic() > drain_deadline:
                    print(f"drain deadline ({drain_s:g} s) passed: requests still running end with finish_reason "
                          "cancelled", flush=True)
                    announced = True
                if drain_deadline is not None and time.monotonic() > drain_deadline + CANCEL_GRACE_S + KILL_GRACE_S:
                    print(f"drain deadline ({drain_s:g} s) passed: stopping what still runs", flush=True)
                    server.interrupt(signal.SIGKILL)
                    drain_deadline = None
                time.sleep(0.2)
        finally:
            if frontend is not None:
                frontend.stop()
        code = server.process.returncode
        server.stop()  # reap, and kill whatever of its process group is left
    finally:
        for s, handler in old_handlers.items():
            signal.signal(s, handler)
        if old_env is None:
            os.environ.pop(DRAIN_FILE_ENV, None)
        else:
            os.environ[DRAIN_FILE_ENV] = old_env
        shutil.rmtree(control_dir, ignore_errors=True)
    if not stopping:
        print(f"tritonserver exited unexpectedly with code {code}; last log lines ({server.log_path}):", file=sys.stderr)
        print("\n".join(server.log_text().splitlines()[-20:]), file=sys.stderr)
        return 1
    if code != 0:
        print(f"tritonserver stopped with code {code} (log: {server.log_path})")
    else:
        print("tritonserver stopped")
    return 0


def run(args: argparse.Namespace) -> int:
    return serve(Path(args.repo), args)


def run_setup_backend(args: argparse.Namespace) -> int:
    from tritonlm.backend_setup import prepare_backend_dir

    print(f"backend directory ready: {prepare_backend_dir()}")
    return 0
