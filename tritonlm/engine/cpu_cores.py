"""How many CPU cores this process really gets, and how many compute threads to run on them.

Two limits are read once, at load:
    affinity   os.sched_getaffinity (taskset, a cpuset, Kubernetes' static CPU manager)
    quota      the CFS bandwidth limit of this process's cgroup and its ancestors
               (tritonlm/engine/cgroup_cpu.py; a Kubernetes CPU limit is such a quota)
torch's OpenMP pool follows the affinity mask but not the quota, and `os.cpu_count()`
follows neither, so a pod limited to 2 CPUs on a 64-core node would start 64 threads that
are throttled together. `usable_cores()` is the smaller of the two.

While serving, the team can get fewer cores than that. An OpenMP team waits for its
slowest thread at every parallel op; when one of them is off its core the rest spin, and a
step made of hundreds of such ops stalls (docs/benchmarks.md, "A shared CPU"). `CoreWatch`
measures, for this process and not for the node, the two ways a team loses cores:
    throttled  where a quota applies, the cgroup's own throttled time (cpu.stat) per second
               of wall time: about how many cores' worth of runnable work it had beyond
               the quota, whatever the rest of the node does
    waiting    the compute threads' run-queue wait (schedstat, tritonlm/engine/schedstat.py)
               per second: the time they were runnable while something else held the core.
               A neighbour counts only as far as it makes them wait: a niced or idle-class
               process that yields, or one busy on CPUs the scheduler does not put them
               on, costs nothing and is not counted
Busy time on the node's CPUs says neither: with a 4-core quota on a 64-core node the node
can be full while the pod runs free, or quiet while the pod is throttled. `thread_count()`
turns the cores lost into a team size, and the engine applies it between steps
(`ThreadGovernor`). Never more threads than the load-time count.
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

from tritonlm.engine.cgroup_cpu import Quota, cgroup_quota_cores, cgroup_quotas, throttled_s
from tritonlm.engine.schedstat import TASKS, threads_named
from tritonlm.engine.threads import ENGINE_THREAD, OS_NAME_BYTES

log = logging.getLogger(__name__)

COMPUTE_THREAD = ENGINE_THREAD[:OS_NAME_BYTES]  # the compute thread's OS name; its OpenMP workers inherit it


@dataclass(frozen=True)
class CoreBudget:
    """The cores this process may use: `cores` (a quota may make it fractional) and why."""

    cores: float
    why: str

    def threads(self, share: int = 1) -> int:
        """Compute threads for one of `share` processes that split this budget (model
        instances, tensor-parallel ranks): a whole core each, at least one."""
        return max(1, math.floor(self.cores / max(1, share) + 1e-9))


def affinity_cpus() -> list[int]:
    """The CPUs this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def usable_cores(cpus: list[int] | None = None, quota: float | None = None, read_quota: bool = True) -> CoreBudget:
    """The affinity mask's CPU count, capped by the cgroup quota; says which one decided."""
    cpus = affinity_cpus() if cpus is None else cpus
    if read_quota and quota is None:
        quota = cgroup_quota_cores()
    if quota is not None and quota < len(cpus):
        return CoreBudget(quota, f"cgroup CPU quota {quota:g} cores (affinity allows {len(cpus)})")
    total = os.cpu_count() or len(cpus)
    if len(cpus) < total:
        return CoreBudget(float(len(cpus)), f"affinity: {len(cpus)} of the host's {total} CPUs")
    return CoreBudget(float(len(cpus)), f"all {len(cpus)} CPUs (no affinity mask or CPU quota)")


# ---------------------------------------------------------------------------- while serving

LOST_FROM = 0.5  # share of a core the team must lose before that core counts as gone
PROC_STAT = Path("/proc/stat")
# /proc/stat's per-CPU fields: user nice system idle iowait irq softirq steal guest guest_nice
_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)
_IDLE_FIELDS = (3, 4)


def read_cpu_times(cpus: list[int], stat: Path = PROC_STAT) -> tuple[float, float] | None:
    """(busy, idle) seconds summed over `cpus` since boot; None where it cannot be read."""
    try:
        text = stat.read_text()
    except OSError:
        return None
    hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    wanted = {f"cpu{c}" for c in cpus}
    busy = idle = 0
    for line in text.splitlines():
        name, _, rest = line.partition(" ")
        if name in wanted:
            ticks = [int(v) for v in rest.split()]
            busy += sum(ticks[i] for i in _BUSY_FIELDS if i < len(ticks))
            idle += sum(ticks[i] for i in _IDLE_FIELDS if i < len(ticks))
    return busy / hz, idle / hz


