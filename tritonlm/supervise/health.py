"""What the probes, the metrics and the OpenAI frontend know about the served models.

One HealthBoard per `tritonlm serve`. The supervisor writes it (main thread); the health
endpoint and the OpenAI frontend read it (their own threads), hence the lock.

- ready: every model Triton serves has all the processes its configuration asks for, and
  nothing is draining or recovering (readiness probe). The models follow the server: one
  unloaded leaves the board, one loaded joins it once Triton serves it;
- live: recovery has not given up (liveness probe): a drain or a restart in progress is
  not a reason to kill the pod, a model that cannot come back is.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge

from tritonlm.supervise.procs import is_dead, process_state
from tritonlm.supervise.watch import ModelView

LOADING, READY, RECOVERING, DRAINING, FAILED = "loading", "ready", "recovering", "draining", "failed"


@dataclass
class ModelHealth:
    state: str = LOADING
    cause: str = ""  # why it is not ready (the fault, in words)
    since: float = 0.0  # wall-clock time of the last change


class HealthBoard:
    def __init__(self, models: list[str] | None = None):
        self._lock = threading.Lock()
        self._models: dict[str, ModelHealth] = {}
        self._gave_up: str | None = None
        self._draining = False
        self._views: dict[str, ModelView] = {}
        self._epoch = 0  # faults so far: a request that saw it change lived through a restart
        self._last_cause = ""
        self.registry = CollectorRegistry()
        self._healthy = Gauge("tritonlm_model_healthy", "1 while the model serves; 0 while it loads, recovers, "
                              "drains or has failed", ["model"], registry=self.registry)
        self._restarts = Counter("tritonlm_model_restarts", "Restarts after a fault of the model (cause: died, "
                                 "worker_died, wedged, failed, server_exited, load_failed)", ["model", "cause"],
                                 registry=self.registry)
        self._recovery = Gauge("tritonlm_recovery_in_progress", "1 while tritonserver is being restarted after a fault",
                               registry=self.registry)
        for name in models or []:
            self._set(name, LOADING, "")

    # --- writes (the supervisor) ---------------------------------------------------------
    def _set(self, model: str, state: str, cause: str) -> None:
        self._models[model] = ModelHealth(state, cause, time.time())
        self._healthy.labels(model).set(1 if state == READY else 0)

    def follow(self, views: dict[str, ModelView]) -> None:
        """After every check (and every start): the models Triton serves now, with their
        processes. A model with fewer live stubs than it asks for is loading (readiness off,
        no fault); any other model is forgotten. The readiness probe checks the processes
        itself, so one that died since the supervisor last looked is never reported ready."""
        with self._lock:
            if self._draining or self._gave_up is not None:  # what the probes say now stays
                return
            self._views = dict(views)
            for gone in set(self._models) - set(views):
                del self._models[gone]
                self._healthy.remove(gone)
            for name, view in views.items():
                missing = _missing(view)
                state, cause = (READY, "") if not missing else (LOADING, missing)
                old = self._models.get(name)
                if old is None or (old.state, old.cause) != (state, cause):
                    self._set(name, state, cause)
            self._recovery.set(0)

    def set_models(self, models: list[str]) -> None:
        """The models served, with no processes to check (a stand-in server's)."""
        self.follow({name: ModelView(name, (), (), 0) for name in models})

    def recovering(self, model: str, cause: str, restart_cause: str) -> None:
        """A fault of `model` (or of tritonserver): every model goes down while the server
        restarts; the restart is counted against `model`."""
        with self._lock:
            for name in self._models:
                self._set(name, RECOVERING, cause)
            self._epoch += 1
            self._last_cause = cause
            self._restarts.labels(model, restart_cause).inc()
            self._recovery.set(1)

    def draining(self) -> None:
        with self._lock:
            self._draining = True
            for name in self._models:
                self._set(name, DRAINING, "the server is shutting down")

    def give_up(self, cause: str) -> None:
        with self._lock:
            self._gave_up = cause
            for name in self._models:
                self._set(name, FAILED, cause)
            self._recovery.set(0)

    # --- reads (probes, the frontend) ------------------------------------------------------
    def _ready(self) -> bool:
        return (not self._draining and self._gave_up is None and bool(self._models)
                and all(m.state == READY for m in self._models.values())
                and not any(_missing(view) for view in self._views.values()))

    def ready(self) -> bool:
        with self._lock:
            return self._ready()

    def live(self) -> bool:
        with self._lock:
            return self._gave_up is None

    def unavailable(self, model: str) -> str | None:
        """Why `model` cannot take a request now (None: it can, or it is not one we watch)."""
        with self._lock:
            health = self._models.get(model)
            if self._gave_up is not None:
                return f"model {model} is out of service: {self._gave_up}"
            if health is None or health.state == READY:
                return None
            if health.state == RECOVERING:
                return f"model {model} is restarting ({health.cause}); retry shortly"
            if health.state == DRAINING:
                return f"model {model} is unavailable: the server is shutting down"
            return f"model {model} is not ready yet ({health.state}); retry shortly"

    def epoch(self) -> int:
        with self._lock:
            return self._epoch

    def explain(self, model: str, since_epoch: int) -> str | None:
        """Why a request to `model` that began at since_epoch (epoch()) lost its connection:
        the model is down now, or it went down and came back while the request ran. A
        restart the request lived through is named even while the model still loads after
        it: "not ready yet" alone would hide the fault that ended the request. None while the
        model is down with no fault marked since (the caller waits, then asks unavailable())."""
        with self._lock:
            health = self._models.get(model)
            if (self._epoch != since_epoch and health is not None and self._gave_up is None
                    and health.state in (READY, LOADING)):
                return f"model {model} was restarted while this request ran ({self._last_cause}); retry"
            if (self._epoch == since_epoch and health is not None and self._gave_up is None
                    and health.state == LOADING):
                # fewer live processes and no fault marked: a check saw the process gone before
                # the supervisor named why, which it does on its next look; not an answer yet
                return None
        return self.unavailable(model)

    def status(self) -> dict:
        with self._lock:
            return {
                "ready": self._ready(),
                "live": self._gave_up is None,
                "gave_up": self._gave_up,
                "models": {name: {"state": m.state, "cause": m.cause or None, "since": m.since}
                           for name, m in sorted(self._models.items())},
            }


def _missing(view: ModelView) -> str:
    """What the model lacks to serve, in words ("" when nothing): live stubs short of the
    instances it asks for, or a dead model-parallel worker."""
    live = sum(not is_dead(process_state(pid)) for pid in view.stubs)
    if live < view.asked:
        return f"{live} of its {view.asked} instance processes run"
    dead = [pid for pid in view.workers if is_dead(process_state(pid))]
    return f"its model-parallel worker process (pid {dead[0]}) died" if dead else ""
