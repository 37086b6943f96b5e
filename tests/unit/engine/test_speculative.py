"""tritonlm/engine/speculative.py: speculative decoding in the engine: exact greedy output,
the target's distribution when sampling, and a cache rolled back to exactly the
non-speculative state."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.models import MIXED_PROMPTS, Collector, drain, hf_greedy_text, make_speculative_engine, tiny
from tests.helpers.stats import chi_square_p_value
from tritonlm.engine.request import SamplingParams
from tritonlm.engine.sampler import RowState
from tritonlm.engine.speculative import Proposal, lookup, verify_row


REPEATING = "one two three four, one two three four, one two three four, one two"


@pytest.mark.parametrize("kind", ["self", "random", "lookup"])
def test_greedy_output_is_the_targets_token_for_token(kind):
    engine = make_speculative_engine(kind)
    col = Collector()
    prompts = MIXED_PROMPTS + [REPEATING]
    rids = [col.request(engine, p, stream=bool(i % 2), max_tokens=30) for i, p in enumerate(prompts)]
    drain(engine)
    for p, rid in zip(prompts, rids):
        assert col.ids(rid) == hf_greedy_text(p, 30), (kind, p)
    fins = [col.final(r) for r in rids]
    proposed = sum(f.draft_tokens for f in fins)
    accepted = sum(f.accepted_draft_tokens for f in fins)
    assert proposed > 0
    if kind == "self":
        assert accepted == proposed  # the target drafting for itself is always right
    if kind == "random":
        assert accepted / proposed < 0.2
    assert engine.cache.used_bytes == 0 and engine.drafter.__dict__.get("cache", engine.cache).used_bytes == 0


def test_per_request_k_zero_turns_speculation_off():
    from tritonlm.engine.request import GenerationRequest

    engine = make_speculative_engine("self")
    col = Collector()
    req = GenerationRequest(engine.encode(MIXED_PROMPTS[1]), SamplingParams(max_tokens=12), col._on_event, num_draft_tokens=0)
    col.events[req.request_id] = []
    engine.submit(req)
    drain(engine)
    assert col.final(req.request_id).draft_tokens == 0
    assert col.ids(req.request_id) == hf_greedy_text(MIXED_PROMPTS[1], 12)


def test_speculation_takes_fewer_target_passes_when_the_draft_is_right():
    engine = make_speculative_engine("self", k=4)
    col = Collector()
    rid = col.request(engine, MIXED_PROMPTS[1], max_tokens=40)
    drain(engine)
    assert col.ids(rid) == hf_greedy_text(MIXED_PROMPTS[1], 40)
    # one prefill pass plus decode passes: with K up to 4 always accepted, ~40/5 + ramp-up
    assert engine.stats.steps <= 14


def test_cache_after_rejections_equals_the_cache_without_speculation():
    model, tok = tiny()
    engine = make_speculative_engine("random")
    col = Collector()
    rid = col.request(engine, MIXED_PROMPTS[1], max_tokens=40)
    for _ in range(12):
        engine.step()
    seq = engine.scheduler.get(rid)
    assert seq.draft_tokens > seq.accepted_draft_tokens  # there were rejections
    # the next target step from the engine's cache vs a full forward without any cache
    from tritonlm.engine.batch import StepBatch

    pending = seq.pending_tokens
    batch = StepBatch.build([pending], [seq.num_computed], [engine.cache.slots(seq.id, seq.num_tokens)])
    logits = engine.runner.forward(batch, engine.cache.pool)[0]
    with torch.no_grad():
        ref = model(torch.tensor([seq.token_ids])).logits[0, -1]
    assert torch.allclose(logits, ref, atol=1e-4)


def test_prompt_lookup_proposes_what_followed_the_last_ngram():
    assert lookup([1, 2, 3, 9, 9, 1, 2, 3], 3, 3) == [9, 9, 1]
    assert lookup([5, 6, 7, 5, 6], 2, 3) == [7, 5]
    assert lookup([1, 2, 3], 2, 3) == []


# ---- the sampling rule on a tiny vocabulary ------------------------------------------


def test_speculative_sampling_has_the_targets_distribution():
    vocab, k, draws = 6, 2, 6000
    gen = torch.Generator().manual_seed(0)
    target_logits = torch.randn(k + 1, vocab, generator=gen) * 1.5  # p_i for positions 0..K
    draft_probs = torch.softmax(torch.randn(k, vocab, generator=gen) * 1.5, dim=-1)  # q_i, a different model
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=0)
    p0 = torch.softmax(target_logits[0], dim=-1)
    first_spec = torch.zeros(vocab)
    first_draft = torch.zeros(vocab)
    draft_gen = torch.Generator().manual_seed(1)  # the drafter's own draws
    for seed in range(draws):
        row = RowState(params, [0], 1, None, seed)  # a seed per draw: the verifier's uniforms are per (seed, index)
        guesses = [int(torch.multinomial(draft_probs[i], 1, generator=draft_gen)) for i in range(k)]
        emitted = [t for t, _ in verify_row(target_logits, Proposal(guesses, [draft_probs[0], draft_probs[1]]), row)[0]]
        first_spec[emitted[0]] += 1
        first_draft[guesses[0]] += 1
    # the same target logits at every position: the first emitted token must follow p_0
    alpha = 0.001
    assert chi_square_p_value(first_spec, p0) > alpha
    assert chi_square_p_value(first_draft, p0) < alpha  # taking the draft's guesses would be detectably wrong


def test_speculative_sampling_second_token_follows_the_target_too():
    vocab, draws = 5, 5000
    gen = torch.Generator().manual_seed(3)
    target_logits = torch.randn(3, vocab, generator=gen) * 1.5
    q = torch.softmax(torch.randn(vocab, generator=gen) * 2, dim=-1)
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=0)
    counts = torch.zeros(vocab, vocab)
    draft_gen = torch.Generator().manual_seed(4)
    for seed in range(draws):
        row = RowState(params, [0], 1, None, seed)
        guesses = [int(torch.multinomial(q, 1, generator=draft_gen)) for _ in range(2)]
        emitted = [t for t, _ in verify_row(target_logits, Proposal(guesses, [q, q]), row)[0]]
        if len(emitted) >= 2:
            counts[emitted[0], emitted[1]] += 1
    # condition on the first token being the first guess-accepted path is not needed:
    # the second emitted token after any first token follows p_1 (positions are fixed here)
    p1 = torch.softmax(target_logits[1], dim=-1)
    assert chi_square_p_value(counts.sum(0), p1) > 0.001


def test_a_draft_with_a_shorter_context_than_max_context_refuses_to_load(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    from tests.helpers.servers import add_generation_model
    from tritonlm.engine.loader import build_engine
    from tritonlm.engine.settings import EngineSettings, SettingsError

    folder = add_generation_model(tmp_path, "m")
    _, tok = tiny()
    short = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_positions=128, n_layer=1, n_embd=32, n_head=2))
    short.save_pretrained(folder / "1" / "draft_hf")
    tok.save_pretrained(folder / "1" / "draft_hf")
    settings = EngineSettings.from_params({"draft_model": "1/draft_hf", "max_context": "256"}, folder)
    with pytest.raises(SettingsError, match=r"draft_model: it reads 128 positions, less than max_context=256"):
        build_engine(settings)
    settings = EngineSettings.from_params({"draft_model": "1/draft_hf", "max_context": "128"}, folder)
    build_engine(settings).shutdown()  # within the draft's reach: loads


def test_verification_draws_hold_no_hidden_state():
    """The verifier's uniforms are functions of (seed, token index, purpose): verifying the
    same guesses again (as after a rollback) decides the same tokens, and another seed
    decides others."""
    vocab = 8
    gen = torch.Generator().manual_seed(6)
    target_logits = torch.randn(4, vocab, generator=gen)
    q = torch.softmax(torch.randn(vocab, generator=gen) * 3, dim=-1)
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=0)
    proposal = Proposal([int(q.argmax())] * 3, [q, q, q])
    outcomes = set()
    for seed in range(40):
        row = RowState(params, [0], 1, None, seed)
        first = verify_row(target_logits, proposal, row)
        assert verify_row(target_logits, proposal, row) == first and row.token_ids == [0]
        outcomes.add(tuple(t for t, _ in first[0]))
    assert len(outcomes) >= 3  # seeds decide differently
