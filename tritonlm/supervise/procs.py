"""The process table, read from /proc: which Python backend stubs a tritonserver runs, for
which model, and whether a process still runs.

A stub killed under a decoupled model stays a zombie: Triton 2.51 does not reap it and keeps
answering ready (triton-inference-server/server#8604), so "zombie" counts as dead here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

STUB_BINARY = "triton_python_backend_stub"
STUB_COMM = STUB_BINARY[:15]  # the kernel keeps 15 characters of a program's name, a zombie's too
RUNNING, SLEEPING, STOPPED, ZOMBIE, GONE = "running", "sleeping", "stopped", "zombie", "gone"


PF_EXITING = 0x4  # the kernel's task flag: the process is tearing itself down (killed or exiting)


def _stat(pid: int) -> tuple[str, list[str]] | None:
    """(comm, the fields after it) of /proc/pid/stat; None when the process is gone.
    "pid (comm) S ppid pgrp session tty tpgid flags ...": comm may hold spaces and
    parentheses, so the fields follow the last ')'."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    close = stat.rfind(")")
    return stat[stat.find("(") + 1:close], stat[close + 2:].split()


def process_state(pid: int) -> str:
    """running / sleeping (any waiting state) / stopped (SIGSTOP or traced) / zombie (also
    while it is still exiting: a killed process runs on for a moment freeing its memory) /
    gone."""
    stat = _stat(pid)
    if stat is None:
        return GONE
    fields = stat[1]
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


def is_dead(state: str) -> bool:
    return state in (ZOMBIE, GONE)


def start_time(pid: int) -> int:
    """When pid started, in clock ticks since boot (a zombie keeps it); 0 when gone. Orders
    processes where pids cannot: they wrap."""
    stat = _stat(pid)
    return int(stat[1][19]) if stat is not None and len(stat[1]) > 19 else 0


def _parent(pid: int) -> int | None:
    stat = _stat(pid)
    if stat is None:
        return None
    fields = stat[1]
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
    started: int = 0  # start_time(pid): a reload's new stubs start after the ones they replace


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


@dataclass
class StubScan:
    """tritonserver's stubs at one look at the process table."""

    stubs: list[Stub] = field(default_factory=list)  # named by their command line, zombies known from it
    # stubs that died before anyone read their command line: a zombie's is empty, only its
    # program name (comm) is left, so their model is unknown
    unnamed_dead: list[int] = field(default_factory=list)


def scan_stubs(server_pid: int) -> StubScan:
    """The stubs tritonserver (server_pid) has started and not yet reaped."""
    scan = StubScan()
    for pid in children(server_pid):
        stub = parse_stub(pid, command_line(pid))
        if stub is not None:
            scan.stubs.append(Stub(stub.pid, stub.model, stub.instance, start_time(pid)))
            continue
        stat = _stat(pid)
        if stat is not None and stat[0] == STUB_COMM and is_dead(process_state(pid)):
            scan.unnamed_dead.append(pid)
    return scan


def find_stubs(server_pid: int) -> list[Stub]:
    """The stubs of server_pid named by their command line (see scan_stubs)."""
    return scan_stubs(server_pid).stubs
