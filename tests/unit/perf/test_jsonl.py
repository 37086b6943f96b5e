"""tritonlm/perf/jsonl.py: JSON Lines read as json.loads reads each line, blank lines skipped,
and errors of the caller's type naming the file and the line."""

from __future__ import annotations

import json

import pytest

from tritonlm.perf.jsonl import read_jsonl


class DatasetError(ValueError):
    pass


def test_each_non_blank_line_is_an_object_with_its_line_number(tmp_path):
    rows = [{"prompt": "caf\u00e9 \u2603", "max_tokens": 16}, {"prompt": "x", "nested": {"a": [1, 2]}}, {}]
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps(rows[0]) + "\n\n   \n" + json.dumps(rows[1]) + "\n" + json.dumps(rows[2]))
    assert list(read_jsonl(path, DatasetError)) == [(1, rows[0]), (4, rows[1]), (5, rows[2])]


@pytest.mark.parametrize("line, why", [
    ('{"prompt": "a",}', "not JSON"),
    ('[1, 2]', "not a JSON object"),
    ('"just text"', "not a JSON object"),
])
def test_a_bad_line_is_named_by_file_and_number(tmp_path, line, why):
    path = tmp_path / "traffic.jsonl"
    path.write_text('{"ok": 1}\n' + line + "\n")
    rows = read_jsonl(path, DatasetError)
    assert next(rows) == (1, {"ok": 1})  # lines before the bad one are read
    with pytest.raises(DatasetError, match=rf"^{path}:2: {why}"):
        next(rows)
