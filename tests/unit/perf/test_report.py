"""tritonlm/perf/report.py: the text tables the harnesses print."""

from __future__ import annotations

from tritonlm.perf.report import table


def test_table_aligns_columns():
    text = table([{"a": 1, "b": "x"}, {"a": 22.5, "b": "yy"}], title="T")
    lines = text.splitlines()
    assert lines[0] == "T" and lines[1].split() == ["a", "b"]
    assert lines[3].startswith("    1") and lines[4].startswith("22.50")
