"""Search max_queue_delay x max_batch_size x instance count within a p99 budget; --write the winning config.

Thin wrapper of `tritonlm perf tune` (all logic in tritonlm/perf/tune.py); e.g.
    python perf/tune.py --help
"""

import sys

from tritonlm.cli import main

if __name__ == "__main__":
    sys.exit(main(["perf", "tune", *sys.argv[1:]]))
