"""tritonlm/engine/sampler.py: the sampler against transformers' own logits processors,
the batched sample_rows and filter_batch against the per-row path and the reference
distribution (on CUDA too, where present),
seeded draws through the engine (plain and speculative) against the reference
distribution (chi-square), and penalties, bans, seeds and log probs through the engine
against transformers' generate() and forward pass.

A wrong top-p cut-off (one token too many or too few), a wrong top-k, or another filter
order changes the support or the weights of the distribution and fails here."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from tests.helpers.models import (
    MIXED_PROMPTS,
    Collector,
    drain,
    hf_greedy_text,
    make_engine,
    make_speculative_engine,
    reference_greedy,
    tiny,
)
from tests.helpers.stats import chi_square_p_value
from tritonlm.engine.request import InvalidRequestError, SamplingParams
from tritonlm.engine.sampler import (
    RowState,
    filter_batch,
    filter_top_k_top_p,
    next_token_distribution,
    process_logits,
    sample_row,
    sample_rows,
)


# ---- through the engine, against transformers' generate() and forward pass ----------


def test_repetition_penalty_matches_hf():
    engine = make_engine()
    col = Collector()
    rid = col.request(engine, MIXED_PROMPTS[1], max_tokens=20, repetition_penalty=1.5)
    drain(engine)
    assert col.ids(rid) == hf_greedy_text(MIXED_PROMPTS[1], 20, repetition_penalty=1.5)


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch():
    def run(with_neighbours: bool):
        engine = make_engine()
        col = Collector()
        if with_neighbours:
            for p in MIXED_PROMPTS:
                col.request(engine, p, max_tokens=15, temperature=0.9, seed=7)
        rid = col.request(engine, "Once upon a time", max_tokens=25, temperature=1.0, top_k=40, top_p=0.9, seed=1234)
        drain(engine)
        return col.ids(rid)

    first = run(False)
    assert first == run(False) == run(True)
    other_engine = make_engine()
    col = Collector()
    rid = col.request(other_engine, "Once upon a time", max_tokens=25, temperature=1.0, top_k=40, top_p=0.9, seed=99)
    drain(other_engine)
    assert col.ids(rid) != first  # another seed, another text
    greedy = hf_greedy_text("Once upon a time", 25)
    assert first != greedy


def test_top_k_one_is_greedy():
    engine = make_engine()
    col = Collector()
    rid = col.request(engine, MIXED_PROMPTS[0], max_tokens=15, temperature=1.3, top_k=1, seed=3)
    drain(engine)
    assert col.ids(rid) == hf_greedy_text(MIXED_PROMPTS[0], 15)


def test_bad_words_are_never_produced():
    _, tok = tiny()
    ref = hf_greedy_text(MIXED_PROMPTS[0], 30)
    banned = ref[3]
    engine = make_engine()
    col = Collector()
    rid = col.request(engine, MIXED_PROMPTS[0], max_tokens=30, bad_words=((banned,),))
    drain(engine)
    assert banned not in col.ids(rid) and col.ids(rid)[:3] == ref[:3]


@pytest.mark.parametrize("native", [True, False], ids=["cpp-argmax", "torch-max"])
def test_one_argmax_per_pass_picks_what_sample_row_picks_row_by_row(native, monkeypatch):
    from tritonlm.engine import sampler
    from tritonlm.engine.sampler import RowState, greedy_tokens, sample_row

    from tritonlm.engine.kernels import kernels_available

    if native:
        assert kernels_available()[0]  # a runner loads them at model load; sampling only uses them
    else:
        monkeypatch.setattr(sampler, "native_argmax", lambda: False)
    assert sampler.native_argmax() == native

    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(3))  # [n, V]
    logits[1, 7] = logits[1, 30] = 99.0  # a tie: the first index wins, as in transformers' argmax
    logits[2, 11] = float("nan")
    logits[3, 4] = float("inf")
    logits[4] = float("-inf")
    logits[4, 9] = -1e30  # the one finite value wins
    row = RowState.make(SamplingParams(max_tokens=1), [1, 2], eos_id=None)
    batched = greedy_tokens(logits)
    assert batched[0] == sample_row(logits[0], row)[0] and batched[5] == sample_row(logits[5], row)[0]
    assert batched[1] == 7 == sample_row(logits[1], row)[0]
    assert batched[4] == 9 == sample_row(logits[4], row)[0]
    # a winner that is not finite is left to sample_row, which masks NaN and clips +inf
    assert batched[2:4] == [None, None]
    assert sample_row(logits[2], row)[0] == int(torch.argmax(torch.nan_to_num(logits[2], nan=float("-inf"))))
    assert sample_row(logits[3], row)[0] == 4


def test_greedy_sampling_never_loads_the_kernels_itself():
    """In a process where no runner loaded the C++ ops, greedy rows take torch's max and leave
    them unloaded: no build, and no TRITONLM_KERNEL_ISA refusal, on the engine thread mid-step."""
    import os
    import subprocess
    import sys

    code = (
        "import torch\n"
        "from tritonlm.engine.sampler import greedy_tokens\n"
        "from tritonlm.engine.kernels import kernels_loaded\n"
        "x = torch.randn(4, 50)\n"
        "assert greedy_tokens(x) == torch.max(x, dim=-1).indices.tolist()\n"
        "assert not kernels_loaded()\n"
        "print('ok')\n"
    )
    env = {**os.environ, "TRITONLM_KERNEL_ISA": "not-a-level"}  # loading would raise
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_log_probs_are_those_of_the_model():
    model, tok = tiny()
    engine = make_engine()
    col = Collector()
    rid = col.request(engine, MIXED_PROMPTS[0], max_tokens=5, return_log_probs=True)
    drain(engine)
    ids = col.ids(rid)
    lps = [lp for e in col.events[rid] for lp in e.log_probs]
    full = torch.tensor([tok(MIXED_PROMPTS[0]).input_ids + ids])
    with torch.no_grad():
        logits = model(full).logits[0].log_softmax(-1)
    n = len(tok(MIXED_PROMPTS[0]).input_ids)
    expected = [float(logits[n - 1 + i, t]) for i, t in enumerate(ids)]
    assert lps == pytest.approx(expected, abs=1e-4)


@pytest.mark.parametrize("engine_kind", ["plain", "speculative"])
def test_sampled_log_probs_with_penalties_are_the_models_and_agree_with_their_alternatives(engine_kind, monkeypatch):
    """Sampling at temperature 1.4 with repetition and frequency penalties, in one batch with a
    greedy row on the same prompt: every chosen token's log-probability and its 5 most likely
    alternatives are log_softmax of transformers' logits over the sequence (not of the
    processed logits), the chosen token's value is its entry among the alternatives when
    listed, bit for bit, and a position both rows share (the first) has the same values.
    Speculative: the verifier's tokens carry the same raw values (alternatives turn speculation
    off, so none are asked there)."""
    import tritonlm.engine.executor as executor

    verified = []
    real_verify = executor.verify_row
    monkeypatch.setattr(executor, "verify_row",
                        lambda logits, proposal, row: verified.append(1) or real_verify(logits, proposal, row))
    model, tok = tiny()
    engine = make_engine() if engine_kind == "plain" else make_speculative_engine("random", k=3)
    top_n = 5 if engine_kind == "plain" else 0
    col = Collector()
    prompt = MIXED_PROMPTS[1]
    sampled = col.request(engine, prompt, max_tokens=12, temperature=1.4, seed=21, repetition_penalty=1.3,
                          frequency_penalty=0.8, return_log_probs=True, top_log_probs=top_n, end_id=-1)
    greedy = col.request(engine, prompt, max_tokens=12, return_log_probs=True, top_log_probs=top_n, end_id=-1)
    drain(engine)
    assert bool(verified) == (engine_kind == "speculative")
    prompt_ids = tok(prompt).input_ids
    listed = 0
    runs = {}
    for rid in (sampled, greedy):
        ids = col.ids(rid)
        lps = [lp for e in col.events[rid] for lp in e.log_probs]
        tops = [t for e in col.events[rid] for t in e.top_log_probs] or [[] for _ in ids]
        assert len(ids) == len(lps) == len(tops) == 12
        with torch.no_grad():
            want = model(torch.tensor([prompt_ids + ids])).logits[0, len(prompt_ids) - 1:-1].log_softmax(-1)  # [T, V]
        assert lps == pytest.approx([float(want[i, t]) for i, t in enumerate(ids)], abs=1e-4)
        for i, (token, lp, top) in enumerate(zip(ids, lps, tops)):
            assert [t for t, _ in top] == torch.topk(want[i], top_n).indices.tolist()
            assert [v for _, v in top] == pytest.approx(torch.topk(want[i], top_n).values.tolist(), abs=1e-4)
            if token in dict(top):
                assert dict(top)[token] == lp
                listed += 1
        runs[rid] = (ids, lps, tops)
    assert runs[sampled][0] != runs[greedy][0]  # the settings did change the text
    if top_n:
        assert listed > 0
        assert any(t not in dict(top) for t, top in zip(runs[sampled][0], runs[sampled][2]))  # a draw outside the top 5
        # the first position: the same logits in both rows, so the same values whatever the settings
        assert runs[sampled][2][0] == runs[greedy][2][0]


# ---- against transformers' logits processors ------------------------------------------


def hf_distribution(logits: torch.Tensor, history: list[int], temperature: float, top_k: int, top_p: float,
                    repetition_penalty: float = 1.0, banned: int | None = None) -> torch.Tensor:
    """[V] logits -> [V] probabilities, as transformers' generate(do_sample=True) builds them:
    repetition penalty, then temperature, top-k, top-p (its own warper order)."""
    procs = LogitsProcessorList()
    if repetition_penalty != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(repetition_penalty))
    if temperature != 1.0:
        procs.append(TemperatureLogitsWarper(temperature))
    if top_k > 0:
        procs.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        procs.append(TopPLogitsWarper(top_p))
    ids = torch.tensor([history], dtype=torch.long)
    scores = logits.float().unsqueeze(0).clone()
    if banned is not None:  # EOS before min_tokens: transformers' MinNewTokensLength runs before the warpers
        scores[0, banned] = float("-inf")
    return torch.softmax(procs(ids, scores)[0], dim=-1)


def near_top_p_boundary(logits: torch.Tensor, history, temperature, top_k, top_p, rp) -> bool:
    """True when a cumulative mass of the filtered distribution is within float rounding of
    top_p: there the two summation orders may legitimately keep a different last token."""
    before_p = hf_distribution(logits, history, temperature, top_k, 1.0, rp)
    cum = torch.sort(before_p, descending=True).values.cumsum(0)
    return bool(((cum - top_p).abs() < 1e-5).any())


SETTINGS = [
    (t, k, p, rp)
    for t in (0.3, 0.7, 1.0, 1.6)
    for k in (0, 1, 2, 7, 50)
    for p in (1.0, 0.95, 0.6, 0.25, 0.05)
    for rp in (1.0, 1.3)
]


@pytest.mark.parametrize("vocab,scale", [(11, 1.0), (64, 3.0), (512, 2.0)])
def test_next_token_distribution_equals_transformers_warpers(vocab, scale):
    gen = torch.Generator().manual_seed(vocab)
    checked = skipped = 0
    for i, (t, k, p, rp) in enumerate(SETTINGS):
        for _ in range(3):
            logits = torch.randn(vocab, generator=gen) * scale
            history = torch.randint(0, vocab, (6,), generator=gen).tolist()
            if p < 1.0 and near_top_p_boundary(logits, history, t, k, p, rp):
                skipped += 1
                continue
            params = SamplingParams(max_tokens=4, temperature=t, top_k=k, top_p=p, repetition_penalty=rp, seed=i)
            ours = next_token_distribution(logits, RowState.make(params, list(history), None))
            ref = hf_distribution(logits, history, t, k, p, rp)
            where = f"temperature={t} top_k={k} top_p={p} repetition_penalty={rp}"
            assert torch.equal(ours > 0, ref > 0), f"different support: {where}"
            torch.testing.assert_close(ours, ref, atol=1e-6, rtol=1e-5, msg=lambda m: f"{where}: {m}")
            checked += 1
    assert checked >= 0.98 * 3 * len(SETTINGS)  # boundary cases are rare: nearly every case is compared


def test_sample_row_draws_follow_the_reference_distribution():
    """The draw itself (inverse CDF with the row's uniform) on random logits, top-k and top-p
    on; a seed per draw, the uniform being a function of (seed, token index)."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(40, generator=gen) * 2
    for t, k, p in [(0.8, 12, 0.9), (1.3, 0, 0.7), (1.0, 5, 1.0)]:
        ref = hf_distribution(logits, [0], t, k, p)
        counts = torch.zeros(40)
        for seed in range(4000):
            params = SamplingParams(max_tokens=4, temperature=t, top_k=k, top_p=p, seed=seed)
            counts[sample_row(logits, RowState.make(params, [0], None))[0]] += 1
        assert counts[ref == 0].sum() == 0
        assert chi_square_p_value(counts, ref) > 0.001, (t, k, p)


def test_greedy_picks_the_first_maximum_even_with_nan_and_inf():
    """Greedy takes one pass over the logits when nothing processes them; rows holding NaN
    or +inf must still get what the full path (NaN never wins, +inf clamped) picks."""
    params = SamplingParams(max_tokens=4)  # greedy, nothing else
    row = RowState.make(params, [0], None)
    base = torch.tensor([0.5, 2.0, -1.0, 2.0, 1.0])
    assert sample_row(base, row)[0] == 1  # ties: the first maximum, like torch.argmax
    nan = base.clone()
    nan[0] = float("nan")
    assert sample_row(nan, row)[0] == 1
    inf = base.clone()
    inf[4] = float("inf")
    assert sample_row(inf, row)[0] == 4
    assert sample_row(torch.tensor([float("-inf"), 3.0]), row)[0] == 1
    with pytest.raises(ValueError, match="no finite value"):
        sample_row(torch.full((5,), float("nan")), row)
    banned = RowState.make(SamplingParams(max_tokens=4, bad_words=[[1]]), [0], None)
    assert sample_row(base, banned)[0] == 3  # a ban goes through the full path


# ---- seeded draws through the engine ---------------------------------------------------


PROMPT = "Once upon a time"


def model_logits(token_lists: list[list[int]]) -> torch.Tensor:
    """The tiny model's last-position logits for each token list (same length each)."""
    model, _ = tiny()
    with torch.no_grad():
        return model(torch.tensor(token_lists)).logits[:, -1, :].float()


def engine_draws(engine, n: int, max_tokens: int, **params) -> list[list[int]]:
    out = []
    col = Collector()
    rids = []
    for i in range(n):
        rids.append(col.request(engine, PROMPT, max_tokens=max_tokens, min_tokens=max_tokens, seed=1000 + i, **params))
        if len(rids) % 100 == 0:
            drain(engine)
    drain(engine)
    for rid in rids:
        assert col.final(rid).num_output_tokens == max_tokens
        out.append(col.ids(rid))
    return out


SAMPLED = [dict(temperature=0.8, top_k=6, top_p=1.0), dict(temperature=1.2, top_k=0, top_p=0.5),
           dict(temperature=1.0, top_k=8, top_p=0.7)]


@pytest.mark.parametrize("params", SAMPLED, ids=lambda p: f"t{p['temperature']}-k{p['top_k']}-p{p['top_p']}")
def test_engine_first_token_follows_the_reference(params):
    _, tok = tiny()
    prompt_ids = tok(PROMPT)["input_ids"]
    ref = hf_distribution(model_logits([prompt_ids])[0], prompt_ids, params["temperature"], params["top_k"],
                          params["top_p"], banned=tok.eos_token_id)
    draws = engine_draws(make_engine(kv_sequences=100, max_context=64, max_num_seqs=100), 1000, 1, **params)
    counts = torch.zeros_like(ref)
    for ids in draws:
        counts[ids[0]] += 1
    assert counts[ref == 0].sum() == 0, "a token outside top-k / top-p was drawn"
    assert chi_square_p_value(counts, ref) > 0.001


def joint_reference(params: dict) -> dict[tuple[int, int], float]:
    """P(t1, t2) for the first two generated tokens under the reference rule."""
    _, tok = tiny()
    prompt_ids = tok(PROMPT)["input_ids"]
    t, k, p = params["temperature"], params["top_k"], params["top_p"]
    p1 = hf_distribution(model_logits([prompt_ids])[0], prompt_ids, t, k, p, banned=tok.eos_token_id)
    firsts = torch.nonzero(p1).flatten().tolist()
    second_logits = model_logits([prompt_ids + [a] for a in firsts])
    joint = {}
    for a, logits in zip(firsts, second_logits):
        p2 = hf_distribution(logits, prompt_ids + [a], t, k, p, banned=tok.eos_token_id)
        for b in torch.nonzero(p2).flatten().tolist():
            joint[(a, b)] = float(p1[a] * p2[b])
    return joint


@pytest.mark.parametrize("params", SAMPLED[2:], ids=lambda p: f"t{p['temperature']}-k{p['top_k']}-p{p['top_p']}")
@pytest.mark.parametrize("drafter", ["random", "self"])
def test_speculative_engine_first_two_tokens_follow_the_reference(params, drafter, monkeypatch):
    """The second token goes through the verifier (draft guesses accepted or rejected):
    the pair (t1, t2) must still follow the target's filtered distribution."""
    import tritonlm.engine.executor as executor

    verified = []
    real_verify = executor.verify_row
    monkeypatch.setattr(executor, "verify_row",
                        lambda logits, proposal, row: verified.append(len(proposal.tokens)) or real_verify(logits, proposal, row))
    joint = joint_reference(params)
    engine = make_speculative_engine(drafter, k=3)
    draws = engine_draws(engine, 1000, 4, **params)  # 4: room for a draft after the first token
    pairs = list(joint)
    index = {pair: i for i, pair in enumerate(pairs)}
    counts = torch.zeros(len(pairs), dtype=torch.float64)
    for ids in draws:
        pair = (ids[0], ids[1])
        assert pair in index, f"drawn {pair}: outside the reference support"
        counts[index[pair]] += 1
    probs = torch.tensor([joint[pr] for pr in pairs], dtype=torch.float64)
    assert chi_square_p_value(counts, probs) > 0.001
    assert len(verified) >= 1000 and min(verified) >= 1  # every second token came through the verifier


# ---- OpenAI's and vLLM's sampling fields ------------------------------------------------------

PENALTIES = [
    dict(frequency_penalty=1.5),
    dict(presence_penalty=1.2),
    dict(frequency_penalty=0.8, presence_penalty=-0.5),
    dict(logit_bias={17: 6.0, 300: 4.0}),
    dict(frequency_penalty=2.0, logit_bias={5: -100.0}),
]


@pytest.mark.parametrize("fields", PENALTIES, ids=lambda f: ",".join(f))
@pytest.mark.parametrize("engine_kind", ["plain", "speculative"])
def test_penalties_and_logit_bias_equal_the_reference_loop(fields, engine_kind):
    """Greedy through the engine (also with speculative decoding, whose guesses must see the
    same penalties) = a loop over transformers' logits with the fields' definitions."""
    engine = make_engine() if engine_kind == "plain" else make_speculative_engine("self")
    col = Collector()
    params = dict(fields)
    if "logit_bias" in params:
        params["logit_bias"] = tuple(sorted(params["logit_bias"].items()))
    rids = {p: col.request(engine, p, max_tokens=24, **params) for p in MIXED_PROMPTS[:3]}
    drain(engine)
    for prompt, rid in rids.items():
        assert col.ids(rid) == reference_greedy(engine.encode(prompt), 24, **fields), (prompt, fields)


def test_stop_token_ids_end_the_answer_like_eos():
    engine = make_engine()
    col = Collector()
    free = col.request(engine, MIXED_PROMPTS[0], max_tokens=20)
    drain(engine)
    stop = col.ids(free)[5]  # a token the free answer makes, the 6th
    rid = col.request(engine, MIXED_PROMPTS[0], max_tokens=20, stop_token_ids=(stop,))
    late = col.request(engine, MIXED_PROMPTS[0], max_tokens=20, stop_token_ids=(stop,), min_tokens=10)
    drain(engine)
    assert col.ids(rid) == reference_greedy(engine.encode(MIXED_PROMPTS[0]), 20, stop_token_ids=(stop,))
    assert stop not in col.ids(rid) and col.final(rid).finish_reason == "stop"
    assert stop not in col.ids(late)[:10]  # before min_tokens a stop token id is banned, as EOS is


@pytest.mark.parametrize("min_p", [0.01, 0.1, 0.3, 0.9])
def test_min_p_keeps_what_transformers_min_p_warper_keeps(min_p):
    gen = torch.Generator().manual_seed(int(min_p * 100))
    for t in (0.5, 1.0, 1.5):
        logits = torch.randn(300, generator=gen) * 3
        params = SamplingParams(max_tokens=4, temperature=t, min_p=min_p, seed=1)
        ours = next_token_distribution(logits, RowState.make(params, [0], None))
        warped = LogitsProcessorList([TemperatureLogitsWarper(t), MinPLogitsWarper(min_p)])(
            torch.tensor([[0]]), logits.clone().unsqueeze(0))[0]
        ref = torch.softmax(warped, dim=-1)
        assert torch.equal(ours > 0, ref > 0), (min_p, t)
        torch.testing.assert_close(ours, ref, atol=1e-6, rtol=1e-5)


def test_penalties_count_the_answer_not_the_prompt():
    logits = torch.zeros(10)
    params = SamplingParams(max_tokens=4, frequency_penalty=1.0, presence_penalty=0.5)
    row = RowState.make(params, [3, 3, 3], None)  # the prompt: three 3s
    row.token_ids.extend([4, 4, 7])  # the answer so far
    out = process_logits(logits, row)
    assert out[3] == 0.0  # in the prompt only: untouched
    assert out[4] == -(2 * 1.0 + 0.5) and out[7] == -(1 * 1.0 + 0.5)


@pytest.mark.parametrize("fields, message", [
    (dict(frequency_penalty=2.5), r"frequency_penalty: must be in \[-2, 2\]"),
    (dict(presence_penalty=float("nan")), r"presence_penalty: must be in \[-2, 2\]"),
    (dict(logit_bias=((3, 101.0),)), r"logit_bias: .*biases in \[-100, 100\]"),
    (dict(min_p=1.5), r"min_p: must be in \[0, 1\]"),
    (dict(stop_token_ids=(-1,)), r"stop_token_ids: token ids must be >= 0"),
])
def test_out_of_range_fields_are_refused_by_name(fields, message):
    with pytest.raises(InvalidRequestError, match=message):
        SamplingParams(max_tokens=4, **fields).validate()


def test_token_ids_past_the_vocabulary_are_refused_by_name():
    engine = make_engine()
    col = Collector()
    vocab = engine.runner.spec.vocab_size
    with pytest.raises(InvalidRequestError, match=rf"logit_bias: token ids must be in \[0, {vocab}\)"):
        col.request(engine, "x", max_tokens=4, logit_bias=((vocab, 1.0),))
    with pytest.raises(InvalidRequestError, match=rf"stop_token_ids: token ids must be in \[0, {vocab}\)"):
        col.request(engine, "x", max_tokens=4, stop_token_ids=(vocab + 5,))


# ---- batched: sample_rows and filter_batch ----------------------------------------

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
def test_log_probs_are_the_raw_logits_whatever_the_settings(device):
    """The chosen token's log-probability is log_softmax of the raw logits (computed here
    with torch directly), not of the logits after penalties, bias, bans and temperature: the
    same token on the same logits has the same value under every setting; token_log_probs
    gives it bit for bit as its entry among the most likely, and its rank."""
    from tritonlm.engine.sampler import token_log_probs

    logits = (torch.randn(5, 25, generator=torch.Generator().manual_seed(4)) * 2).to(device)  # [n, V]
    logits[4, 3] = float("nan")  # counts as -inf: the row's other values stay finite
    rows = [row(1, [3, 3], temperature=0.7, top_k=4, return_log_probs=True),
            row(2, [3, 5], repetition_penalty=1.4, return_log_probs=True),
            row(3, temperature=1.3, frequency_penalty=1.0, presence_penalty=0.5, logit_bias=((6, 3.0),),
                return_log_probs=True),
            row(4, temperature=0.9),
            row(5, [2], temperature=1.6, bad_words=((1,),), return_log_probs=True)]
    reference = torch.log_softmax(torch.nan_to_num(logits.double().cpu(), nan=float("-inf")), dim=-1)  # [n, V]
    drawn = sample_rows(logits, rows)
    for i, ((token, lp), r, want) in enumerate(zip(drawn, rows, reference)):
        assert lp == (pytest.approx(float(want[token]), abs=1e-5) if r.params.return_log_probs else 0.0)
        assert sample_row(logits[i], r) == (token, lp)
    # a token in a row of its own settings and in a plain greedy row: one value
    greedy = RowState.make(SamplingParams(max_tokens=4, return_log_probs=True), [0], eos_id=None)
    token, lp = drawn[2]
    forced = RowState.make(SamplingParams(max_tokens=4, return_log_probs=True, logit_bias=((token, 100.0),)), [0], None)
    assert sample_row(logits[2], forced) == (token, lp)  # the bias decides the token, not its value
    assert sample_row(logits[2], greedy)[1] == pytest.approx(float(reference[2].max()), abs=1e-5)
    details = token_log_probs(logits, [t for t, _ in drawn], [5, 0, 25, 1, 3])
    for (token, lp), found, want in zip(drawn, details, reference):
        assert found.chosen == pytest.approx(float(want[token]), abs=1e-5)
        assert found.rank == int((want > want[token]).sum()) + 1
        assert [t for t, _ in found.top] == torch.topk(want, len(found.top)).indices.tolist()
        for t, v in found.top:
            assert v == pytest.approx(float(want[t]), abs=1e-5)
            if t == token:
                assert v == found.chosen  # one source: the same float
    assert len(details[2].top) == 25 and details[1].top == []


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
