"""What a running server holds, read from outside: its processes' memory, and the metrics
it exposes on its metrics port (Prometheus text), for harnesses, benchmarks and tests."""

from __future__ import annotations

import re
import time
import urllib.request
from pathlib import Path

from tritonlm.supervise.procs import descendants

GAUGES = ("tritonlm_requests_waiting", "tritonlm_requests_running", "tritonlm_kv_cache_used_bytes")

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]

_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


# ---- processes -----------------------------------------------------------------------------------


def process_tree(pid: int) -> list[int]:
    """pid and all its descendants (tritonserver and its Python backend stubs)."""
    return [pid] + descendants(pid)


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


# ---- metrics -------------------------------------------------------------------------------------


def parse_prometheus(text: str) -> Samples:
    """{(metric name, sorted label pairs): value} from Prometheus text exposition."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line.strip())
        if not m:
            continue
        name, labels, value = m.groups()
        try:
            v = float(value)
        except ValueError:
            continue
        pairs = tuple(sorted(_LABEL.findall(labels or "")))
        out[(name, pairs)] = v
    return out


def metric_sum(samples: Samples, name: str, model: str | None = None) -> float | None:
    """A metric summed over its series (only the model's series when given: every instance
    and version); None when the server does not expose it."""
    found = [v for (n, labels), v in samples.items() if n == name and (model is None or ("model", model) in labels)]
    return sum(found) if found else None


def read_metrics(metrics_url: str, timeout_s: float = 10.0) -> Samples:
    with urllib.request.urlopen(metrics_url, timeout=timeout_s) as r:
        return parse_prometheus(r.read().decode("utf-8", "replace"))


def engine_gauges(metrics_url: str, model: str) -> dict[str, float]:
    """requests_waiting / requests_running / kv_cache_used_bytes of one model (all instances
    summed); a gauge the server does not expose is left out."""
    samples = read_metrics(metrics_url)
    out: dict[str, float] = {}
    for name in GAUGES:
        value = metric_sum(samples, name, model)
        if value is not None:
            out[name.removeprefix("tritonlm_")] = value
    return out


def is_idle(gauges: dict[str, float]) -> bool:
    """Nothing waiting, nothing running, no KV cache held (and the gauges were read)."""
    return bool(gauges) and all(v == 0 for v in gauges.values())


def wait_idle(metrics_url: str, model: str, timeout_s: float = 60.0, poll_s: float = 0.2) -> tuple[dict[str, float], float]:
    """Poll the model's engine gauges until it is idle or timeout_s passes; (the last gauges
    read, seconds waited). The caller decides what not going idle means: is_idle(gauges)."""
    t0 = time.monotonic()
    while True:
        gauges = engine_gauges(metrics_url, model)
        waited = time.monotonic() - t0
        if is_idle(gauges) or waited > timeout_s:
            return gauges, waited
        time.sleep(poll_s)
