"""tritonlm/engine/engine.py: the engine alone (no server), end to end: continuous batching,
requests joining a running batch, cancellation, its thread; checked token for token
against transformers' own generate()."""

from __future__ import annotations

import pytest

from tests.helpers.models import MIXED_PROMPTS, Collector, drain, hf_greedy_text, make_engine, tiny
from tritonlm.engine.request import InvalidRequestError


def test_batch_of_mixed_prompts_equals_hf_generate_token_for_token():
    engine = make_engine(max_num_batched_tokens=8)  # small budget: prompts prefill in chunks
    col = Collector()
    rids = [col.request(engine, p, max_tokens=24) for p in MIXED_PROMPTS]
    drain(engine)
    _, tok = tiny()
    for p, rid in zip(MIXED_PROMPTS, rids):
        ref = hf_greedy_text(p, 24)
        assert col.ids(rid) == ref, p
        assert col.text(rid) == tok.decode(ref)
        fin = col.final(rid)
        assert fin.finish_reason == "length" and fin.num_output_tokens == 24
        assert fin.num_input_tokens == len(tok(p).input_ids)
    assert engine.cache.used_bytes == 0 and engine.cache.live_sequences() == 0


def test_same_text_alone_in_a_batch_of_16_and_when_joining_a_running_batch():
    prompt = "Once upon a time"
    alone = Collector()
    e1 = make_engine()
    rid = alone.request(e1, prompt, max_tokens=30)
    drain(e1)
    expected = alone.text(rid)

    e2 = make_engine()
    batch = Collector()
    mixed = [MIXED_PROMPTS[i % len(MIXED_PROMPTS)] + " " * (i % 3) for i in range(15)]
    rids = [batch.request(e2, p, max_tokens=10 + i) for i, p in enumerate(mixed)]
    target = batch.request(e2, prompt, max_tokens=30)
    drain(e2)
    assert batch.text(target) == expected
    assert e2.stats.max_batch_size == 16

    e3 = make_engine()
    late = Collector()
    for p in MIXED_PROMPTS:
        late.request(e3, p, max_tokens=40)
    for _ in range(7):  # others are mid-decode when it joins
        e3.step()
    target = late.request(e3, prompt, max_tokens=30)
    drain(e3)
    assert late.text(target) == expected


def test_kv_cache_off_gives_the_same_tokens():
    on, off = make_engine(), make_engine(use_kv_cache=False)
    c_on, c_off = Collector(), Collector()
    r_on = [c_on.request(on, p, max_tokens=12) for p in MIXED_PROMPTS[:3]]
    r_off = [c_off.request(off, p, max_tokens=12) for p in MIXED_PROMPTS[:3]]
    drain(on)
    drain(off)
    for a, b in zip(r_on, r_off):
        assert c_on.ids(a) == c_off.ids(b)


def test_invalid_requests_are_refused_with_the_input_named():
    engine = make_engine(max_context=64)
    col = Collector()
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        col.request(engine, "hello", max_tokens=0)
    with pytest.raises(InvalidRequestError, match="text_input: the prompt has"):
        col.request(engine, "word " * 200, max_tokens=1)
    with pytest.raises(InvalidRequestError, match="ask for at most"):
        col.request(engine, "hello", max_tokens=64)
    with pytest.raises(InvalidRequestError, match="top_p"):
        col.request(engine, "hello", max_tokens=4, top_p=1.5)
    with pytest.raises(InvalidRequestError, match="temperature"):
        col.request(engine, "hello", max_tokens=4, temperature=-1.0)
    assert not engine._inbox  # nothing was queued


def test_cancel_frees_the_cache_at_once_and_others_continue():
    engine = make_engine()
    col = Collector()
    victim = col.request(engine, MIXED_PROMPTS[0], max_tokens=100)
    other = col.request(engine, MIXED_PROMPTS[1], max_tokens=20)
    for _ in range(5):
        engine.step()
    used = engine.cache.used_bytes
    engine.cancel(victim)
    engine.step()
    assert col.final(victim).finish_reason == "cancelled"
    assert engine.cache.used_bytes < used
    drain(engine)
    assert col.ids(other) == hf_greedy_text(MIXED_PROMPTS[1], 20)
    assert engine.cache.used_bytes == 0


