"""tritonlm/perf/tune.py: the candidate grid, the recommendation against brute force over the
candidates (ties to fewer instances, then lower p99), a config described from Triton's own
protobuf text, and a candidate's table row."""

from __future__ import annotations

import itertools

from google.protobuf import text_format
from hypothesis import given, settings
from hypothesis import strategies as st

from tritonlm.perf.analyzer import Point
from tritonlm.perf.target import ModelStats
from tritonlm.perf.tune import Candidate, candidate_specs, describe, recommend
from tritonlm.perf.variants import ModelConfig, VariantSpec


def point(load: float, throughput: float, p99_ms: float, avg_batch: float = 1.0) -> Point:
    stats = ModelStats(inference_count=int(10 * avg_batch), execution_count=10)
    return Point(model="m", mode="concurrency", load=load, throughput=throughput, p50_ms=p99_ms / 2, p90_ms=p99_ms,
                 p95_ms=p99_ms, p99_ms=p99_ms, avg_ms=p99_ms / 2, client_requests=10, server=stats)


def test_the_grid_is_every_combination_once_with_dynamic_batching_on():
    specs = candidate_specs([0, 100, 500], [4, 8], [1, 2])
    assert len(specs) == 12
    assert {(s.max_queue_delay_us, s.max_batch_size, s.instance_count) for s in specs} == set(
        itertools.product([0, 100, 500], [4, 8], [1, 2]))
    assert all(s.dynamic_batching for s in specs)


def candidate(instances: int, best: tuple[float, float] | None) -> Candidate:
    c = Candidate(VariantSpec(dynamic_batching=True, max_batch_size=8, max_queue_delay_us=100, instance_count=instances),
                  label=f"i{instances}")
    c.best = point(4, *best) if best else None
    return c


@settings(max_examples=200, deadline=None, database=None)  # a failure prints its example
@given(st.lists(st.tuples(st.integers(1, 3), st.none() | st.tuples(st.integers(1, 4), st.integers(1, 4))), max_size=8))
def test_the_recommendation_is_the_best_by_throughput_then_instances_then_p99(drawn):
    candidates = [candidate(i, None if best is None else (float(best[0]), float(best[1]))) for i, best in drawn]
    chosen = recommend(candidates)
    within = [c for c in candidates if c.best is not None]
    if not within:
        assert chosen is None
        return
    key = lambda c: (c.best.throughput, -c.spec.instance_count, -c.best.p99_ms)  # noqa: E731
    assert chosen in within and all(key(c) <= key(chosen) for c in within)


def test_a_tie_in_throughput_goes_to_fewer_instances_before_lower_p99():
    two_fast, one_slow = candidate(2, (100.0, 10.0)), candidate(1, (100.0, 40.0))
    assert recommend([two_fast, one_slow]) is one_slow
    assert recommend([candidate(1, None)]) is None


def test_describe_reads_the_config_as_triton_parses_it():
    config = text_format.Parse(
        'name: "m" max_batch_size: 16 dynamic_batching { max_queue_delay_microseconds: 250 } '
        'instance_group [ { count: 2 kind: KIND_CPU }, { kind: KIND_CPU } ]', ModelConfig())
    assert describe(config) == "max_batch_size 16, queue delay 250us, 3 instance(s)"
    plain = text_format.Parse('name: "m" max_batch_size: 0', ModelConfig())
    assert describe(plain) == "max_batch_size 0, queue delay off, 1 instance(s)"


def test_a_candidates_row_says_what_it_found_or_why_not():
    found = candidate(2, (123.456, 7.891))
    found.best = point(8, 123.456, 7.891, avg_batch=3.5)
    row = found.row(budget_ms=10)
    assert (row["candidate"], row["instances"], row["max_batch_size"], row["max_queue_delay_us"]) == ("i2", 2, 8, 100)
    assert (row["best_per_s"], row["at_concurrency"], row["p99_ms"], row["server_avg_batch"]) == (123.5, 8, 7.89, 3.5)
    assert row["within_budget"] is True and row["error"] == ""
    failed = candidate(1, None)
    failed.error = "load failed: bad config"
    row = failed.row(budget_ms=10)
    assert (row["best_per_s"], row["within_budget"], row["error"]) == (0.0, False, "load failed: bad config")
