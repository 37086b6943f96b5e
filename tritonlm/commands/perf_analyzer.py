"""`tritonlm perf-analyzer ARGS`: the real perf_analyzer 2.51.0, run with the libraries it needs
(tritonlm/paths.py finds both); tritonlm/perf/analyzer.py runs it for the harnesses."""

from __future__ import annotations

import argparse
import subprocess

from tritonlm.paths import perf_analyzer_binary, perf_analyzer_env


def add_parser(sub) -> None:
    p = sub.add_parser("perf-analyzer", help="run perf_analyzer (arguments passed through)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="perf_analyzer arguments, e.g. -m echo --concurrency-range 1:4")
    p.set_defaults(func=lambda a: subprocess.call([str(perf_analyzer_binary()), *a.args], env=perf_analyzer_env()))
