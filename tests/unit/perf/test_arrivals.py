"""tritonlm/perf/arrivals.py: the open-loop arrival processes have the rate and the burstiness
(coefficient of variation of the gaps) they are asked for, on fixed seeds with bounds far
wider than the sampling error; and `tritonlm perf arrivals` writes perf_analyzer's file."""

from __future__ import annotations

import statistics

import pytest

from tritonlm.cli import main as cli_main
from tritonlm.perf.arrivals import ArrivalProcess, describe
from tritonlm.perf.target import PerfError


@pytest.mark.parametrize("spec, rate, cv", [("poisson:20", 20.0, 1.0), ("gamma:20:2", 20.0, 2.0),
                                            ("gamma:5:3", 5.0, 3.0), ("gamma:50:4", 50.0, 4.0)])
def test_rate_and_coefficient_of_variation_are_as_stated(spec, rate, cv):
    process = ArrivalProcess.parse(spec)
    gaps = process.gaps(400_000, seed=7)
    got_rate, got_cv = describe(gaps)
    assert got_rate == pytest.approx(rate, rel=0.03)
    assert got_cv == pytest.approx(cv, rel=0.08)  # a CV-4 gamma's tail makes its sample CV the slowest to settle
    # times() over a duration: about rate x duration arrivals, all inside it, in order
    times = process.times(2000.0, seed=7)
    assert len(times) == pytest.approx(rate * 2000, rel=0.05)
    assert times == sorted(times) and 0 < times[0] and times[-1] < 2000.0
    assert times[0] == gaps[0]  # the same draws from the same seed


def test_bursty_arrivals_cluster():
    """With CV 3 most gaps are far shorter than the mean and a few are very long."""
    gaps = ArrivalProcess.parse("gamma:10:3").gaps(100_000, seed=1)
    assert statistics.median(gaps) < 0.1 * statistics.fmean(gaps)
    assert statistics.median(ArrivalProcess.parse("poisson:10").gaps(100_000, seed=1)) > 0.6 * 0.1


def test_the_same_seed_gives_the_same_schedule():
    p = ArrivalProcess.parse("gamma:20:2")
    assert p.gaps(100, seed=3) == p.gaps(100, seed=3) != p.gaps(100, seed=4)


@pytest.mark.parametrize("spec, message", [
    ("poisson", "is not 'poisson:RATE' or 'gamma:RATE:CV'"),
    ("gamma:10", "is not 'poisson:RATE' or 'gamma:RATE:CV'"),
    ("uniform:10", "is not 'poisson:RATE' or 'gamma:RATE:CV'"),
    ("poisson:fast", "is not 'poisson:RATE' or 'gamma:RATE:CV'"),
    ("poisson:0", "the rate must be a positive number"),
    ("gamma:10:-1", "the coefficient of variation must be positive"),
])
def test_a_bad_process_is_named(spec, message):
    with pytest.raises(PerfError, match=message):
        ArrivalProcess.parse(spec)


def test_the_cli_writes_perf_analyzers_intervals_file(tmp_path, capsys):
    out = tmp_path / "intervals.txt"
    assert cli_main(["perf", "arrivals", "gamma:20:3", "--count", "500", "--seed", "2", "--out", str(out)]) == 0
    micros = [int(line) for line in out.read_text().splitlines()]
    want = ArrivalProcess.parse("gamma:20:3").gaps(500, seed=2)
    assert len(micros) == 500 and all(m >= 1 for m in micros)
    assert micros == [max(1, round(g * 1e6)) for g in want]
    assert "500 arrivals (gamma, seed 2)" in capsys.readouterr().out


def test_the_cli_names_a_bad_process_in_one_line(tmp_path, capsys):
    assert cli_main(["perf", "arrivals", "gamma:1", "--out", str(tmp_path / "x")]) == 1
    err = capsys.readouterr().err
    assert err.strip() == ("error: arrivals: 'gamma:1' is not 'poisson:RATE' or 'gamma:RATE:CV' "
                           "(e.g. poisson:20, gamma:20:3)")
    assert not (tmp_path / "x").exists()
