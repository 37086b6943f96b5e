"""The SLO warm-up at load (tritonlm/engine/slo_warmup.py) through a real engine (tiny-gpt2):
it fits the step-time model on steps of every kind, leaves nothing behind (no sequence, no
cache block in use, no count, no event) and changes no answer. Step times are the host's,
so nothing here asserts on them."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.helpers.models import (MIXED_PROMPTS, Collector, assert_greedy_answers, drain, make_engine,
                                  make_prefix_caching_engine)
from tests.unit.engine.test_engine import overlap_engine
from tests.unit.engine.test_output import Recorder
from tritonlm.engine import slo_warmup
from tritonlm.engine.settings import EngineSettings, SettingsError
from tritonlm.engine.slo.controller import COLD_STEPS
from tritonlm.engine.slo_warmup import WARMUP_PROMPTS, _token_draw, _workload, warm_up_slo


@pytest.fixture(autouse=True)
def no_time_bound(monkeypatch):
    """The warm-up's 60 s bound is for a very slow model in production; here a slow or busy
    host must not cut it and change what it covers."""
    monkeypatch.setattr(slo_warmup, "MAX_SECONDS", math.inf)


class StepKinds:
    """Wraps a controller's observe_step: counts the steps of each kind it is told of."""

    def __init__(self, slo):
        self.kinds = {"prompt": 0, "decode": 0, "mixed": 0}
        self.widest = self.largest_chunk = 0
        inner = slo.observe_step

        def observe(prefill_tokens, decode_rows, *args, **kwargs):
            kind = "mixed" if prefill_tokens and decode_rows else "prompt" if prefill_tokens else "decode"
            self.kinds[kind] += 1
            self.widest = max(self.widest, decode_rows)
            self.largest_chunk = max(self.largest_chunk, prefill_tokens)
            inner(prefill_tokens, decode_rows, *args, **kwargs)

        slo.observe_step = observe


def test_the_warm_up_fits_the_step_model_on_every_kind_of_step_and_leaves_nothing_behind():
    engine = make_engine(max_num_batched_tokens=64, max_num_seqs=8, slo_ttft_s=600.0, slo_tpot_s=1e-3)
    slo = engine.scheduler.slo
    kinds = StepKinds(slo)
    warm_up_slo(engine)
    assert slo.model.ready and slo.steps_seen > COLD_STEPS + slo.model.min_steps
    # prompt-only, decode-only and mixed steps, decode steps as wide as max_num_seqs and
    # chunks as large as max_num_batched_tokens: the controller only watched (its tight
    # TPOT target would have cut them), and its targets are back
    assert all(kinds.kinds.values()), kinds.kinds
    assert kinds.widest == 8 and kinds.largest_chunk >= 64 - 8
    assert slo.targets.tpot_s == 1e-3
    # the load is forgotten, the host is not
    assert (slo.budget, slo.cap, slo.row_context, slo.typical_step_s, slo.deferred_steps) == (64, 8, 0.0, 0.0, 0)
    assert slo.model.steps == slo.steps_seen - COLD_STEPS
    # nothing running, nothing in use, nothing counted
    sched = engine.scheduler
    assert not engine.has_work() and not engine._inbox
    assert sched.cache.used_bytes == 0 and engine._step_tokens == 0
    assert (sched.ledger.met, sched.ledger.missed, sched.ledger.shed) == (0, 0, 0)
    assert sched.ledger.drain_gaps() == []
    assert engine.stats.steps == 0 and engine.stats.tokens_generated == 0 and not engine.stats.finished


def test_answers_after_the_warm_up_are_transformers_greedy_ones():
    engine = make_engine(max_num_batched_tokens=32, slo_ttft_s=600.0, slo_tpot_s=60.0)
    warm_up_slo(engine)
    jobs = [(MIXED_PROMPTS[i % len(MIXED_PROMPTS)], 4 + 3 * i) for i in range(4)]
    assert_greedy_answers(engine, jobs)
    assert engine.scheduler.ledger.met == len(jobs)  # counted from the first real request on


def test_the_warm_up_fits_a_small_context_and_a_small_step():
    engine = make_engine(max_context=40, max_num_batched_tokens=16, max_num_seqs=4, slo_tpot_s=60.0)
    jobs = _workload(engine)
    assert len(jobs) == len(WARMUP_PROMPTS) + 4
    assert all(1 <= prompt <= 16 and prompt + answer <= 40 for _, prompt, answer in jobs)
    warm_up_slo(engine)
    assert engine.scheduler.slo.model.ready and not engine.has_work()