def test_engine_thread_serves_submissions_and_shuts_down_cleanly():
    import threading

    engine = make_engine().start()
    done = threading.Event()
    col = Collector()
    original = col._on_event

    def on_event(ev):
        original(ev)
        if ev.finished:
            done.set()

    col._on_event = on_event
    rid = col.request(engine, MIXED_PROMPTS[0], max_tokens=10)
    assert done.wait(60), "the engine thread did not answer"
    assert col.ids(rid) == hf_greedy_text(MIXED_PROMPTS[0], 10)
    pending = col.request(engine, MIXED_PROMPTS[1], max_tokens=200)
    engine.shutdown()
    assert not engine._thread.is_alive()
    final = col.final(pending)  # never left without an answer
    assert final.finish_reason in ("error", "length")


def test_engine_output_is_the_same_with_either_attention_backend(tmp_path):
    """The paged-attention kernel (the default on a float32 CPU) and the gathered copy
    give the same greedy tokens, equal to transformers' own generate()."""
    from tests.helpers.servers import add_generation_model
    from tritonlm.engine.loader import build_engine
    from tritonlm.engine.settings import EngineSettings

    folder = add_generation_model(tmp_path, "tiny")
    texts = {}
    for backend in ("paged", "gather"):
        engine = build_engine(EngineSettings.from_params(
            {"task": "generate", "max_context": "256", "attention_backend": backend}, folder))
        assert engine.runner.attention == backend
        col = Collector()
        rids = [col.request(engine, p, max_tokens=12) for p in MIXED_PROMPTS]
        drain(engine)
        texts[backend] = [col.ids(r) for r in rids]
        engine.shutdown()
    assert texts["paged"] == texts["gather"] == [hf_greedy_text(p, 12) for p in MIXED_PROMPTS]


def test_fault_names_a_failed_runner_or_a_dead_loop_and_not_a_shutdown():
    """What the model's heartbeat reports to tritonlm serve (tritonlm/glue/heartbeat.py)."""
    engine = make_engine().start()
    try:
        assert engine.fault() is None
        engine.runner.failure = "tensor-parallel worker rank 1 (pid 7) died with signal SIGKILL"
        assert engine.fault() == "tensor-parallel worker rank 1 (pid 7) died with signal SIGKILL"
        engine.runner.failure = None
    finally:
        engine.shutdown()
    assert engine.fault() is None  # shut down on purpose: not a fault
    stopped = make_engine()
    stopped._thread = _finished_thread()
    assert stopped.fault() == "the engine thread stopped"


def _finished_thread():
    import threading

    t = threading.Thread(target=lambda: None)
    t.start()
    t.join()
    return t


# ---- overlap: a step's text and events made while the next step runs ----------------------


def overlap_engine(overlap: bool, schedule_ahead: bool = False, prefix_caching: bool = False,
                   use_kv_cache: bool = True, **sched):
    from tritonlm.engine.engine import Engine
    from tritonlm.engine.kv_cache import KVCacheManager
    from tritonlm.engine.runners.torch_runner import TorchRunner
    from tritonlm.engine.scheduler import SchedulerConfig

    model, tok = tiny()
    runner = TorchRunner(model)
    cache = KVCacheManager(runner.spec, 12 * 272 * runner.spec.bytes_per_token, 16, allocate_kv=runner.allocate_kv,
                           prefix_caching=prefix_caching)
    return Engine(runner, tok, cache, SchedulerConfig(**sched), max_context=96, overlap=overlap,
                  schedule_ahead=schedule_ahead, use_kv_cache=use_kv_cache)


def events_of(col: Collector, rid: int) -> list[tuple]:
    return [(e.text, list(e.token_ids), e.finished, e.finish_reason, e.num_output_tokens, e.error)
            for e in col.events[rid]]


