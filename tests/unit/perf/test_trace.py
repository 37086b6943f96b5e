"""tritonlm/perf/trace.py: a replayed trace has the mean rate it is asked for and keeps the
coefficient of variation of its recorded gaps (computed here independently, with numpy, from
the CSV); token lengths are scaled so the 99th percentile becomes the longest allowed and stay
within [1, longest]; the processes give the schedule arrivals.py draws; bad specs and bad
trace files are named."""

from __future__ import annotations

import csv

import numpy as np
import pytest

from tritonlm.perf.arrivals import ArrivalProcess, describe
from tritonlm.perf.target import PerfError
from tritonlm.perf.trace import (BUILTIN_TRACES, TraceArrivals, build_schedule, gaps_cv, parse_arrivals, read_trace,
                                  scale_lengths, with_rate)


def numpy_trace(path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(seconds from the first row, context tokens, generated tokens), read without trace.py."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))[1:]
    stamps = np.array([np.datetime64(r[0].replace(" ", "T")[:26], "us") for r in rows])
    seconds = (stamps - stamps[0]).astype(np.float64) / 1e6
    return seconds, np.array([int(r[1]) for r in rows]), np.array([int(r[2]) for r in rows])


@pytest.mark.parametrize("name", sorted(BUILTIN_TRACES))
def test_the_shipped_slices_are_five_contiguous_minutes(name):
    seconds, context, generated = numpy_trace(BUILTIN_TRACES[name])
    assert np.all(np.diff(seconds) >= 0) and 290 < seconds[-1] < 300
    assert len(seconds) > 500 and context.min() >= 1 and generated.min() >= 1


@pytest.mark.parametrize("name, rate", [("azure-conv", 2.0), ("azure-code", 0.5), ("azure-conv", 40.0)])
def test_a_replayed_trace_has_the_rate_asked_and_the_traces_own_burstiness(name, rate):
    seconds, _, _ = numpy_trace(BUILTIN_TRACES[name])
    recorded = np.diff(seconds)
    # one replay cycle: the recorded gaps, and one mean gap from the last row back to the first
    cycle = np.append(recorded, recorded.mean())
    want_cv = cycle.std() / cycle.mean()
    arrivals = parse_arrivals(f"{name}:{rate}")
    for cycles in (1, 3):
        gaps = arrivals.gaps(cycles * len(seconds), seed=5)
        got_rate, got_cv = describe(gaps)
        assert got_rate == pytest.approx(rate, rel=1e-9)
        assert got_cv == pytest.approx(want_cv, rel=1e-9)
    # a replay's gaps are the recorded ones times one factor, in the recorded order
    gaps = np.array(arrivals.gaps(50, seed=0))
    assert any(np.allclose(gaps / gaps.sum(), np.roll(cycle, -start)[:50] / np.roll(cycle, -start)[:50].sum())
               for start in range(len(cycle)))


def test_the_code_traces_bursts_are_far_burstier_than_poisson():
    gaps = parse_arrivals("azure-code:1").gaps(5000, seed=1)
    assert gaps_cv(gaps) > 3 * gaps_cv(ArrivalProcess.parse("poisson:1").gaps(5000, seed=1))


def test_the_seed_picks_where_the_replay_starts():
    arrivals = parse_arrivals("azure-conv:2")
    assert arrivals.gaps(30, seed=4) == arrivals.gaps(30, seed=4) != arrivals.gaps(30, seed=9)


def test_a_duration_holds_the_arrivals_before_it():
    arrivals = parse_arrivals("azure-conv:3")
    times = [t for t, _ in arrivals.requests(seed=2, duration_s=200.0)]
    assert times == sorted(times) and 0 < times[0] and times[-1] < 200.0
    assert len(times) == pytest.approx(600, rel=0.25)  # the slice's own rate varies over a window this long
    # the same rows with a count; the window's times scaled to its own mean rate, gaps in proportion
    window = arrivals.requests(seed=2, count=len(times))
    assert [i for _, i in window] == [i for _, i in arrivals.requests(seed=2, duration_s=200.0)]
    assert len(window) / window[-1][0] == pytest.approx(3.0, rel=1e-12)
    assert np.allclose(np.array([t for t, _ in window]) / window[-1][0], np.array(times) / times[-1])


@pytest.mark.parametrize("name, count", [("azure-conv", 40), ("azure-code", 40), ("azure-code", 300)])
def test_a_short_window_is_offered_at_the_rate_asked(name, count):
    """A few dozen requests of a trace can sit in a burst or a lull: the window itself is scaled."""
    for seed in range(5):
        gaps = parse_arrivals(f"{name}:2").gaps(count, seed=seed)
        assert describe(gaps)[0] == pytest.approx(2.0, rel=1e-9)


def test_lengths_scale_so_the_99th_percentile_is_the_longest_and_stay_in_bounds():
    _, context, generated = numpy_trace(BUILTIN_TRACES["azure-conv"])
    for lengths, longest in ((context, 200), (generated, 48), (context, 1)):
        scaled = np.array(scale_lengths(lengths.tolist(), longest))
        assert scaled.min() >= 1 and scaled.max() <= longest
        want = np.clip(np.round(lengths * longest / np.percentile(lengths, 99)), 1, longest)
        assert np.array_equal(scaled, want)
        assert np.mean(scaled == longest) >= 0.01  # the top percent is clipped to the longest
    # the order of lengths is kept
    order = np.argsort(context, kind="stable")
    assert np.all(np.diff(np.array(scale_lengths(context.tolist(), 200))[order]) >= 0)


def test_a_trace_schedule_has_scaled_lengths_and_a_process_schedule_fixed_ones():
    trace = build_schedule(parse_arrivals("azure-code:2"), seed=1, prompt_tokens=100, output_tokens=20, count=400)
    assert len(trace) == 400 and all(1 <= s.prompt_tokens <= 100 and 1 <= s.output_tokens <= 20 for s in trace)
    assert len({s.prompt_tokens for s in trace}) > 20  # the trace's spread survives the scaling
    process = ArrivalProcess.parse("gamma:5:3")
    fixed = build_schedule(process, seed=1, prompt_tokens=64, output_tokens=16, count=100)
    assert {(s.prompt_tokens, s.output_tokens) for s in fixed} == {(64, 16)}
    assert [s.at_s for s in fixed] == pytest.approx(np.cumsum(process.gaps(100, seed=1)).tolist())
    timed = build_schedule(process, seed=1, prompt_tokens=64, output_tokens=16, duration_s=30.0)
    assert [s.at_s for s in timed] == process.times(30.0, seed=1)


def test_another_rate_keeps_the_trace_and_the_process():
    assert with_rate(parse_arrivals("gamma:5:3"), 2.0) == ArrivalProcess("gamma", 2.0, 3.0)
    trace = with_rate(parse_arrivals("azure-conv:5"), 2.0)
    assert isinstance(trace, TraceArrivals) and trace.rate == 2.0 and trace.name == "azure-conv"


def test_any_csv_of_the_schema_is_a_trace(tmp_path):
    path = tmp_path / "mine.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2024-01-01 00:00:00.0000000,10,5\n"
                    "2024-01-01 00:00:01.5000000,20,6\n2024-01-01 00:00:02.0000000,30,7\n")
    arrivals = parse_arrivals(f"trace:{path}:4")
    assert [r.at_s for r in arrivals.rows] == [0.0, 1.5, 2.0] and arrivals.recorded_rate == 1.0
    assert describe(arrivals.gaps(3 * 4, seed=0))[0] == pytest.approx(4.0)


