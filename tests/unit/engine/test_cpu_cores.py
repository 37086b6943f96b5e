"""tritonlm/engine/cpu_cores.py, cgroup_cpu.py and schedstat.py: the cores a process may use
(affinity, cgroup v1/v2 quotas, split over instances and ranks), the cores its compute
threads lose while serving (its cgroup's throttling, their run-queue wait), and the governor
that sizes the compute thread's team from that. A temp folder stands in for /sys/fs/cgroup
and /proc/self/task."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tritonlm.engine.cgroup_cpu import Quota, cgroup_quota_cores, cgroup_quotas, throttled_s
from tritonlm.engine.cpu_cores import (
    COMPUTE_THREAD,
    CoreBudget,
    CoreWatch,
    ThreadGovernor,
    instances_in_config,
    thread_count,
    usable_cores,
)
from tritonlm.engine.schedstat import read_schedstat, threads_named


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


def test_each_quota_on_the_way_keeps_its_throttling_beside_it(tmp_path):
    root, proc = v2_host(tmp_path, "/kubepods/pod1/ctr", {
        "kubepods": "max 100000",
        "kubepods/pod1": "200000 100000",
        "kubepods/pod1/ctr": "400000 100000",
    })
    assert cgroup_quotas(root, proc) == [Quota(4.0, root / "kubepods/pod1/ctr/cpu.stat"),
                                         Quota(2.0, root / "kubepods/pod1/cpu.stat")]
    v1_root, v1_proc = tmp_path / "v1", tmp_path / "v1_cgroup"
    v1_proc.write_text("4:cpu,cpuacct:/docker/abc\n")
    write(v1_root / "cpu,cpuacct" / "cpu.cfs_quota_us", "100000\n")
    write(v1_root / "cpu,cpuacct" / "cpu.cfs_period_us", "100000\n")
    assert cgroup_quotas(v1_root, v1_proc) == [Quota(1.0, v1_root / "cpu,cpuacct" / "cpu.stat")]


def test_throttled_time_in_v2_and_v1_cpu_stat(tmp_path):
    v2 = tmp_path / "v2.stat"
    v2.write_text("usage_usec 9000000\nuser_usec 8000000\nsystem_usec 1000000\n"
                  "nr_periods 40\nnr_throttled 12\nthrottled_usec 1500000\n")
    assert throttled_s(v2) == pytest.approx(1.5)
    v1 = tmp_path / "v1.stat"
    v1.write_text("nr_periods 40\nnr_throttled 12\nthrottled_time 2500000000\nnr_bursts 0\nburst_time 0\n")
    assert throttled_s(v1) == pytest.approx(2.5)
    assert throttled_s(tmp_path / "missing") is None
    no_bandwidth = tmp_path / "bare.stat"  # v2 without the cpu controller enabled: usage only
    no_bandwidth.write_text("usage_usec 1\nuser_usec 1\nsystem_usec 0\n")
    assert throttled_s(no_bandwidth) is None


def test_schedstat_of_the_threads_with_a_name(tmp_path):
    tasks = tmp_path / "task"
    write(tasks / "7" / "comm", f"{COMPUTE_THREAD}\n")
    write(tasks / "7" / "schedstat", "5000 300 12\n")
    write(tasks / "8" / "comm", "triton_python_b\n")
    write(tasks / "8" / "schedstat", "9000 700 3\n")
    write(tasks / "9" / "comm", f"{COMPUTE_THREAD}\n")  # ended between the listing and the read
    assert read_schedstat(tasks / "7").waiting_ns == 300
    assert read_schedstat(tasks / "9") is None
    assert {tid: s.waiting_ns for tid, s in threads_named(COMPUTE_THREAD, tasks).items()} == {7: 300}
    assert set(threads_named(None, tasks)) == {7, 8}
    assert threads_named(COMPUTE_THREAD, tmp_path / "missing") == {}


def test_this_process_has_schedstat():
    """The real file: a running thread's time on a CPU is counted (Linux with schedstat)."""
    if not Path("/proc/self/task").exists():
        pytest.skip("no /proc/self/task: not Linux")
    mine = threads_named(None)
    assert mine and all(s.on_cpu_ns >= 0 and s.waiting_ns >= 0 for s in mine.values())


