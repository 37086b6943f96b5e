"""The server a harness measures: where it is, what it serves, its own statistics.

Either a running tritonserver (host and ports, as `tritonlm serve` prints them) or
one the harness starts for itself (`--serve`: free ports, explicit model control,
stopped at the end). Every failure becomes a PerfError with a one-line message.
"""

from __future__ import annotations

import logging
import signal
import threading
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from tritonlm.errors import CliError

log = logging.getLogger(__name__)


class PerfError(CliError):
    """A harness cannot go on; the message says what was wrong and what to do."""


@dataclass(frozen=True)
class ModelStats:
    """Cumulative counters of one model (all versions), from the server's statistics API."""

    inference_count: int = 0  # inferences, counting each batch element
    execution_count: int = 0  # model executions (a batch of 8 is one)
    success_count: int = 0  # successful requests
    queue_ns: int = 0
    compute_infer_ns: int = 0
    batch_executions: dict[int, int] = field(default_factory=dict)  # batch size -> executions

    def __sub__(self, other: "ModelStats") -> "ModelStats":
        sizes = set(self.batch_executions) | set(other.batch_executions)
        return ModelStats(
            self.inference_count - other.inference_count,
            self.execution_count - other.execution_count,
            self.success_count - other.success_count,
            self.queue_ns - other.queue_ns,
            self.compute_infer_ns - other.compute_infer_ns,
            {s: self.batch_executions.get(s, 0) - other.batch_executions.get(s, 0) for s in sizes},
        )

    @property
    def avg_batch(self) -> float:
        return self.inference_count / self.execution_count if self.execution_count else 0.0


