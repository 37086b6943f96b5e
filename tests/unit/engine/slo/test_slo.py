"""The SLO hooks through a real engine (tiny-gpt2): settings, the ledger's goodput counts and
inter-token gaps, the controller's budget in the scheduler, and shedding at submit. Step
times are the host's, so nothing here asserts on them: only on what is counted and refused."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.helpers.models import MIXED_PROMPTS, Collector, assert_greedy_answers, drain, make_engine
from tritonlm.engine.settings import EngineSettings, SettingsError
from tritonlm.engine.slo import LatencyLedger, SloShedError, SloTargets
from tritonlm.engine.slo.controller import COLD_STEPS
from tritonlm.engine.slo.ledger import MAX_GAPS
from tritonlm.openai.errors import from_triton


@pytest.fixture()
def model_dir(tmp_path) -> Path:
    (tmp_path / "gen/1/hf").mkdir(parents=True)
    return tmp_path / "gen"


def test_slo_settings_are_off_by_default_and_checked(model_dir):
    s = EngineSettings.from_params({}, model_dir)
    assert (s.slo_ttft_ms, s.slo_tpot_ms) == (0.0, 0.0)
    s = EngineSettings.from_params({"slo_ttft_ms": "500", "slo_tpot_ms": "40.5"}, model_dir)
    assert (s.slo_ttft_ms, s.slo_tpot_ms) == (500.0, 40.5)
    for bad in ("-1", "inf", "nan"):
        with pytest.raises(SettingsError, match=r"slo_tpot_ms: must be a finite number of milliseconds >= 0"):
            EngineSettings.from_params({"slo_tpot_ms": bad}, model_dir)
    with pytest.raises(SettingsError, match="slo_ttft_ms: 'fast' is not a number"):
        EngineSettings.from_params({"slo_ttft_ms": "fast"}, model_dir)


def test_without_an_slo_there_is_no_controller():
    engine = make_engine()
    assert engine.scheduler.slo is None


def test_with_slos_the_answers_are_the_same_and_each_request_is_judged():
    # a generous SLO: the host's speed must not decide the counts
    engine = make_engine(max_num_batched_tokens=64, slo_ttft_s=600.0, slo_tpot_s=60.0)
    jobs = [(MIXED_PROMPTS[i % len(MIXED_PROMPTS)], 3 + 2 * i) for i in range(6)]
    assert_greedy_answers(engine, jobs)
    ledger, slo = engine.scheduler.ledger, engine.scheduler.slo
    assert (ledger.met, ledger.missed, ledger.shed) == (len(jobs), 0, 0)
    # every step reported; the first ones after load (one-time costs) are kept out of the fit
    assert slo.steps_seen == engine.stats.steps and slo.model.steps == engine.stats.steps - COLD_STEPS
    assert slo.model.ready
    assert slo.budget <= 64 and slo.cap <= engine.scheduler.config.max_num_seqs
    # one gap per token after the first: a request of n tokens has n - 1
    assert len(ledger.drain_gaps()) == sum(n - 1 for _, n in jobs)
    assert ledger.drain_gaps() == []


def test_an_impossible_tpot_is_counted_as_missed():
    engine = make_engine(slo_tpot_s=1e-9)  # no host makes a token in a nanosecond
    col = Collector()
    col.request(engine, "Hello there", max_tokens=5, end_id=-1)
    drain(engine)
    assert (engine.scheduler.ledger.met, engine.scheduler.ledger.missed) == (0, 1)


def test_a_request_that_cannot_meet_its_ttft_is_shed_at_submit_with_a_clear_error():
    engine = make_engine(slo_ttft_s=0.5)
    slo = engine.scheduler.slo
    for _ in range(COLD_STEPS + slo.model.min_steps):  # this host, as the model learned it: a second a step
        slo.observe_step(64, 0, 1000, 1.0)
    col = Collector()
    # an idle engine admits whatever the prediction (controller.admit says why)
    first = col.request(engine, "Hello there", max_tokens=4)
    assert slo.predicted_ttft_s > 0.5
    with pytest.raises(SloShedError) as e:  # behind it, refused
        col.request(engine, "Hello there", max_tokens=4)
    message = str(e.value)
    assert message.startswith("overloaded: predicted time to first token ")
    assert "slo_ttft_ms=500" in message and "retry later" in message
    assert engine.scheduler.ledger.shed == 1
    assert engine.scheduler.num_waiting + len(engine._inbox) == 1  # the first one only was queued
    # the OpenAI frontend answers it with 503 (and Retry-After: tests/unit/openai/test_app.py)
    error = from_triton(f"[request id: 1] {message}")
    assert (error.status, error.code) == (503, "slo_overloaded")
    # a fast host again: admitted
    for _ in range(2000):
        slo.observe_step(64, 0, 1000, 0.001)
    rid = col.request(engine, "Hello there", max_tokens=4)
    drain(engine)
    assert col.final(first).finish_reason == col.final(rid).finish_reason == "length"


def test_the_ledger_judges_only_answers_and_keeps_a_bounded_gap_list():
    ledger = LatencyLedger(SloTargets(ttft_s=1.0, tpot_s=0.1))

    def seq(i, first, last, n, arrival=0.0):
        request = SimpleNamespace(arrival=arrival)
        return SimpleNamespace(id=i, first_token_time=first, last_token_time=last, num_output_tokens=n, request=request)

    ledger.finished(seq(1, 0.5, 0.5 + 9 * 0.1, 10), "length")  # TTFT 0.5, TPOT 0.1: met
    ledger.finished(seq(2, 1.5, 1.6, 2), "stop")  # TTFT 1.5: missed
    ledger.finished(seq(3, 0.1, 9.0, 2), "stop")  # TPOT 8.9: missed
    ledger.finished(seq(4, 0.1, 9.0, 2), "cancelled")  # not an answer: not judged
    ledger.finished(seq(5, None, None, 0), "error")
    assert (ledger.met, ledger.missed) == (1, 2)
    for t in range(MAX_GAPS + 10):  # nobody drains: the list stops growing
        ledger.step_done([seq(6, 0.0, float(t), t)])
    assert len(ledger.drain_gaps()) == MAX_GAPS and ledger.drain_gaps() == []