class FakeProc:
    """A clock, /proc/self/task with two compute threads and the stub's main thread, and one
    cgroup's cpu.stat (v2), moved by hand."""

    COMPUTE = (101, 102)
    OTHER = 100

    def __init__(self, tmp_path: Path, quota: float | None = 4.0):
        self.now = 0.0
        self.tasks = tmp_path / "task"
        self.waited = {tid: 0 for tid in (self.OTHER, *self.COMPUTE)}
        self.stat = tmp_path / "cgroup" / "pod" / "cpu.stat"
        self.throttled_us = 0
        self.quotas = [] if quota is None else [Quota(quota, self.stat)]
        write(self.tasks / str(self.OTHER) / "comm", "triton_python_b\n")
        for tid in self.COMPUTE:
            write(self.tasks / str(tid) / "comm", COMPUTE_THREAD + "\n")
        self._write()

    def _write(self) -> None:
        for tid, ns in self.waited.items():
            write(self.tasks / str(tid) / "schedstat", f"1000000 {ns} 10\n")
        write(self.stat, f"usage_usec 0\nnr_periods 0\nnr_throttled 0\nthrottled_usec {self.throttled_us}\n")

    def advance(self, seconds: float, waiting: float = 0.0, throttled: float = 0.0, others_wait: float = 0.0) -> None:
        """`seconds` pass; the compute threads wait `waiting` cores' worth of them (split
        over the two), the cgroup stands throttled `throttled` cores' worth, and threads
        that are not compute threads wait `others_wait`."""
        self.now += seconds
        for tid in self.COMPUTE:
            if tid in self.waited:  # not ended
                self.waited[tid] += round(seconds * waiting / len(self.COMPUTE) * 1e9)
        self.waited[self.OTHER] += round(seconds * others_wait * 1e9)
        self.throttled_us += round(seconds * throttled * 1e6)
        self._write()

    def watch(self) -> CoreWatch:
        return CoreWatch(self.quotas, tasks=self.tasks, clock=lambda: self.now, stat=None)  # no /proc/stat here


def test_core_watch_counts_the_compute_threads_wait_and_the_cgroups_throttling(tmp_path):
    proc = FakeProc(tmp_path)
    watch = proc.watch()
    proc.advance(1.0, waiting=0.7)
    r = watch.reading()
    assert (r.window_s, r.waiting, r.throttled, r.lost) == pytest.approx((1.0, 0.7, 0.0, 0.7))
    proc.advance(2.0, throttled=1.0, others_wait=3.0)  # the stub's own threads waiting do not count
    r = watch.reading()
    assert (r.waiting, r.throttled, r.lost) == pytest.approx((0.0, 1.0, 1.0))
    proc.advance(1.0, waiting=0.5, throttled=0.5)  # a throttled thread's wait may be the same time
    assert watch.lost_cores() == pytest.approx(0.5)
    assert watch.reading() is None  # no time passed


def test_where_the_mask_binds_other_processes_on_our_cpus_count(tmp_path):
    """Two CPUs of our own (no quota): a neighbour busy on one of them is a core lost to a
    team of two, and nothing to a team of one (the other CPU is free for it); the team's
    own CPU time is not a neighbour's. Under a quota smaller than the mask the node's CPUs
    are not ours, and /proc/stat is not read."""
    hz = os.sysconf("SC_CLK_TCK")
    clock, own = [0.0], [0.0]
    stat = tmp_path / "stat"

    def write_stat(busy0: float, busy1: float) -> None:  # seconds busy on cpu0, cpu1 since boot
        line = lambda n, busy: f"cpu{n} {round(busy * hz)} 0 0 {round((100 - busy) * hz)} 0 0 0 0 0 0"
        stat.write_text("cpu 0 0 0 0 0 0 0 0 0 0\n" + line(0, busy0) + "\n" + line(1, busy1) + "\n")

    write_stat(0.0, 0.0)
    watch = CoreWatch([], tasks=tmp_path / "no-tasks", clock=lambda: clock[0], cpus=[0, 1], stat=stat,
                      own_cpu=lambda: own[0])
    clock[0], own[0] = 1.0, 1.0
    write_stat(1.0, 1.0)  # ours on cpu0 (1 s), a neighbour's on cpu1 (1 s)
    r = watch.reading()
    assert (r.foreign, r.cpus) == pytest.approx((1.0, 2))
    assert r.lost_for(2) == pytest.approx(1.0) and r.lost_for(1) == pytest.approx(0.0)
    assert thread_count(2, r.lost_for(2), 2) == 1
    quota = Quota(1.0, tmp_path / "q" / "cpu.stat")
    assert CoreWatch([quota], tasks=tmp_path / "no-tasks", cpus=[0, 1], stat=stat).stat is None


