"""What a benchmark ran on: hosts of one machine kind differ in CPU features (bf16,
AMX, VNNI), so every benchmark prints this and figures are compared within one run."""

from __future__ import annotations

import os
import platform

FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8")


def describe_cpu() -> str:
    """'Intel(R) Xeon(R) ... | 2 cores | avx2 avx512f avx512_vnni' (the flags that matter here)."""
    model, flags = platform.processor() or "unknown CPU", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and model in ("", "unknown CPU", platform.processor()):
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    have = " ".join(f for f in FLAGS if f in flags) or "none of " + "/".join(FLAGS)
    return f"{model} | {os.cpu_count()} cores | {have}"
