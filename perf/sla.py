"""Highest throughput whose p99 latency stays within a budget (concurrency or request-rate sweep).

Thin wrapper of `tritonlm perf sla` (all logic in tritonlm/perf/sla.py); e.g.
    python perf/sla.py --help
"""

import sys

from tritonlm.cli import main

if __name__ == "__main__":
    sys.exit(main(["perf", "sla", *sys.argv[1:]]))
