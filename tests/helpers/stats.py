"""Statistics the sampling tests share."""

from __future__ import annotations

import torch


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square goodness of fit of observed counts to probabilities: the p-value
    (outcomes of probability 0 are left out; a count there is the caller's to check)."""
    n = counts.sum()
    expected = probs * n
    keep = expected > 0
    stat = ((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), stat.double() / 2.0))
