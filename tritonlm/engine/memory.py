"""How much memory the KV cache gets: free device memory, and the default budget
(the loader, the parallel workers and `tritonlm export` all need these)."""

from __future__ import annotations

import os

import torch

DEFAULT_FULL_SEQUENCES = 8  # without a budget: room for this many full-context sequences


def free_memory_bytes(device: str) -> int:
    """Bytes free on a CUDA device, or available host memory for "cpu"."""
    if device.startswith("cuda"):
        free, _total = torch.cuda.mem_get_info(torch.device(device))
        return int(free)
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))


def default_kv_budget(bytes_per_token: int, max_context: int, block_size: int = 16,
                      sequences: int = DEFAULT_FULL_SEQUENCES) -> int:
    """The KV budget in bytes when none is configured: room for `sequences` full-context
    sequences, each with one extra KV block (a sequence's last block may be partly used).
    The engine's default (no kv_cache_bytes / kv_cache_fraction) and what `tritonlm export`
    writes into config.pbtxt."""
    return sequences * (max_context + block_size) * bytes_per_token
