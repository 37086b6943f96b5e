"""JSON Lines files the harnesses read (prompt datasets, traffic logs): one JSON object a
line, blank lines skipped, and every error naming the file and line it is about."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path


def read_jsonl(path: Path, error: type[Exception]) -> Iterator[tuple[int, dict]]:
    """(line number, object) for each non-blank line; `error("PATH:N: not JSON (...)")` for a
    line that is not a JSON object."""
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise error(f"{path}:{n}: not JSON ({e})") from None
            if not isinstance(obj, dict):
                raise error(f"{path}:{n}: not a JSON object")
            yield n, obj
