"""The process table, read from /proc: which Python backend stubs a tritonserver runs, for
which model, and whether a process still runs.

A stub killed under a decoupled model stays a zombie: Triton 2.51 does not reap it and keeps
answering ready (triton-inference-server/server#8604), so "zombie" counts as dead here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

STUB_BINARY = "triton_python_backend_stub"
RUNNING, SLEEPING, STOPPED, ZOMBIE, GONE = "running", "sleeping", "stopped", "zombie", "gone"


PF_EXITING = 0x4  # the kernel's task flag: the process is tearing itself down (killed or exiting)


def process_state(pid: int) -> str:
    """running / sleeping (any waiting state) / stopped (SIGSTOP or traced) / zombie (also
    while it is still exiting: a killed process runs on for a moment freeing its memory) /
    gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return GONE
    # "pid (comm) S ppid pgrp session tty tpgid flags ...": comm may hold spaces and
    # parentheses; the fields follow the last ')'
    fields = stat[stat.rfind(")") + 2:].split()
    code = fields[0] if fields else ""
    if len(fields) > 6 and int(fields[6]) & PF_EXITING:
        return ZOMBIE
    if code == "R":
        return RUNNING
    if code in ("T", "t"):
        return STOPPED
    if code in ("Z", "X", "x"):
        return ZOMBIE
    return SLEEPING


def describe_exit(code: int) -> str:
    """A process's exit status in words: "signal SIGKILL", "exit code 1"."""
    import signal

    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def is_dead(state: str) -> bool:
    return state in (ZOMBIE, GONE)


def _parent(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2:].split()
    return int(fields[1]) if len(fields) > 1 else None


def children(pid: int) -> list[int]:
    """Direct children of pid, from every process's parent field (no procps needed)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and _parent(int(entry)) == pid:
            out.append(int(entry))
    return sorted(out)


def descendants(pid: int) -> list[int]:
    """Every process below pid (children, their children, ...)."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            ppid = _parent(int(entry))
            if ppid is not None:
                parents.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return sorted(out)


def command_line(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


@dataclass(frozen=True)
class Stub:
    """One Python backend stub: a model instance's process."""

    pid: int
    model: str  # the model's folder name in the repository (Triton's model name)
    instance: str  # e.g. "tiny_0_0"


def parse_stub(pid: int, argv: list[str]) -> Stub | None:
    """The stub's model from its command line: STUB <repo>/<model>/<version>/model.py <shm>
    <sizes> <parent pid> <backend dir> <ipc handle> <instance name> <runtime dir>."""
    if not argv or Path(argv[0]).name != STUB_BINARY or len(argv) < 2:
        return None
    model_file = Path(argv[1])
    if len(model_file.parts) < 3:
        return None
    instance = argv[8] if len(argv) > 8 else ""
    return Stub(pid, model_file.parts[-3], instance)


def find_stubs(server_pid: int) -> list[Stub]:
    """The stubs tritonserver (server_pid) has started and not yet reaped, zombies included."""
    stubs = []
    for pid in children(server_pid):
        stub = parse_stub(pid, command_line(pid))
        if stub is None and process_state(pid) == ZOMBIE:
            continue  # a zombie's command line is empty: known from an earlier scan or not at all
        if stub is not None:
            stubs.append(stub)
    return stubs
