"""What a running server holds, read from outside: its processes' memory and the
engine's gauges on the metrics port (for soak and load benchmarks and tests)."""

from __future__ import annotations

import os
import urllib.request
from collections import defaultdict
from pathlib import Path

GAUGES = ("tritonlm_requests_waiting", "tritonlm_requests_running", "tritonlm_kv_cache_used_bytes")


def process_tree(pid: int) -> list[int]:
    """pid and all its descendants (tritonserver and its Python backend stubs)."""
    children: dict[int, list[int]] = defaultdict(list)
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            children[int(stat.rsplit(")", 1)[1].split()[1])].append(int(entry))
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo.extend(children.get(p, []))
    return tree


def process_tree_rss(pid: int) -> tuple[int, int]:
    """(resident bytes of pid and all its descendants, number of processes)."""
    total, count = 0, 0
    for p in process_tree(pid):
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
                    count += 1
        except OSError:
            pass
    return total, count


def engine_gauges(metrics_url: str, model: str) -> dict[str, float]:
    """requests_waiting / requests_running / kv_cache_used_bytes of one model (all instances summed)."""
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        for name in GAUGES:
            if line.startswith(name + "{") and f'model="{model}"' in line:
                key = name.replace("tritonlm_", "")
                out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out
