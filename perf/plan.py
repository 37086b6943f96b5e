"""KV cache capacity planner: bytes per token, sequences that fit, max_sequence_length from a traffic log;
and replicas: how many a request rate needs, and the HPA target (tritonlm/perf/replicas.py).

Thin wrapper of `tritonlm plan` (all logic in tritonlm/perf/plan.py); e.g.
    python perf/plan.py llama-7b --device a100-80gb --context 512,16384
    python perf/plan.py --rate 100 --p99-ms 500 --capacity results/sla/sla.csv
"""

import sys

from tritonlm.cli import main

if __name__ == "__main__":
    sys.exit(main(["plan", *sys.argv[1:]]))
