#!/usr/bin/env python3
"""Export a model into a Triton model repository: the same as `tritonlm export ...`.

    python export/export_model.py tiny-gpt2 --repo /tmp/repo --formats onnx,onnx-int8
"""

import os
import sys

try:
    import tritonlm  # noqa: F401
except ImportError:  # a checkout without `pip install -e .`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tritonlm.export.cli import main

if __name__ == "__main__":
    sys.exit(main(["export", *sys.argv[1:]]))
