"""tritonlm/engine/scheduler.py: admission within the KV budget and the bounded waiting
queue, through the engine; the priority order of the waiting queue, on the scheduler alone
and through the engine."""

from __future__ import annotations

import pytest

from tests.helpers.models import MIXED_PROMPTS, Collector, drain, hf_greedy_text, make_engine
from tritonlm.engine.kv_cache import KVCacheManager
from tritonlm.engine.model_shape import ModelShape
from tritonlm.engine.request import GenerationEvent, GenerationRequest, InvalidRequestError, SamplingParams, ServerBusyError
from tritonlm.engine.scheduler import Scheduler, SchedulerConfig
from tritonlm.engine.sequence import Sequence


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


# ---- priorities ------------------------------------------------------------------------------
PRIO_SPEC = ModelShape("gpt2", num_layers=1, num_heads=1, num_kv_heads=1, head_dim=4, vocab_size=100, max_positions=256)


def _bare_scheduler(max_num_seqs: int = 1, kv_tokens: int = 10_000) -> Scheduler:
    """A Scheduler alone (no model): admission order is all these tests look at."""
    cache = KVCacheManager(PRIO_SPEC, PRIO_SPEC.bytes_per_token * kv_tokens, 16)
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs), cache)


def _queued(sched: Scheduler, priority: int, prompt: int = 8, max_tokens: int = 4) -> Sequence:
    req = GenerationRequest([1] * prompt, SamplingParams(max_tokens=max_tokens), on_event=lambda e: None, priority=priority)
    seq = Sequence(request=req, token_ids=[1] * prompt, sampling=None, detok=None, reserve_tokens=prompt + max_tokens)
    sched.add(seq)
    return seq


def _admission_order(sched: Scheduler) -> list[int]:
    """Request ids in the order the scheduler starts them, one slot at a time."""
    order = []
    while sched.num_waiting:
        sched.schedule()
        (seq,) = sched.running
        order.append(seq.id)
        sched.finish(seq, "length")
    return order


def test_waiting_requests_start_in_priority_order_and_fifo_among_equals():
    sched = _bare_scheduler()
    prios = [0, 5, -3, 0, 5, -3, 0]
    seqs = [_queued(sched, p) for p in prios]
    want = [s.id for s in sorted(seqs, key=lambda s: s.request.priority)]  # sorted() is stable: FIFO among equals
    assert [s.id for s in sched.waiting] == want
    assert _admission_order(sched) == want


def test_equal_priorities_keep_arrival_order():
    sched = _bare_scheduler()
    seqs = [_queued(sched, 7) for _ in range(5)]
    assert _admission_order(sched) == [s.id for s in seqs]


def test_a_better_priority_arrival_jumps_the_queue_but_not_the_running():
    sched = _bare_scheduler()
    first = _queued(sched, 0)
    sched.schedule()
    assert sched.running == [first]
    late = [_queued(sched, 0), _queued(sched, 0)]
    urgent = _queued(sched, -1)
    sched.finish(first, "length")  # never preempted: it ran until it finished
    assert _admission_order(sched) == [urgent.id, late[0].id, late[1].id]


def test_head_of_line_blocking_applies_to_the_best_priority_head():
    """A big request of the best priority waits for cache room; smaller, worse ones wait behind it."""
    sched = _bare_scheduler(max_num_seqs=4, kv_tokens=64)
    small = _queued(sched, 0, prompt=8, max_tokens=8)
    sched.schedule()
    big = _queued(sched, -1, prompt=40, max_tokens=8)  # needs blocks the small one holds
    behind = _queued(sched, 0, prompt=8, max_tokens=8)
    sched.schedule()
    assert sched.running == [small] and list(sched.waiting) == [big, behind]
    sched.finish(small, "length")
    sched.schedule()
    assert sched.running[0] is big


