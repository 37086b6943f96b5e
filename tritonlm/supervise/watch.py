"""Faults in the processes a tritonserver runs for its models.

A model is at fault when, while Triton still serves it:
- died / worker_died: its stub / one of its model-parallel workers is gone or a zombie;
- wedged: its stub has been stopped (SIGSTOP), or silent (no heartbeat), for deadline_s;
- failed: its heartbeat names a fault (the engine thread ended, a worker was lost).
A stub that goes away while its model is no longer served (an unload through the
model-control API) is not a fault; a worker that dies while its stub lives always is (the
parallel runner may ask Triton to unload the model it broke: it comes back with the server). check() is cheap (a /proc scan and one file read per
stub): the supervisor calls it a few times a second.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from tritonlm.glue.heartbeat import beat_path, read_beat
from tritonlm.supervise.procs import STOPPED, Stub, command_line, descendants, find_stubs, is_dead, process_state

WORKER_MODULE = "tritonlm.engine.parallel.worker"
DEFAULT_DEADLINE_S = 4.0  # a stopped or silent model is wedged after this long (detected within 5 s)
SERVER = "tritonserver"  # Fault.model when the fault is the server process's own


@dataclass(frozen=True)
class Fault:
    model: str  # the model's name, or SERVER
    kind: str  # "died" | "worker_died" | "wedged" | "failed" | "server_exited"
    cause: str  # one sentence for the log, the probes and the clients

    def describe(self) -> str:
        return self.cause if self.model == SERVER else f"model {self.model}: {self.cause}"


@dataclass
class _Watched:
    stub: Stub
    workers: list[int] = field(default_factory=list)
    stopped_since: float | None = None


class ModelWatch:
    """The stubs of one tritonserver process (server_pid) and their faults.

    model_served(model) says whether Triton still serves the model (its ready endpoint);
    it is asked only when something looks wrong."""

    def __init__(self, server_pid: int, health_dir: Path | None, model_served: Callable[[str], bool],
                 deadline_s: float = DEFAULT_DEADLINE_S, clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time):
        self.server_pid = server_pid
        self.health_dir = Path(health_dir) if health_dir is not None else None
        self.model_served = model_served
        self.deadline_s = deadline_s
        self.clock, self.wall_clock = clock, wall_clock
        self.watched: dict[int, _Watched] = {}

    def _scan(self) -> None:
        """Add stubs started since the last scan (a model loaded through the API), with the
        model-parallel workers each runs."""
        for stub in find_stubs(self.server_pid):
            if stub.pid not in self.watched:
                workers = [p for p in descendants(stub.pid) if WORKER_MODULE in command_line(p)]
                self.watched[stub.pid] = _Watched(stub, workers)

    def models(self) -> list[str]:
        return sorted({w.stub.model for w in self.watched.values()})

    def check(self) -> Fault | None:
        """The first fault found, or None."""
        self._scan()
        for pid, w in list(self.watched.items()):
            fault = self._check_one(pid, w)
            if fault is None:
                continue
            if fault.kind == "died" and not self.model_served(w.stub.model):
                del self.watched[pid]  # unloaded on purpose: its stub is gone for good
                continue
            return fault
        return None

    def _check_one(self, pid: int, w: _Watched) -> Fault | None:
        model = w.stub.model
        state = process_state(pid)
        if is_dead(state):
            return Fault(model, "died", f"its process (pid {pid}, instance {w.stub.instance}) died")
        for worker in w.workers:
            if is_dead(process_state(worker)):
                return Fault(model, "worker_died", f"its model-parallel worker process (pid {worker}) died")
        now = self.clock()
        if state == STOPPED:
            w.stopped_since = w.stopped_since if w.stopped_since is not None else now
            if now - w.stopped_since >= self.deadline_s:
                return Fault(model, "wedged", f"its process (pid {pid}) has been stopped for {now - w.stopped_since:.1f} s")
            return None  # a stopped process beats no more: its stop, not its silence, is timed
        else:
            w.stopped_since = None
        if self.health_dir is None:
            return None
        beat = read_beat(beat_path(self.health_dir, pid))
        if beat is None:
            return None  # not a tritonlm model, or not started yet: its process state is all there is
        if beat.get("fault"):
            return Fault(model, "failed", str(beat["fault"]))
        silent = self.wall_clock() - float(beat.get("time", 0.0))
        if silent >= self.deadline_s:
            return Fault(model, "wedged", f"its process (pid {pid}) has not answered for {silent:.1f} s")
        return None
