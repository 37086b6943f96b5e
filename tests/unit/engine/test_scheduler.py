"""tritonlm/engine/scheduler.py: admission within the KV budget and the bounded waiting
queue, through the engine."""

from __future__ import annotations

import pytest

from tests.helpers.models import MIXED_PROMPTS, Collector, drain, hf_greedy_text, make_engine
from tritonlm.engine.request import ServerBusyError


def test_kv_budget_of_two_sequences_serves_twelve_requests():
    engine = make_engine(kv_sequences=2)
    budget = engine.cache.total_bytes
    col = Collector()
    prompts = [MIXED_PROMPTS[i % len(MIXED_PROMPTS)] for i in range(12)]
    rids = [col.request(engine, p, max_tokens=200) for p in prompts]  # each reserves most of a full context
    peak_running = 0
    while engine.has_work() or engine._inbox:
        engine.step()
        peak_running = max(peak_running, engine.scheduler.num_running)
        assert engine.cache.used_bytes <= budget
    assert peak_running == 2
    assert engine.stats.max_kv_used_bytes <= budget
    for p, rid in zip(prompts, rids):
        assert col.final(rid).finish_reason == "length"
        assert col.ids(rid) == hf_greedy_text(p, 200)


def test_full_queue_says_server_busy():
    engine = make_engine(max_queue_size=2, max_num_seqs=1)
    col = Collector()
    col.request(engine, "a", max_tokens=2)  # will run at once: it does not count as waiting
    col.request(engine, "b", max_tokens=2)
    col.request(engine, "c", max_tokens=2)
    with pytest.raises(ServerBusyError, match="server busy"):
        col.request(engine, "d", max_tokens=2)
    engine.step()  # "a" runs; "b" and "c" wait: the queue is full
    with pytest.raises(ServerBusyError, match="max_queue_size=2"):
        col.request(engine, "e", max_tokens=2)
    drain(engine)
    assert all(col.final(r).finish_reason == "length" for r in col.events)