def test_cancelling_a_queued_request_keeps_the_others_order():
    sched = _bare_scheduler()
    a, b, c, d = _queued(sched, 2), _queued(sched, 1), _queued(sched, 1), _queued(sched, 0)
    sched.finish(sched.get(c.id), "cancelled")
    assert sched.get(c.id) is None and c not in sched.waiting
    assert _admission_order(sched) == [d.id, b.id, a.id]


def test_priority_through_the_engine_orders_answers_cancels_and_keeps_greedy_tokens():
    """One running slot: queued requests start by priority, a cancelled queued one ends with
    no tokens and the rest keep their order, and each answer is the greedy one."""
    engine = make_engine(max_num_seqs=1)
    col = Collector()
    first_token: list[int] = []  # request ids in the order their first tokens came

    def on_event(ev: GenerationEvent) -> None:
        if ev.token_ids and not col.events[ev.request_id]:
            first_token.append(ev.request_id)
        col._on_event(ev)

    def request(prompt: str, priority: int) -> int:
        req = GenerationRequest(engine.encode(prompt), SamplingParams(max_tokens=6), on_event, priority=priority)
        col.events[req.request_id] = []
        engine.submit(req)
        return req.request_id

    prompts = [MIXED_PROMPTS[i % len(MIXED_PROMPTS)] for i in range(5)]
    a, b, c, d, e = (request(p, prio) for p, prio in zip(prompts, (0, 3, -2, 3, -5)))
    engine.step()  # all five queued: the best priority starts
    assert [s.id for s in engine.scheduler.running] == [e]
    assert [s.id for s in engine.scheduler.waiting] == [c, a, b, d]
    engine.cancel(c)
    drain(engine)
    assert col.final(c).finish_reason == "cancelled" and col.ids(c) == []
    assert first_token == [e, a, b, d]
    for prompt, rid in zip(prompts, (a, b, c, d, e)):
        if rid != c:
            assert col.ids(rid) == hf_greedy_text(prompt, 6)


def test_a_priority_out_of_range_is_refused_at_submit():
    engine = make_engine()
    req = GenerationRequest(engine.encode("hi"), SamplingParams(max_tokens=2), lambda ev: None, priority=1001)
    with pytest.raises(InvalidRequestError, match=r"^priority: must be in \[-1000, 1000\]"):
        engine.submit(req)
    assert not engine.has_work() and not engine._inbox


def test_max_loras_holds_the_running_adapters_and_the_rest_wait_their_turn():
    """max_loras=2: requests under a third adapter wait at the head of the queue (none refused)
    until a running adapter's last request leaves; the base model and an adapter already
    running are never held back by it."""
    from types import SimpleNamespace

    cache = KVCacheManager(PRIO_SPEC, PRIO_SPEC.bytes_per_token * 10_000, 16)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_loras=2), cache)
    a, b, c = (SimpleNamespace(name=n, digest=n.encode()) for n in "abc")

    def queue(lora) -> Sequence:
        req = GenerationRequest([1] * 8, SamplingParams(max_tokens=4), on_event=lambda e: None, lora=lora)
        seq = Sequence(request=req, token_ids=[1] * 8, sampling=None, detok=None, reserve_tokens=12)
        sched.add(seq)
        return seq

    first = [queue(a), queue(b), queue(a), queue(None)]
    held = queue(c)
    behind = [queue(None), queue(b)]  # head-of-line: they wait behind c's request
    sched.schedule()
    assert sched.running == first and list(sched.waiting) == [held, *behind]
    sched.finish(first[1], "length")  # b's only running request leaves: c's may start
    sched.schedule()
    assert held in sched.running and behind[0] in sched.running
    assert behind[1] in sched.waiting  # a and c run now: b waits again
    sched.finish(first[0], "length")
    sched.finish(first[2], "length")  # a's last request leaves
    sched.schedule()
    assert not sched.waiting and {getattr(s.request.lora, "name", None) for s in sched.running} == {"c", "b", None}
