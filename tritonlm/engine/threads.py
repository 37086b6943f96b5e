"""Threads named for the OS too, not only for Python.

Python 3.11's `threading.Thread(name=...)` names a thread for Python alone: `top -H`,
`ps -L` and /proc/<pid>/task/<tid>/comm show every thread of a model's process as
`triton_python_b` (the stub binary). Named here, an operator can tell which of
tritonlm's threads takes the CPU, and perf/bench_peer.py's CPU split can find the compute
threads. A thread that a thread starts inherits its OS name, so torch's OpenMP workers,
started by the compute thread's first parallel op, are named after it.
"""

from __future__ import annotations

import ctypes
import sys
import threading
from typing import Callable

PR_SET_NAME = 15  # prctl(2); Linux keeps 15 bytes of a thread's name
OS_NAME_BYTES = 15
# names that tools find threads by (perf/tritonlm_bench/cpusplit.py): one place for each
ENGINE_THREAD = "tritonlm-engine"  # the compute thread; its OpenMP workers inherit the name
EVENTS_THREAD = "tritonlm-events"  # the event dispatcher, which sends every response

_prctl = None
if sys.platform.startswith("linux"):
    try:  # the C library this process already has loaded (no ldconfig run to find it)
        _prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # no prctl to call: threads keep the inherited name
        _prctl = None


def set_os_thread_name(name: str) -> None:
    """The calling thread's name for the OS, cut to 15 bytes; nothing off Linux."""
    if _prctl is not None:
        _prctl(PR_SET_NAME, ctypes.c_char_p(name.encode("utf-8")[:OS_NAME_BYTES]), 0, 0, 0)


def named_thread(target: Callable[[], None], name: str, daemon: bool = True) -> threading.Thread:
    """A (not yet started) thread that takes `name` for Python and for the OS."""

    def run() -> None:
        set_os_thread_name(name)
        target()

    return threading.Thread(target=run, name=name, daemon=daemon)