def test_a_thread_that_starts_or_ends_in_the_window(tmp_path):
    """A team that grows gets new workers; their wait since they started is in the window.
    A thread that ends takes its counters with it: the rest still count."""
    proc = FakeProc(tmp_path, quota=None)
    watch = proc.watch()
    write(proc.tasks / "103" / "comm", COMPUTE_THREAD + "\n")
    write(proc.tasks / "103" / "schedstat", "1000 250000000 1\n")
    proc.advance(1.0, waiting=0.2)
    assert watch.lost_cores() == pytest.approx(0.45)
    del proc.waited[102]
    shutil.rmtree(proc.tasks / "102")
    proc.advance(1.0, waiting=0.2)
    assert watch.lost_cores() == pytest.approx(0.1)


def test_the_watch_reads_no_quota_where_none_applies(tmp_path):
    proc = FakeProc(tmp_path, quota=None)
    watch = proc.watch()
    proc.advance(1.0, throttled=2.0)
    assert watch.reading().throttled == 0.0


@pytest.mark.parametrize("lost, want", [(0.0, 4), (0.3, 4), (0.49, 4), (0.5, 3), (1.2, 3), (1.5, 2), (3.5, 1),
                                        (9.0, 1)])
def test_a_core_counts_as_lost_from_half_of_it(lost, want):
    assert thread_count(4, lost, most=4) == want
    assert thread_count(4, lost, most=2) == min(want, 2)  # never above the load-time count


def make_governor(proc: FakeProc, applied: list[int], most: int = 2) -> ThreadGovernor:
    return ThreadGovernor(most, applied.append, watch=proc.watch(), interval_s=0.25, grow_after=4,
                          clock=lambda: proc.now)


def test_governor_lowers_the_team_at_once_and_raises_it_after_four_calm_readings(tmp_path):
    """A team too large stalls at every op; one too small loses one thread's share."""
    proc = FakeProc(tmp_path)
    applied: list[int] = []
    gov = make_governor(proc, applied)

    def interval(waiting: float) -> None:
        proc.advance(0.25, waiting=waiting)
        gov.tick()

    interval(0.05)
    interval(0.2)
    assert applied == [] and gov.current == 2  # quiet: the full team
    interval(0.7)
    assert applied == [1] and gov.current == 1  # one reading of a neighbour: one thread
    for _ in range(3):
        interval(0.0)
    interval(0.6)  # the neighbour was only pausing (one thread that waits: it lowers nothing more)
    for _ in range(3):
        interval(0.0)
    assert applied == [1]
    interval(0.0)  # the fourth calm reading in a row
    assert applied == [1, 2] and gov.current == 2 and gov.changes == 2


def test_a_neighbour_that_yields_is_not_counted(tmp_path):
    """A niced or idle-class process busy on the team's cores, or the rest of a full node,
    shows nowhere the governor looks unless it makes the compute threads wait: the team stays.
    One that holds a core makes a compute thread wait most of the window, and is counted."""
    proc = FakeProc(tmp_path, quota=None)
    applied: list[int] = []
    gov = make_governor(proc, applied)
    for _ in range(20):  # the neighbour yields: each wakeup of ours costs it its core at once
        proc.advance(0.25, waiting=0.02)
        gov.tick()
    assert applied == [] and gov.current == 2
    proc.advance(0.25, waiting=0.75)  # one that holds its core: a thread waits three quarters of the time
    gov.tick()
    assert applied == [1]


