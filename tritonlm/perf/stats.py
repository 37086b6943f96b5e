"""The summary statistics benchmarks report, with one meaning everywhere in the repository.

A percentile here is always `percentile(values, q)` with q in [0, 100], interpolated
linearly between the two closest ranks: numpy.percentile's default, the convention most
readers assume when they see "p99". A harness that needs an observed value instead (a
length that covers q% of requests) says so by name: tritonlm.perf.plan.nearest_rank.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence


def percentile(values: Iterable[float], q: float) -> float:
    """The q-th percentile of values, q in [0, 100]: linear interpolation between the two
    closest ranks (numpy.percentile's default), so percentile(v, 50) is the median and
    percentile(v, 100) the maximum. NaN values are left out (a one-token request has no
    inter-token latency); NaN when none is left."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q is in [0, 100], got {q!r} (p99 is q=99)")
    s = sorted(v for v in values if v == v)
    if not s:
        return float("nan")
    k = (len(s) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def summarize(values: Sequence[float]) -> dict[str, float]:
    """avg, min, p50, p90, p99 and max of values, NaN skipped (all NaN when none is left)."""
    values = [v for v in values if not math.isnan(v)]
    if not values:
        return dict.fromkeys(("avg", "min", "p50", "p90", "p99", "max"), float("nan"))
    return {
        "avg": sum(values) / len(values),
        "min": min(values),
        "p50": percentile(values, 50),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99),
        "max": max(values),
    }
