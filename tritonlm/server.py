"""Start, watch and stop a real tritonserver process.

Used by `tritonlm serve` and by the test fixture: one place knows the flags,
the environment and how to turn a failed start into a clear message.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from tritonlm.backend_setup import prepare_backend_dir
from tritonlm.paths import StackError, server_env, triton_install


class ServerStartError(RuntimeError):
    """tritonserver did not become ready; the message carries the server's own words."""


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_ports(n: int) -> list[int]:
    """n distinct ports the kernel says are free now (held open together so they differ)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def check_repository(repo: Path) -> None:
    if not repo.is_dir():
        raise ServerStartError(f"model repository {repo} does not exist (export a model first: tritonlm export MODEL --repo {repo})")
    models = [p for p in repo.iterdir() if (p / "config.pbtxt").is_file()]
    if not models:
        raise ServerStartError(
            f"model repository {repo} holds no model (no <name>/config.pbtxt); export one with: tritonlm export MODEL --repo {repo}"
        )


_FAILED_LOAD = re.compile(r"failed to load '([^']+)'.*?: (.*)$")
_STATUS_ROW = re.compile(r"^\|\s*(\S+)\s*\|\s*(\d+)\s*\|\s*(UNAVAILABLE:.*?)\s*\|?\s*$")


def model_load_errors(log: str) -> dict[str, str]:
    """Model name -> the server's own reason, from its startup log."""
    errors: dict[str, str] = {}
    for line in log.splitlines():
        m = _FAILED_LOAD.search(line)
        if m:
            errors.setdefault(m.group(1), m.group(2).strip())
            continue
        m = _STATUS_ROW.match(line.strip())
        if m:
            errors.setdefault(m.group(1), m.group(3).strip())
    return errors


@dataclass
class TritonServer:
    repo: Path
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    model_control: str = "none"  # "none" loads everything; "explicit" for the model-control API
    load_models: list[str] = field(default_factory=list)  # with explicit: models loaded at start ("*" = all)
    log_path: Path | None = None
    exit_timeout_s: int = 5  # how long shutdown waits for open client connections
    extra_args: list[str] = field(default_factory=list)
    process: subprocess.Popen | None = None

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def command(self) -> list[str]:
        install = triton_install()
        backend_dir = prepare_backend_dir(install)
        cmd = [
            str(install.server_binary),
            f"--model-repository={Path(self.repo).resolve()}",
            f"--backend-directory={backend_dir}",
            f"--http-port={self.http_port}",
            f"--grpc-port={self.grpc_port}",
            f"--metrics-port={self.metrics_port}",
            "--allow-cpu-metrics=true",
            f"--exit-timeout-secs={self.exit_timeout_s}",
            f"--model-control-mode={self.model_control}",
        ]
        for name in self.load_models:
            cmd.append(f"--load-model={name}")
        return cmd + list(self.extra_args)

    def start(self, timeout_s: float = 180.0) -> "TritonServer":
        repo = Path(self.repo)
        if self.model_control == "none":
            check_repository(repo)
        elif not repo.is_dir():
            raise ServerStartError(f"model repository {repo} does not exist")
        for flag, port in (("--http-port", self.http_port), ("--grpc-port", self.grpc_port), ("--metrics-port", self.metrics_port)):
            if not port_is_free(port):
                raise ServerStartError(f"port {port} ({flag}) is already in use: stop what holds it or choose another port")
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix="tritonserver-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        log = open(self.log_path, "wb")
        try:
            self.process = subprocess.Popen(
                self.command(), stdout=log, stderr=subprocess.STDOUT, env=server_env(), start_new_session=True
            )
        except StackError:
            log.close()
            raise
        log.close()
        self.wait_ready(timeout_s)
        return self

    def log_text(self) -> str:
        if self.log_path is None or not Path(self.log_path).exists():
            return ""
        return Path(self.log_path).read_text(errors="replace")

    def is_ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.http_url}/v2/health/ready", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            return False

    def wait_ready(self, timeout_s: float) -> None:
        assert self.process is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServerStartError(self._failure_message(f"tritonserver exited with code {self.process.returncode}"))
            if self.is_ready():
                return
            time.sleep(0.25)
        self.stop()
        raise ServerStartError(self._failure_message(f"tritonserver not ready after {timeout_s:.0f} s"))

    def _failure_message(self, headline: str) -> str:
        log = self.log_text()
        errors = model_load_errors(log)
        parts = [headline]
        for name, reason in errors.items():
            parts.append(f"model '{name}' failed to load: {reason}")
        if not errors:
            tail = "\n".join(log.splitlines()[-25:])
            parts.append(f"last lines of the server log ({self.log_path}):\n{tail}")
        return "\n".join(parts)

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGINT (Triton's graceful shutdown), then SIGKILL after timeout_s. Whatever is
        left of the server's process group afterwards (a Python backend stub the server
        gave up on) is killed too: no orphan outlives the server."""
        if self.process is None:
            return None
        pgid = self.process.pid  # start_new_session: the server leads its own group
        if self.process.poll() is None:
            try:
                os.killpg(pgid, signal.SIGINT)
            except ProcessLookupError:
                pass
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(pgid, signal.SIGKILL)
                self.process.wait(timeout=10)
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return self.process.returncode

    def __enter__(self) -> "TritonServer":
        return self.start() if self.process is None else self

    def __exit__(self, *exc) -> None:
        self.stop()
