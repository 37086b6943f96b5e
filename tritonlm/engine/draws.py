"""Counter-based random draws: a uniform in [0, 1) that is a pure function of
(seed, counter, stream), and a token drawn from a distribution with such a uniform.

A row's draws hold no hidden state: the uniform for a decision comes from the row's seed,
the absolute index of the token being decided (the counter) and what the draw is for
(the stream). So a seeded row decides the same token on any device, whatever else shares
its batch, and however often a speculative step rolls the sequence back; and two purposes
at one position (an acceptance test and a residual draw) never share a uniform.

The hash is splitmix64 (Steele, Lea and Flood 2014), applied once per input so that
nearby seeds, counters and streams give unrelated uniforms.
"""

from __future__ import annotations

import torch

MASK64 = (1 << 64) - 1
TWO_POW_32 = float(1 << 32)

# Stream ids: one per purpose, so no two purposes at the same position reuse a uniform.
SAMPLE = 0  # the next token of a row (plain sampling, or a speculative step's bonus token)
ACCEPT = 1  # speculative verification: the test that accepts or rejects a guess
RESIDUAL = 2  # speculative verification: the token drawn after a rejection
DRAFT = 3  # a draft model's guess


def splitmix64(x: int) -> int:
    """One splitmix64 step on a 64-bit integer: a bijection that scrambles every bit."""
    z = (x + 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def uniform(seed: int, counter: int, stream: int) -> float:
    """A uniform in [0, 1) (at most 1 - 2**-32) for one (seed, counter, stream)."""
    # hashing between the inputs (not one hash of their xor) keeps (s, c) and (c, s) apart
    z = splitmix64(seed & MASK64)
    z = splitmix64(z ^ (counter & MASK64))
    z = splitmix64(z ^ (stream & MASK64))
    # the top 32 bits: exact in float64, and the product u * total in inverse_cdf stays below total
    return (z >> 32) / TWO_POW_32


def inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """weights [n, V] (non-negative, any scale), u [n] float64 in [0, 1) -> [n] int64 tokens.

    Row i gets the first index whose cumulative weight exceeds u_i x the row's total, so a
    token of weight 0 is never drawn: it adds nothing to the running sum, and the sum
    before the first positive weight is 0, which no target exceeds. Rows with no positive
    or no finite total give an arbitrary index: the caller checks the total."""
    cum = weights.to(torch.float64).cumsum(-1)  # [n, V]
    total = cum[:, -1:].contiguous()  # [n, 1]
    target = u.to(device=cum.device, dtype=torch.float64).unsqueeze(-1) * total  # [n, 1]
    token = torch.searchsorted(cum, target, right=True)  # [n, 1]
    # target < total whenever u < 1 and the total is finite and positive; clamping to where
    # the running sum first reaches the total (a positive weight) also covers rounding
    last = torch.searchsorted(cum, total, right=False)  # [n, 1]
    # and a NaN total must still give an index inside the row (an out-of-range index
    # would be a device-side assert on a GPU, fatal to the whole process)
    return torch.minimum(token, last).clamp_(max=weights.shape[-1] - 1).squeeze(-1)
