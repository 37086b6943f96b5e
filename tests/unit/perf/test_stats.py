"""tritonlm/perf/stats.py: percentiles as numpy computes them."""

from __future__ import annotations

import pytest

from tritonlm.perf.stats import percentile


def test_percentile_matches_numpy():
    import numpy as np

    values = [3.0, 1.0, 4.0, 1.5, 9.0, 2.6, 5.0]
    for q in (0, 10, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
