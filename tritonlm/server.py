"""Start, watch and stop a real tritonserver process.

Used by `tritonlm serve` and by the test fixture: one place knows the flags,
the environment and how to turn a failed start into a clear message.
"""

from __future__ import annotations

import ipaddress
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
from tritonlm.paths import server_env, triton_install


class ServerStartError(RuntimeError):
    """tritonserver did not become ready; the message carries the server's own words."""


DEFAULT_HOST = "127.0.0.1"  # loopback: nothing outside this machine reaches the server unless asked to

_HEADER_KEY = re.compile(r"[a-z0-9][a-z0-9_.-]*")
_HEADER_VALUE = re.compile(r"[\x21-\x7e]+")  # visible ASCII, no spaces


def check_host(host: str) -> str:
    """The address every endpoint binds to: an IPv4 address ('localhost' means 127.0.0.1).
    Not IPv6: tritonserver 2.51 joins the address to its gRPC port without brackets, and fails."""
    if host == "localhost":
        return DEFAULT_HOST
    try:
        return str(ipaddress.IPv4Address(host))
    except ValueError:
        raise ServerStartError(
            f"host {host!r} is not an IPv4 address: use 127.0.0.1 (this machine only, the default), "
            "0.0.0.0 (every interface) or one interface's address"
        ) from None


def is_loopback(host: str) -> bool:
    return ipaddress.IPv4Address(host).is_loopback


def connect_host(host: str) -> str:
    """Where a client on this machine reaches a server bound to host."""
    return "127.0.0.1" if ipaddress.IPv4Address(host).is_unspecified else host


def parse_restriction(text: str) -> tuple[str, str]:
    """KEY=VALUE of --restrict-model-control: the header a model-control request must carry.
    The key is lowercase (gRPC metadata keys are; HTTP headers match case-insensitively)."""
    key, sep, value = text.partition("=")
    if not sep or not _HEADER_KEY.fullmatch(key) or not _HEADER_VALUE.fullmatch(value) or "," in value:
        raise ServerStartError(
            "--restrict-model-control takes KEY=VALUE (not repeated here: it holds a secret): KEY a lowercase header name "
            "(letters, digits, '-', '_', '.'), VALUE visible ASCII without spaces or commas "
            "(example: tritonlm-admin=<a long random secret>)"
        )
    return key, value


def check_exposure(host: str, model_control: str, restrict_model_control: str | None) -> None:
    """Refuse what lets anyone who reaches the port load code: explicit model control (the
    load API takes a config, and files, from the request) on an address other machines can
    reach, unless the model-control API needs a secret header."""
    host = check_host(host)
    if restrict_model_control is not None:
        parse_restriction(restrict_model_control)
    if model_control == "explicit" and not is_loopback(host) and restrict_model_control is None:
        raise ServerStartError(
            f"--model-control explicit on {host} lets any client that reaches the port load a model "
            "(and the code it names); restrict the model-control API with --restrict-model-control KEY=VALUE "
            "(requests must send that header), or serve on 127.0.0.1, or use --model-control none"
        )


