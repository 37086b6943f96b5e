"""`tritonlm serve` as a child process, as an orchestrator runs it: free ports, its output
kept as it comes, its probes and its supervisor's counts read from outside. Used by the
tests of serving and faults and by perf/stress.py."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from tritonlm.perf.serverstats import parse_prometheus
from tritonlm.server import free_ports
from tritonlm.supervise.procs import children, command_line


def http_status(url: str, timeout_s: float = 5.0):
    """The HTTP status a GET of url gets; "refused" when nothing listens; None for no answer
    (e.g. a timeout on a busy machine)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except urllib.error.URLError as e:
        if isinstance(e.reason, ConnectionRefusedError):
            return "refused"  # nothing listens: a probe or a load balancer's check fails
        return None
    except OSError:
        return None


class ServeProcess:
    """`tritonlm serve` on free ports. The OpenAI API is off unless openai=True; the probes'
    endpoint is on (self.health)."""

    def __init__(self, repo: Path, *extra: str, openai: bool = False):
        self.http, self.grpc, self.metrics, self.openai, self.health = free_ports(5)
        binary = Path(sys.executable).parent / "tritonlm"
        self.proc = subprocess.Popen(
            [str(binary), "serve", "--repo", str(repo), "--http-port", str(self.http), "--grpc-port", str(self.grpc),
             "--metrics-port", str(self.metrics), "--openai-port", str(self.openai if openai else 0),
             "--health-port", str(self.health), *extra],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)
        self._reader.start()

    @property
    def output(self) -> str:
        return "".join(self.lines)

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics}/metrics"

    def wait_ready(self, timeout_s: float = 600.0) -> None:
        """Until serve says it is ready; its output in the error if it exits (or hangs) first."""
        deadline = time.monotonic() + timeout_s
        while "tritonserver ready" not in self.output:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("tritonlm serve did not become ready:\n" + self.output)
            time.sleep(0.1)

    def ready_status(self):
        """Triton's own readiness (/v2/health/ready)."""
        return http_status(f"http://127.0.0.1:{self.http}/v2/health/ready", timeout_s=1)

    def probe(self, path: str):
        """The probes' endpoint: /health/ready, /health/live, /health, /metrics."""
        return http_status(f"http://127.0.0.1:{self.health}{path}")

    def tritonserver_pid(self) -> int | None:
        for pid in children(self.proc.pid):
            argv = command_line(pid)
            if argv and Path(argv[0]).name == "tritonserver":
                return pid
        return None

    def restarts(self, model: str | None = None) -> dict[str, float]:
        """tritonlm_model_restarts_total by cause (of one model, or of all), from /metrics."""
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.health}/metrics", timeout=10).read().decode()
        out: dict[str, float] = {}
        for (name, labels), value in parse_prometheus(text).items():
            found = dict(labels)
            if name == "tritonlm_model_restarts_total" and (model is None or found.get("model") == model):
                out[found["cause"]] = out.get(found["cause"], 0.0) + value
        return out

    def faults(self) -> list[str]:
        return [line.strip() for line in self.lines if line.startswith("FAULT")]

    def stop(self, timeout_s: float = 60.0) -> int:
        """SIGTERM (a drain), then SIGKILL if it does not exit in time."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()

    def kill(self, timeout_s: float = 600.0) -> None:
        """Two SIGINTs: the second kills tritonserver outright."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            self.proc.send_signal(signal.SIGINT)
            self.proc.wait(timeout_s)