def test_without_an_slo_the_warm_up_runs_nothing():
    engine = make_engine()
    warm_up_slo(engine)
    assert engine.stats.steps == 0 and engine.scheduler.cache.used_bytes == 0


def test_the_warm_up_setting(tmp_path: Path):
    (tmp_path / "gen/1/hf").mkdir(parents=True)
    assert EngineSettings.from_params({}, tmp_path / "gen").slo_warmup is True
    assert EngineSettings.from_params({"slo_warmup": "false"}, tmp_path / "gen").slo_warmup is False
    with pytest.raises(SettingsError, match="slo_warmup: 'maybe' is not a boolean"):
        EngineSettings.from_params({"slo_warmup": "maybe"}, tmp_path / "gen")


def test_nothing_of_the_warm_up_reaches_the_metrics_or_the_prefix_cache():
    engine = make_prefix_caching_engine(True, slo_ttft_s=600.0, slo_tpot_s=60.0)
    observer = Recorder()
    engine.output.observer = observer
    warm_up_slo(engine)
    assert observer.calls == []
    assert engine.output.observer is observer and engine.scheduler.cache.prefix_caching
    cache = engine.scheduler.cache
    assert cache.cached_blocks == 0 and (cache.hit_tokens, cache.query_tokens) == (0, 0)
    # the first real request is counted and can be cached as usual
    Collector().request(engine, MIXED_PROMPTS[0] * 4, max_tokens=2)
    drain(engine)
    assert any(call[0] == "finish" for call in observer.calls) and cache.query_tokens > 0


def test_a_failing_warm_up_leaves_a_model_that_serves(monkeypatch, caplog):
    engine = make_engine(slo_ttft_s=600.0, slo_tpot_s=60.0)
    calls = {"n": 0}
    process = engine.output.process

    def fails_once(step):  # a step's outputs: outside the forward pass, so step() raises
        calls["n"] += 1
        if calls["n"] == 20:  # past the cold steps: the step model has begun
            raise RuntimeError("a detokenizer that breaks")
        process(step)

    monkeypatch.setattr(engine.output, "process", fails_once)
    observer = Recorder()
    engine.output.observer = observer
    warm_up_slo(engine)
    assert "SLO warm-up failed" in caplog.text
    assert not engine.has_work() and not engine._inbox and engine.scheduler.cache.used_bytes == 0
    assert engine.scheduler.slo.targets.tpot_s == 60.0 and engine.stats.steps == 0
    assert engine.output.observer is observer and engine.scheduler.step_in_flight is None
    assert_greedy_answers(engine, [(MIXED_PROMPTS[1], 5)])


def test_warm_up_prompts_are_ordinary_tokens_of_both_vocabularies():
    class Tokenizer:
        all_special_ids = [0, 1, 2]

        def __len__(self):
            return 50

    engine = SimpleNamespace(runner=SimpleNamespace(spec=SimpleNamespace(vocab_size=64)), tokenizer=Tokenizer())
    draw = _token_draw(engine)
    tokens = [draw() for _ in range(2000)]
    assert min(tokens) == 3 and max(tokens) == 49


def test_a_warm_up_cut_at_its_bound_leaves_a_model_that_serves(monkeypatch, caplog):
    monkeypatch.setattr(slo_warmup, "MAX_STEPS", 15)
    engine = make_engine(slo_ttft_s=600.0, slo_tpot_s=60.0)
    warm_up_slo(engine)
    assert "still running after 15 steps" in caplog.text
    assert not engine.has_work() and not engine._inbox and engine.scheduler.cache.used_bytes == 0
    assert_greedy_answers(engine, [(MIXED_PROMPTS[2], 6)])


@pytest.mark.parametrize("schedule_ahead", [False, True], ids=["overlap", "overlap+ahead"])
def test_the_warm_up_ends_with_nothing_left_on_the_device_or_for_events(schedule_ahead):
    engine = overlap_engine(True, schedule_ahead=schedule_ahead, max_num_batched_tokens=32, slo_ttft_s=600.0,
                            slo_tpot_s=60.0)
    warm_up_slo(engine)
    assert engine.scheduler.slo.model.ready
    assert not engine.has_work() and engine._ahead is None and engine._deferred == []
    assert engine.scheduler.cache.used_bytes == 0
    assert_greedy_answers(engine, [(MIXED_PROMPTS[0], 5), (MIXED_PROMPTS[3], 7)])
