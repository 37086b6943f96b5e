#!/usr/bin/env python3
"""Export a model into a Triton model repository: the same as `tritonlm export ...`.

    python export/export_model.py tiny-gpt2 --repo /tmp/repo --formats onnx,onnx-int8
"""

import sys

from tritonlm.cli import main

if __name__ == "__main__":
    sys.exit(main(["export", *sys.argv[1:]]))