def _short(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


@dataclass
class Target:
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    repo: Path | None = None  # the model repository this server serves, when known

    @property
    def http_url(self) -> str:
        return f"{self.host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}/metrics"

    def client(self):
        """An HTTP client for the calling thread (tritonclient.http's gevent client must stay in one thread)."""
        import tritonclient.http as httpclient

        if "_local" not in self.__dict__:
            self._local = threading.local()
            self._clients = []
        client = getattr(self._local, "client", None)
        if client is None:
            client = httpclient.InferenceServerClient(self.http_url, connection_timeout=10.0, network_timeout=120.0)
            self._local.client = client
            self._clients.append((threading.get_ident(), client))
        return client

    # --- checks ---------------------------------------------------------------------------------
    def check_live(self) -> None:
        try:
            live = self.client().is_server_live()
        except Exception as e:  # connection refused, DNS, timeout: all mean "not there"
            raise PerfError(
                f"cannot reach tritonserver at http://{self.http_url} ({_short(e)}): start it with `tritonlm serve` "
                "or pass --serve to start one for this run"
            ) from None
        if not live:
            raise PerfError(f"tritonserver at http://{self.http_url} answers but is not live")

    def model_states(self) -> dict[str, str] | None:
        """Each model's state in the repository index (READY, UNLOADING, UNAVAILABLE, ...);
        None where the server cannot be asked."""
        try:
            index = self.client().get_model_repository_index()
        except Exception:
            return None
        return {m["name"]: m.get("state") for m in index}

    def loaded_models(self) -> list[str]:
        return sorted(name for name, state in (self.model_states() or {}).items() if state == "READY")

    def model_state(self, model: str) -> str | None:
        """One model's state (model_states); None where it is not known."""
        return (self.model_states() or {}).get(model)

    def require_model(self, model: str) -> None:
        self.check_live()
        try:
            ready = self.client().is_model_ready(model)
        except Exception:
            ready = False
        if not ready:
            loaded = ", ".join(self.loaded_models()) or "none"
            raise PerfError(
                f"model '{model}' is not loaded on tritonserver at http://{self.http_url} (loaded: {loaded}); "
                "check --model, or load it"
            )

    # --- model facts ----------------------------------------------------------------------------
    def metadata(self, model: str) -> dict:
        return self.client().get_model_metadata(model)

    def config(self, model: str) -> dict:
        return self.client().get_model_config(model)

    def is_decoupled(self, model: str) -> bool:
        cfg = self.config(model)
        return bool(cfg.get("model_transaction_policy", {}).get("decoupled", False))

    def stats(self, model: str) -> ModelStats:
        try:
            data = self.client().get_inference_statistics(model)
        except Exception as e:
            raise PerfError(f"cannot read statistics of model '{model}' from http://{self.http_url}: {_short(e)}") from None
        total = ModelStats()
        for s in data.get("model_stats", []):
            batches = {int(b["batch_size"]): int(b["compute_infer"]["count"]) for b in s.get("batch_stats", [])}
            inf = s.get("inference_stats", {})
            total = ModelStats(
                total.inference_count + int(s.get("inference_count", 0)),
                total.execution_count + int(s.get("execution_count", 0)),
                total.success_count + int(inf.get("success", {}).get("count", 0)),
                total.queue_ns + int(inf.get("queue", {}).get("ns", 0)),
                total.compute_infer_ns + int(inf.get("compute_infer", {}).get("ns", 0)),
                {k: total.batch_executions.get(k, 0) + batches.get(k, 0) for k in set(total.batch_executions) | set(batches)},
            )
        return total

    def metrics_text(self, timeout_s: float = 5.0) -> str:
        try:
            with urllib.request.urlopen(self.metrics_url, timeout=timeout_s) as r:
                return r.read().decode("utf-8", "replace")
        except (urllib.error.URLError, OSError) as e:
            raise PerfError(f"cannot read Triton metrics at {self.metrics_url} ({_short(e)}): check --metrics-port") from None

    # --- model control --------------------------------------------------------------------------
    def load(self, model: str, config_json: str | None = None) -> None:
        try:
            if config_json is None:
                self.client().load_model(model)
            else:
                self.client().load_model(model, config=config_json)
        except Exception as e:
            msg = _short(e)
            hint = ""
            if "explicit model load" in msg or "not allowed" in msg:
                hint = "; the server must run with --model-control-mode=explicit (`tritonlm serve --model-control explicit`), or pass --serve"
            elif "poll" in msg:
                hint = (
                    f"; is --repo ({self.repo}) the model repository this server serves? "
                    "Otherwise the config is invalid: see the server log, or pass --serve"
                )
            raise PerfError(f"loading model '{model}' failed: {msg}{hint}") from None

    def unload(self, model: str) -> None:
        try:
            self.client().unload_model(model)
        except Exception as e:  # best effort: used in cleanup
            log.warning("unloading %s failed: %s", model, _short(e))

    def close(self) -> None:
        """Close this thread's client (others' are dropped: gevent objects cannot be closed from here)."""
        local = self.__dict__.get("_local")
        client = getattr(local, "client", None) if local is not None else None
        if client is not None:
            try:
                client.close()
            except Exception:
                pass
            local.client = None
        self.__dict__.pop("_clients", None)


class ManagedServer:
    """`--serve`: a private tritonserver on free ports, explicit model control, loading `models`."""

    def __init__(self, repo: Path, models: list[str], log_path: Path | None = None):
        self.repo = Path(repo)
        self.models = models
        self.log_path = log_path
        self.server = None

    def __enter__(self) -> Target:
        from tritonlm.paths import StackError
        from tritonlm.server import ServerStartError, TritonServer, free_ports

        for name in self.models:
            if not (self.repo / name / "config.pbtxt").is_file():
                raise PerfError(f"model '{name}' is not in the model repository {self.repo} (no {name}/config.pbtxt): check --model and --repo")
        http, grpc, metrics = free_ports(3)
        self.server = TritonServer(
            self.repo, http, grpc, metrics, model_control="explicit", load_models=list(self.models), log_path=self.log_path
        )
        # The server runs in its own session: SIGTERM to this process must still stop it.
        if threading.current_thread() is threading.main_thread():
            self._old_sigterm = signal.signal(signal.SIGTERM, _exit_on_sigterm)
        print(f"starting tritonserver on {self.repo} (ports {http}/{grpc}/{metrics}) ...", flush=True)
        try:
            self.server.start(timeout_s=300)
        except (ServerStartError, StackError) as e:
            self.__exit__(None, None, None)
            lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()][:3]
            raise PerfError("; ".join(lines) + f" (server log: {self.server.log_path})") from None
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return Target("127.0.0.1", http, grpc, metrics, repo=self.repo)

    def __exit__(self, *exc) -> None:
        try:
            if self.server is not None:
                self.server.stop()
        finally:
            if getattr(self, "_old_sigterm", None) is not None:
                signal.signal(signal.SIGTERM, self._old_sigterm)
                self._old_sigterm = None


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)
