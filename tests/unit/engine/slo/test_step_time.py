"""tritonlm/engine/slo/step_time.py: the online fit of step_seconds ~ a + b*tokens + c*context,
on synthetic steps whose true coefficients are known (seeded noise)."""

from __future__ import annotations

import random

import pytest

from tritonlm.engine.slo.step_time import StepTimeModel

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
