"""tritonlm/engine/cpu_cores.py: the cores a process may use (affinity, cgroup v1/v2 quotas,
split over instances and ranks), the neighbours' share measured from /proc/stat, and the
governor that sizes the compute thread's team from it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tritonlm.engine.cpu_cores import (
    CoreBudget,
    CoreWatch,
    ThreadGovernor,
    cgroup_quota_cores,
    instances_in_config,
    read_cpu_times,
    thread_count,
    usable_cores,
)


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def v2_host(tmp_path: Path, group: str, limits: dict[str, str]) -> tuple[Path, Path]:
    """A fake cgroup v2 file system: /proc/self/cgroup names `group`; `limits` maps a folder
    (relative to the root) to its cpu.max."""
    root = tmp_path / "cgroup"
    root.mkdir(parents=True)
    for folder, text in limits.items():
        write(root / folder / "cpu.max", text + "\n")
    proc = tmp_path / "proc_cgroup"
    proc.write_text(f"0::{group}\n")
    return root, proc


def test_cgroup_v2_quota_is_the_tightest_on_the_way_to_the_root(tmp_path):
    root, proc = v2_host(tmp_path, "/kubepods/pod1/ctr", {
        "kubepods": "max 100000",
        "kubepods/pod1": "250000 100000",  # the pod's limit: 2.5 CPUs
        "kubepods/pod1/ctr": "400000 100000",  # looser below it: the pod's applies
    })
    assert cgroup_quota_cores(root, proc) == pytest.approx(2.5)


def test_cgroup_v2_without_a_limit_and_a_fractional_one(tmp_path):
    root, proc = v2_host(tmp_path, "/", {"": "max 100000"})
    assert cgroup_quota_cores(root, proc) is None
    root2, proc2 = v2_host(tmp_path / "b", "/ctr", {"ctr": "50000 100000"})
    assert cgroup_quota_cores(root2, proc2) == pytest.approx(0.5)
    assert usable_cores(cpus=list(range(8)), quota=0.5).threads() == 1  # under one core: still one thread


def test_cgroup_v1_cfs_quota_inside_a_container_and_unlimited(tmp_path):
    root = tmp_path / "cgroup"
    proc = tmp_path / "proc_cgroup"
    # inside a container the cpu hierarchy's top is the container's own group: the host path
    # /proc/self/cgroup names does not exist under the mount
    proc.write_text("12:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n")
    write(root / "cpu,cpuacct" / "cpu.cfs_quota_us", "300000\n")
    write(root / "cpu,cpuacct" / "cpu.cfs_period_us", "100000\n")
    assert cgroup_quota_cores(root, proc) == pytest.approx(3.0)
    write(root / "cpu,cpuacct" / "cpu.cfs_quota_us", "-1\n")
    assert cgroup_quota_cores(root, proc) is None


def test_no_cgroup_files_means_no_quota(tmp_path):
    assert cgroup_quota_cores(tmp_path / "none", tmp_path / "missing") is None


def test_usable_cores_takes_the_smaller_of_affinity_and_quota_and_says_which():
    assert usable_cores(cpus=[0, 1, 2, 3], quota=2.0) == CoreBudget(2.0, "cgroup CPU quota 2 cores (affinity allows 4)")
    b = usable_cores(cpus=[3], quota=None, read_quota=False)
    assert b.cores == 1.0 and ("affinity" in b.why or "all 1" in b.why)
    assert usable_cores(cpus=[0, 1], quota=8.0).cores == 2.0  # a quota above the mask does not add cores


@pytest.mark.parametrize("cores, share, threads", [(16.0, 1, 16), (16.0, 2, 8), (16.0, 3, 5), (2.0, 4, 1), (2.5, 1, 2),
                                                   (64.0, 4 * 2, 8)])
def test_threads_split_the_budget_over_instances_and_tensor_parallel_ranks(cores, share, threads):
    """share = model instances x ranks per instance (the last row: 4 instances of a 2-rank model)."""
    assert CoreBudget(cores, "").threads(share) == threads


def test_this_process_affinity_is_what_auto_counts():
    mask = os.sched_getaffinity(0)
    assert usable_cores(read_quota=False).cores == len(mask)


def test_instances_in_a_triton_config():
    assert instances_in_config({}) == 1
    assert instances_in_config({"instance_group": [{"kind": "KIND_CPU", "count": 3}]}) == 3
    assert instances_in_config({"instance_group": [{"kind": "KIND_GPU", "count": 2, "gpus": [0, 1]},
                                                   {"kind": "KIND_CPU", "count": 1}]}) == 5


def test_cpu_times_sum_only_the_listed_cpus(tmp_path):
    stat = tmp_path / "stat"
    hz = os.sysconf("SC_CLK_TCK")
    stat.write_text(
        "cpu  999 0 999 999 0 0 0 0 0 0\n"
        f"cpu0 {hz} 0 {hz} {3 * hz} {hz} 0 0 0 0 0\n"  # 2 s busy, 4 s idle (iowait counts idle)
        f"cpu1 {5 * hz} 0 0 0 0 0 0 {hz} 0 0\n"  # 6 s busy, steal included
        "intr 12345\n"
    )
    assert read_cpu_times([0], stat) == (2.0, 4.0)
    assert read_cpu_times([0, 1], stat) == (8.0, 4.0)
    assert read_cpu_times([0], tmp_path / "missing") is None


class FakeHost:
    """A clock, this process's CPU time and the busy time of its cores, moved by hand."""

    def __init__(self):
        self.now = self.own = self.busy = 0.0

    def advance(self, seconds: float, own_cores: float, foreign_cores: float) -> None:
        self.now += seconds
        self.own += seconds * own_cores
        self.busy += seconds * (own_cores + foreign_cores)

    def watch(self, cpus: int) -> CoreWatch:
        return CoreWatch(list(range(cpus)), clock=lambda: self.now, own_cpu=lambda: self.own,
                         cpu_times=lambda _: (self.busy, 0.0))


