"""tritonlm/engine/slo/step_time.py: the online fit of
step_seconds ~ a + p*mixed + b_prefill*prefill_tokens + b_decode*decode_rows + c*context, on synthetic
steps whose true coefficients are known (seeded noise)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from tritonlm.engine.slo.step_time import DecayingMean, StepCost, StepTimeModel, _nonnegative_solve

# 12 ms + 0.25 ms per prompt token + 0.15 ms per decoding row + 0.3 us per cached position,
# and 10 ms more where a step has both prompt tokens and decoding rows (its second pass)
TRUE = StepCost(0.012, 0.00025, 0.00015, 3e-7, 0.010)
SHAPES = [(0, 1, 100), (64, 0, 64), (0, 48, 48 * 1000), (512, 0, 2000), (200, 16, 16 * 800)]


def steps(rng: random.Random, cost: StepCost, n: int, noise: float = 0.02):
    """n steps of mixed shapes: decode batches, prefill chunks, both; `noise` relative."""
    for _ in range(n):
        rows = rng.randint(0, 48)
        prefill = rng.choice([0, 0, 16, 64, 200, 400]) if rows else rng.choice([16, 64, 200, 400])
        context = rows * rng.randint(50, 1500) + prefill
        yield prefill, rows, context, cost.predict(prefill, rows, context) * (1 + rng.gauss(0, noise))


def test_recovers_known_coefficients():
    rng = random.Random(0)
    model = StepTimeModel()
    assert not model.ready
    for step in steps(rng, TRUE, 2000):
        model.observe(*step)
    assert model.ready
    for got, want in zip(model.cost, TRUE):
        assert got == pytest.approx(want, rel=0.1)
    for shape in SHAPES:
        assert model.predict(*shape) == pytest.approx(TRUE.predict(*shape), rel=0.03)


@pytest.mark.parametrize("noise", [0.02, 0.1, 0.3])
def test_the_relative_error_is_the_hosts_noise(noise):
    """The controller's margin for first tokens follows how far steps land from the fit: on
    steps with a known relative noise, the model's relative error is that noise."""
    model = StepTimeModel()
    assert model.relative_error > 0.1  # before any step: not taken for exact
    for step in steps(random.Random(11), TRUE, 3000, noise=noise):
        model.observe(*step)
    assert model.relative_error == pytest.approx(noise, rel=0.35)


def test_a_decaying_mean_counts_its_guess_as_so_many_samples():
    mean = DecayingMean(1.0, alpha=0.1, guess_samples=2)
    assert mean.value == pytest.approx(1.0)  # before any sample: the guess
    mean.add(0.0)  # one sample against a guess worth two
    assert mean.value == pytest.approx(2 / 3, rel=0.06)
    for _ in range(30):
        mean.add(0.0)
    assert mean.value < 0.01
    # a guess worth 1 / alpha samples is a plain EWMA started at the guess
    plain, ewma = DecayingMean(1.0, alpha=0.1, guess_samples=10), 1.0
    for x in (0.0, 0.5, 2.0, 0.0):
        plain.add(x)
        ewma += 0.1 * (x - ewma)
        assert plain.value == pytest.approx(ewma)


def test_the_assumed_error_gives_way_to_a_few_dozen_measured_steps():
    """Before any step the error is assumed (a fit just ready is not taken for an exact
    one); measured steps replace the guess as they add up, so after the few dozen steps of
    the warm-up at load (slo_warmup.py) on a quiet host, admission's margin is that host's."""
    model = StepTimeModel()
    assert model.prompt_step_error > 0.1
    for step in steps(random.Random(3), TRUE, model.min_steps + 50, noise=0.03):
        model.observe(*step)
    assert model.relative_error < 0.07 and model.prompt_step_error < 0.07


def test_prompt_tokens_and_decoding_rows_are_told_apart():
    """Where a prompt token costs twice a decoding row, a single per-token cost would
    mispredict both kinds of step; the fit gets each within a few percent."""
    rng = random.Random(5)
    model = StepTimeModel()
    cost = StepCost(0.015, 0.0013, 0.0007, 0.0)
    for step in steps(rng, cost, 600):
        model.observe(*step)
    assert model.predict(0, 32, 32 * 500) == pytest.approx(cost.predict(0, 32, 0), rel=0.05)
    assert model.predict(256, 0, 256) == pytest.approx(cost.predict(256, 0, 0), rel=0.05)


def test_follows_a_change_of_host():
    rng = random.Random(1)
    model = StepTimeModel()
    for step in steps(rng, TRUE, 1000):
        model.observe(*step)
    slower = StepCost(0.020, 0.0005, 0.0003, 6e-7)  # a neighbour took half the cores
    for step in steps(rng, slower, 400):
        model.observe(*step)
    for shape in SHAPES:
        assert model.predict(*shape) == pytest.approx(slower.predict(*shape), rel=0.05)


