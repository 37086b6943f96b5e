"""tritonlm/perf/sla.py: the best point within a p99 budget and when a sweep stops, against
brute force over every point; the result's rows."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tritonlm.perf.analyzer import Point
from tritonlm.perf.sla import SlaResult, best_within, over_budget_stopper
from tritonlm.perf.target import ModelStats


def point(load: float, throughput: float, p99_ms: float) -> Point:
    return Point(model="m", mode="concurrency", load=load, throughput=throughput, p50_ms=p99_ms / 2, p90_ms=p99_ms,
                 p95_ms=p99_ms, p99_ms=p99_ms, avg_ms=p99_ms / 2, client_requests=10, server=ModelStats())


# small integer grids make ties in throughput and in p99 common
measures = st.lists(st.tuples(st.integers(0, 6), st.integers(1, 6)), max_size=8)


@settings(max_examples=200, deadline=None, database=None)  # a failure prints its example
@given(measures, st.integers(0, 7))
def test_best_within_is_the_fastest_point_within_budget_then_the_lowest_p99(measured, budget):
    points = [point(i + 1, float(t), float(p99)) for i, (t, p99) in enumerate(measured)]
    best = best_within(points, budget)
    within = [p for p in points if p.p99_ms <= budget]
    if not within:
        assert best is None
        return
    assert best in within
    # brute force: nothing within the budget beats it on throughput, then on p99
    assert all((p.throughput, -p.p99_ms) <= (best.throughput, -best.p99_ms) for p in within)


def test_best_within_breaks_a_throughput_tie_by_the_lower_p99():
    a, b, c = point(1, 100, 40), point(2, 100, 30), point(4, 120, 80)
    assert best_within([a, b, c], budget_ms=50) is b
    assert best_within([a, b, c], budget_ms=80) is c  # the budget is inclusive
    assert best_within([a, b, c], budget_ms=29.9) is None


@settings(max_examples=200, deadline=None, database=None)
@given(st.lists(st.booleans(), max_size=12), st.integers(1, 4))
def test_the_stopper_stops_at_the_first_run_of_patience_points_over_budget(over, patience):
    budget = 10.0
    stop = over_budget_stopper(budget, patience)
    decisions = [stop(point(i + 1, 1.0, budget + 1 if o else budget)) for i, o in enumerate(over)]
    # brute force: the length of the run of over-budget points ending at each point
    runs, run = [], 0
    for o in over:
        run = run + 1 if o else 0
        runs.append(run)
    assert decisions == [r >= patience for r in runs]


def test_a_point_at_the_budget_is_within_it_and_resets_the_stopper():
    stop = over_budget_stopper(50.0)
    assert [stop(point(i, 1.0, p99)) for i, p99 in enumerate([60, 50, 60, 70, 40], 1)] == [
        False, False, False, True, False]


@pytest.mark.parametrize("budget, met", [(35.0, True), (5.0, False)])
def test_the_result_is_met_when_a_point_is_within_and_rows_say_which(budget, met):
    points = [point(1, 50, 10), point(2, 90, 30), point(4, 95, 60)]
    result = SlaResult(points, budget, best_within(points, budget))
    assert result.met is met
    assert [r["within_budget"] for r in result.rows()] == [p.p99_ms <= budget for p in points]
    assert [r["concurrency"] for r in result.rows()] == [1, 2, 4]
