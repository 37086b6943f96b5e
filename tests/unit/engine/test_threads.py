"""tritonlm/engine/threads.py: threads named for the OS, and the threads they start."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest

from tritonlm.engine.threads import named_thread

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and prctl are Linux's")


def os_name(tid: int) -> str:
    return Path(f"/proc/self/task/{tid}/comm").read_text().strip()


def test_a_named_thread_is_named_for_the_os_and_its_own_threads_inherit_the_name():
    seen: dict[str, str] = {}

    def child() -> None:
        seen["child"] = os_name(threading.get_native_id())

    def parent() -> None:
        seen["parent"] = os_name(threading.get_native_id())
        t = threading.Thread(target=child)  # a plain thread, as OpenMP's workers are
        t.start()
        t.join()

    t = named_thread(parent, "tritonlm-cancel-poll")
    t.start()
    t.join()
    assert t.name == "tritonlm-cancel-poll"
    assert seen == {"parent": "tritonlm-cancel", "child": "tritonlm-cancel"}  # the OS keeps 15 bytes
