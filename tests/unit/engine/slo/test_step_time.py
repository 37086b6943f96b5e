"""tritonlm/engine/slo/step_time.py: the online fit of step_seconds ~ a + b*tokens + c*context,
on synthetic steps whose true coefficients are known (seeded noise)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from tritonlm.engine.slo.step_time import StepTimeModel, _nonnegative_solve

TRUE = (0.012, 0.00015, 3e-7)  # 12 ms + 0.15 ms per token + 0.3 us per cached position


def steps(rng: random.Random, coef, n: int, noise: float = 0.02):
    """n steps of mixed shapes: decode batches, prefill chunks, both; `noise` relative."""
    a, b, c = coef
    for _ in range(n):
        rows = rng.randint(1, 48)
        tokens = rows + rng.choice([0, 0, 16, 64, 200, 400])
        context = rows * rng.randint(50, 1500)
        yield tokens, context, (a + b * tokens + c * context) * (1 + rng.gauss(0, noise))


def test_recovers_known_coefficients():
    rng = random.Random(0)
    model = StepTimeModel()
    assert not model.ready
    for tokens, context, seconds in steps(rng, TRUE, 2000):
        model.observe(tokens, context, seconds)
    assert model.ready
    for got, want in zip(model.coefficients, TRUE):
        assert got == pytest.approx(want, rel=0.1)
    for tokens, context in [(1, 100), (64, 64 * 1000), (512, 2000)]:
        assert model.predict(tokens, context) == pytest.approx(TRUE[0] + TRUE[1] * tokens + TRUE[2] * context, rel=0.03)


def test_follows_a_change_of_host():
    rng = random.Random(1)
    model = StepTimeModel()
    for tokens, context, seconds in steps(rng, TRUE, 1000):
        model.observe(tokens, context, seconds)
    slower = (0.020, 0.0003, 6e-7)  # a neighbour took half the cores
    for tokens, context, seconds in steps(rng, slower, 400):
        model.observe(tokens, context, seconds)
    for tokens, context in [(1, 100), (64, 64 * 1000), (512, 2000)]:
        want = slower[0] + slower[1] * tokens + slower[2] * context
        assert model.predict(tokens, context) == pytest.approx(want, rel=0.05)


def test_a_steady_batch_keeps_the_fit_where_it_was_learned():
    """Thousands of identical steps: nothing new in two of three directions; the fit must
    still predict those steps and stay near the long-run fit elsewhere (no wind-up)."""
    rng = random.Random(2)
    model = StepTimeModel()
    for tokens, context, seconds in steps(rng, TRUE, 1000):
        model.observe(tokens, context, seconds)
    a, b, c = TRUE
    for _ in range(3000):
        model.observe(32, 32 * 400, (a + b * 32 + c * 32 * 400) * (1 + rng.gauss(0, 0.02)))
    assert model.predict(32, 32 * 400) == pytest.approx(a + b * 32 + c * 32 * 400, rel=0.03)
    assert model.predict(400, 2000) == pytest.approx(a + b * 400 + c * 2000, rel=0.2)


def test_forget_out_of_range_is_refused():
    with pytest.raises(ValueError, match=r"forget: must be in \(0, 1\]"):
        StepTimeModel(forget=0.0)


@pytest.mark.parametrize("seed", range(6))
def test_the_fit_is_the_best_one_without_a_negative_cost(seed):
    """_nonnegative_solve meets the optimality (KKT) conditions of least squares with every
    coefficient >= 0: a free coefficient has a zero gradient, one held at 0 a gradient that
    would only push it negative. Data drawn with a negative coefficient forces one to 0."""
    rng = np.random.default_rng(seed)
    x = np.column_stack([np.ones(40), rng.uniform(0, 3, 40), rng.uniform(0, 3, 40)])
    truth = rng.normal(0, 1, 3)
    y = x @ truth + rng.normal(0, 0.05, 40)
    m, v = x.T @ x, x.T @ y
    beta = _nonnegative_solve(m, v)
    grad = m @ beta - v
    scale = np.abs(v).max()
    assert (beta >= 0).all()
    assert np.all(np.abs(grad[beta > 0]) <= 1e-9 * scale)
    assert np.all(grad[beta == 0] >= -1e-9 * scale)
    if (truth >= 0).all():
        assert np.allclose(beta, np.linalg.solve(m, v))


def test_single_row_steps_are_predicted_and_no_cost_is_negative():
    """Single-row steps whose context hardly varies leave the intercept and the per-position
    cost nearly interchangeable: the fit keeps both >= 0 and still predicts the steps."""
    model = StepTimeModel()
    rng = random.Random(3)
    for _ in range(200):
        tokens, context = rng.choice([1, 16]), rng.randint(100, 300)
        model.observe(tokens, context, 0.010 + 0.0002 * tokens + 2e-7 * context + rng.gauss(0, 0.0003))
    a, b, c = model.coefficients
    assert min(a, b, c) >= 0
    for tokens, context in ((1, 200), (16, 200), (64, 300)):
        truth = 0.010 + 0.0002 * tokens + 2e-7 * context
        assert model.predict(tokens, context) == pytest.approx(truth, rel=0.15)
