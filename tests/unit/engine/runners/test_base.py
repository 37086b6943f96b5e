"""tritonlm/engine/runners/base.py: the runner contract, kept by every runner (torch and
ONNX) against Hugging Face's own forward pass, with a paged KV pool; and load_runner.

No server. Two tiny seeded models (tiny-gpt2; a tiny grouped-query Llama with tied
embeddings), each with both runners. The ONNX artifacts come from the project's exporter
(tritonlm.export.onnx_export), once per session (tests/unit/engine/conftest.py).
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.models import (
    LLAMA_VOCAB,
    assert_close,
    forward_rows,
    hf_greedy_ids,
    hf_logits,
    paged_cache,
    random_tokens,
)
from tritonlm.engine.batch import StepBatch
from tritonlm.engine.runners import SCRATCH_SLOT, Runner, load_runner


# torch: decode steps through the paged-attention kernel; torch-gather: the gathered copy + SDPA
CASES = [("gpt2", "torch"), ("gpt2", "torch-gather"), ("gpt2", "onnx"), ("gpt2", "onnx-iobinding"),
         ("llama", "torch"), ("llama", "torch-gather"), ("llama", "onnx")]


@pytest.fixture(scope="module", params=CASES, ids=[f"{a}-{k}" for a, k in CASES])
def case(request, hf_models):
    arch, kind = request.param
    model = hf_models[arch]
    if kind.startswith("torch"):
        runner = load_runner("torch", model, attention="gather" if kind == "torch-gather" else "auto")
        assert runner.attention == kind.removeprefix("torch-").replace("torch", "paged"), runner.attention_why
    else:
        from tritonlm.engine.runners.onnx_runner import OnnxRunner

        path = request.getfixturevalue("onnx_paths")[arch]
        runner = OnnxRunner(model, path, io_binding=(kind == "onnx-iobinding"))
    return model, runner


# ---------------------------------------------------------------------------- (a)


def test_runner_protocol(case):
    _, runner = case
    assert isinstance(runner, Runner)
    assert runner.spec.vocab_size == LLAMA_VOCAB


def test_prefill_then_decode_matches_hf(case):
    model, runner = case
    mgr = paged_cache(runner)
    seq = random_tokens(16, seed=1)
    ref = hf_logits(model, seq)
    mgr.allocate(1, len(seq))
    out = forward_rows(runner, mgr, [(1, 0, seq[:10])])
    assert out.shape == (1, LLAMA_VOCAB) and out.dtype == torch.float32
    assert_close(out[0], ref[9])
    for p in range(10, 16):
        out = forward_rows(runner, mgr, [(1, p, [seq[p]])])
        assert_close(out[0], ref[p])


# ---------------------------------------------------------------------------- (b)


def scattered_manager(runner):
    """Blocks of 4 slots. Seq 7's blocks are [5, 3, 1]: descending, with the live bystanders'
    blocks 2, 4 and 6 between them. Seqs 8 and 9 get fresh blocks after them."""
    mgr = paged_cache(runner, blocks=24, block_size=4)
    for sid in range(1, 7):
        mgr.allocate(sid, 4)  # blocks 1..6
    for sid in (1, 3, 5):
        mgr.free(sid)
    mgr.allocate(7, 12)
    blocks = [slot // 4 for slot in mgr.slots(7, 12)[::4]]
    assert blocks == [5, 3, 1], blocks
    mgr.allocate(8, 12)
    mgr.allocate(9, 12)
    return mgr


def test_mixed_batch_one_call_matches_each_alone(case):
    model, runner = case
    mgr = scattered_manager(runner)
    a, b, c = random_tokens(8, seed=2), random_tokens(8, seed=3), random_tokens(9, seed=4)
    # pasts written one sequence at a time: a has 3 cached, b has 7, c (scattered blocks) has 6
    forward_rows(runner, mgr, [(8, 0, a[:3])])
    forward_rows(runner, mgr, [(9, 0, b[:7])])
    forward_rows(runner, mgr, [(7, 0, c[:6])])
    # ONE call: a prefills a chunk of 5, b decodes 1 on a past of 7, c verifies 3
    rows = [(8, 3, a[3:8]), (9, 7, b[7:8]), (7, 6, c[6:9])]
    out = forward_rows(runner, mgr, rows, all_logits=True)
    assert out.shape == (3, 5, LLAMA_VOCAB)
    assert_close(out[0, :5], hf_logits(model, a)[3:8])
    assert_close(out[1, :1], hf_logits(model, b)[7:8])
    assert_close(out[2, :3], hf_logits(model, c)[6:9])
    # the same mixed call, last-token logits only
    # (re-running it rewrites the same K/V into the same slots: idempotent)
    out = forward_rows(runner, mgr, rows)
    assert out.shape == (3, LLAMA_VOCAB)
    assert_close(out[0], hf_logits(model, a)[7])
    assert_close(out[1], hf_logits(model, b)[7])
    assert_close(out[2], hf_logits(model, c)[8])
    # what the mixed call wrote is right: one more decode each, batched
    a2, b2, c2 = a + [11], b + [12], c + [13]
    out = forward_rows(runner, mgr, [(8, 8, [11]), (9, 8, [12]), (7, 9, [13])])
    assert_close(out[0], hf_logits(model, a2)[-1])
    assert_close(out[1], hf_logits(model, b2)[-1])
    assert_close(out[2], hf_logits(model, c2)[-1])


# ---------------------------------------------------------------------------- (c)


def test_chunked_prefill_equals_one_shot(case):
    model, runner = case
    mgr = paged_cache(runner)
    prompt = random_tokens(20, seed=5)
    mgr.allocate(1, 20)
    mgr.allocate(2, 20)
    one = forward_rows(runner, mgr, [(1, 0, prompt)], all_logits=True)[0]  # [20, V]
    chunks, past = [], 0
    for n in (8, 8, 4):
        chunks.append(forward_rows(runner, mgr, [(2, past, prompt[past : past + n])], all_logits=True)[0, :n])
        past += n
    chunked = torch.cat(chunks)
    assert_close(chunked, one, atol=1e-5)
    assert_close(one, hf_logits(model, prompt))
    # both sequences' caches hold the same keys/values
    s1, s2 = mgr.slots(1, 20), mgr.slots(2, 20)
    for cache in mgr.pool.k + mgr.pool.v:
        assert_close(cache[s1], cache[s2], atol=1e-5)


# ---------------------------------------------------------------------------- (d)


def test_all_logits_for_speculative_verify(case):
    model, runner = case
    mgr = paged_cache(runner)
    seq, other = random_tokens(10, seed=6), random_tokens(7, seed=7)
    mgr.allocate(1, 10)
    mgr.allocate(2, 7)
    forward_rows(runner, mgr, [(1, 0, seq[:6]), (2, 0, other[:5])])
    # verify K=4 drafted tokens for seq, 2 for other (right-padded to width 4)
    out = forward_rows(runner, mgr, [(1, 6, seq[6:10]), (2, 5, other[5:7])], all_logits=True)
    assert out.shape == (2, 4, LLAMA_VOCAB) and out.dtype == torch.float32
    assert_close(out[0], hf_logits(model, seq)[6:10])
    assert_close(out[1, :2], hf_logits(model, other)[5:7])


# ---------------------------------------------------------------------------- (e)


def greedy(runner, mgr, prompts: list[list[int]], new: int) -> list[list[int]]:
    """Batched greedy decode: prefill all prompts in one call, then decode steps."""
    sids = list(range(1, len(prompts) + 1))
    for sid, p in zip(sids, prompts):
        mgr.allocate(sid, len(p) + new)
    out = forward_rows(runner, mgr, [(sid, 0, p) for sid, p in zip(sids, prompts)])
    gen = [[int(t)] for t in out.argmax(-1)]
    for _ in range(new - 1):
        rows = [(sid, len(p) + len(g) - 1, [g[-1]]) for sid, p, g in zip(sids, prompts, gen)]
        out = forward_rows(runner, mgr, rows)
        for g, t in zip(gen, out.argmax(-1)):
            g.append(int(t))
    return gen


def test_greedy_decode_equals_generate(case):
    model, runner = case
    prompts = [random_tokens(5, seed=8), random_tokens(11, seed=9)]
    mgr = paged_cache(runner)
    ours = greedy(runner, mgr, prompts, 20)
    for prompt, got in zip(prompts, ours):
        want = hf_greedy_ids(model, prompt, 20)
        assert got == want
    assert len(set(ours[0])) > 1  # a non-degenerate continuation


# ---------------------------------------------------------------------------- (f)


CANARY = 7.25


def test_padding_never_touches_other_slots(case):
    _, runner = case
    mgr = paged_cache(runner, blocks=16, block_size=4)
    for cache in mgr.pool.k + mgr.pool.v:
        cache.fill_(CANARY)
    mgr.allocate(1, 12)
    mgr.allocate(2, 12)
    mgr.allocate(3, 12)  # a live bystander: not in the batch
    a, b = random_tokens(5, seed=10), random_tokens(1, seed=11)
    batch = StepBatch.build([a, b], [0, 0], [mgr.slots(1, 5), mgr.slots(2, 1)])
    # poison the padding part of the slot table: point it at the bystander's slots.
    # The contract says padding entries are never read unmasked; they must never be written.
    bystander = torch.tensor(mgr.slots(3, 12))
    assert batch.slot_table.shape[1] == 5
    batch.slot_table[1, 1:] = bystander[:4]
    runner.forward(batch, mgr.pool)
    written = set(mgr.slots(1, 5)) | set(mgr.slots(2, 1))
    untouched = [s for s in range(mgr.pool.num_slots) if s not in written and s != SCRATCH_SLOT]
    idx = torch.tensor(untouched)
    for cache in mgr.pool.k + mgr.pool.v:
        assert bool((cache[idx] == CANARY).all()), "a padding entry wrote outside its own slots"
        assert bool((cache[torch.tensor(sorted(written))] != CANARY).all()), "a valid token was not written"


# ---------------------------------------------------------------------------- factory and refusals


def test_load_runner_unknown_kind_names_the_field(hf_models):
    with pytest.raises(ValueError, match=r"kind.*'tensorrt'"):
        load_runner("tensorrt", hf_models["gpt2"])


def test_load_runner_onnx_needs_path(hf_models):
    with pytest.raises(ValueError, match="onnx_path"):
        load_runner("onnx", hf_models["gpt2"])


def test_load_runner_from_hf_folder(hf_models, tmp_path, onnx_paths):
    model = hf_models["gpt2"]
    model.save_pretrained(tmp_path)
    seq = random_tokens(6, seed=12)
    ref = hf_logits(model, seq)[-1]
    for runner in (
        load_runner("torch", tmp_path),
        load_runner("onnx", tmp_path, onnx_path=onnx_paths["gpt2"]),
    ):
        assert runner.spec.architecture == "gpt2"
        mgr = paged_cache(runner)
        mgr.allocate(1, 6)
        assert_close(forward_rows(runner, mgr, [(1, 0, seq)])[0], ref)


def test_bad_batches_are_refused(hf_models):
    runner = load_runner("torch", hf_models["gpt2"])
    mgr = paged_cache(runner)
    mgr.allocate(1, 8)
    batch = StepBatch.build([[5, 6]], [0], [mgr.slots(1, 2)])
    batch.num_new[0] = 0
    with pytest.raises(ValueError, match="num_new"):
        runner.forward(batch, mgr.pool)
    batch = StepBatch.build([[5, 6]], [0], [mgr.slots(1, 2)])
    batch.past_len[0] = 3  # slot table too short for past + new
    with pytest.raises(ValueError, match="slot_table"):
        runner.forward(batch, mgr.pool)
    long = StepBatch(
        input_ids=torch.tensor([[5]]),
        num_new=torch.tensor([1]),
        past_len=torch.tensor([runner.spec.max_positions]),
        slot_table=torch.zeros(1, runner.spec.max_positions + 1, dtype=torch.int64),
    )
    with pytest.raises(ValueError, match="max_positions"):
        runner.forward(long, mgr.pool)
