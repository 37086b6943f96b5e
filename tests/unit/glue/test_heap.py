"""freeze_startup_heap: what lives at start-up leaves the collector's full passes, and what
serving allocates later is still collected."""

from __future__ import annotations

import gc

import pytest

from tritonlm.glue.heap import freeze_startup_heap


class Node:
    def __init__(self):
        self.me = self  # a reference cycle: only the collector frees it


@pytest.fixture
def unfrozen():
    yield
    gc.unfreeze()


def test_the_startup_heap_leaves_full_collections_and_later_garbage_is_still_collected(unfrozen):
    startup = [Node() for _ in range(1000)]
    frozen = freeze_startup_heap()
    # a frozen object that dies is still freed by its reference count, on any of the process's
    # threads at any moment, so the count can only have fallen since
    assert frozen >= len(startup) and 0 < gc.get_freeze_count() <= frozen
    walked = {id(o) for o in gc.get_objects(generation=2)}
    assert not any(id(n) in walked for n in startup)  # a full collection no longer walks them

    later = [Node() for _ in range(100)]
    del later
    assert gc.collect() >= 100  # serving's own cycles are still found and freed
