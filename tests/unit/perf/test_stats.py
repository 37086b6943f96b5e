"""tritonlm/perf/stats.py: percentiles as numpy computes them."""

from __future__ import annotations

import pytest

from tritonlm.perf.stats import percentile


def test_percentile_matches_numpy():
    import numpy as np

    values = [3.0, 1.0, 4.0, 1.5, 9.0, 2.6, 5.0]
    for q in (0, 10, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_t95_is_students_t_and_tends_to_the_normal():
    from tritonlm.perf.stats import t95

    # scipy.stats.t.ppf(0.975, dof)
    for dof, want in ((1, 12.706), (2, 4.303), (4, 2.776), (10, 2.228), (20, 2.086), (30, 2.042), (120, 1.980)):
        assert t95(dof) == pytest.approx(want, abs=0.01)
    with pytest.raises(ValueError, match="at least 1"):
        t95(0)


def test_mean_ci95_of_three_repetitions():
    import statistics

    from tritonlm.perf.stats import mean_ci95

    values = [5.0, 6.0, 7.5]
    mean, half = mean_ci95(values)
    assert mean == pytest.approx(statistics.fmean(values))
    assert half == pytest.approx(4.303 * statistics.stdev(values) / 3 ** 0.5, rel=1e-3)
    assert mean_ci95([4.0])[0] == 4.0 and mean_ci95([4.0])[1] != mean_ci95([4.0])[1]  # NaN half-width
    assert mean_ci95([float("nan"), 2.0, 2.0]) == (2.0, 0.0)