@dataclass(frozen=True)
class CoreReading:
    """One window of `window_s` seconds, in cores' worth (seconds per second of wall time)."""

    window_s: float
    waiting: float  # the compute threads' run-queue wait
    throttled: float  # the most any group with a quota on our path stood throttled
    foreign: float = 0.0  # other processes' CPU time on our CPUs (only where the mask binds)
    cpus: int = 0  # the CPUs of that mask (0: foreign not read)

    def lost_for(self, team: int) -> float:
        """Cores a team of `team` threads did not get. The largest of the three, not their
        sum: where the kernel keeps a throttled thread on its run queue, its throttled time
        is wait as well, and a neighbour's CPU time is what the team waited for. Other
        processes count only on the CPUs the team would use: those beyond it are free."""
        crowded = self.foreign - max(0, self.cpus - team) if self.cpus else 0.0
        return max(self.waiting, self.throttled, crowded)

    @property
    def lost(self) -> float:
        """lost_for a team that fills the CPUs."""
        return self.lost_for(self.cpus)


class CoreWatch:
    """How many cores the compute threads lost over the last interval, to waiting for a
    core and to the cgroup's quota.

    thread_name: the OS name of the threads whose waits count (the compute thread and the
    OpenMP workers it started); None counts every thread of the process. quotas: the
    groups whose throttling counts (read from /proc/self/cgroup when None).

    Where the affinity mask, not a quota, is the binding limit (a cpuset, taskset), the
    mask's CPUs are this process's to use, and the CPU time other processes took on them
    (`stat`, /proc/stat, less this process's own) is read too: a team the scheduler crowds
    onto fewer cores than it has threads stalls at every op while its workers, asleep at
    the barriers, hardly wait on a run queue. Under a quota on a larger node the mask is
    the node's, not ours, and only the wait and the throttling count. stat None: off."""

    def __init__(self, quotas: list[Quota] | None = None, thread_name: str | None = COMPUTE_THREAD,
                 tasks: Path = TASKS, clock=time.monotonic, cpus: list[int] | None = None,
                 stat: Path | None = PROC_STAT, own_cpu=time.process_time):
        self.quotas = cgroup_quotas() if quotas is None else quotas
        self.thread_name, self.tasks, self._clock = thread_name, tasks, clock
        self.cpus = affinity_cpus() if cpus is None else cpus
        quota = min((q.cores for q in self.quotas), default=None)
        self.stat = stat if quota is None or quota >= len(self.cpus) else None
        self._own = own_cpu
        self._t = clock()
        self._waits = self._read_waits()
        self._throttled = [throttled_s(q.stat) for q in self.quotas]
        self._busy = self._read_busy()

    def _read_busy(self) -> tuple[float, float] | None:
        """(busy seconds on our CPUs since boot, this process's CPU seconds); None: not read."""
        if self.stat is None:
            return None
        times = read_cpu_times(self.cpus, self.stat)
        return None if times is None else (times[0], self._own())

    def _read_waits(self) -> dict[int, int]:
        return {tid: s.waiting_ns for tid, s in threads_named(self.thread_name, self.tasks).items()}

    def reading(self) -> CoreReading | None:
        """Since the last call (or since it was made); None when no time has passed."""
        now, waits = self._clock(), self._read_waits()
        throttled = [throttled_s(q.stat) for q in self.quotas]
        busy = self._read_busy()
        last_t, last_waits, last_throttled, last_busy = self._t, self._waits, self._throttled, self._busy
        self._t, self._waits, self._throttled, self._busy = now, waits, throttled, busy
        wall = now - last_t
        if wall <= 0:
            return None
        foreign, cpus = 0.0, 0
        if busy is not None and last_busy is not None:
            others = (busy[0] - last_busy[0]) - (busy[1] - last_busy[1])
            foreign, cpus = min(float(len(self.cpus)), max(0.0, others / wall)), len(self.cpus)
        # a thread first seen now started during the window (a team grows by new workers);
        # one that ended took its counters with it and is left out
        waited_ns = sum(max(0, ns - last_waits.get(tid, 0)) for tid, ns in waits.items())
        over = [max(0.0, b - a) for a, b in zip(last_throttled, throttled) if a is not None and b is not None]
        return CoreReading(wall, waited_ns / 1e9 / wall, max(over, default=0.0) / wall, foreign, cpus)

    def lost_cores(self) -> float | None:
        """The cores lost since the last call as one number (CoreReading.lost)."""
        reading = self.reading()
        return None if reading is None else reading.lost


