"""perf/tritonlm_bench/agreement.py on tiny-gpt2 (seeded weights): batched, left-padded reference
continuations are transformers' own greedy generate() of each prompt alone; teacher-forced
agreement counts what transformers' own forward pass predicts after each prefix."""

from __future__ import annotations

import pytest

from tests.helpers.models import hf_greedy_ids, hf_logits, random_tokens, tiny
from tritonlm.engine.runners.torch_runner import TorchRunner
from tritonlm_bench.agreement import Agreement, positional_agreement, reference_continuations, teacher_forced_agreement


@pytest.fixture(scope="module")
def model_and_prompts():
    model = tiny()[0]
    vocab = model.config.vocab_size
    lengths = [5, 1, 9, 3, 7]  # unequal: the batch is left-padded
    return model, [random_tokens(n, seed, vocab) for seed, n in enumerate(lengths)]


def test_batched_padded_references_are_each_prompts_own_greedy_generate(model_and_prompts):
    model, prompts = model_and_prompts
    got = reference_continuations(model, prompts, max_tokens=6, batch=3)  # two groups: 3 + 2
    assert got == [hf_greedy_ids(model, p, 6) for p in prompts]
    assert all(len(c) == 6 for c in got)


def test_teacher_forced_agreement_counts_transformers_own_predictions(model_and_prompts):
    model, prompts = model_and_prompts
    vocab = model.config.vocab_size
    # continuations the model did not choose: agreement is whatever transformers' argmax says
    continuations = [random_tokens(6, 100 + i, vocab) for i in range(len(prompts))]
    expected = 0
    for ids, cont in zip(prompts, continuations):
        predicted = hf_logits(model, ids + cont)[len(ids) - 1:-1].argmax(-1).tolist()
        expected += sum(p == c for p, c in zip(predicted, cont))
    runner = TorchRunner(model)
    got = teacher_forced_agreement(runner, prompts, continuations, batch=2)
    assert got == Agreement(expected, 6 * len(prompts))
    # fed a few tokens a pass over the KV cache (sequences of unequal lengths ending in
    # different passes): the same predictions
    for chunk in (1, 4):
        assert teacher_forced_agreement(runner, prompts, continuations, batch=2, chunk=chunk) == got
    # its own greedy continuations it predicts every time
    reference = [hf_greedy_ids(model, p, 6) for p in prompts]
    assert teacher_forced_agreement(runner, prompts, reference).fraction == 1.0


def test_positional_agreement_and_the_fraction():
    got = positional_agreement([[1, 2, 3], [4, 5, 9], [7]], [[1, 2, 4], [4, 5, 6], [7, 8]])
    assert got == Agreement(5, 8) and got.fraction == pytest.approx(5 / 8)
    assert Agreement(0, 0).fraction == 1.0  # nothing to disagree on


def test_random_continuations_are_not_all_predicted(model_and_prompts):
    """The check above can fail: random continuations agree far less than the model's own."""
    model, prompts = model_and_prompts
    vocab = model.config.vocab_size
    continuations = [random_tokens(6, 100 + i, vocab) for i in range(len(prompts))]
    assert teacher_forced_agreement(TorchRunner(model), prompts, continuations).fraction < 0.5
