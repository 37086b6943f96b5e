"""What the Linux scheduler recorded for each thread of this process: time on a CPU and time
spent runnable but waiting on a run queue for one.

/proc/<pid>/task/<tid>/schedstat holds three numbers: nanoseconds on a CPU, nanoseconds
waiting on a run queue, and time slices run (CONFIG_SCHED_INFO; kernels built without
schedstats and delay accounting print zeros). The wait is the scheduler's own account of
a thread that wanted a core and did not get one: a thread asleep, or spinning on its core,
waits for nothing. tritonlm/engine/cpu_cores.py reads it for the compute threads, and
perf/tritonlm_bench/cpusplit.py for where a benchmark's CPU went.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

TASKS = Path("/proc/self/task")


@dataclass(frozen=True)
class SchedStat:
    on_cpu_ns: int
    waiting_ns: int  # runnable, on a run queue, not running


def read_schedstat(task: Path) -> SchedStat | None:
    """One thread's counters from its /proc folder; None once it has ended (or off Linux)."""
    try:
        fields = (task / "schedstat").read_text().split()
        return SchedStat(int(fields[0]), int(fields[1]))
    except (OSError, ValueError, IndexError):
        return None


def threads_named(name: str | None, tasks: Path = TASKS) -> dict[int, SchedStat]:
    """The counters of each thread whose OS name is `name` (every thread where None), by
    thread id; threads that end while they are read are left out."""
    found: dict[int, SchedStat] = {}
    try:
        tids = [int(t) for t in (p.name for p in tasks.iterdir()) if t.isdigit()]
    except OSError:
        return found
    for tid in tids:
        task = tasks / str(tid)
        if name is not None:
            try:
                if (task / "comm").read_text().rstrip("\n") != name:
                    continue
            except OSError:
                continue
        stat = read_schedstat(task)
        if stat is not None:
            found[tid] = stat
    return found
