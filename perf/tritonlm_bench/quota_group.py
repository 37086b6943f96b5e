"""A child cgroup with a CFS CPU quota, for runs that must see a real one (a Kubernetes CPU
limit on a machine without Kubernetes): perf/bench_cpu_quota.py and the shared-CPU tests.

The group is made under this process's own group: cgroup v2 (`cpu.max`) where the cpu
controller is on the unified hierarchy, else v1's cpu hierarchy (`cpu.cfs_quota_us`).
A process joins it by writing its pid to the `cgroup.procs` that quota_group() yields,
before it starts threads, so that all of them run under the quota. Needs root on a
writable cgroup file system; NoQuotaGroup says why not elsewhere.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

from tritonlm.engine.cgroup_cpu import CGROUP_ROOT, PROC_CGROUP


class NoQuotaGroup(RuntimeError):
    """This host does not let this process make a cgroup with a CPU quota (the reason)."""


def _own_group(v2: bool) -> str | None:
    """This process's group on the unified hierarchy (v2) or on v1's cpu hierarchy."""
    try:
        lines = PROC_CGROUP.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        number, controllers, path = line.split(":", 2)
        if (v2 and number == "0" and controllers == "") or (not v2 and "cpu" in controllers.split(",")):
            return path
    return None


def _under(base: Path, path: str) -> Path:
    return base.joinpath(*[p for p in path.split("/") if p])


@contextlib.contextmanager
def quota_group(quota_us: int, period_us: int = 100_000, name: str | None = None) -> Iterator[Path]:
    """A new child group allowed `quota_us` of CPU time per `period_us` (100000 100000: one
    core); yields its cgroup.procs and removes the group afterwards."""
    controllers = CGROUP_ROOT / "cgroup.controllers"
    v2_path, v1_path = _own_group(True), _own_group(False)
    if controllers.exists() and "cpu" in controllers.read_text().split() and v2_path is not None:
        parent, limit = _under(CGROUP_ROOT, v2_path), {"cpu.max": f"{quota_us} {period_us}"}
    elif v1_path is not None and (CGROUP_ROOT / "cpu" / "cpu.cfs_quota_us").exists():
        parent = _under(CGROUP_ROOT / "cpu", v1_path)
        limit = {"cpu.cfs_period_us": str(period_us), "cpu.cfs_quota_us": str(quota_us)}
    else:
        raise NoQuotaGroup("no cgroup cpu controller here (neither v2's cpu.max nor v1's cpu hierarchy)")
    group = parent / (name or f"tritonlm-quota-{os.getpid()}")
    try:
        group.mkdir()
    except OSError as e:
        raise NoQuotaGroup(f"cannot make a child cgroup under {parent} ({e.strerror}): "
                           "needs root on a writable cgroup file system") from e
    try:
        try:
            for file, value in limit.items():
                (group / file).write_text(value)
        except OSError as e:  # v2: cpu is not in the parent's subtree_control (it holds processes itself)
            raise NoQuotaGroup(f"cannot set a CPU quota on a child of {parent} ({e.strerror})") from e
        yield group / "cgroup.procs"
    finally:
        for _ in range(100):  # the last member's exit can reach the cgroup a moment after its wait()
            try:
                group.rmdir()
                break
            except OSError:
                time.sleep(0.05)


def join_line(procs: Path) -> str:
    """Python source that moves the process running it into the group: the first line of a
    `python -c` script, before any import that starts a thread."""
    return f"import os\nopen({str(procs)!r}, 'w').write(str(os.getpid()))\n"
