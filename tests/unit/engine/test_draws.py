"""tritonlm/engine/draws.py: counter-based uniforms (range, no reuse across seeds, counters
and streams, uniformity) and the inverse-CDF draw (exact proportions on a grid of
uniforms, never a token of weight 0)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.stats import chi_square_p_value
from tritonlm.engine.draws import ACCEPT, DRAFT, RESIDUAL, SAMPLE, inverse_cdf, splitmix64, uniform

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")),
]
STREAMS = (SAMPLE, ACCEPT, RESIDUAL, DRAFT)


def test_splitmix64_is_the_published_generator():
    # the first outputs of splitmix64 seeded with 0 (Vigna's reference splitmix64.c)
    assert splitmix64(0) == 0xE220A8397B1DCDAF
    assert splitmix64(0x9E3779B97F4A7C15) == 0x6E789E6AA1B965F4


def test_uniforms_lie_in_the_unit_interval_and_depend_only_on_their_inputs():
    values = [uniform(seed, counter, stream) for seed in (0, 1, -1, 2**63, 2**64 + 5) for counter in range(200)
              for stream in STREAMS]
    assert all(0.0 <= u <= 1.0 - 2.0**-32 for u in values)
    assert uniform(7, 3, SAMPLE) == uniform(7, 3, SAMPLE)  # no hidden state
    assert len(set(STREAMS)) == len(STREAMS)


def test_seeds_counters_and_streams_each_give_other_uniforms():
    for seed in range(50):
        for counter in range(50):
            assert len({uniform(seed, counter, s) for s in STREAMS}) == len(STREAMS)
    for seed in range(20):
        assert len({uniform(seed, c, SAMPLE) for c in range(2000)}) == 2000
    for counter in range(20):
        assert len({uniform(s, counter, SAMPLE) for s in range(2000)}) == 2000
    # swapped inputs are different inputs
    assert uniform(3, 5, SAMPLE) != uniform(5, 3, SAMPLE)


@pytest.mark.parametrize("vary", ["counter", "seed", "stream-pairs"])
def test_uniforms_are_uniform_and_neighbours_uncorrelated(vary):
    n = 40_000
    if vary == "counter":  # one row's draws over its answer
        u = torch.tensor([uniform(12345, c, SAMPLE) for c in range(n)], dtype=torch.float64)
        v = torch.tensor([uniform(12345, c + 1, SAMPLE) for c in range(n)], dtype=torch.float64)
    elif vary == "seed":  # consecutive seeds (OpenAI's n choices take seed + i)
        u = torch.tensor([uniform(s, 0, SAMPLE) for s in range(n)], dtype=torch.float64)
        v = torch.tensor([uniform(s + 1, 0, SAMPLE) for s in range(n)], dtype=torch.float64)
    else:  # the acceptance test and the residual draw at one position
        u = torch.tensor([uniform(s, 3, ACCEPT) for s in range(n)], dtype=torch.float64)
        v = torch.tensor([uniform(s, 3, RESIDUAL) for s in range(n)], dtype=torch.float64)
    buckets = 32
    counts = torch.bincount((u * buckets).long(), minlength=buckets).double()
    assert chi_square_p_value(counts, torch.full((buckets,), 1.0 / buckets, dtype=torch.float64)) > 1e-4
    # pairs fall evenly on an 8 x 8 grid too: no dependence between neighbouring uniforms
    cells = (u * 8).long() * 8 + (v * 8).long()
    grid = torch.bincount(cells, minlength=64).double()
    assert chi_square_p_value(grid, torch.full((64,), 1.0 / 64, dtype=torch.float64)) > 1e-4
    assert abs(float(torch.corrcoef(torch.stack([u, v]))[0, 1])) < 0.03


@pytest.mark.parametrize("device", DEVICES)
def test_inverse_cdf_gives_each_token_its_share_of_the_unit_interval(device):
    weights = torch.tensor([[0.0, 0.1, 0.0, 0.0, 0.25, 0.15, 0.0, 0.5, 0.0],
                            [3.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]], device=device)  # [2, V], any scale
    grid = 10_000
    u = (torch.arange(grid, dtype=torch.float64) + 0.5) / grid  # [grid]: evenly spread uniforms
    for row in range(2):
        tokens = inverse_cdf(weights[row].expand(grid, -1), u)  # [grid]
        counts = torch.bincount(tokens.cpu(), minlength=weights.shape[1]).double()
        share = (weights[row] / weights[row].sum()).double().cpu()
        assert torch.all((counts - share * grid).abs() <= 1), (row, counts)


@pytest.mark.parametrize("device", DEVICES)
def test_inverse_cdf_never_draws_a_token_of_weight_zero(device):
    weights = torch.tensor([0.0, 0.0, 0.2, 0.0, 0.0, 0.3, 1e-30, 0.0, 0.5, 0.0, 0.0], device=device)  # [V]
    cum = weights.double().cumsum(0).cpu()
    # the extremes, every boundary of the cumulative sum and its neighbours in float64
    u = [0.0, 2.0**-32, 0.5, 1.0 - 2.0**-32]
    for c in (cum / cum[-1]).tolist():
        below = torch.nextafter(torch.tensor(c, dtype=torch.float64), torch.tensor(0.0, dtype=torch.float64))
        u += [float(below), c] if c < 1.0 else [float(below)]
    u += [uniform(s, 0, SAMPLE) for s in range(2000)]
    u_t = torch.tensor(u, dtype=torch.float64)
    tokens = inverse_cdf(weights.expand(len(u), -1), u_t)  # [len(u)]
    assert torch.all(weights[tokens] > 0)
    assert int(inverse_cdf(weights[None], torch.tensor([0.0], dtype=torch.float64))[0]) == 2  # the first positive
    assert int(inverse_cdf(weights[None], torch.tensor([1.0 - 2.0**-32], dtype=torch.float64))[0]) == 8  # the last


def test_inverse_cdf_stays_inside_the_row_when_the_total_is_not_finite():
    weights = torch.tensor([[float("nan")] * 5, [0.0] * 5, [1.0, float("inf"), 0.0, 0.0, 0.0]])  # [3, V]
    tokens = inverse_cdf(weights, torch.tensor([0.3, 0.9, 0.99], dtype=torch.float64))
    assert tokens.shape == (3,) and torch.all((tokens >= 0) & (tokens < 5))
