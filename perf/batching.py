"""Dynamic batching on vs off: throughput, p50/p95/p99 latency and the server's batch size per concurrency.

Thin wrapper of `tritonlm perf batching` (all logic in tritonlm/perf/batching.py); e.g.
    python perf/batching.py --help
"""

import sys

from tritonlm.cli import main

if __name__ == "__main__":
    sys.exit(main(["perf", "batching", *sys.argv[1:]]))
