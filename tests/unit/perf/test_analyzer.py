"""tritonlm/perf/analyzer.py: the load list a harness sweeps, and perf_analyzer's error text
kept without its usage dump."""

from __future__ import annotations

import pytest

from tritonlm.perf.analyzer import error_text, parse_loads


def test_parse_loads():
    assert parse_loads("1,2,4") == [1, 2, 4]
    assert parse_loads("1:64") == [1, 2, 4, 8, 16, 32, 64]
    assert parse_loads("10:30:10") == [10, 20, 30]
    for bad in ("", "0,1", "8:1", "a,b"):
        with pytest.raises(ValueError):
            parse_loads(bad)


def test_error_text_keeps_perf_analyzers_words_and_drops_usage():
    stdout = "Error: Failed to parse --input-data. Unsupported type provided\nUsage: perf_analyzer [options]\n -m <model>\n"
    assert error_text(stdout, "") == "Error: Failed to parse --input-data. Unsupported type provided"
    stderr = "error: failed to get model metadata: Request for unknown model: 'nope' is not found\n"
    assert "unknown model: 'nope'" in error_text("*** Measurement Settings ***\n", stderr)
    assert error_text("", "") == "no output"
