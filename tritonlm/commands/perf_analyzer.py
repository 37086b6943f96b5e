"""Locate and run the real perf_analyzer 2.51.0 with the libraries it needs."""

from __future__ import annotations

import argparse
import subprocess
from dataclasses import dataclass

from tritonlm.paths import perf_analyzer_binary, perf_analyzer_env


def add_parser(sub) -> None:
    p = sub.add_parser("perf-analyzer", help="run perf_analyzer (arguments passed through)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="perf_analyzer arguments, e.g. -m echo --concurrency-range 1:4")
    p.set_defaults(func=lambda a: subprocess.call([str(perf_analyzer_binary()), *a.args], env=perf_analyzer_env()))


@dataclass
class PerfResult:
    returncode: int
    stdout: str
    stderr: str


def run_perf_analyzer(args: list[str], timeout_s: float = 600.0) -> PerfResult:
    proc = subprocess.run(
        [str(perf_analyzer_binary()), *args],
        env=perf_analyzer_env(),
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    return PerfResult(proc.returncode, proc.stdout, proc.stderr)


def read_perf_csv(path) -> list[dict[str, float]]:
    """Rows of perf_analyzer's `-f FILE` CSV (one per concurrency or rate), numbers as floats.
    Latency columns are in microseconds, as perf_analyzer writes them."""
    import csv

    rows = []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            parsed = {}
            for key, value in row.items():
                if key is None:
                    continue
                try:
                    parsed[key.strip()] = float(value)
                except (TypeError, ValueError):
                    pass
            if parsed:
                rows.append(parsed)
    return rows
