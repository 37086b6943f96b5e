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
from tritonlm.glue.heartbeat import HEALTH_DIR_ENV
from tritonlm.openai.frontdoor import API_KEY_ENV, api_key_from
from tritonlm.openai.lora_admin import ALLOW_ENV, allow_runtime_lora_from
from tritonlm.server import (
    DEFAULT_HOST, ServerStartError, TritonServer, check_exposure, check_host, parse_restriction, port_is_free,
)
from tritonlm.supervise.recovery import DEFAULT_MAX_RESTARTS, DEFAULT_WINDOW_S, RestartPolicy
from tritonlm.supervise.supervisor import EXIT_GAVE_UP, POLL_S, Supervisor
from tritonlm.supervise.watch import DEFAULT_DEADLINE_S


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="start tritonserver on a model repository")
    add_server_args(p)
    p.set_defaults(func=run)
    sub.add_parser("setup-backend", help="prepare the backend directory (Python backend stub)").set_defaults(
        func=run_setup_backend
    )


def host_arg(text: str) -> str:
    """--host, checked as an address to bind (`tritonlm serve` and `tritonlm openai`)."""
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
    p.add_argument("--host", type=host_arg, default=DEFAULT_HOST,
                   help=f"address HTTP, gRPC and metrics bind to (default: {DEFAULT_HOST}, this machine only; "
                   "0.0.0.0: every interface)")
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=8001)
    p.add_argument("--metrics-port", type=int, default=8002)
    p.add_argument("--openai-port", type=int, default=9000,
                   help="port of the OpenAI-compatible API (/v1/chat/completions, /v1/completions, /v1/models) on the same "
                   "--host, in front of this server (default 9000; 0: off)")
    p.add_argument("--api-key", default=None,
                   help="the OpenAI API wants 'Authorization: Bearer KEY' on every request but /health "
                   f"(default: ${API_KEY_ENV}; unset: no key)")
    p.add_argument("--allow-runtime-lora", action="store_true",
                   help="the OpenAI API serves /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's), which "
                   f"rewrite a model's multi_lora.json in --repo (default: ${ALLOW_ENV}; off)")
    p.add_argument("--model-control", choices=["none", "explicit", "poll"], default="none",
                   help="none (default): load the repository at start, no load/unload API; explicit: the "
                   "load/unload API is on (refused on a non-loopback --host without --restrict-model-control)")
    p.add_argument("--restrict-model-control", type=_restriction, metavar="KEY=VALUE", default=None,
                   help="model-control (load/unload/index) requests over HTTP and gRPC must send header KEY: VALUE")
    p.add_argument("--log-file", default=None,
                   help="tritonserver's log (default: a temporary file, removed after a clean stop, kept on failure)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for readiness")
    p.add_argument("--health-port", type=_port("--health-port"), default=DEFAULT_HEALTH_PORT,
                   help="port of the probes' endpoint on the same --host: /health/ready (every model serves), "
                   "/health/live (recovery has not given up), /health, /metrics (restarts, model health) "
                   f"(default {DEFAULT_HEALTH_PORT}; 0: off)")
    p.add_argument("--health-deadline", type=_seconds("--health-deadline", 1, 600), default=DEFAULT_DEADLINE_S,
                   metavar="S", help="a model process stopped, silent (no heartbeat), or with its engine in one step "
                   "while requests wait, this long is wedged and the server restarts (a step is given longer where the "
                   "engine's finished steps say it is normal, and its first steps 60 s)"
                   f" (default {DEFAULT_DEADLINE_S:g})")
    p.add_argument("--max-restarts", type=_count("--max-restarts"), default=DEFAULT_MAX_RESTARTS, metavar="N",
                   help="after a model's process dies or hangs, tritonserver restarts; more than N restarts within "
                   f"--restart-window and serve exits {EXIT_GAVE_UP} (default {DEFAULT_MAX_RESTARTS}; 0: exit at the "
                   "first fault)")
    p.add_argument("--restart-window", type=_seconds("--restart-window", 1, 86400), default=DEFAULT_WINDOW_S,
                   metavar="S", help=f"see --max-restarts (default {DEFAULT_WINDOW_S:g})")
    p.add_argument("--tritonserver", type=Path, default=None, metavar="PATH",
                   help="run this tritonserver binary with its own backends (NVIDIA's container: "
                   "/opt/tritonserver/bin/tritonserver) instead of the nvidia-pytriton wheel's")
    p.add_argument("--drain-timeout", type=_drain_timeout, default=DEFAULT_DRAIN_TIMEOUT_S, metavar="S",
                   help="on SIGTERM or Ctrl-C: readiness goes off, new requests are refused, in-flight requests "
                   f"get up to S seconds to finish; what still runs then ends with finish_reason cancelled "
                   f"and the exit is 0 (default {DEFAULT_DRAIN_TIMEOUT_S:.0f})")