def cores_lost(lost: float) -> int:
    """Whole cores in `lost` cores' worth: a core counts once half of it is lost. A neighbour
    that holds a core keeps a thread of the team waiting for most of the window; the
    server's own threads waking on the team's cores on a quiet host cost a fraction of
    that, and must not shrink the team."""
    return max(0, math.floor(lost + 1 - LOST_FROM + 1e-9))


def thread_count(current: int, lost: float, most: int) -> int:
    """The team that fits the cores left: `current` threads less each core lost; at least
    one thread, never more than `most`."""
    return max(1, min(most, current - cores_lost(lost)))


class ThreadGovernor:
    """Keeps the compute thread's OpenMP team at the cores it actually gets.

    tick() runs on the compute thread between steps (the team belongs to the thread that
    runs the parallel ops); it is a clock read except every `interval_s`, when it takes a
    CoreWatch reading. A reading that shows cores lost lowers the team at once: a team one
    thread too large for its cores stalls at every op, one thread too small loses at most
    that thread's share.

    Raising needs a probe: once the team is small enough its threads stop waiting, so a
    reading cannot tell a neighbour that left from one still there. After `grow_after`
    readings in a row with nothing lost the team grows by one thread, on trial for the next
    `grow_after` readings. A trial that ends in a lowering doubles the calm readings the
    next probe waits for (up to `grow_after * max_backoff`), so a neighbour that stays
    costs one short stalled window now and then; a trial that holds brings the wait back
    to `grow_after`. The engine says how long it was idle before this step: after an idle
    spell longer than the interval, the reading starts afresh, since one over idle time
    says nothing about now. (A long gap between ticks is not idleness: a starved step can
    take seconds, and that is when a reading matters most.)"""

    def __init__(self, most: int, set_threads, watch: CoreWatch | None = None, interval_s: float = 0.25,
                 grow_after: int = 4, max_backoff: int = 32, clock=time.monotonic):
        self.most, self.current = most, most
        self.set_threads = set_threads  # applies a count; called on the thread that ticks
        self.watch = watch or CoreWatch()
        self.interval_s, self.grow_after = interval_s, grow_after
        self.most_calm = grow_after * max_backoff
        self._clock = clock
        self._next = clock() + interval_s
        self._calm = 0  # readings in a row with nothing lost
        self._needed = grow_after  # calm readings the next probe waits for
        self._trial = 0  # readings left before the last raise counts as holding
        self.changes = 0

    def tick(self, idle_s: float = 0.0) -> None:
        """Before a step; idle_s: how long the loop waited for work before it."""
        if self.most <= 1:  # one thread is the least a team can have: nothing to decide
            return
        now = self._clock()
        if idle_s > self.interval_s:
            self.watch.reading()  # a fresh reading from now
            self._next = now + self.interval_s
            return
        if now < self._next:
            return
        self._next = now + self.interval_s
        reading = self.watch.reading()
        if reading is None:
            return
        lost = reading.lost_for(self.current)
        if cores_lost(lost):
            if self._trial:  # the probe found the cores still taken: wait longer for the next
                self._needed = min(self._needed * 2, self.most_calm)
            self._trial = self._calm = 0
            want = thread_count(self.current, lost, self.most)
            if want < self.current:
                self._apply(want, f"lost {lost:.2f} cores' worth over {reading.window_s:.2f} s "
                                  f"(run-queue wait {reading.waiting:.2f}, cgroup throttled {reading.throttled:.2f}, "
                                  f"other processes on our CPUs {reading.foreign:.2f})")
            return
        if self._trial:
            self._trial -= 1
            if not self._trial:
                self._needed = self.grow_after
        if self.current >= self.most:
            return
        self._calm += 1
        if self._calm >= self._needed:
            self._calm, self._trial = 0, self.grow_after
            self._apply(self.current + 1, f"nothing lost for {self._needed} readings")

    def _apply(self, threads: int, why: str) -> None:
        log.info("compute threads %d -> %d: %s", self.current, threads, why)
        self.set_threads(threads)
        self.current = threads
        self.changes += 1


def instances_in_config(config: dict) -> int:
    """Processes a Triton model config starts (instance_group: count, per listed GPU for
    KIND_GPU), each a Python backend stub that computes on this host's cores."""
    total = 0
    for group in config.get("instance_group") or []:
        count = int(group.get("count") or 1)
        total += count * max(1, len(group.get("gpus") or []))
    return max(1, total)
