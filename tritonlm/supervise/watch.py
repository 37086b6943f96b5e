"""Faults in the processes a tritonserver runs for its models, and which models serve.

Every check() looks again at what the server serves (its repository index: each model's
state) and at its processes (the stubs among its children), so models unloaded, loaded
or reloaded through the model-control API, or by poll mode, are followed as they come and
go. A model is at fault when:
- died: a stub of a model Triton serves (READY) is gone or a zombie, and no live stub
  replaces it: none started after it with its instance name, nor as many as the model's
  configuration asks for. A stub that ends while its model is unloaded, loaded or reloaded
  (Triton starts the new stubs, then ends the old ones) is not a fault; nor is the stub
  Triton runs only to read a model's configuration (named after the model itself);
- worker_died: one of a stub's model-parallel workers is gone or a zombie while the stub
  has not begun to unload (its heartbeat file is still there);
- wedged: its stub has been stopped (SIGSTOP), or silent (no heartbeat), for deadline_s;
  or its engine has been in one step for deadline_s while requests wait (a hang that
  frees the GIL: the heartbeat thread still beats);
- failed: its heartbeat names a fault (the engine thread ended, a worker was lost).
A stub that died before it was ever seen (its zombie's command line is already empty) is
named by its heartbeat file, or else charged to the served model that lacks a stub.

check() is cheap (a /proc scan, one index request to Triton, one file read per stub): the
supervisor calls it a few times a second. After each, views() says what each served model
has: its stubs, their workers, and how many stubs its configuration asks for, which the
health board turns into readiness. An index that has never been readable for the deadline
(an endpoint refused, a proxy in the way) is logged, and the models whose stubs run stand in
for it until it can be read: readiness must not stay off for good over it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol

from tritonlm.health_beat import beat_path, read_beat
from tritonlm.supervise.procs import (
    GONE, STOPPED, Stub, command_line, descendants, is_dead, process_state, scan_stubs, start_time,
)
from tritonlm.supervise.served import READY

WORKER_MODULE = "tritonlm.engine.parallel.worker"
# a stopped, silent or stuck model is wedged after this long (detected within a beat and a
# check more). A step is given longer where the engine's finished steps say it is normal,
# and its first steps FIRST_STEPS_S (step_limit).
DEFAULT_DEADLINE_S = 4.0
STEP_MARGIN = 4.0  # a step counts as stuck past this many times what the finished ones say is normal
WARM_STEPS = 4  # steps (that ran tokens) before the finished ones are a yardstick
FIRST_STEPS_S = 60.0  # the limit of a step before that
SERVER = "tritonserver"  # Fault.model when the fault is the server process's own

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Fault:
    model: str  # the model's name, or SERVER
    kind: str  # "died" | "worker_died" | "wedged" | "failed" | "server_exited"
    cause: str  # one sentence for the log, the probes and the clients

    def describe(self) -> str:
        return self.cause if self.model == SERVER else f"model {self.model}: {self.cause}"


@dataclass(frozen=True)
class ModelView:
    """One model Triton serves (READY in its index), as the last check saw it."""

    name: str
    stubs: tuple[int, ...]  # its instances' stub processes (the probe checks they still live)
    workers: tuple[int, ...]  # their model-parallel workers
    asked: int  # stubs its configuration asks for (0: a backend without stubs)


class ServedModels(Protocol):
    """What the watch asks tritonserver (served.TritonModels; a stand-in in tests)."""

    def index(self) -> dict[str, str] | None: ...  # model -> state; None: unreadable

    def stubs_asked(self, model: str) -> int | None: ...  # None: unreadable


@dataclass
class _Watched:
    stub: Stub
    workers: list[int] = field(default_factory=list)
    stopped_since: float | None = None
    last_beat: dict | None = None  # the last beat read from its heartbeat file
    unknown_since: float | None = None  # dead, and Triton could not say whether it still serves the model


def is_config_stub(stub: Stub) -> bool:
    """The stub Triton's Python backend runs while loading a model only to read (auto-
    complete) its configuration: it carries the model's own name, and ends by itself."""
    return stub.instance == stub.model


