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


def describe_cpu(cpuinfo: str = "/proc/cpuinfo") -> str:
    """'AMD EPYC (family 26 model 2) | 2 cores | avx2 avx512f avx512_vnni': the CPU's name, its
    x86 family and model (one name covers several generations: an AMD EPYC may be Zen 2, 3,
    4 or 5, each with its own vector units and caches), the cores this process may use, and
    which of FLAGS (the ones that decide CPU inference speed here) it has."""
    info: dict[str, str] = {}
    try:
        with open(cpuinfo) as f:
            for line in f:
                key, _, value = line.partition(":")
                info.setdefault(key.strip(), value.strip())
                if key.strip() == "flags":  # the last field of the first processor that matters here
                    break
    except OSError:
        pass
    model = info.get("model name") or platform.processor() or platform.machine() or "unknown CPU"
    if info.get("cpu family") and info.get("model"):
        model = f"{model} (family {info['cpu family']} model {info['model']})"
    flags = set(info.get("flags", "").split())
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