def test_core_watch_counts_what_other_processes_took():
    host = FakeHost()
    watch = host.watch(2)
    host.advance(1.0, own_cores=1.0, foreign_cores=1.0)
    assert watch.foreign_cores() == pytest.approx(1.0)
    host.advance(2.0, own_cores=1.8, foreign_cores=0.1)
    assert watch.foreign_cores() == pytest.approx(0.1)
    assert watch.foreign_cores() is None  # no time passed


@pytest.mark.parametrize("foreign, want", [(0.0, 2), (0.3, 2), (0.5, 2), (0.6, 1), (1.0, 1), (2.0, 1)])
def test_a_core_counts_as_free_while_at_most_half_of_it_is_taken(foreign, want):
    assert thread_count(2, foreign, most=2) == want
    assert thread_count(8, foreign, most=4) == 4  # never above the load-time count


def make_governor(host: FakeHost, applied: list[int]) -> ThreadGovernor:
    return ThreadGovernor(2, applied.append, watch=host.watch(2), interval_s=0.25, grow_after=4, clock=lambda: host.now)


def test_governor_lowers_the_team_at_once_and_raises_it_after_four_free_readings():
    """A team too large stalls at every op; one too small loses one thread's share."""
    host = FakeHost()
    applied: list[int] = []
    gov = make_governor(host, applied)

    def interval(foreign: float) -> None:
        host.advance(0.25, own_cores=2.0 - foreign, foreign_cores=foreign)
        gov.tick()

    interval(0.1)
    interval(0.3)
    assert applied == [] and gov.current == 2  # quiet: the full team
    interval(1.0)
    assert applied == [1] and gov.current == 1  # one reading of a neighbour: one thread
    for _ in range(3):
        interval(0.0)
    interval(1.0)  # the neighbour was only pausing
    for _ in range(3):
        interval(0.0)
    assert applied == [1]
    interval(0.0)  # the fourth free reading in a row
    assert applied == [1, 2] and gov.current == 2 and gov.changes == 2


def test_governor_starts_a_fresh_reading_after_an_idle_spell():
    """A window that is mostly idle time says nothing about the neighbour now; short waits
    between back-to-back requests do not restart it (or a busy server would never read)."""
    host = FakeHost()
    applied: list[int] = []
    gov = make_governor(host, applied)
    host.advance(0.25, 2.0, 0.0)
    gov.tick()
    host.advance(30.0, 0.0, 1.0)  # idle while a neighbour ran, which has just left
    gov.tick(idle_s=30.0)
    host.advance(0.25, 2.0, 0.0)
    gov.tick()
    assert applied == []  # judged on the fresh window alone
    for _ in range(5):  # requests 50 ms apart with a neighbour: each wait is short
        host.advance(0.05, 1.0, 1.0)
        gov.tick(idle_s=0.01)
    assert applied == [1]


def test_a_starved_step_that_outlasts_the_interval_still_counts():
    """A step that stalls for seconds (the team waiting on a thread off its core) is when a
    reading matters most: it lowers the team at the next tick."""
    host = FakeHost()
    applied: list[int] = []
    gov = make_governor(host, applied)
    host.advance(3.0, own_cores=1.0, foreign_cores=1.0)
    gov.tick()
    assert applied == [1]


def test_governor_reads_proc_only_once_an_interval():
    host = FakeHost()
    reads = []
    watch = CoreWatch([0, 1], clock=lambda: host.now, own_cpu=lambda: host.own,
                      cpu_times=lambda cpus: reads.append(1) or (host.busy, 0.0))
    gov = ThreadGovernor(2, lambda n: None, watch=watch, interval_s=0.25, clock=lambda: host.now)
    before = len(reads)
    for _ in range(100):
        host.advance(0.002, 2.0, 0.0)  # a hundred 2 ms steps
        gov.tick()
    assert len(reads) - before == 0
    host.advance(0.05, 2.0, 0.0)
    gov.tick()
    assert len(reads) - before == 1