def test_a_steady_batch_keeps_the_fit_where_it_was_learned():
    """Thousands of identical steps: nothing new in two of three directions; the fit must
    still predict those steps and stay near the long-run fit elsewhere (no wind-up)."""
    rng = random.Random(2)
    model = StepTimeModel()
    for step in steps(rng, TRUE, 1000):
        model.observe(*step)
    for _ in range(3000):
        model.observe(0, 32, 32 * 400, TRUE.predict(0, 32, 32 * 400) * (1 + rng.gauss(0, 0.02)))
    assert model.predict(0, 32, 32 * 400) == pytest.approx(TRUE.predict(0, 32, 32 * 400), rel=0.03)
    assert model.predict(400, 0, 2000) == pytest.approx(TRUE.predict(400, 0, 2000), rel=0.2)


def test_forget_out_of_range_is_refused():
    with pytest.raises(ValueError, match=r"forget: must be in \(0, 1\]"):
        StepTimeModel(forget=0.0)


@pytest.mark.parametrize("seed", range(6))
def test_the_fit_is_the_best_one_without_a_negative_cost(seed):
    """_nonnegative_solve meets the optimality (KKT) conditions of least squares with every
    coefficient >= 0: a free coefficient has a zero gradient, one held at 0 a gradient that
    would only push it negative. Data drawn with a negative coefficient forces one to 0."""
    rng = np.random.default_rng(seed)
    x = np.column_stack([np.ones(40), rng.uniform(0, 3, 40), rng.uniform(0, 3, 40), rng.uniform(0, 3, 40)])
    truth = rng.normal(0, 1, 4)
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
    cost nearly interchangeable: the fit keeps every cost >= 0 and still predicts the steps."""
    model = StepTimeModel()
    rng = random.Random(3)
    truth = StepCost(0.010, 0.0002, 0.0002, 2e-7)
    for _ in range(200):
        prefill, rows = rng.choice([(0, 1), (16, 0)])
        context = rng.randint(100, 300)
        model.observe(prefill, rows, context, truth.predict(prefill, rows, context) + rng.gauss(0, 0.0003))
    assert min(model.cost) >= 0
    for shape in ((0, 1, 200), (16, 0, 200), (64, 0, 300)):
        assert model.predict(*shape) == pytest.approx(truth.predict(*shape), rel=0.15)


def test_a_row_count_that_never_varies_leaves_the_row_cost_tied_to_the_token_cost():
    """Every step runs the same two decoding rows: the steps cannot tell a decoding row's
    cost from the step's fixed cost at all. The fit takes the prompt-token cost for the row
    (the tie), so the fixed cost is the rest, and a step of many rows is predicted from it."""
    rng = random.Random(9)
    model = StepTimeModel()
    truth = StepCost(0.020, 0.0017, 0.0017, 0.0)
    for _ in range(400):
        prefill = rng.choice([0, 16, 64, 128])
        model.observe(prefill, 2, 0, truth.predict(prefill, 2, 0) * (1 + rng.gauss(0, 0.02)))
    cost = model.cost
    assert cost.decode_row_s == pytest.approx(cost.prefill_token_s, rel=0.1)
    assert cost.step_s == pytest.approx(truth.step_s, rel=0.1)
    assert model.predict(0, 32, 0) == pytest.approx(truth.predict(0, 32, 0), rel=0.1)


def test_rows_of_one_context_do_not_put_the_row_cost_on_the_positions():
    """Short prompts at a busy server, then long prompts at a low rate: one or two decoding
    rows a step, each reading about the same long context, now and then a long prompt's
    chunk. Such steps cannot tell a row's own cost from its positions' (they move together);
    the fit must not explain the row by a per-position cost that a step of many long rows
    then multiplies (the running cap is planned from it). Noisy steps (20%), ten draws."""
    truth = StepCost(0.017, 0.0014, 0.0012, 3e-7)
    for seed in range(10):
        rng, model = random.Random(seed), StepTimeModel()
        for busy in (True, False):
            for _ in range(800):
                if busy:
                    prefill, rows = (64, rng.randint(0, 8)) if rng.random() < 0.1 else (0, rng.randint(1, 10))
                    context = rows * rng.randint(70, 100) + prefill
                else:
                    prefill, rows = (256, rng.choice([0, 1])) if rng.random() < 0.05 else (0, rng.choice([1, 1, 2]))
                    context = rows * rng.randint(260, 300) + prefill
                model.observe(prefill, rows, context, truth.predict(prefill, rows, context) * (1 + rng.gauss(0, 0.2)))
        assert model.predict(0, 10, 2800) == pytest.approx(truth.predict(0, 10, 2800), rel=0.25), seed


def test_a_step_with_prompt_tokens_and_decoding_rows_pays_a_second_pass():
    """The executor runs a step's prompt chunks in a pass of their own beside its decoding
    rows, so such a step costs a fixed pass more (on a CPU about as much as the step's fixed
    cost: each reads every weight once). The fit tells that pass from the fixed cost and the
    per-token costs, and predicts decode-only, prompt-only and mixed steps alike; one fixed
    cost per step would predict the mixed steps short and the decode-only ones long."""
    truth = StepCost(0.013, 0.0007, 0.0007, 1e-7, 0.015)
    model = StepTimeModel()
    for step in steps(random.Random(21), truth, 800, noise=0.05):
        model.observe(*step)
    assert model.cost.pass_s == pytest.approx(truth.pass_s, rel=0.15)
    for shape in ((0, 8, 800), (64, 0, 64), (16, 8, 816), (128, 8, 928)):
        assert model.predict(*shape) == pytest.approx(truth.predict(*shape), rel=0.05)
    # what a chunk adds beside decoding rows: its pass, its tokens and their positions
    assert model.predict(16, 8, 816) - model.predict(0, 8, 800) == pytest.approx(
        truth.predict(16, 8, 816) - truth.predict(0, 8, 800), rel=0.1)


def test_the_error_of_steps_with_prompt_tokens_is_their_own():
    """A first token ends a step that ran prompt tokens, so admission's margin follows how
    far those steps land from the fit, not the decode-only steps' (the many, and on a CPU
    the steadier): steps with prompt tokens 20% noisy, decode-only ones (four in five) 2%."""
    rng, model = random.Random(22), StepTimeModel()
    for _ in range(3000):
        rows = rng.randint(1, 48)
        prefill = rng.choice([16, 64, 200]) if rng.random() < 0.2 else 0
        context = rows * rng.randint(50, 1500) + prefill
        noise = 0.2 if prefill else 0.02
        model.observe(prefill, rows, context, TRUE.predict(prefill, rows, context) * (1 + rng.gauss(0, noise)))
    assert model.prompt_step_error == pytest.approx(0.2, rel=0.35)
    assert model.relative_error < 0.8 * model.prompt_step_error


def test_chunks_the_decode_pass_takes_pay_no_second_pass():
    """Where the executor runs chunks of up to `joined` prompt tokens in the decoding rows'
    pass (ModelExecutor.chunk_rows), only wider chunks beside decoding rows pay a pass of
    their own: the fit learns that pass from those steps alone, predicts both kinds, and
    sizes the prompt tokens that fit in a step's room on either side of the limit."""
    truth = StepCost(0.013, 0.0007, 0.0007, 1e-7, 0.015, joined=64)
    model = StepTimeModel()
    model.joined = 64
    for step in steps(random.Random(22), truth, 800, noise=0.05):
        model.observe(*step)
    cost = model.cost
    assert cost.joined == 64 and cost.pass_s == pytest.approx(truth.pass_s, rel=0.15)
    for shape in ((16, 8, 816), (64, 8, 864), (200, 8, 1000), (0, 8, 800), (200, 0, 200)):
        assert model.predict(*shape) == pytest.approx(truth.predict(*shape), rel=0.05)
    assert truth.chunk_pass_s(8, 64) == 0.0 and truth.chunk_pass_s(8, 65) == truth.pass_s
    assert truth.chunk_pass_s(0, 400) == 0.0  # no decoding rows: the chunk's pass is the step's
    b = truth.prefill_token_s
    assert truth.tokens_within(40 * b, 8) == pytest.approx(40)  # within the decode pass
    assert truth.tokens_within(80 * b, 8) == 64  # past it the pass would leave fewer: the decode pass's
    assert truth.tokens_within(100 * b + truth.pass_s, 8) == pytest.approx(100)  # past it, with the pass
    assert truth.tokens_within(100 * b, 0) == pytest.approx(100)  # nothing decoding: no second pass
    assert truth.tokens_within(0.0, 8) == 0.0
    assert StepCost(0.01, 0.0, 0.001, 0.0).tokens_within(0.01, 4) == float("inf")


def test_the_passes_a_step_ran_in_decide_its_second_pass():
    """A small chunk that ran apart all the same (beside a speculative verify row, or a
    prompt whose log-probabilities are kept) pays the pass: told so, the fit learns it
    from such steps whatever `joined` says."""
    truth = StepCost(0.013, 0.0007, 0.0007, 1e-7, 0.015)  # every mixed step pays the pass
    model = StepTimeModel()
    model.joined = 500  # every chunk below would join the decode pass by the rule
    for prefill, rows, context, seconds in steps(random.Random(23), truth, 800, noise=0.05):
        model.observe(prefill, rows, context, seconds, second_pass=prefill > 0 and rows > 0)
    assert model.cost.pass_s == pytest.approx(truth.pass_s, rel=0.15)
