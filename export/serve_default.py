#!/usr/bin/env python3
"""Export a model if it is not in the repository yet, then serve the repository:
the same as `tritonlm serve-default ...` (what `make serve` runs).

    python export/serve_default.py --model tiny-gpt2 --repo /tmp/repo --http-port 8000
"""

import sys

from tritonlm.cli import main

if __name__ == "__main__":
    sys.exit(main(["serve-default", *sys.argv[1:]]))