@pytest.mark.parametrize("spec, message", [
    ("azure-conv", "is not 'poisson:RATE'"),
    ("azure-conv:fast", "is not 'poisson:RATE'"),
    ("azure-conv:0", "the rate must be a positive number"),
    ("azure-conv:x.csv:2", "is not 'poisson:RATE'"),
    ("trace::2", "names no trace file"),
    ("trace:/nonexistent/t.csv:2", "cannot read it"),
    ("burst:3", "is not 'poisson:RATE', 'gamma:RATE:CV', 'azure-conv:RATE'"),
    ("gamma:3", "or a trace: 'poisson:RATE'"),
])
def test_a_bad_spec_is_named(spec, message):
    with pytest.raises(PerfError, match=message):
        parse_arrivals(spec)


@pytest.mark.parametrize("text, message", [
    ("when,ContextTokens,GeneratedTokens\n1,2,3\n", "no column TIMESTAMP"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2024-01-01 00:00:00,ten,3\n", ":2: expected a timestamp and two token counts"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2024-01-01 00:00:01,1,3\n2024-01-01 00:00:00,1,3\n", ":3: timestamps must not go back"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2024-01-01 00:00:00,0,3\n", ":2: token counts must be positive"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2024-01-01 00:00:00,4,3\n", "needs at least two rows"),
])
def test_a_bad_trace_file_is_named(tmp_path, text, message):
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(PerfError, match=message):
        read_trace(path)


@pytest.mark.parametrize("kwargs, message", [
    ({"count": 0}, "--count: at least 1"),
    ({"duration_s": -1.0}, "--duration: a positive number"),
    ({"count": 5, "duration_s": 5.0}, "either a count of requests or a duration"),
    ({"count": 5, "prompt_tokens": 0}, "--prompt-tokens: at least 1"),
])
def test_a_bad_schedule_is_named(kwargs, message):
    args = {"seed": 0, "prompt_tokens": 10, "output_tokens": 10, **kwargs}
    with pytest.raises(PerfError, match=message):
        build_schedule(parse_arrivals("poisson:1"), **args)
