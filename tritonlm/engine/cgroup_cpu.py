"""This process's cgroup CPU quota and how often it ran into it, read from the cgroup file system.

The quota is the CFS bandwidth limit of this process's cgroup and of each group above it (a
limit anywhere on the way applies): cgroup v2 `cpu.max` ("QUOTA PERIOD" or "max PERIOD"),
v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us` (-1: none). A Kubernetes CPU limit is such a
quota. Each group with a quota keeps its throttling in its `cpu.stat`: v2 `throttled_usec`,
v1 `throttled_time` (nanoseconds). The kernel adds up the time each CPU's share of the group
stood throttled, so over a window that is about how many cores' worth of runnable work the
group had beyond its quota.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")


@dataclass(frozen=True)
class Quota:
    """One group's CFS quota on this process's path: `cores` per period, and the `cpu.stat`
    file that counts its throttling."""

    cores: float
    stat: Path


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


def cgroup_quotas(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> list[Quota]:
    """Every CFS quota on this process's cgroup path, innermost first; empty where there is
    none (or no cgroup file system to read)."""
    v2, v1 = _cgroup_paths(proc_cgroup)
    found: list[Quota] = []
    if v2 is not None:
        for folder in _ancestors(root, v2):
            text = _read(folder / "cpu.max")
            if text:
                quota, _, period = text.partition(" ")
                if quota != "max" and period:
                    found.append(Quota(int(quota) / int(period), folder / "cpu.stat"))
    if v1 is not None:
        # the controller is mounted as cpu, cpu,cpuacct or cpuacct,cpu; inside a container
        # the mount's top is the container's own group, so the host path may not exist
        for mount in (root / "cpu", root / "cpu,cpuacct", root / "cpuacct,cpu"):
            for folder in _ancestors(mount, v1) + [mount]:
                quota, period = _read(folder / "cpu.cfs_quota_us"), _read(folder / "cpu.cfs_period_us")
                if quota and period and int(quota) > 0 and int(period) > 0:
                    found.append(Quota(int(quota) / int(period), folder / "cpu.stat"))
    return list(dict.fromkeys(found))  # the v1 mount's top can be reached twice


def cgroup_quota_cores(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> float | None:
    """The tightest CFS quota over this process's cgroup and its ancestors, in cores; None
    where there is none."""
    quotas = cgroup_quotas(root, proc_cgroup)
    return min(q.cores for q in quotas) if quotas else None


def throttled_s(stat: Path) -> float | None:
    """Seconds a group's CPUs stood throttled since it was made, summed over its CPUs (v2
    `throttled_usec`, v1 `throttled_time` in ns); None where the file cannot be read."""
    text = _read(stat)
    if text is None:
        return None
    fields = dict(line.split(None, 1) for line in text.splitlines() if " " in line)
    try:
        if "throttled_usec" in fields:
            return int(fields["throttled_usec"]) / 1e6
        if "throttled_time" in fields:
            return int(fields["throttled_time"]) / 1e9
    except ValueError:
        return None
    return None
