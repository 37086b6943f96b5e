"""What a benchmark ran on, printed with every figure it reports.

Hosts of one machine kind differ in CPU features (bf16, AMX, VNNI) and in how many
cores a process may use, so a figure means little without them; compare figures
within one run, on one line of this description.
"""

from __future__ import annotations

import os
import platform

FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8")


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask: a container or taskset
    may allow fewer than the machine has)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def describe_cpu() -> str:
    """'Intel(R) Xeon(R) ... | 2 cores | avx2 avx512f avx512_vnni': the CPU's name, the
    cores this process may use, and which of FLAGS (the ones that decide CPU inference
    speed here) it has."""
    model, flags = "", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and not model:
                    model = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
                    break
    except OSError:
        pass
    model = model or platform.processor() or platform.machine() or "unknown CPU"
    have = " ".join(f for f in FLAGS if f in flags) or "none of " + "/".join(FLAGS)
    return f"{model} | {usable_cores()} cores | {have}"


def describe_gpu(device: str = "cuda:0") -> str:
    """'NVIDIA H200 | 139.8 GiB | compute capability 9.0' for a CUDA device; '' when torch
    sees none."""
    import torch

    if not device.startswith("cuda") or not torch.cuda.is_available():
        return ""
    props = torch.cuda.get_device_properties(torch.device(device))
    return f"{props.name} | {props.total_memory / 2**30:.1f} GiB | compute capability {props.major}.{props.minor}"