def port_is_free(port: int, host: str = DEFAULT_HOST) -> bool:
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
    host: str = DEFAULT_HOST  # every endpoint (HTTP, gRPC, metrics) binds here; 0.0.0.0: all interfaces
    model_control: str = "none"  # "none" loads everything; "explicit" for the model-control API
    load_models: list[str] = field(default_factory=list)  # with explicit: models loaded at start ("*" = all)
    # "KEY=VALUE": model-control requests (load/unload/index) must carry that header, HTTP and gRPC
    restrict_model_control: str | None = None
    log_path: Path | None = None  # None: a temporary file, removed after a clean stop (kept on failure)
    exit_timeout_s: int = 5  # how long shutdown waits for open client connections
    extra_args: list[str] = field(default_factory=list)
    # a tritonserver binary with its own backends (NVIDIA's container: /opt/tritonserver);
    # None: the nvidia-pytriton wheel's, with the backend folder tritonlm prepares
    binary: Path | None = None
    process: subprocess.Popen | None = None
    _own_log: bool = field(default=False, init=False, repr=False)
    _started: bool = field(default=False, init=False, repr=False)
    _stop_requested: bool = field(default=False, init=False, repr=False)
    _log_offset: int = field(default=0, init=False, repr=False)

    @property
    def http_url(self) -> str:
        """host:port a client on this machine connects to (loopback when bound to all interfaces)."""
        return f"{connect_host(self.host)}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{connect_host(self.host)}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{connect_host(self.host)}:{self.metrics_port}/metrics"

    def listen_addresses(self) -> dict[str, str]:
        """What each endpoint is bound to, as a URL (0.0.0.0: every interface)."""
        h = self.host
        return {
            "HTTP": f"http://{h}:{self.http_port}",
            "gRPC": f"{h}:{self.grpc_port}",
            "metrics": f"http://{h}:{self.metrics_port}/metrics",
        }

    def restriction_args(self) -> list[str]:
        if self.restrict_model_control is None:
            return []
        key, value = parse_restriction(self.restrict_model_control)
        return [
            f"--http-restricted-api=model-repository:{key}={value}",
            f"--grpc-restricted-protocol=model-repository:{key}={value}",
        ]

    def command(self) -> list[str]:
        if self.binary is not None:
            cmd = [str(self.binary)]  # its own backend folder holds python and tritonlm
        else:
            install = triton_install()
            cmd = [str(install.server_binary), f"--backend-directory={prepare_backend_dir(install)}"]
        cmd += [
            f"--model-repository={Path(self.repo).resolve()}",
            f"--http-address={self.host}",
            f"--http-port={self.http_port}",
            f"--grpc-address={self.host}",
            f"--grpc-port={self.grpc_port}",
            f"--metrics-address={self.host}",
            f"--metrics-port={self.metrics_port}",
            "--allow-cpu-metrics=true",
            f"--exit-timeout-secs={self.exit_timeout_s}",
            f"--model-control-mode={self.model_control}",
            *self.restriction_args(),
        ]
        for name in self.load_models:
            cmd.append(f"--load-model={name}")
        return cmd + list(self.extra_args)

    def environment(self) -> dict[str, str]:
        if self.binary is not None:  # its own install: its image's environment is right for it
            return {**os.environ, "TOKENIZERS_PARALLELISM": os.environ.get("TOKENIZERS_PARALLELISM", "false")}
        return server_env()

    def start(self, timeout_s: float = 180.0, append_log: bool = False) -> "TritonServer":
        """Start and wait until ready. Whatever interrupts the wait (a failed start, Ctrl-C,
        a signal handler's exception) stops the server first: it runs in its own session, so
        nothing else would. The log is kept then, and named in the error. append_log (a
        restart): the same log goes on, and log_text() reads this start's part."""
        self.host = check_host(self.host)
        check_exposure(self.host, self.model_control, self.restrict_model_control)
        repo = Path(self.repo)
        if self.model_control == "none":
            check_repository(repo)
        elif not repo.is_dir():
            raise ServerStartError(f"model repository {repo} does not exist")
        for flag, port in (("--http-port", self.http_port), ("--grpc-port", self.grpc_port), ("--metrics-port", self.metrics_port)):
            if not port_is_free(port, self.host):
                raise ServerStartError(f"port {port} ({flag}) is already in use: stop what holds it or choose another port")
        command = self.command()  # a missing stack fails here, before any file or process exists
        append = append_log and self.log_path is not None and Path(self.log_path).exists()
        if not append and (self.log_path is None or self._own_log):
            fd, name = tempfile.mkstemp(prefix="tritonserver-", suffix=".log")
            os.close(fd)
            self.log_path, self._own_log = Path(name), True
        self._log_offset = Path(self.log_path).stat().st_size if append else 0
        self._started = self._stop_requested = False
        with open(self.log_path, "ab" if append else "wb") as log:
            self.process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=self.environment(), start_new_session=True
            )
        try:
            self.wait_ready(timeout_s)
            self._started = True
        except BaseException:
            self.stop()  # not ready: the log stays for the user to read
            raise
        return self

    @property
    def started(self) -> bool:
        """start() has succeeded and stop() has not run since."""
        return self._started

    def log_text(self) -> str:
        """The log of the last start."""
        if self.log_path is None or not Path(self.log_path).exists():
            return ""
        with open(self.log_path, "rb") as f:
            f.seek(self._log_offset)
            return f.read().decode(errors="replace")

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

    def interrupt(self, sig: int = signal.SIGINT) -> None:
        """Send sig to the server's process group (SIGINT: graceful shutdown) and remember that
        the exit was asked for. Safe in a signal handler."""
        if self.process is None:
            return
        self._stop_requested = True
        try:
            os.killpg(self.process.pid, sig)  # start_new_session: the server leads its own group
        except ProcessLookupError:
            pass

    def kill(self) -> int | None:
        """SIGKILL to the whole process group (server, stubs, their workers) and reap: every
        connection closes now, so no client waits on a request a dead process held."""
        if self.process is None:
            return None
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()
        self._started = False
        return self.process.returncode

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGINT (Triton's graceful shutdown), then SIGKILL after timeout_s (or at once when
        the wait is interrupted, e.g. a second Ctrl-C). Whatever is left of the server's
        process group afterwards (a Python backend stub the server gave up on) is killed
        too: no orphan outlives the server. A temporary log is removed when the server had
        been ready and exited cleanly when asked to; otherwise (a failed start, a crash, an
        exit on its own) it is kept at log_path for the user."""
        if self.process is None:
            return None
        pgid = self.process.pid  # start_new_session: the server leads its own group
        try:
            if self.process.poll() is None:
                self.interrupt(signal.SIGINT)
                try:
                    self.process.wait(timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    pass
        finally:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            if self.process.poll() is None:
                self.process.wait(timeout=10)
        clean = self._started and self._stop_requested and self.process.returncode == 0
        if clean and self._own_log and self.log_path is not None:
            Path(self.log_path).unlink(missing_ok=True)
        self._started = False
        return self.process.returncode

    def __enter__(self) -> "TritonServer":
        return self.start() if self.process is None else self

    def __exit__(self, *exc) -> None:
        self.stop()
