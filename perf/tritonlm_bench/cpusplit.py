"""Where a benchmark run's CPU went, read from /proc: tritonlm's compute threads, its
response thread, the rest of the model's process, the server, the clients, the machine.

Why: on a host whose cores torch's compute threads fill, what the serving path costs
shows up twice: as CPU the compute threads do not get, and as their preemptions (a
preempted OpenMP thread stalls its partner at the next barrier). perf/bench_peer.py
prints this split for every run at its top concurrency, served and in-process.

Threads are told apart by the OS names tritonlm's threads set (tritonlm/engine/threads.py).
torch's OpenMP workers inherit the compute thread's: libgomp, which PyTorch's Linux wheels
use, gives each thread that starts a parallel region a team of its own, so they are
created by the compute thread. Limits, each small in bench_peer's runs:
- a thread that the compute thread starts for another job is counted as compute;
- tensor / pipeline parallel worker processes hold no compute thread and count as server;
- a process that ends between start() and stop() is left out, and a named thread that
  ends counts as the rest of its process.
Linux only: elsewhere start() and stop() return nothing.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from tritonlm.engine.schedstat import read_schedstat
from tritonlm.engine.threads import ENGINE_THREAD, EVENTS_THREAD, OS_NAME_BYTES
from tritonlm.perf.serverstats import process_tree

COMPUTE_THREAD = ENGINE_THREAD[:OS_NAME_BYTES]  # the engine loop's thread and its OpenMP team
RESPONSE_THREAD = EVENTS_THREAD[:OS_NAME_BYTES]  # the EventDispatcher: every response goes out here
TICK_S = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01

# the split's fields, in the order a table shows them
FIELDS = ("compute_cores", "compute_threads", "compute_preempt_per_s", "response_cores", "model_other_cores",
          "server_cores", "client_cores", "machine_cores", "others_cores", "steal_cores", "ctxt_per_s")


@dataclass
class _Thread:
    name: str
    cpu_s: float
    preempted: int  # nonvoluntary context switches since the thread started


@dataclass
class _Process:
    cpu_s: float  # all its threads, ended ones included
    threads: dict[int, _Thread]


def _thread_cpu_s(task: Path) -> float:
    fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
    ticks_s = (int(fields[11]) + int(fields[12])) * TICK_S  # utime + stime
    stat = read_schedstat(task)  # nanoseconds on a CPU, finer than ticks
    if stat is None:
        return ticks_s
    # older kernels print 0 there when schedstats and delay accounting are both off
    return stat.on_cpu_ns / 1e9 if stat.on_cpu_ns > 0 or ticks_s == 0 else ticks_s


def _read_process(pid: int) -> _Process | None:
    root = Path(f"/proc/{pid}")
    try:
        fields = (root / "stat").read_text().rsplit(")", 1)[1].split()
        cpu_s = (int(fields[11]) + int(fields[12])) * TICK_S
        threads: dict[int, _Thread] = {}
        for tid in os.listdir(root / "task"):
            task = root / "task" / tid
            try:
                status = (task / "status").read_text()
                preempted = next(int(line.split()[1]) for line in status.splitlines()
                                 if line.startswith("nonvoluntary_ctxt_switches"))
                threads[int(tid)] = _Thread((task / "comm").read_text().strip(), _thread_cpu_s(task), preempted)
            except (OSError, StopIteration, ValueError):
                continue  # the thread ended while we looked
        return _Process(cpu_s, threads)
    except OSError:
        return None


def _machine() -> tuple[float, float, int]:
    """(busy CPU seconds over all cores, stolen CPU seconds, context switches), since boot.
    Steal is time the hypervisor gave another guest while this one wanted the CPU."""
    busy = steal = 0.0
    ctxt = 0
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith("cpu "):
            v = [int(x) for x in line.split()[1:]] + [0] * 8
            busy = (v[0] + v[1] + v[2] + v[5] + v[6]) * TICK_S  # user nice system irq softirq (guest is in user)
            steal = v[7] * TICK_S
        elif line.startswith("ctxt "):
            ctxt = int(line.split()[1])
    return busy, steal, ctxt


class CpuSplit:
    """Counters at start() and at stop(); stop() gives the split in cores (CPU seconds per
    second of wall time), preemptions and context switches per second, and wall_s.

    server_pid's process tree is the server: tritonserver and its Python backend stubs,
    llama-server, or (in-process) this process itself. The processes holding compute
    threads are the model's; the rest of the tree counts as server. With
    clients_here, this process's own CPU counts as the clients' (a benchmark's client
    threads), unless this process is in the tree."""

    def __init__(self, server_pid: int, clients_here: bool = True):
        self.server_pid, self.clients_here = server_pid, clients_here
        self._pids: list[int] = []
        self._start: dict[int, _Process] = {}
        self._t0 = self._busy0 = self._steal0 = 0.0
        self._ctxt0 = 0
        self._self0 = 0.0

    def start(self) -> "CpuSplit":
        if not Path("/proc/stat").exists():
            return self
        self._pids = process_tree(self.server_pid)
        self._start = {p: s for p in self._pids if (s := _read_process(p)) is not None}
        self._busy0, self._steal0, self._ctxt0 = _machine()
        t = os.times()
        self._self0 = t.user + t.system
        self._t0 = time.perf_counter()
        return self

    def stop(self) -> dict[str, float]:
        if not self._start:
            return {}
        wall = time.perf_counter() - self._t0
        busy, steal, ctxt = _machine()
        t = os.times()
        self_s = t.user + t.system - self._self0
        compute = response = model_other = server = 0.0
        compute_threads, preempted = 0, 0
        for pid, before in self._start.items():
            after = _read_process(pid)
            if after is None:
                continue
            process_s = max(0.0, after.cpu_s - before.cpu_s)
            ours = {tid: th for tid, th in after.threads.items() if th.name in (COMPUTE_THREAD, RESPONSE_THREAD)}
            if not any(th.name == COMPUTE_THREAD for th in ours.values()):
                server += process_s
                continue
            named_s = 0.0
            for tid, th in ours.items():
                was = before.threads.get(tid, _Thread(th.name, 0.0, 0))
                used = max(0.0, th.cpu_s - was.cpu_s)
                named_s += used
                if th.name == RESPONSE_THREAD:
                    response += used
                    continue
                compute += used
                if used > 0.01 * wall:  # a member of the team that worked (idle pool threads are named too)
                    compute_threads += 1
                    preempted += th.preempted - was.preempted
            model_other += max(0.0, process_s - named_s)
        clients = self_s if self.clients_here and os.getpid() not in self._start else 0.0
        machine = max(0.0, busy - self._busy0)
        return {
            "compute_cores": compute / wall,
            "compute_threads": compute_threads,
            "compute_preempt_per_s": preempted / wall,
            "response_cores": response / wall,
            "model_other_cores": model_other / wall,
            "server_cores": server / wall,
            "client_cores": clients / wall,
            "machine_cores": machine / wall,
            # everything else that ran meanwhile: other work on a shared host disturbs a run
            "others_cores": max(0.0, machine - compute - response - model_other - server - clients) / wall,
            "steal_cores": max(0.0, steal - self._steal0) / wall,
            "ctxt_per_s": (ctxt - self._ctxt0) / wall,
            "wall_s": wall,
        }
