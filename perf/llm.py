"""Streaming LLM metrics (TTFT, inter-token latency, tokens/s) of a decoupled model over gRPC.

Thin wrapper of `tritonlm perf llm` (all logic in tritonlm/perf/llm.py); e.g.
    python perf/llm.py --help
"""

import sys

from tritonlm.cli import main

if __name__ == "__main__":
    sys.exit(main(["perf", "llm", *sys.argv[1:]]))
