"""tritonlm/engine/sampler.py, batched: filter_batch against the per-row filter, the draws of
sample_rows against next_token_distribution (chi-square), a seeded row's tokens alone and
in any batch, tokens of probability 0 never drawn, and rows without a finite logit."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from tests.helpers.stats import chi_square_p_value
from tritonlm.engine.request import SamplingParams
from tritonlm.engine.sampler import (
    RowState,
    filter_batch,
    filter_top_k_top_p,
    next_token_distribution,
    process_logits,
    sample_row,
    sample_rows,
)

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")),
]
ALPHA = 1e-4  # chi-square tests fail below this p-value


def row(seed: int, history: list[int] | None = None, **fields) -> RowState:
    return RowState.make(SamplingParams(max_tokens=64, seed=seed, **fields), list(history or [0]), eos_id=None)


# ---- filter_batch = filter_top_k_top_p row by row ----------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_filter_batch_equals_the_per_row_filter(device):
    gen = torch.Generator().manual_seed(0)
    n, vocab = 240, 37
    logits = torch.randn(n, vocab, generator=gen) * 2  # [n, V]
    logits[::3] = torch.round(logits[::3] * 2) / 2  # many exact ties, at the top-k and top-p cut-offs too
    logits[1::4] = torch.randint(0, 3, (len(logits[1::4]), vocab), generator=gen).float()  # ties everywhere
    logits[torch.rand(n, vocab, generator=gen) < 0.2] = float("-inf")
    logits[5] = float("-inf")
    logits[5, 3] = 1.0  # one finite value
    settings = list(itertools.product((0, 1, 2, 5, 36, 37, 50), (1.0, 0.95, 0.5, 0.1, 1e-6), (0.0, 0.05, 0.5)))
    random.Random(1).shuffle(settings)
    top_k = torch.tensor([settings[i % len(settings)][0] for i in range(n)])  # [n]
    top_p = torch.tensor([settings[i % len(settings)][1] for i in range(n)], dtype=torch.float64)  # [n]
    min_p = torch.tensor([settings[i % len(settings)][2] for i in range(n)], dtype=torch.float64)  # [n]
    logits = logits.to(device)
    batched = filter_batch(logits, top_k.to(device), top_p.to(device), min_p.to(device))  # [n, V]
    for i in range(n):
        k, p, m = settings[i % len(settings)]
        alone = filter_top_k_top_p(logits[i], k, p, m)
        assert torch.equal(batched[i], alone), (i, k, p, m)
    off = (top_k == 0) & (top_p == 1.0) & (min_p == 0.0)
    assert off.any() and torch.equal(batched[off.to(device)], logits[off.to(device)])  # untouched


# ---- the draws follow the distribution ---------------------------------------------------


CONFIGS = [
    dict(temperature=0.7),
    dict(temperature=1.3, top_k=8),
    dict(temperature=1.0, top_p=0.8),
    dict(temperature=0.9, min_p=0.05, top_k=20, top_p=0.9),
    dict(temperature=1.5, min_p=0.1, repetition_penalty=1.3),  # processed on its own, then filtered
]


@pytest.mark.parametrize("device", DEVICES)
def test_draws_follow_next_token_distribution(device):
    """One sample_rows call of all configurations interleaved (so rows that filter and rows
    that do not share it), seeds 0..N-1: each configuration's histogram against the
    distribution next_token_distribution gives for it."""
    vocab, per_config = 50, 20_000
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(7)) * 2.5  # [V]
    history = [3, 3, 9, 0]
    rows = [row(seed, history, **CONFIGS[seed % len(CONFIGS)]) for seed in range(per_config * len(CONFIGS))]
    tokens = torch.tensor([t for t, _ in sample_rows(logits.to(device).expand(len(rows), -1), rows)])
    for c, fields in enumerate(CONFIGS):
        ref = next_token_distribution(logits, row(0, history, **fields)).double()  # [V]
        counts = torch.bincount(tokens[c :: len(CONFIGS)], minlength=vocab).double()
        assert counts[ref == 0].sum() == 0, f"a token of probability 0 was drawn: {fields}"
        assert (ref > 0).sum() > 3, fields  # a distribution worth testing
        assert chi_square_p_value(counts, ref) > ALPHA, fields


@pytest.mark.parametrize("device", DEVICES)
def test_a_token_of_probability_zero_is_never_drawn(device):
    vocab, n = 16, 4000
    logits = torch.zeros(vocab)
    logits[[0, 1, 6, 7, 8, 14, 15]] = float("-inf")  # banned at both ends and in between
    logits[9] = 4.0  # a dominant token: the others sit near the ends of the cumulative sum
    support = torch.isfinite(logits)
    fields = [dict(temperature=1.0), dict(temperature=3.0), dict(temperature=0.2), dict(temperature=1.0, top_k=3)]
    rows = [row(seed, **fields[seed % len(fields)]) for seed in range(n)]
    tokens = torch.tensor([t for t, _ in sample_rows(logits.to(device).expand(n, -1), rows)])
    assert bool(support[tokens].all())
    assert set(tokens.tolist()) == set(torch.nonzero(support).flatten().tolist())  # the rest all do come up
    # a row's bans (bad words) and top-k cut inside the batch too
    banned = [row(seed, bad_words=((4,), (10,)), temperature=2.0) for seed in range(500)]
    drawn = {t for t, _ in sample_rows(logits.to(device).expand(500, -1), banned)}
    assert drawn.isdisjoint({0, 1, 4, 6, 7, 8, 10, 14, 15})


# ---- seeded rows: the same tokens alone and in any batch -----------------------------------


def mixed_rows() -> list[RowState]:
    """Rows of every kind the batch handles: plain sampled, filtered, processed on their own,
    greedy with and without processing, log-probabilities asked for or not."""
    return [
        row(11, temperature=0.8),
        row(12, temperature=1.2, top_k=5, return_log_probs=True),
        row(13, temperature=1.0, top_p=0.7, min_p=0.02),
        row(14, [1, 2, 2], temperature=0.9, frequency_penalty=0.5, presence_penalty=0.3, logit_bias=((7, 2.0),)),
        row(15, [4, 4], temperature=1.4, repetition_penalty=1.2, return_log_probs=True),
        row(16),  # plain greedy
        row(17, [5], repetition_penalty=1.5, return_log_probs=True),  # greedy, processed
        row(18, temperature=0.5, min_tokens=3),  # min_tokens with no EOS or stop ids: nothing banned
        row(19, temperature=1.1, bad_words=((2,), (0, 3))),
    ]


@pytest.mark.parametrize("device", DEVICES)
def test_a_seeded_row_gets_the_same_tokens_alone_and_in_any_batch(device):
    vocab, steps = 30, 12
    gen = torch.Generator().manual_seed(2)
    rows = mixed_rows()
    n = len(rows)
    orders = [list(range(n))] + [random.Random(s).sample(range(n), n) for s in range(4)]
    alone = [[] for _ in rows]
    batched = {k: [[] for _ in rows] for k in range(len(orders))}
    for _ in range(steps):
        logits = (torch.randn(n, vocab, generator=gen) * 2).to(device)  # [n, V]: row i's logits
        for i, r in enumerate(rows):
            alone[i].append(sample_row(logits[i], r))
            assert sample_rows(logits[i : i + 1], [r]) == [alone[i][-1]]  # a batch of one
        for k, order in enumerate(orders):
            for i, got in zip(order, sample_rows(logits[order], [rows[i] for i in order])):
                batched[k][i].append(got)
        for i, r in enumerate(rows):  # the history grows: the next token is the next index
            r.token_ids.append(alone[i][-1][0])
    for k in batched:
        assert batched[k] == alone, orders[k]
    for i, r in enumerate(rows):
        if not r.params.greedy:
            assert len({t for t, _ in alone[i]}) > 2, i  # the draws move on with the index
        if not r.params.return_log_probs:
            assert all(lp == 0.0 for _, lp in alone[i])


@pytest.mark.parametrize("device", DEVICES)
def test_log_probs_are_those_of_the_processed_logits(device):
    logits = (torch.randn(4, 25, generator=torch.Generator().manual_seed(4)) * 2).to(device)  # [n, V]
    rows = [row(1, [3, 3], temperature=0.7, top_k=4, return_log_probs=True),
            row(2, [3, 5], repetition_penalty=1.4, return_log_probs=True),
            row(3, temperature=1.3, frequency_penalty=1.0, return_log_probs=True),
            row(4, temperature=0.9)]
    for (token, lp), r, lg in zip(sample_rows(logits, rows), rows, logits):
        expected = float(torch.log_softmax(process_logits(lg, r), dim=-1)[token]) if r.params.return_log_probs else 0.0
        assert lp == pytest.approx(expected, abs=1e-5)


def test_rows_get_a_seed_each_and_forks_keep_it():
    unseeded = [RowState.make(SamplingParams(max_tokens=4, temperature=1.0), [0], None) for _ in range(3)]
    assert len({r.seed for r in unseeded}) == 3  # unseeded requests differ from run to run
    assert RowState.make(SamplingParams(max_tokens=4, seed=9), [0], None).seed == 9
    fork = unseeded[0].fork()
    assert fork.seed == unseeded[0].seed and fork.uniform() == unseeded[0].uniform()
    fork.token_ids.append(5)
    assert fork.uniform() != unseeded[0].uniform()  # the next index, the next uniform


# ---- rows without a finite logit ------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_a_row_without_a_finite_logit_raises_like_sample_row(device):
    logits = torch.randn(3, 10).to(device)  # [n, V]
    logits[1] = float("nan")
    rows = [row(1, temperature=1.0), row(2, temperature=0.8), row(3)]
    with pytest.raises(ValueError, match="no finite value"):
        sample_rows(logits, rows)
    with pytest.raises(ValueError, match="no finite value"):
        sample_row(logits[1], rows[1])
    logits[1, 4] = float("inf")  # +inf is clipped to the largest float: it wins
    assert sample_rows(logits, rows)[1][0] == 4 == sample_row(logits[1], rows[1])[0]