DEFAULT_DRAIN_TIMEOUT_S = 30.0
DEFAULT_HEALTH_PORT = 8003
# After the drain deadline the backend cancels what still runs (final responses, finish_reason
# cancelled) and the models unload: tritonserver's own exit timeout comes this much later, so
# it does not abort first.
CANCEL_GRACE_S = 5.0
KILL_GRACE_S = 3.0  # after that: tritonserver aborts on its own exit timeout and can hang there; then SIGKILL


def _seconds(flag: str, low: float, high: float):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = low - 1
        if not (low <= value <= high):
            raise argparse.ArgumentTypeError(f"{flag} takes seconds between {low:g} and {high:g}, not {text!r}")
        return value

    return parse


def _port(flag: str):
    def parse(text: str) -> int:
        if not text.isdigit() or int(text) > 65535:
            raise argparse.ArgumentTypeError(f"{flag} takes a port number from 0 (off) to 65535, not {text!r}")
        return int(text)

    return parse


def _count(flag: str):
    def parse(text: str) -> int:
        if not text.isdigit():
            raise argparse.ArgumentTypeError(f"{flag} takes a whole number >= 0, not {text!r}")
        return int(text)

    return parse


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


def _openai_frontend(server: TritonServer, repo: Path, args: argparse.Namespace, board):
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
    return OpenAIServer(server.grpc_url, host=server.host, port=port, repo=repo, headers=headers, health=board,
                        api_key=api_key_from(getattr(args, "api_key", None)), metrics_url=server.metrics_url,
                        allow_runtime_lora=allow_runtime_lora_from(getattr(args, "allow_runtime_lora", False)))


def _check_port(port: int, host: str, flag: str) -> None:
    if port and not port_is_free(port, check_host(host)):
        raise CliError(f"port {port} ({flag}) is already in use: stop what holds it or choose another port (0 turns it off)")


