"""perf/tritonlm_bench/quota_group.py against cgroup file systems laid out in a temporary folder
(v2's unified hierarchy, v1's cpu hierarchy, neither): where the group is made, what quota
it is given, what is refused and why; and the line that moves a process into it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tritonlm_bench import quota_group as qg


def fake_cgroups(monkeypatch, tmp_path: Path, proc_cgroup: str, files: dict[str, str]) -> Path:
    root = tmp_path / "sys-fs-cgroup"
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    (tmp_path / "proc-self-cgroup").write_text(proc_cgroup)
    monkeypatch.setattr(qg, "CGROUP_ROOT", root)
    monkeypatch.setattr(qg, "PROC_CGROUP", tmp_path / "proc-self-cgroup")
    return root


def emptied(group: Path) -> None:
    """cgroupfs's files vanish with the group; a real folder must be emptied for rmdir."""
    for f in group.iterdir():
        f.unlink()


def test_v2_a_child_of_this_process_group_with_cpu_max(monkeypatch, tmp_path):
    root = fake_cgroups(monkeypatch, tmp_path, "0::/user.slice/session-1.scope\n",
                        {"cgroup.controllers": "cpuset cpu io memory pids\n", "user.slice/session-1.scope/cgroup.procs": ""})
    with qg.quota_group(50_000, name="bench") as procs:
        group = root / "user.slice" / "session-1.scope" / "bench"
        assert procs == group / "cgroup.procs"
        assert (group / "cpu.max").read_text() == "50000 100000"
        emptied(group)
    assert not group.exists()  # removed afterwards


def test_v1_a_child_in_the_cpu_hierarchy_with_a_cfs_quota(monkeypatch, tmp_path):
    root = fake_cgroups(monkeypatch, tmp_path, "12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n0::/\n",
                        {"cpu/cpu.cfs_quota_us": "-1\n", "cpu/docker/abc/cgroup.procs": ""})
    with qg.quota_group(25_000, period_us=50_000) as procs:
        group = procs.parent
        assert group.parent == root / "cpu" / "docker" / "abc" and group.name.startswith("tritonlm-quota-")
        assert (group / "cpu.cfs_period_us").read_text() == "50000"
        assert (group / "cpu.cfs_quota_us").read_text() == "25000"
        emptied(group)
    assert not group.exists()


def test_v2_without_the_cpu_controller_falls_to_v1_or_is_refused(monkeypatch, tmp_path):
    fake_cgroups(monkeypatch, tmp_path, "0::/a\n", {"cgroup.controllers": "memory pids\n"})
    with pytest.raises(qg.NoQuotaGroup, match=r"no cgroup cpu controller here \(neither v2's cpu.max nor v1's"):
        with qg.quota_group(100_000):
            pass


def test_a_group_that_cannot_be_made_says_it_needs_root(monkeypatch, tmp_path):
    # this process's group is not in the file system: mkdir fails as it does without root
    fake_cgroups(monkeypatch, tmp_path, "0::/not/here\n", {"cgroup.controllers": "cpu\n"})
    with pytest.raises(qg.NoQuotaGroup, match="cannot make a child cgroup under .*needs root"):
        with qg.quota_group(100_000):
            pass


def test_the_join_line_writes_the_running_process_pid(tmp_path):
    procs = tmp_path / "it's cgroup.procs"  # a quote in the path: the line must quote it
    child = subprocess.run([sys.executable, "-c", qg.join_line(procs) + "print(os.getpid())"],
                           capture_output=True, text=True, check=True)
    assert procs.read_text() == child.stdout.strip()
