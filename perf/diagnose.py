"""Sample Triton's metrics under load and classify the operating point, with advice.

Thin wrapper of `tritonlm perf diagnose` (all logic in tritonlm/perf/diagnose.py); e.g.
    python perf/diagnose.py --help
"""

import sys

from tritonlm.cli import main

if __name__ == "__main__":
    sys.exit(main(["perf", "diagnose", *sys.argv[1:]]))
