"""How many CPU cores this process really gets, and how many compute threads to run on them.

Two limits are read once, at load:
    affinity   os.sched_getaffinity (taskset, a cpuset, Kubernetes' static CPU manager)
    quota      the CFS bandwidth limit of this process's cgroup and its ancestors: cgroup v2
               `cpu.max` ("QUOTA PERIOD" or "max PERIOD"), v1 `cpu.cfs_quota_us` /
               `cpu.cfs_period_us` (-1: none). A Kubernetes CPU limit is such a quota.
torch's OpenMP pool follows the affinity mask but not the quota, and `os.cpu_count()`
follows neither, so a pod limited to 2 CPUs on a 64-core node would start 64 threads that
are throttled together. `usable_cores()` is the smaller of the two.

A third limit changes while serving: another process busy on one of our cores. An OpenMP
team waits for its slowest thread at every parallel op; when one of them is off its core
the rest spin, and a step made of hundreds of such ops stalls (docs/benchmarks.md, "A
shared CPU"). `CoreWatch` measures, from /proc/stat,
the CPU time on our cores that went to other processes, and `thread_count()` turns the
cores left over into a thread count; the engine applies it between steps
(`ThreadGovernor`). One compute thread per core left, never more than the load-time count.
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

CGROUP_ROOT = Path("/sys/fs/cgroup")


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


def _cgroup_paths(proc_cgroup: Path) -> tuple[str | None, str | None]:
    """(the v2 path, the v1 `cpu` controller's path) from /proc/self/cgroup."""
    v2 = v1 = None
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None, None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            v2 = path
        elif "cpu" in controllers.split(","):
            v1 = path
    return v2, v1


def _ancestors(base: Path, path: str) -> list[Path]:
    """base/path and each folder above it up to base: a limit anywhere on the way applies."""
    parts = [p for p in path.split("/") if p]
    return [base.joinpath(*parts[:i]) for i in range(len(parts), -1, -1)]


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def cgroup_quota_cores(root: Path = CGROUP_ROOT, proc_cgroup: Path = Path("/proc/self/cgroup")) -> float | None:
    """The tightest CFS quota over this process's cgroup and its ancestors, in cores; None
    where there is none (or no cgroup file system to read)."""
    v2, v1 = _cgroup_paths(proc_cgroup)
    limits: list[float] = []
    if v2 is not None:
        for folder in _ancestors(root, v2):
            text = _read(folder / "cpu.max")
            if text:
                quota, _, period = text.partition(" ")
                if quota != "max" and period:
                    limits.append(int(quota) / int(period))
    if v1 is not None:
        # the controller is mounted as cpu, cpu,cpuacct or cpuacct,cpu; inside a container
        # the mount's top is the container's own group, so the host path may not exist
        for mount in (root / "cpu", root / "cpu,cpuacct", root / "cpuacct,cpu"):
            for folder in _ancestors(mount, v1) + [mount]:
                quota, period = _read(folder / "cpu.cfs_quota_us"), _read(folder / "cpu.cfs_period_us")
                if quota and period and int(quota) > 0 and int(period) > 0:
                    limits.append(int(quota) / int(period))
    return min(limits) if limits else None


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

_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)  # user nice system irq softirq steal (steal: the hypervisor took it)
_IDLE_FIELDS = (3, 4)  # idle iowait


def read_cpu_times(cpus: list[int], stat: Path = Path("/proc/stat")) -> tuple[float, float] | None:
    """(busy, idle) seconds summed over `cpus` since boot; None where /proc/stat is missing."""
    text = _read(stat)
    if text is None:
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


class CoreWatch:
    """How many of our cores other processes took over the last interval.

    foreign = CPU time spent on our cores - this process's own CPU time, per second of wall
    time. Our own threads spinning at a barrier keep other processes off our cores only as
    far as the scheduler lets them, so a neighbour that wants a whole core shows up as most
    of one."""

    def __init__(self, cpus: list[int] | None = None, clock=time.monotonic, own_cpu=time.process_time,
                 cpu_times=read_cpu_times):
        self.cpus = affinity_cpus() if cpus is None else cpus
        self._clock, self._own, self._times = clock, own_cpu, cpu_times
        self._last = self._sample()

    def _sample(self) -> tuple[float, float, float] | None:
        times = self._times(self.cpus)
        return None if times is None else (self._clock(), self._own(), times[0])

    def foreign_cores(self) -> float | None:
        """Cores' worth of our CPUs used by other processes since the last call; None when
        /proc/stat cannot be read or no time has passed."""
        now = self._sample()
        last, self._last = self._last, now
        if now is None or last is None or now[0] <= last[0]:
            return None
        wall = now[0] - last[0]
        foreign = (now[2] - last[2]) - (now[1] - last[1])
        return min(float(len(self.cpus)), max(0.0, foreign / wall))


def thread_count(cores: int, foreign: float, most: int) -> int:
    """One thread per core that other processes leave free; a core counts as free while at
    most half of it is taken (the server's own other processes and the tick accounting take
    a few tenths on a quiet host; a neighbour that wants a core shows up as most of one)."""
    return max(1, min(most, math.floor(cores - foreign + 0.5 + 1e-9)))


class ThreadGovernor:
    """Keeps the compute thread's OpenMP team at the cores other processes leave free.

    tick() runs on the compute thread between steps (the team belongs to the thread that
    runs the parallel ops); it is a clock read except every `interval_s`, when it reads
    /proc/stat. The two directions are not alike: a team one thread too large for its
    cores stalls at every op, one thread too small loses at most that thread's share. So
    one reading lowers the team, and only `grow_after` readings in a row raise it, so a
    neighbour that pauses for a moment does not bring the stalls back. The engine says how
    long it was idle before this step: after an idle spell longer than the interval, the
    reading starts afresh, since one over idle time says nothing about now. (A long gap
    between ticks is not idleness: a starved step can take seconds, and that is when a
    reading matters most.)"""

    def __init__(self, most: int, set_threads, watch: CoreWatch | None = None, interval_s: float = 0.25,
                 grow_after: int = 4, clock=time.monotonic):
        self.most, self.current = most, most
        self.set_threads = set_threads  # applies a count; called on the thread that ticks
        self.watch = watch or CoreWatch()
        self.interval_s, self.grow_after = interval_s, grow_after
        self._clock = clock
        self._next = clock() + interval_s
        self._grow_votes = 0
        self.changes = 0

    def tick(self, idle_s: float = 0.0) -> None:
        """Before a step; idle_s: how long the loop waited for work before it."""
        now = self._clock()
        if idle_s > self.interval_s:
            self.watch.foreign_cores()  # a fresh reading from now
            self._next = now + self.interval_s
            return
        if now < self._next:
            return
        self._next = now + self.interval_s
        foreign = self.watch.foreign_cores()
        if foreign is None:
            return
        want = thread_count(len(self.watch.cpus), foreign, self.most)
        if want > self.current:
            self._grow_votes += 1
            if self._grow_votes < self.grow_after:
                return
        self._grow_votes = 0
        if want == self.current:
            return
        log.info("compute threads %d -> %d: other processes took %.1f of %d cores",
                 self.current, want, foreign, len(self.watch.cpus))
        self.set_threads(want)
        self.current = want
        self.changes += 1


def instances_in_config(config: dict) -> int:
    """Processes a Triton model config starts (instance_group: count, per listed GPU for
    KIND_GPU), each a Python backend stub that computes on this host's cores."""
    total = 0
    for group in config.get("instance_group") or []:
        count = int(group.get("count") or 1)
        total += count * max(1, len(group.get("gpus") or []))
    return max(1, total)
