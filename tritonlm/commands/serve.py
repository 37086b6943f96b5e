"""`tritonlm serve`: run the real tritonserver on a model repository until Ctrl-C."""

from __future__ import annotations

import argparse
import os
import signal
import time
import sys
from pathlib import Path

from tritonlm.errors import CliError
from tritonlm.paths import StackError
from tritonlm.server import ServerStartError, TritonServer


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="start tritonserver on a model repository")
    add_server_args(p)
    p.set_defaults(func=run)
    sub.add_parser("setup-backend", help="prepare the backend directory (Python backend stub)").set_defaults(
        func=run_setup_backend
    )


def add_server_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--repo", default="model_repository", help="model repository (default: model_repository)")
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=8001)
    p.add_argument("--metrics-port", type=int, default=8002)
    p.add_argument("--model-control", choices=["none", "explicit", "poll"], default="none")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for readiness")


def serve(repo: Path, args: argparse.Namespace) -> int:
    server = TritonServer(
        repo,
        args.http_port,
        args.grpc_port,
        args.metrics_port,
        model_control=args.model_control,
        load_models=["*"] if args.model_control == "explicit" else [],
    )
    print(f"starting tritonserver on {repo} ...", flush=True)
    try:
        server.start(timeout_s=args.timeout)
    except (ServerStartError, StackError) as e:
        raise CliError(str(e)) from None
    print(
        f"tritonserver ready (log: {server.log_path})\n"
        f"  HTTP     http://localhost:{args.http_port}\n"
        f"  gRPC     localhost:{args.grpc_port}\n"
        f"  metrics  http://localhost:{args.metrics_port}/metrics\n"
        "Ctrl-C stops it.",
        flush=True,
    )
    stopping = False

    # The handler only signals: waiting inside it would deadlock with the main thread's
    # own wait on the same process. A second Ctrl-C kills the server outright.
    def on_signal(signum, frame):
        nonlocal stopping
        sig = signal.SIGKILL if stopping else signal.SIGINT
        if not stopping:
            print("\nstopping tritonserver ...", flush=True)
        stopping = True
        try:
            os.killpg(server.process.pid, sig)
        except ProcessLookupError:
            pass

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    while server.process.poll() is None:
        time.sleep(0.2)
    code = server.process.returncode
    server.stop()  # reap, and kill whatever of its process group is left
    if not stopping:
        print(f"tritonserver exited unexpectedly with code {code}; last log lines:", file=sys.stderr)
        print("\n".join(server.log_text().splitlines()[-20:]), file=sys.stderr)
        return 1
    print("tritonserver stopped")
    return 0


def run(args: argparse.Namespace) -> int:
    return serve(Path(args.repo), args)


def run_setup_backend(args: argparse.Namespace) -> int:
    from tritonlm.backend_setup import prepare_backend_dir

    print(f"backend directory ready: {prepare_backend_dir()}")
    return 0
