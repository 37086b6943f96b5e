"""Replica planner: how many replicas a request rate needs, and the HPA target that keeps it.

Input: the target request rate (req/s), the p99 latency budget, and one replica's measured
capacity: the highest req/s at which its p99 met that budget, as `tritonlm perf sla`
reports it (a number, or the sla.csv it writes).

    replicas = ceil(rate / (capacity x utilization))

The utilization target (default 0.8) is headroom: a replica planned at 100% of its
measured capacity sits at the edge of its latency budget, where any burst or slow
request breaks it; 80% leaves room for bursts and for one replica draining during a
rolling update.

The HPA in deploy/k8s scales on `tritonlm_requests_waiting` (requests queued for KV
cache room, averaged per pod). A request queued behind W others is admitted after about
W / capacity seconds (at saturation a replica frees one place per finished request), so
the queue a replica may hold is what the budget's headroom allows:

    waiting target = max(1, floor(capacity x p99 budget (s) x (1 - utilization)))

i.e. the share of the latency budget the utilization headroom leaves for queueing.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass
from pathlib import Path

DEFAULT_UTILIZATION = 0.8
HPA_METRIC = "tritonlm_requests_waiting"  # deploy/k8s/base/hpa.yaml
_EPS = 1e-9  # 96 / (30 x 0.8) must be 4, not 4.0000000001 -> 5


class ReplicaPlanError(ValueError):
    pass


@dataclass(frozen=True)
class ReplicaPlan:
    rate: float
    p99_ms: float
    capacity: float
    utilization: float
    replicas: int
    per_replica_rate: float  # req/s each replica serves at the planned count
    hpa_waiting_target: int  # average tritonlm_requests_waiting per pod

    @property
    def per_replica_utilization(self) -> float:
        return self.per_replica_rate / self.capacity


def plan_replicas(rate: float, p99_ms: float, capacity: float, utilization: float = DEFAULT_UTILIZATION) -> ReplicaPlan:
    """Raises ReplicaPlanError naming the flag of a bad value."""
    if not (rate > 0 and math.isfinite(rate)):
        raise ReplicaPlanError(f"--rate must be a positive request rate (req/s), not {rate:g}")
    if not (p99_ms > 0 and math.isfinite(p99_ms)):
        raise ReplicaPlanError(f"--p99-ms must be a positive latency budget in milliseconds, not {p99_ms:g}")
    if not (capacity > 0 and math.isfinite(capacity)):
        raise ReplicaPlanError(
            f"--capacity must be one replica's positive req/s within the budget (from `tritonlm perf sla`), not {capacity:g}"
        )
    if not 0 < utilization <= 1:
        raise ReplicaPlanError(f"--utilization must be in (0, 1], not {utilization:g}")
    replicas = max(1, math.ceil(rate / (capacity * utilization) - _EPS))
    waiting = max(1, math.floor(capacity * (p99_ms / 1000.0) * (1 - utilization) + _EPS))
    return ReplicaPlan(rate, p99_ms, capacity, utilization, replicas, rate / replicas, waiting)


def capacity_from(value: str, p99_ms: float) -> float:
    """--capacity: a number (req/s), or the sla.csv (or a JSON list of the same rows) that
    `tritonlm perf sla` wrote: the best throughput_per_s among rows whose p99_ms is within
    p99_ms (the budget asked for here, which may differ from the sweep's)."""
    try:
        return float(value)
    except ValueError:
        pass
    path = Path(value)
    if not path.is_file():
        raise ReplicaPlanError(f"--capacity: {value!r} is neither a number (req/s) nor a file")
    try:
        if path.suffix.lower() == ".json":
            rows = json.loads(path.read_text())
            rows = rows.get("points", rows.get("rows", [])) if isinstance(rows, dict) else rows
        else:
            with open(path, newline="") as f:
                rows = list(csv.DictReader(f))
        points = [(float(r["throughput_per_s"]), float(r["p99_ms"])) for r in rows]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ReplicaPlanError(
            f"--capacity: {path} is not a `tritonlm perf sla` result (rows with throughput_per_s and p99_ms): {e}"
        ) from None
    within = [t for t, p in points if p <= p99_ms]
    if not within:
        raise ReplicaPlanError(
            f"--capacity: no point of {path} kept p99 within {p99_ms:g} ms: one replica cannot meet this budget "
            "at any load measured (more replicas do not lower a single request's latency)"
        )
    return max(within)


def describe(plan: ReplicaPlan) -> str:
    return "\n".join([
        f"target {plan.rate:g} req/s, p99 budget {plan.p99_ms:g} ms, one replica: {plan.capacity:g} req/s within it",
        f"replicas: {plan.replicas} = ceil({plan.rate:g} / ({plan.capacity:g} x {plan.utilization:g} utilization target)); "
        f"each serves {plan.per_replica_rate:.1f} req/s ({plan.per_replica_utilization:.0%} of its capacity)",
        f"HPA (deploy/k8s/base/hpa.yaml): metric {HPA_METRIC}, target averageValue \"{plan.hpa_waiting_target}\" "
        f"= floor({plan.capacity:g} req/s x {plan.p99_ms / 1000:g} s x (1 - {plan.utilization:g})): the queue a replica "
        "can admit within the budget's headroom; set minReplicas to "
        f"{plan.replicas} for this steady rate",
    ])
