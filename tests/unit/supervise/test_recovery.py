"""Restart policy: immediate first restart, doubling waits, a cap per window, then give up."""

from __future__ import annotations

import pytest

from tests.helpers.clock import FakeClock
from tritonlm.supervise.recovery import BACKOFF_CAP_S, RestartPolicy


def test_backoff_doubles_then_gives_up_past_the_cap():
    clock = FakeClock()
    policy = RestartPolicy(max_restarts=4, window_s=300, clock=clock)
    assert [policy.next_delay() for _ in range(4)] == [0.0, 1.0, 2.0, 4.0]
    assert policy.next_delay() is None  # the fifth within the window
    assert policy.recent() == 4


def test_restarts_older_than_the_window_no_longer_count():
    clock = FakeClock()
    policy = RestartPolicy(max_restarts=2, window_s=60, clock=clock)
    assert policy.next_delay() == 0.0
    assert policy.next_delay() == 1.0
    assert policy.next_delay() is None
    clock.now += 61  # a model that has served a whole window since its last restart starts afresh
    assert policy.recent() == 0
    assert policy.next_delay() == 0.0


def test_the_wait_is_capped_and_zero_restarts_means_none():
    clock = FakeClock()
    policy = RestartPolicy(max_restarts=50, window_s=1e9, clock=clock)
    delays = [policy.next_delay() for _ in range(20)]
    assert max(delays) == BACKOFF_CAP_S
    assert RestartPolicy(max_restarts=0, clock=clock).next_delay() is None
    with pytest.raises(ValueError, match="max_restarts"):
        RestartPolicy(max_restarts=-1)
