"""perf/tritonlm_bench/steptime.py: a --rows argument read as row counts, and refused by name."""

from __future__ import annotations

import pytest

from tritonlm_bench.steptime import row_counts


def test_rows_are_read_and_bad_ones_refused_naming_the_argument():
    assert row_counts("1,8, 32,") == [1, 8, 32]
    for bad in ("", "0,8", "one", "1,-2"):
        with pytest.raises(ValueError, match=r"--rows .*: comma-separated row counts of at least 1"):
            row_counts(bad)