def serve(repo: Path, args: argparse.Namespace) -> int:
    check_server_args(args)
    drain_s = float(getattr(args, "drain_timeout", DEFAULT_DRAIN_TIMEOUT_S))
    health_port = getattr(args, "health_port", 0)
    _check_port(getattr(args, "openai_port", 0), args.host, "--openai-port")
    _check_port(health_port, args.host, "--health-port")
    binary = getattr(args, "tritonserver", None)
    if binary is not None and not (binary.is_file() and os.access(binary, os.X_OK)):
        raise CliError(f"--tritonserver {str(binary)!r} is not an executable file (NVIDIA's container: "
                       "/opt/tritonserver/bin/tritonserver)")
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
        binary=binary,
    )
    stopping = False
    drain_deadline: float | None = None
    # where the drain deadline and the models' heartbeats go (tritonlm/glue/drain.py,
    # tritonlm/glue/heartbeat.py); the stubs inherit the variables from tritonserver
    control_dir = Path(tempfile.mkdtemp(prefix="tritonlm-serve-"))
    drain_file = control_dir / "deadline"
    health_dir = control_dir / "beats"
    saved_env = {k: os.environ.get(k) for k in (DRAIN_FILE_ENV, HEALTH_DIR_ENV)}
    os.environ[DRAIN_FILE_ENV] = str(drain_file)
    os.environ[HEALTH_DIR_ENV] = str(health_dir)
    from tritonlm.supervise.endpoint import HealthEndpoint
    from tritonlm.supervise.health import HealthBoard

    board = HealthBoard()
    supervisor = Supervisor(
        server, board, health_dir,
        RestartPolicy(getattr(args, "max_restarts", DEFAULT_MAX_RESTARTS), getattr(args, "restart_window", DEFAULT_WINDOW_S)),
        deadline_s=getattr(args, "health_deadline", DEFAULT_DEADLINE_S), start_timeout_s=args.timeout,
        say=lambda line: print(line, flush=True),
    )
    supervisor.stop_requested = lambda: stopping
    supervisor.clear_beats()

    # Installed before the start: tritonserver runs in its own session, so a Ctrl-C or a
    # SIGTERM reaches only us. While it starts (or restarts), the handler raises
    # KeyboardInterrupt, and TritonServer.start stops the server before passing it on. Once
    # it is ready the handler only signals (waiting inside it would deadlock with the main
    # thread's own wait on the same process); a second Ctrl-C kills the server outright.
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
            stopping = True
            raise KeyboardInterrupt
        sig = signal.SIGKILL if stopping else signal.SIGINT
        if not stopping:
            name = signal.Signals(signum).name
            print(f"\n{name}: draining (readiness off, new requests refused, in-flight requests get up to "
                  f"{drain_s:g} s) ...", flush=True)
            board.draining()
            drain_deadline = time.monotonic() + drain_s
            try:
                write_deadline(drain_file, time.time() + drain_s)
            except OSError as e:  # the drain still works; only the cut at the deadline is rougher
                print(f"warning: cannot pass the drain deadline to the backend: {e}", file=sys.stderr, flush=True)
        stopping = True
        server.interrupt(sig)

    old_handlers = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    endpoint = frontend = None
    code: int | None = None
    try:
        if health_port:  # first, so the probes answer "not ready" (not "refused") while models load
            endpoint = HealthEndpoint(board, server.host, health_port).start()
        print(f"starting tritonserver on {repo} ...", flush=True)
        try:
            server.start(timeout_s=args.timeout)
        except (ServerStartError, StackError) as e:
            raise CliError(str(e)) from None
        except KeyboardInterrupt:
            kept = f" (log: {server.log_path})" if server.log_path and Path(server.log_path).exists() else ""
            print(f"\ninterrupted while starting; tritonserver stopped{kept}", file=sys.stderr, flush=True)
            return 130
        supervisor.started()
        frontend = _openai_frontend(server, repo, args, board)
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
        if endpoint is not None:
            lines.append(f"  {'probes':<8} http://{server.host}:{health_port}/health/ready, /health/live, /metrics")
        if ipaddress.IPv4Address(server.host).is_unspecified:
            lines.append(f"  (every interface: other machines reach it too; from this one: http://{server.http_url})")
        if args.restrict_model_control:
            key = args.restrict_model_control.partition("=")[0]
            lines.append(f"  model control needs header {key} (gRPC metadata: triton-grpc-protocol-{key})")
        lines.append("Ctrl-C stops it.")
        print("\n".join(lines), flush=True)
        code = _supervise(server, supervisor, drain_s, lambda: stopping, lambda: drain_deadline)
    finally:
        if frontend is not None:
            frontend.stop()
        if endpoint is not None:
            endpoint.stop()
        for s, handler in old_handlers.items():
            signal.signal(s, handler)
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(control_dir, ignore_errors=True)
    return code


def _supervise(server: TritonServer, supervisor: Supervisor, drain_s: float, stopping, drain_deadline) -> int:
    """Until tritonserver exits when asked to (0) or recovery gives up (EXIT_GAVE_UP): watch
    the models and restart the server after a fault; after a stop signal, keep the drain's
    deadlines."""
    announced = killed = False
    while True:
        if stopping():
            if server.process.poll() is not None:
                break
            deadline = drain_deadline()
            if deadline is not None and not announced and time.monotonic() > deadline:
                print(f"drain deadline ({drain_s:g} s) passed: requests still running end with finish_reason "
                      "cancelled", flush=True)
                announced = True
            if deadline is not None and not killed and time.monotonic() > deadline + CANCEL_GRACE_S + KILL_GRACE_S:
                print(f"drain deadline ({drain_s:g} s) passed: stopping what still runs", flush=True)
                server.interrupt(signal.SIGKILL)
                killed = True
        else:
            fault = supervisor.check()
            if fault is not None and not stopping():
                try:
                    gave_up = supervisor.recover(fault)
                except KeyboardInterrupt:  # a stop signal while it restarted: the server is stopped
                    print("stop signal during recovery: tritonserver stopped", flush=True)
                    return 0
                if gave_up is not None:
                    server.stop()
                    return gave_up
        time.sleep(POLL_S)
    code = server.process.returncode
    server.stop()  # reap, and kill whatever of its process group is left
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