class ModelWatch:
    """The stubs of one tritonserver process (server_pid), their faults, and the models it
    serves (`served`: its repository index and configurations)."""

    def __init__(self, server_pid: int, health_dir: Path | None, served: ServedModels,
                 deadline_s: float = DEFAULT_DEADLINE_S, clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time):
        self.server_pid = server_pid
        self.health_dir = Path(health_dir) if health_dir is not None else None
        self.served = served
        self.deadline_s = deadline_s
        self.clock, self.wall_clock = clock, wall_clock
        self.watched: dict[int, _Watched] = {}
        self._settled: set[int] = set()  # dead stubs judged no fault (their zombies may linger)
        self._states: dict[str, str] | None = None  # the last index read: model -> state
        self._asked: dict[str, tuple[frozenset[int], int]] = {}  # model -> (its live stubs then, stubs asked)
        self._began = clock()
        # the index has never been readable for deadline_s: the models with stubs stand in for it
        self._index_fallback = False

    # --- the process table -----------------------------------------------------------------
    def _scan(self) -> list[int]:
        """Watch stubs started since the last scan, with the model-parallel workers each
        runs; returns the dead stubs no scan could name."""
        scan = scan_stubs(self.server_pid)
        for stub in scan.stubs:
            if stub.pid not in self.watched and stub.pid not in self._settled:
                self._watch(stub)
        return [pid for pid in scan.unnamed_dead if pid not in self.watched and pid not in self._settled]

    def _watch(self, stub: Stub) -> _Watched:
        workers = [p for p in descendants(stub.pid) if WORKER_MODULE in command_line(p)]
        self.watched[stub.pid] = _Watched(stub, workers)
        return self.watched[stub.pid]

    def _live_stubs(self, model: str) -> list[Stub]:
        return [w.stub for pid, w in self.watched.items()
                if w.stub.model == model and not is_config_stub(w.stub) and not is_dead(process_state(pid))]

    def models(self) -> list[str]:
        return sorted({w.stub.model for w in self.watched.values()})

    # --- what Triton serves ---------------------------------------------------------------
    def _read_index(self) -> dict[str, str] | None:
        states = self.served.index()
        if states is not None:
            if self._index_fallback:
                log.info("tritonserver's repository index is readable again: readiness follows it")
            self._states, self._index_fallback = states, False
        elif self._states is None and not self._index_fallback and self.clock() - self._began >= self.deadline_s:
            # never read (an endpoint refused, a proxy in the way): readiness must not stay off for
            # good over it, so the models whose stubs run count as served until it can be read
            self._index_fallback = True
            log.warning("tritonserver's repository index (POST /v2/repository/index) has not been readable for "
                        "%.1f s: readiness follows the model processes alone until it is", self.deadline_s)
        return states

    def _served_states(self) -> dict[str, str] | None:
        """model -> state at the last readable index; in the fallback, every model with stubs."""
        if self._states is None and self._index_fallback:
            return {m: READY for m in self.models()}
        return self._states

    def _stubs_asked(self, model: str, live: list[Stub]) -> int:
        """Asked again whenever the model's stubs change (a reload may change its count)."""
        key = frozenset(s.pid for s in live)
        known = self._asked.get(model)
        if known is not None and known[0] == key:
            return known[1]
        asked = self.served.stubs_asked(model)
        if asked is None:
            return known[1] if known is not None else 0  # asked again at the next check
        self._asked[model] = (key, asked)
        return asked

    def views(self) -> dict[str, ModelView]:
        """The models Triton served at the last readable index, each with its processes."""
        states = self._served_states()
        if states is None:
            return {}
        out = {}
        for name in sorted(m for m, state in states.items() if state == READY):
            mine = [(pid, w) for pid, w in self.watched.items() if w.stub.model == name and not is_config_stub(w.stub)]
            out[name] = ModelView(name, tuple(pid for pid, _ in mine), tuple(p for _, w in mine for p in w.workers),
                                  self._stubs_asked(name, self._live_stubs(name)))
        return out

    # --- faults ---------------------------------------------------------------------------
    def first_death(self) -> Fault | None:
        """A watched stub or worker that is dead, unjudged: once tritonserver itself has
        exited there is nothing left to ask, and a death before its exit is the likelier cause."""
        for pid, w in self.watched.items():
            if is_config_stub(w.stub):
                continue
            if is_dead(process_state(pid)):
                return self._died(pid, w.stub)
            for worker in w.workers:
                if is_dead(process_state(worker)):
                    return Fault(w.stub.model, "worker_died", f"its model-parallel worker process (pid {worker}) died")
        return None

    def check(self) -> Fault | None:
        """The first fault found, or None."""
        self._settled = {pid for pid in self._settled if process_state(pid) != GONE}
        self._read_index()
        unnamed = self._scan()
        for pid, w in list(self.watched.items()):
            fault = self._check_one(pid, w)
            if fault is not None and fault.kind == "died":
                fault = self._judge_death(pid, w, fault)
            elif fault is not None and fault.kind == "worker_died" and self._unloading(pid, w):
                w.workers = [p for p in w.workers if not is_dead(process_state(p))]
                fault = None
            if fault is not None:
                return fault
        for pid in unnamed:
            fault = self._unnamed_death(pid)
            if fault is not None:
                return fault
        return None

    def _judge_death(self, pid: int, w: _Watched, fault: Fault) -> Fault | None:
        """A dead stub is a fault only if Triton still serves its model (asked again now,
        not at the start of this check) and no live stub replaces it (the process table
        read again: a replacement may have started since)."""
        if is_config_stub(w.stub) or self._unloading(pid, w):
            return self._settle(pid)  # ended on its own, its model unloaded cleanly
        states = self._read_index()
        if states is not None and states.get(w.stub.model) != READY:
            return self._settle(pid)  # unloaded, or being (re)loaded: Triton ended it
        asked = None
        if states is not None:
            self._scan()
            live = [s for s in self._live_stubs(w.stub.model) if s.pid != pid]
            if any(s.instance == w.stub.instance and s.started > w.stub.started for s in live):
                return self._settle(pid)  # a reload's stub of the same instance took its place
            asked = self.served.stubs_asked(w.stub.model)  # read now: a reload may have changed it
            if asked is not None and len(live) >= asked:
                return self._settle(pid)  # a reload's new set, or fewer instances, serves
            if asked is not None:
                return fault
        # the server cannot say now: not a verdict either way, for a while
        w.unknown_since = w.unknown_since if w.unknown_since is not None else self.clock()
        return fault if self.clock() - w.unknown_since >= self.deadline_s else None

    def _settle(self, pid: int) -> None:
        """No fault: forget the stub (its zombie, while it lasts, is not judged again)."""
        del self.watched[pid]
        self._settled.add(pid)
        return None

    def _unloading(self, pid: int, w: _Watched) -> bool:
        """The stub has begun to unload its model (finalize removes its heartbeat file first,
        then ends the workers) and its last beat named no fault."""
        if self.health_dir is None or w.last_beat is None or w.last_beat.get("fault"):
            return False
        return not beat_path(self.health_dir, pid).exists()

    def _unnamed_death(self, pid: int) -> Fault | None:
        """A stub that died before any scan read its command line: its heartbeat file names
        it; failing that, a served model with fewer live stubs than it asks for lost it."""
        beat = read_beat(beat_path(self.health_dir, pid)) if self.health_dir is not None else None
        if beat is not None and isinstance(beat.get("model"), str):
            w = self._watch(Stub(pid, beat["model"], str(beat.get("instance", "")), start_time(pid)))
            w.last_beat = beat
            return self._judge_death(pid, w, self._died(pid, w.stub))
        for model, state in sorted((self._served_states() or {}).items()):
            if state != READY:
                continue
            live = self._live_stubs(model)
            if len(live) < self._stubs_asked(model, live):
                return Fault(model, "died", f"its process (pid {pid}) died")
        self._settled.add(pid)  # no model misses it: not charged later to a model that loads
        return None

    @staticmethod
    def _died(pid: int, stub: Stub) -> Fault:
        return Fault(stub.model, "died", f"its process (pid {pid}, instance {stub.instance}) died")

    def _check_one(self, pid: int, w: _Watched) -> Fault | None:
        model = w.stub.model
        state = process_state(pid)
        if is_dead(state):
            return self._died(pid, w.stub)
        w.unknown_since = None
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
            return None  # not a tritonlm model, not started yet, or unloading: its process state is all there is
        w.last_beat = beat
        if beat.get("fault"):
            return Fault(model, "failed", str(beat["fault"]))
        beat_time = float(beat.get("time", 0.0))
        silent = self.wall_clock() - beat_time
        if silent >= self.deadline_s:
            return Fault(model, "wedged", f"its process (pid {pid}) has not answered for {silent:.1f} s")
        # timed by the model's own beat (when it was written, the step had run this long):
        # a step that ends between two beats is never taken for a stuck one
        waiting, step_at = int(beat.get("waiting") or 0), beat.get("step_at")
        if not waiting or step_at is None:
            return None
        in_step = beat_time - float(step_at)
        limit = step_limit(self.deadline_s, beat)
        if in_step >= limit:
            return Fault(model, "wedged", f"its engine (pid {pid}) has been in one step for {in_step:.1f} s "
                         f"(limit {limit:.1f} s) while {waiting} request(s) wait")
        return None


def step_limit(deadline_s: float, beat: dict) -> float:
    """How long one step may run while requests wait before the model counts as wedged.

    The deadline, or longer where the engine's own steps say a step this long is normal:
    STEP_MARGIN times the longest step it has finished, or times its slowest pace per
    token over the tokens of this step (a first full prefill chunk after short prompts
    and decode steps; a one-row decode step reads every weight for one token, so no step
    is slower per token than the slowest seen, short of a stall). Until WARM_STEPS steps
    have finished there is no yardstick, and a first step may compile kernels (a GPU's
    first pass) or be a large model's first prefill chunk on a CPU: FIRST_STEPS_S then.
    A hang in a model whose steps are fast is caught within the deadline."""
    if int(beat.get("steps_done") or 0) < WARM_STEPS:
        return max(deadline_s, FIRST_STEPS_S)
    pace = float(beat.get("sec_per_token") or 0.0) * int(beat.get("step_tokens") or 0)
    return max(deadline_s, STEP_MARGIN * float(beat.get("longest_step") or 0.0), STEP_MARGIN * pace)