def test_overlap_gives_the_same_tokens_text_and_events_as_without():
    """Every way a request ends (max_tokens, the context, EOS by end_id, a stop string, a
    cancel mid-stream) and rows that sample, stream or not, prefill in chunks, all at once:
    overlapped, each request's events are exactly those of the plain loop."""
    probe = overlap_engine(False)
    col = Collector()
    ids = {p: col.request(probe, p, max_tokens=30) for p in MIXED_PROMPTS[:3]}
    drain(probe)
    text0, ids1 = col.text(ids[MIXED_PROMPTS[0]]), col.ids(ids[MIXED_PROMPTS[1]])
    stop = text0[len(text0) // 2 : len(text0) // 2 + 4]  # a stop string inside a greedy answer
    end_id = next(t for i, t in enumerate(ids1) if i >= 3 and t not in ids1[:i])  # EOS in mid-answer
    assert stop.strip() and stop in text0

    results = []
    for overlap, ahead in ((False, False), (True, False), (True, True)):
        engine = overlap_engine(overlap, ahead, max_num_batched_tokens=16)
        col = Collector()
        rids = [
            col.request(engine, MIXED_PROMPTS[0], max_tokens=30, stop_words=(stop,)),
            col.request(engine, MIXED_PROMPTS[1], max_tokens=30, end_id=end_id),
            col.request(engine, MIXED_PROMPTS[2], max_tokens=40),  # cancelled below
            col.request(engine, MIXED_PROMPTS[3], max_tokens=12, stream=False),
            col.request(engine, MIXED_PROMPTS[4], max_tokens=20, temperature=0.9, seed=7, return_log_probs=True),
            col.request(engine, MIXED_PROMPTS[5] * 8, max_tokens=24),  # fills the 96-token context
            col.request(engine, MIXED_PROMPTS[1], max_tokens=25, min_tokens=10, end_id=end_id),
        ]
        for step in range(1000):
            if step == 6:
                engine.cancel(rids[2])
            if not (engine.has_work() or engine._inbox):
                break
            engine.step()
        assert engine.cache.used_bytes == 0 and not engine._deferred and engine._ahead is None
        results.append(([events_of(col, r) for r in rids], engine.stats.tokens_generated, engine.stats.finished, engine.stats.steps))
        reasons = [col.final(r).finish_reason for r in rids]
        assert reasons[:6] == ["stop", "stop", "cancelled", "length", "length", "length"], reasons
    assert results[0] == results[1] == results[2]


def test_schedule_ahead_gives_the_plain_loops_outputs_feeding_tokens_it_has_not_read():
    """Scheduled ahead, each step is launched before the host has read the last step's
    tokens: its rows feed them from the sampler's tensor, their histories holding a
    placeholder. Every way a request ends, greedy and seeded rows, a prefix-cache hit,
    requests joining mid-run, and a row that must be sampled on the host (penalties) joining
    and leaving: the same events as the plain loop, and most steps ran ahead."""
    from tritonlm.engine.executor import PENDING_TOKEN

    probe = overlap_engine(False)
    col = Collector()
    ids = {p: col.request(probe, p, max_tokens=30) for p in MIXED_PROMPTS[:3]}
    drain(probe)
    text0, ids1 = col.text(ids[MIXED_PROMPTS[0]]), col.ids(ids[MIXED_PROMPTS[1]])
    stop = text0[len(text0) // 3 : len(text0) // 3 + 3]
    end_id = next(t for i, t in enumerate(ids1) if i >= 2 and t not in ids1[:i])
    assert stop.strip() and stop in text0

    results, fed = [], []
    for ahead in (False, True):
        engine = overlap_engine(True, ahead, prefix_caching=True, max_num_batched_tokens=12)
        if ahead:  # count the steps whose rows fed a token the host had not read
            forward = engine.executor.forward

            def counting(plan, pending=None, forward=forward):
                if pending is not None and any(seq.token_ids[-1] == PENDING_TOKEN for seq, _ in plan):
                    fed.append(len(plan))
                return forward(plan, pending)

            engine.executor.forward = counting
        col = Collector()
        first = [
            col.request(engine, MIXED_PROMPTS[0], max_tokens=30, stop_words=(stop,)),
            col.request(engine, MIXED_PROMPTS[1], max_tokens=30, end_id=end_id),
            col.request(engine, MIXED_PROMPTS[2], max_tokens=17, temperature=0.8, seed=11, top_k=20),
            col.request(engine, MIXED_PROMPTS[3], max_tokens=9, stream=False, temperature=1.3, seed=3, top_p=0.9),
            col.request(engine, MIXED_PROMPTS[1], max_tokens=22, min_tokens=8, end_id=end_id, seed=5, temperature=0.7),
        ]
        late = []
        for step in range(1000):
            if step == 4:  # joins mid-run; its prompt's first block is cached by now
                late.append(col.request(engine, MIXED_PROMPTS[0] + " and more", max_tokens=14))
            if step == 9:  # sampled on the host while it runs
                late.append(col.request(engine, MIXED_PROMPTS[4], max_tokens=12, repetition_penalty=20.0))
            if step == 12:
                late.append(col.request(engine, MIXED_PROMPTS[5], max_tokens=40))
            if step == 15:
                engine.cancel(late[-1])
            if step > 15 and not (engine.has_work() or engine._inbox):
                break
            engine.step()
        assert engine.cache.used_bytes == 0 and not engine._deferred and engine._ahead is None
        rids = first + late
        results.append(([events_of(col, r) for r in rids], engine.stats.tokens_generated, engine.stats.finished, engine.stats.steps))
        reasons = [col.final(r).finish_reason for r in rids]
        assert reasons[:4] + reasons[5:] == ["stop", "stop", "length", "length", "length", "length", "cancelled"], reasons
    assert results[0] == results[1]
    assert len(fed) >= 15, fed


def test_schedule_ahead_fails_a_row_without_finite_logits_and_ends_the_rest_at_shutdown_as_the_plain_loop():
    """A row whose logits turn NaN fails alone, once its token is read; a shutdown with
    tokens still unread ends every request with the same events as the plain loop."""
    import torch

    results = []
    for ahead in (False, True):
        engine = overlap_engine(True, ahead, max_num_batched_tokens=32)
        forward, passes = engine.runner.forward, []

        def poisoned(batch, pool, forward=forward, passes=passes):
            logits = forward(batch, pool)
            passes.append(batch.batch_size)
            if len(passes) == 6:  # a decode pass: its first row's logits are not a number
                logits = logits.clone()
                logits[0] = float("nan")
            return logits

        engine.runner.forward = poisoned
        col = Collector()
        rids = [col.request(engine, p, max_tokens=40, seed=i, temperature=0.0 if i % 2 else 0.9)
                for i, p in enumerate(MIXED_PROMPTS[:4])]
        for _ in range(12):
            engine.step()
        engine.shutdown("the model is being unloaded")
        results.append([events_of(col, r) for r in rids])
        errors = [col.final(r).error for r in rids]
        assert sum("no finite value" in (e or "") for e in errors) == 1, errors
        assert sum(e == "the model is being unloaded" for e in errors) == 3, errors
        assert len(passes) >= 6
    assert results[0] == results[1]


def test_only_rows_whose_choice_reads_no_token_values_are_decided_ahead():
    """A row is sampled ahead only where its next token depends on its history's length
    alone (seeded draws, min_tokens), never on the tokens in it (penalties, a bad word's
    prefix), and where no log-probability is asked."""
    from tritonlm.engine.request import SamplingParams
    from tritonlm.engine.sampler import RowState, decided_on_device

    def ahead(**params) -> bool:
        return decided_on_device(RowState.make(SamplingParams(**params), [1, 2, 3], eos_id=0))

    assert ahead()
    assert ahead(temperature=0.8, seed=3, top_k=5, top_p=0.9, min_p=0.1)
    assert ahead(min_tokens=4, logit_bias=((7, 2.0),), bad_words=((9,),))
    assert not ahead(repetition_penalty=1.1)
    assert not ahead(frequency_penalty=0.5)
    assert not ahead(presence_penalty=0.5)
    assert not ahead(bad_words=((3, 9),))
    assert not ahead(return_log_probs=True)
    assert not ahead(top_log_probs=2)


def test_schedule_ahead_stays_off_where_it_cannot_run():
    engine = overlap_engine(True, True)
    assert engine.schedule_ahead
    assert not overlap_engine(True, True, use_kv_cache=False).schedule_ahead


def test_overlap_defaults_on_only_where_the_forward_pass_is_asynchronous():
    assert overlap_engine(None).overlap is False  # the CPU runner: nothing to overlap with


@pytest.mark.parametrize("overlap", [False, True])
def test_top_log_probs_are_transformers_log_softmax(overlap: bool):
    """top_log_probs N: at every generated position the N most likely tokens and their
    log-probabilities, those of log_softmax over transformers' own logits for the same
    prefix (within 1e-3), in a batch with rows that ask for none; sampled rows too."""
    import torch

    from tests.helpers.models import hf_logits

    model, tok = tiny()
    engine = overlap_engine(overlap)
    col = Collector()
    asked = [col.request(engine, MIXED_PROMPTS[0], max_tokens=8, return_log_probs=True, top_log_probs=5),
             col.request(engine, MIXED_PROMPTS[1], max_tokens=6, return_log_probs=True, top_log_probs=20,
                         temperature=0.8, seed=11, stream=False)]
    plain = col.request(engine, MIXED_PROMPTS[2], max_tokens=6)
    drain(engine)
    assert all(not e.top_log_probs for e in col.events[plain])
    for rid, prompt, n in ((asked[0], MIXED_PROMPTS[0], 5), (asked[1], MIXED_PROMPTS[1], 20)):
        ids = col.ids(rid)
        tops = [t for e in col.events[rid] for t in e.top_log_probs]
        assert len(tops) == len(ids) and all(len(t) == n for t in tops)
        history = list(tok(prompt).input_ids)
        for token, top in zip(ids, tops):
            want = torch.log_softmax(hf_logits(model, history)[-1], -1)  # [V]: the last position's
            values, order = torch.topk(want, n)
            got_ids, got_values = zip(*top)
            assert list(got_ids) == order.tolist()
            assert torch.allclose(torch.tensor(got_values), values, atol=1e-3)
            history.append(token)


def test_top_log_probs_are_refused_beyond_twenty():
    from tritonlm.engine.request import InvalidRequestError as Invalid

    with pytest.raises(Invalid, match=r"^top_log_probs: must be in \[0, 20\], got 21"):
        Collector().request(overlap_engine(False), "x", top_log_probs=21)


@pytest.mark.parametrize("overlap", [False, True])
def test_prompt_log_probs_are_transformers_log_softmax_with_chunks_and_prefix_cache(overlap: bool):
    """prompt_log_probs N: every prompt token's log-probability (None for the first) and the N
    most likely tokens there equal log_softmax over transformers' logits of the whole prompt
    (within 1e-3): with a prefill split into 7-token chunks, in a batch with rows that ask for
    none, and for a prompt whose blocks are already in the prefix cache (it is run whole);
    the chosen tokens' ranks are their ranks in transformers' distribution."""
    import torch

    from tests.helpers.models import hf_logits

    model, tok = tiny()
    engine = overlap_engine(overlap, max_num_batched_tokens=7)
    engine.cache.prefix_caching = True
    prompt = MIXED_PROMPTS[1] * 3  # several cache blocks
    col = Collector()
    warm = col.request(engine, prompt, max_tokens=2)
    drain(engine)
    asked = [col.request(engine, prompt, max_tokens=3, prompt_log_probs=4, return_log_probs=True),
             col.request(engine, MIXED_PROMPTS[0], max_tokens=3, prompt_log_probs=0, stream=False)]
    plain = col.request(engine, MIXED_PROMPTS[2], max_tokens=3)
    again = col.request(engine, prompt, max_tokens=1)  # the same prompt, not scored: served from the cache
    drain(engine)
    assert col.final(again).num_cached_tokens > 0
    assert col.final(warm).num_cached_tokens == 0 and col.final(asked[0]).num_cached_tokens == 0
    assert all(e.prompt_log_probs is None for e in col.events[plain])
    for rid, text, n in ((asked[0], prompt, 4), (asked[1], MIXED_PROMPTS[0], 0)):
        ids = list(tok(text).input_ids)
        firsts = [e for e in col.events[rid] if e.prompt_log_probs is not None]
        assert len(firsts) == 1 and firsts[0] is col.events[rid][0]  # once, on the first event
        got, tops = firsts[0].prompt_log_probs, firsts[0].prompt_top_log_probs
        want = torch.log_softmax(hf_logits(model, ids), -1)  # [P, V]: position j predicts token j + 1
        assert got[0] is None and len(got) == len(tops) == len(ids)
        assert torch.allclose(torch.tensor(got[1:]), want[torch.arange(len(ids) - 1), ids[1:]], atol=1e-3)
        for j in range(1, len(ids)):
            assert len(tops[j]) == n
            if n:
                values, order = torch.topk(want[j - 1], n)
                assert [t for t, _ in tops[j]] == order.tolist()
                assert torch.allclose(torch.tensor([v for _, v in tops[j]]), values, atol=1e-3)
    history = list(tok(prompt).input_ids)
    for token, rank in zip(col.ids(asked[0]), [r for e in col.events[asked[0]] for r in e.ranks]):
        logits = hf_logits(model, history)[-1]
        assert rank == int((logits > logits[token]).sum()) + 1
        history.append(token)


def test_prompt_log_probs_are_refused_beyond_twenty():
    from tritonlm.engine.request import InvalidRequestError as Invalid

    with pytest.raises(Invalid, match=r"^prompt_log_probs: must be in \[0, 20\]"):
        Collector().request(overlap_engine(False), "x", prompt_log_probs=21)


class HeldLoraRig:
    """An engine on a tiny Llama whose registry serves two PEFT adapters: `slow`, whose load
    on the loader thread waits for `release` (an Event the test sets; `loading` is set once
    it waits), and `dora`, refused at its load. `merged`: PEFT's merged model of `slow`."""

    def __init__(self, tmp_path, **engine_kw):
        import threading

        pytest.importorskip("peft")
        from tests.helpers.lora import make_adapter, write_config
        from tests.helpers.models import tiny_llama
        from tests.helpers.servers import HANG_GUARD_S
        from tritonlm.engine.engine import Engine
        from tritonlm.engine.kv_cache import KVCacheManager
        from tritonlm.engine.lora import attach_lora
        from tritonlm.engine.lora.registry import LoraRegistry
        from tritonlm.engine.runners.torch_runner import TorchRunner
        from tritonlm.engine.scheduler import SchedulerConfig
        from tritonlm.models.builtin import tiny_tokenizer

        self.model = tiny_llama()
        self.merged = make_adapter(self.model, tmp_path / "slow", seed=5, r=4, lora_alpha=8, target_modules="all-linear")
        make_adapter(self.model, tmp_path / "dora", seed=6, r=4, lora_alpha=8, target_modules=["q_proj"])
        write_config(tmp_path / "dora", use_dora=True)
        runner = TorchRunner(self.model)
        attach_lora(runner.transformer)
        self.registry = LoraRegistry(runner.transformer, {"slow": tmp_path / "slow", "dora": tmp_path / "dora"})
        self.loading, self.release = threading.Event(), threading.Event()

        def held(name: str) -> None:
            if name == "slow":
                self.loading.set()
                assert self.release.wait(HANG_GUARD_S)

        self.registry.before_load = held
        cache = KVCacheManager(runner.spec, 64 * 4 * runner.spec.bytes_per_token, 4, allocate_kv=runner.allocate_kv)
        self.engine = Engine(runner, tiny_tokenizer(), cache, SchedulerConfig(), max_context=128, **engine_kw)
        self.engine.lora_registry = self.registry
        self.events: dict[int, list] = {}
        self.done: dict[int, threading.Event] = {}

    def submit(self, prompt: list[int], lora) -> int:
        import threading

        from tritonlm.engine.request import GenerationRequest, SamplingParams

        req = GenerationRequest(list(prompt), SamplingParams(max_tokens=8, end_id=-1), self._on_event, lora=lora)
        self.events[req.request_id], self.done[req.request_id] = [], threading.Event()
        self.engine.submit(req)
        return req.request_id

    def tokens(self, rid: int) -> list[int]:
        return [t for e in self.events[rid] for t in e.token_ids]

    def _on_event(self, ev) -> None:
        self.events[ev.request_id].append(ev)
        if ev.finished:
            self.done[ev.request_id].set()


def test_a_cold_lora_adapter_loads_off_the_step_loop_while_base_requests_run(tmp_path):
    """A request under an adapter that is not loaded waits in the engine while the registry's
    loader thread loads it (held back here on an Event the test controls): a base request sent
    after it is served meanwhile; once the load is let go, the adapter request runs and equals
    PEFT's merged model; an adapter refused at its load fails its own request only, naming why."""
    from tests.helpers.models import hf_greedy_ids, random_tokens
    from tests.helpers.servers import HANG_GUARD_S
    from tritonlm.engine.lora.registry import PendingAdapter

    rig = HeldLoraRig(tmp_path)
    registry, done, events = rig.registry, rig.done, rig.events
    prompt = random_tokens(9, seed=4)
    rig.engine.start()
    try:
        pending = registry.acquire("slow")
        assert isinstance(pending, PendingAdapter) and registry.acquire("slow") is pending  # one load, shared
        slow = rig.submit(prompt, pending)
        assert rig.loading.wait(HANG_GUARD_S)
        base = rig.submit(prompt, None)
        assert done[base].wait(HANG_GUARD_S)  # served while the adapter still loads
        assert rig.tokens(base) == hf_greedy_ids(rig.model, prompt, 8)
        assert events[slow] == [] and not pending.future.done()
        rig.release.set()
        assert done[slow].wait(HANG_GUARD_S)
        assert rig.tokens(slow) == hf_greedy_ids(rig.merged, prompt, 8)
        assert registry.resident == ["slow"] and registry.acquire("slow") is pending.future.result()
        bad = rig.submit(prompt, registry.acquire("dora"))
        again = rig.submit(prompt, None)
        assert done[bad].wait(HANG_GUARD_S) and done[again].wait(HANG_GUARD_S)
        assert events[bad][-1].error.startswith("lora_name: LoRA adapter 'dora': use_dora=True: DoRA")
        assert events[again][-1].finish_reason == "length"
    finally:
        rig.release.set()
        rig.engine.shutdown()


def test_a_request_whose_adapter_load_hangs_times_out_like_a_queued_one(tmp_path):
    """queue_timeout_s holds for a request waiting for its adapter as for one waiting for a
    slot: a load that hangs (held here until the test lets it go) fails the request with an
    error naming the adapter and the setting, while base requests are served; the load goes
    on, and a later request under the adapter runs on it. After shutdown the registry starts
    no loader again: a request for a cold adapter is told the model is shutting down."""
    from tests.helpers.models import hf_greedy_ids, random_tokens
    from tests.helpers.servers import HANG_GUARD_S
    from tritonlm.engine.lora.registry import PendingAdapter
    from tritonlm.engine.request import ServerBusyError

    rig = HeldLoraRig(tmp_path, queue_timeout_s=0.05)
    prompt = random_tokens(7, seed=11)
    rig.engine.start()
    try:
        stuck = rig.submit(prompt, rig.registry.acquire("slow"))
        assert rig.loading.wait(HANG_GUARD_S)
        assert rig.done[stuck].wait(HANG_GUARD_S)  # the idle loop woke for it: nothing else ran
        error = rig.events[stuck][-1].error
        assert error.startswith("lora_name: timed out after waiting") and "'slow'" in error, error
        assert "queue_timeout_s=0.05" in error and rig.tokens(stuck) == []
        rig.engine.queue_timeout_s = 0.0  # the requests below must not race a 50 ms timeout on a busy host
        base = rig.submit(prompt, None)
        assert rig.done[base].wait(HANG_GUARD_S) and rig.tokens(base) == hf_greedy_ids(rig.model, prompt, 8)
        rig.release.set()
        adapter = rig.registry.acquire("slow")
        adapter = adapter.future.result(HANG_GUARD_S) if isinstance(adapter, PendingAdapter) else adapter
        later = rig.submit(prompt, adapter)
        assert rig.done[later].wait(HANG_GUARD_S) and rig.tokens(later) == hf_greedy_ids(rig.merged, prompt, 8)
    finally:
        rig.release.set()
        rig.engine.shutdown()
    with pytest.raises(ServerBusyError, match="shutting down"):
        rig.registry.acquire("dora")


def test_the_slo_step_model_learns_which_steps_ran_a_second_pass():
    """With an SLO, the step-time model counts a second pass only for chunks wider than the
    executor runs beside the decoding rows (ModelExecutor.chunk_rows), and learns each
    step's passes as the executor ran them: a prompt arriving while others decode is one
    pass with its chunk beside the decodes, two with the chunks apart."""
    from tritonlm.engine.runners.torch_runner import FUSED_CHUNK_TOKENS

    for chunk_rows in (None, 0):
        engine = make_engine(slo_ttft_s=10.0, slo_tpot_s=1.0, max_num_batched_tokens=12)
        if chunk_rows is None:
            assert engine.executor.chunk_rows == FUSED_CHUNK_TOKENS
            assert engine.scheduler.slo.model.cost.joined == FUSED_CHUNK_TOKENS
        else:
            engine.executor.chunk_rows = chunk_rows
        seen = []  # second_pass of each step with prompt tokens and decoding rows
        observe = engine.scheduler.slo.observe_step

        def record(prefill, rows, context, seconds, decode_context=None, second_pass=None, observe=observe, seen=seen):
            if prefill and rows:
                seen.append(second_pass)
            observe(prefill, rows, context, seconds, decode_context, second_pass)

        engine.scheduler.slo.observe_step = record
        col = Collector()
        for i, prompt in enumerate(["The quick brown fox", "Once upon a time there was", "Hello there"]):
            col.request(engine, prompt, max_tokens=8, end_id=-1)
            for _ in range(2 + i):
                engine.step()
        drain(engine)
        assert seen and set(seen) == {chunk_rows == 0}, (chunk_rows, seen)
