"""`tritonlm perf ...` (harnesses driving the real perf_analyzer against the real server) and `tritonlm plan`.
Each harness module under tritonlm/perf adds its own HARNESS subcommand; this module hangs them under `perf`."""

from __future__ import annotations

import importlib

HARNESSES = [
    "tritonlm.perf.batching",
    "tritonlm.perf.sla",
    "tritonlm.perf.tune",
    "tritonlm.perf.llm",
    "tritonlm.perf.diagnose",
    "tritonlm.perf.arrivals",
    "tritonlm.perf.goodput",
]


def add_parser(subparsers) -> None:
    perf = subparsers.add_parser(
        "perf",
        help="performance harnesses (perf_analyzer against tritonserver)",
        description="Measure a served model with the real perf_analyzer: tables on stdout, CSV and PNG under results/.",
    )
    sub = perf.add_subparsers(dest="perf_command", metavar="HARNESS")
    for name in HARNESSES:
        importlib.import_module(name).add_parser(sub)
    perf.set_defaults(func=lambda a: perf.print_help() or 2)

    from tritonlm.perf import plan

    plan.add_parser(subparsers)