def test_a_team_over_its_quota_is_lowered_by_the_cores_it_is_over(tmp_path):
    """A 4-core quota on a node of any size: the cgroup's throttling says how far over the
    quota the pod ran, and the team drops by that many cores."""
    proc = FakeProc(tmp_path, quota=4.0)
    applied: list[int] = []
    gov = make_governor(proc, applied, most=4)
    proc.advance(0.25)
    gov.tick()
    assert applied == []
    proc.advance(0.25, throttled=1.1)  # e.g. the frontend and the team together want 5.1 cores
    gov.tick()
    assert applied == [3]


def test_a_probe_that_fails_doubles_the_wait_for_the_next(tmp_path):
    """With one thread fewer the team stops waiting while the neighbour stays; each probe
    that finds the neighbour still there makes the next one wait twice as long, up to
    grow_after x max_backoff readings. A probe that holds brings the wait back to four."""
    proc = FakeProc(tmp_path, quota=None)
    applied: list[int] = []
    gov = make_governor(proc, applied)
    proc.advance(0.25, waiting=0.7)
    gov.tick()
    assert applied == [1]

    def calm_until_probe() -> int:
        n = 0
        while gov.current == 1:
            proc.advance(0.25)
            gov.tick()
            n += 1
        return n

    gaps = []
    for _ in range(7):
        gaps.append(calm_until_probe())
        proc.advance(0.25, waiting=0.7)  # the probe's window: the neighbour is still there
        gov.tick()
        assert gov.current == 1
    assert gaps == [4, 8, 16, 32, 64, 128, 128]
    assert calm_until_probe() == 128
    for _ in range(4):  # the neighbour has left: the probe holds
        proc.advance(0.25)
        gov.tick()
    assert gov.current == 2 and gov._needed == 4


def test_governor_starts_a_fresh_reading_after_an_idle_spell(tmp_path):
    """A window that is mostly idle time says nothing about now; short waits between
    back-to-back requests do not restart it (or a busy server would never read)."""
    proc = FakeProc(tmp_path)
    applied: list[int] = []
    gov = make_governor(proc, applied)
    proc.advance(0.25)
    gov.tick()
    proc.advance(30.0, waiting=12.0)  # idle, but a request that came and went waited a lot
    gov.tick(idle_s=30.0)
    proc.advance(0.25)
    gov.tick()
    assert applied == []  # judged on the fresh window alone
    for _ in range(5):  # requests 50 ms apart with a neighbour: each wait is short
        proc.advance(0.05, waiting=0.7)
        gov.tick(idle_s=0.01)
    assert applied == [1]


def test_a_starved_step_that_outlasts_the_interval_still_counts(tmp_path):
    """A step that stalls for seconds (the team waiting on a thread off its core) is when a
    reading matters most: it lowers the team at the next tick."""
    proc = FakeProc(tmp_path)
    applied: list[int] = []
    gov = make_governor(proc, applied)
    proc.advance(3.0, waiting=0.8)
    gov.tick()
    assert applied == [1]


def test_governor_reads_only_once_an_interval_and_never_for_one_thread(tmp_path):
    proc = FakeProc(tmp_path)
    reads = []

    class Counting(CoreWatch):
        def reading(self):
            reads.append(1)
            return super().reading()

    watch = Counting(proc.quotas, tasks=proc.tasks, clock=lambda: proc.now)
    gov = ThreadGovernor(2, lambda n: None, watch=watch, interval_s=0.25, clock=lambda: proc.now)
    for _ in range(100):
        proc.advance(0.002)  # a hundred 2 ms steps
        gov.tick()
    assert len(reads) == 0
    proc.advance(0.05)
    gov.tick()
    assert len(reads) == 1
    one = ThreadGovernor(1, lambda n: None, watch=watch, interval_s=0.25, clock=lambda: proc.now)
    for _ in range(10):  # a team of one has nothing to lower
        proc.advance(1.0, waiting=0.9)
        one.tick()
    assert len(reads) == 1 and one.current == 1
