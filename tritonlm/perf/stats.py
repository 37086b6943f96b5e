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


# Student's t, two-sided 95%, by degrees of freedom (1..10); the normal's 1.96 past 30
_T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228)


def t95(dof: int) -> float:
    """The two-sided 95% quantile of Student's t with `dof` degrees of freedom (a few
    repetitions of a benchmark need it; the normal's 1.96 understates their spread)."""
    if dof < 1:
        raise ValueError(f"degrees of freedom must be at least 1, got {dof}")
    if dof <= len(_T95):
        return _T95[dof - 1]
    # between the table and 30: linear in 1/dof toward 2.042 at 30, then toward 1.96
    if dof <= 30:
        return 2.042 + (2.228 - 2.042) * (1 / dof - 1 / 30) / (1 / 10 - 1 / 30)
    return 1.96 + (2.042 - 1.96) * 30 / dof


def mean_ci95(values: Sequence[float]) -> tuple[float, float]:
    """(mean, half-width of its 95% confidence interval) of repeated measurements, NaN
    skipped; the half-width is NaN with fewer than two values."""
    values = [v for v in values if not math.isnan(v)]
    if not values:
        return float("nan"), float("nan")
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, float("nan")
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
    return mean, t95(len(values) - 1) * sd / math.sqrt(len(values))
