"""Runners (torch and ONNX) against Hugging Face's own forward pass, with a paged KV pool.

No server. Two tiny seeded models (tiny-gpt2; a tiny grouped-query Llama with tied
embeddings), each with both runners. The ONNX artifacts come from the project's exporter
(tritonlm.export.onnx_export), once per module.
"""

from __future__ import annotations

import pytest
import torch

from tritonlm.engine.batch import StepBatch
from tritonlm.engine.kv_cache import KVCacheManager
from tritonlm.engine.runners import SCRATCH_SLOT, Runner, load_runner
from tritonlm.engine.runners.torch_runner import TorchRunner
from tritonlm.models.builtin import build_tiny

ATOL = 1e-4
VOCAB = 512


def tiny_llama(**overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    args = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        # tied random embeddings at the default 0.02 make every token predict itself
        # (greedy text is one token repeated); larger weights give varied continuations
        initializer_range=0.2,
    )
    args.update(overrides)
    torch.manual_seed(77)
    return LlamaForCausalLM(LlamaConfig(**args)).eval()


@pytest.fixture(scope="module")
def hf_models():
    return {"gpt2": build_tiny("tiny-gpt2")[0], "llama": tiny_llama()}


@pytest.fixture(scope="module")
def onnx_paths(hf_models, tmp_path_factory):
    from tritonlm.export.onnx_export import export_decoder_onnx

    out = tmp_path_factory.mktemp("onnx")
    return {arch: export_decoder_onnx(model, out / f"{arch}.onnx") for arch, model in hf_models.items()}


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


# ---------------------------------------------------------------------------- helpers


def tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n,), generator=g).tolist()


@torch.no_grad()
def hf_logits(model, ids: list[int]) -> torch.Tensor:
    """[len(ids), V] HF logits of the full sequence, run alone."""
    return model(torch.tensor([ids])).logits[0].float()


def manager(runner, blocks: int = 40, block_size: int = 4) -> KVCacheManager:
    budget = runner.spec.bytes_per_token * block_size * blocks
    return KVCacheManager(runner.spec, budget, block_size=block_size, allocate_kv=runner.allocate_kv)


def step(runner, mgr, rows, all_logits=False):
    """rows: list of (seq_id, past_len, new_tokens). Runs one forward, returns logits."""
    batch = StepBatch.build(
        [new for _, _, new in rows],
        [past for _, past, _ in rows],
        [mgr.slots(sid, past + len(new)) for sid, past, new in rows],
        all_logits=all_logits,
    )
    return runner.forward(batch, pool=mgr.pool)


def close(a, b, atol=ATOL):
    diff = (a - b).abs().max().item()
    assert diff <= atol, f"max abs diff {diff:.3g} > {atol}"


# ---------------------------------------------------------------------------- (a)


def test_runner_protocol(case):
    _, runner = case
    assert isinstance(runner, Runner)
    assert runner.spec.vocab_size == VOCAB


def test_prefill_then_decode_matches_hf(case):
    model, runner = case
    mgr = manager(runner)
    seq = tokens(16, seed=1)
    ref = hf_logits(model, seq)
    mgr.allocate(1, len(seq))
    out = step(runner, mgr, [(1, 0, seq[:10])])
    assert out.shape == (1, VOCAB) and out.dtype == torch.float32
    close(out[0], ref[9])
    for p in range(10, 16):
        out = step(runner, mgr, [(1, p, [seq[p]])])
        close(out[0], ref[p])


# ---------------------------------------------------------------------------- (b)


def scattered_manager(runner):
    """Blocks of 4 slots. Seq 7's blocks are [5, 3, 1]: descending, with the live bystanders'
    blocks 2, 4 and 6 between them. Seqs 8 and 9 get fresh blocks after them."""
    mgr = manager(runner, blocks=24, block_size=4)
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
    a, b, c = tokens(8, seed=2), tokens(8, seed=3), tokens(9, seed=4)
    # pasts written one sequence at a time: a has 3 cached, b has 7, c (scattered blocks) has 6
    step(runner, mgr, [(8, 0, a[:3])])
    step(runner, mgr, [(9, 0, b[:7])])
    step(runner, mgr, [(7, 0, c[:6])])
    # ONE call: a prefills a chunk of 5, b decodes 1 on a past of 7, c verifies 3
    rows = [(8, 3, a[3:8]), (9, 7, b[7:8]), (7, 6, c[6:9])]
    out = step(runner, mgr, rows, all_logits=True)
    assert out.shape == (3, 5, VOCAB)
    close(out[0, :5], hf_logits(model, a)[3:8])
    close(out[1, :1], hf_logits(model, b)[7:8])
    close(out[2, :3], hf_logits(model, c)[6:9])
    # the same mixed call, last-token logits only
    # (re-running it rewrites the same K/V into the same slots: idempotent)
    out = step(runner, mgr, rows)
    assert out.shape == (3, VOCAB)
    close(out[0], hf_logits(model, a)[7])
    close(out[1], hf_logits(model, b)[7])
    close(out[2], hf_logits(model, c)[8])
    # what the mixed call wrote is right: one more decode each, batched
    a2, b2, c2 = a + [11], b + [12], c + [13]
    out = step(runner, mgr, [(8, 8, [11]), (9, 8, [12]), (7, 9, [13])])
    close(out[0], hf_logits(model, a2)[-1])
    close(out[1], hf_logits(model, b2)[-1])
    close(out[2], hf_logits(model, c2)[-1])


# ---------------------------------------------------------------------------- (c)


def test_chunked_prefill_equals_one_shot(case):
    model, runner = case
    mgr = manager(runner)
    prompt = tokens(20, seed=5)
    mgr.allocate(1, 20)
    mgr.allocate(2, 20)
    one = step(runner, mgr, [(1, 0, prompt)], all_logits=True)[0]  # [20, V]
    chunks, past = [], 0
    for n in (8, 8, 4):
        chunks.append(step(runner, mgr, [(2, past, prompt[past : past + n])], all_logits=True)[0, :n])
        past += n
    chunked = torch.cat(chunks)
    close(chunked, one, atol=1e-5)
    close(one, hf_logits(model, prompt))
    # both sequences' caches hold the same keys/values
    s1, s2 = mgr.slots(1, 20), mgr.slots(2, 20)
    for cache in mgr.pool.k + mgr.pool.v:
        close(cache[s1], cache[s2], atol=1e-5)


# ---------------------------------------------------------------------------- (d)


def test_all_logits_for_speculative_verify(case):
    model, runner = case
    mgr = manager(runner)
    seq, other = tokens(10, seed=6), tokens(7, seed=7)
    mgr.allocate(1, 10)
    mgr.allocate(2, 7)
    step(runner, mgr, [(1, 0, seq[:6]), (2, 0, other[:5])])
    # verify K=4 drafted tokens for seq, 2 for other (right-padded to width 4)
    out = step(runner, mgr, [(1, 6, seq[6:10]), (2, 5, other[5:7])], all_logits=True)
    assert out.shape == (2, 4, VOCAB) and out.dtype == torch.float32
    close(out[0], hf_logits(model, seq)[6:10])
    close(out[1, :2], hf_logits(model, other)[5:7])


# ---------------------------------------------------------------------------- (e)


def greedy(runner, mgr, prompts: list[list[int]], new: int) -> list[list[int]]:
    """Batched greedy decode: prefill all prompts in one call, then decode steps."""
    sids = list(range(1, len(prompts) + 1))
    for sid, p in zip(sids, prompts):
        mgr.allocate(sid, len(p) + new)
    out = step(runner, mgr, [(sid, 0, p) for sid, p in zip(sids, prompts)])
    gen = [[int(t)] for t in out.argmax(-1)]
    for _ in range(new - 1):
        rows = [(sid, len(p) + len(g) - 1, [g[-1]]) for sid, p, g in zip(sids, prompts, gen)]
        out = step(runner, mgr, rows)
        for g, t in zip(gen, out.argmax(-1)):
            g.append(int(t))
    return gen


@torch.no_grad()
def hf_greedy(model, prompt: list[int], new: int) -> list[int]:
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        do_sample=False,
        max_new_tokens=new,
        min_new_tokens=new,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def test_greedy_decode_equals_generate(case):
    model, runner = case
    prompts = [tokens(5, seed=8), tokens(11, seed=9)]
    mgr = manager(runner)
    ours = greedy(runner, mgr, prompts, 20)
    for prompt, got in zip(prompts, ours):
        want = hf_greedy(model, prompt, 20)
        assert got == want
    assert len(set(ours[0])) > 1  # a non-degenerate continuation


# ---------------------------------------------------------------------------- (f)


CANARY = 7.25


def test_padding_never_touches_other_slots(case):
    _, runner = case
    mgr = manager(runner, blocks=16, block_size=4)
    for cache in mgr.pool.k + mgr.pool.v:
        cache.fill_(CANARY)
    mgr.allocate(1, 12)
    mgr.allocate(2, 12)
    mgr.allocate(3, 12)  # a live bystander: not in the batch
    a, b = tokens(5, seed=10), tokens(1, seed=11)
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
    seq = tokens(6, seed=12)
    ref = hf_logits(model, seq)[-1]
    for runner in (
        load_runner("torch", tmp_path),
        load_runner("onnx", tmp_path, onnx_path=onnx_paths["gpt2"]),
    ):
        assert runner.spec.architecture == "gpt2"
        mgr = manager(runner)
        mgr.allocate(1, 6)
        close(step(runner, mgr, [(1, 0, seq)])[0], ref)


def test_bad_batches_are_refused(hf_models):
    runner = load_runner("torch", hf_models["gpt2"])
    mgr = manager(runner)
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


# ---------------------------------------------------------------------------- Llama variants


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default", "rope_theta": 500000.0},
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
        {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ],
    ids=lambda r: r["rope_type"],
)
def test_llama_rope_variants_and_untied_head(rope):
    model = tiny_llama(rope_parameters=rope, tie_word_embeddings=False, num_key_value_heads=1)
    runner = TorchRunner(model)
    seq = tokens(12, seed=13)
    mgr = manager(runner)
    mgr.allocate(1, 12)
    first = step(runner, mgr, [(1, 0, seq[:9])], all_logits=True)[0]
    rest = step(runner, mgr, [(1, 9, seq[9:])], all_logits=True)[0]
    out = torch.cat([first, rest])
    close(out, hf_logits(model, seq))


def test_llama_length_dependent_rope_is_refused():
    model = tiny_llama(rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    with pytest.raises(ValueError, match="rope_type 'dynamic'"):
        TorchRunner(model)


# ---------------------------------------------------------------------------- reduced precision


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_torch_runner_half_precision(hf_models, dtype):
    """Weights and KV pool in half precision; logits still float32 and close to fp32 HF."""
    model = hf_models["gpt2"]
    runner = load_runner("torch", model, dtype=dtype)
    mgr = manager(runner)
    assert runner.spec.dtype == dtype and mgr.pool.k[0].dtype == dtype
    seq = tokens(12, seed=15)
    ref = hf_logits(model, seq)
    mgr.allocate(1, 12)
    step(runner, mgr, [(1, 0, seq[:10])])
    out = step(runner, mgr, [(1, 10, seq[10:])], all_logits=True)
    assert out.dtype == torch.float32
    close(out[0], ref[10:12], atol=0.1)
    assert next(model.parameters()).dtype == torch.float32  # the HF model itself is left alone


def test_onnx_fp16_artifact(hf_models, onnx_paths, tmp_path):
    """An fp16 artifact: inputs/outputs cast per declared types, KV pool in fp16, logits float32."""
    import onnx
    from onnxruntime.transformers.float16 import convert_float_to_float16

    from tritonlm.engine.runners.onnx_runner import OnnxRunner

    fp16 = convert_float_to_float16(onnx.load(str(onnx_paths["gpt2"])), keep_io_types=False)
    path = tmp_path / "gpt2-fp16.onnx"
    onnx.save(fp16, str(path))
    model = hf_models["gpt2"]
    runner = OnnxRunner(model, path)
    assert runner.spec.dtype == torch.float16
    mgr = manager(runner)
    assert mgr.pool.k[0].dtype == torch.float16
    seq = tokens(10, seed=14)
    ref = hf_logits(model, seq)
    mgr.allocate(1, 10)
    out = step(runner, mgr, [(1, 0, seq[:8])])
    assert out.dtype == torch.float32
    close(out[0], ref[7], atol=0.1)
    out = step(runner, mgr, [(1, 8, seq[8:10])], all_logits=True)
    close(out[0], ref[8:10], atol=0.1)
    assert out[0].argmax(-1).tolist() == ref[8:10].argmax(-1).tolist()


# ---------------------------------------------------------------------------- blocked weights


def test_blocked_row_buckets_are_few_cover_every_count_and_waste_little():
    from tritonlm.engine.runners.layers import blocked_rows

    padded = [blocked_rows(m) for m in range(1, 8193)]
    assert all(p >= m for m, p in zip(range(1, 8193), padded))
    assert padded[:8] == list(range(1, 9))  # single rows and small batches exactly
    assert len(set(padded)) <= 70  # a bounded set of matmul shapes (oneDNN keeps kernels per shape)
    assert max(p / m for m, p in zip(range(9, 8193), padded[8:])) <= 1.9
    assert all(p / m <= 1.25 for m, p in zip(range(65, 8193), padded[64:]))


@pytest.mark.parametrize("widths", [[1] * 9, [7, 3], [70, 5, 33]])
def test_blocked_weights_give_the_plain_matmul_logits(widths):
    """The default CPU float path (oneDNN-blocked weights, rows padded to a bucket) against
    the same weights multiplied plainly, x @ w [in, out], for row counts inside and across
    buckets; a blocked projection refuses to be sliced, naming why."""
    from tritonlm.engine.parallel.shard import tensor_slice
    from tritonlm.engine.runners.model import Transformer

    model = tiny_llama(tie_word_embeddings=False)
    runner = TorchRunner(model)
    assert runner.transformer.layers[0].qkv.blocked is not None and runner.transformer.lm_head.blocked is not None
    plain = TorchRunner(model)
    plain.transformer = Transformer.from_hf(model)  # not blocked
    plain.transformer.use_paged_kernel()  # the same C++ ops as the blocked runner: only the matmuls differ
    gen = torch.Generator().manual_seed(sum(widths))
    rows = [torch.randint(0, VOCAB, (w,), generator=gen).tolist() for w in widths]
    outs = []
    for r in (runner, plain):
        cache = KVCacheManager(r.spec, (sum(w // 16 + 2 for w in widths) + 1) * 16 * r.spec.bytes_per_token, 16,
                               allocate_kv=r.allocate_kv)
        for b, w in enumerate(widths):
            cache.allocate(b, w)
        outs.append(r.forward(StepBatch.build(rows, [0] * len(rows), [cache.slots(b, w) for b, w in enumerate(widths)],
                                              all_logits=True), cache.pool))
    for b, w in enumerate(widths):
        close(outs[0][b, :w], outs[1][b, :w], atol=1e-5)
    with pytest.raises(ValueError, match="blocked weights cannot be sliced"):
        tensor_slice(runner.transformer, 0, 2)


# ---------------------------------------------------------------------------- paged-attention kernel


@pytest.mark.parametrize(
    "heads, kv_heads, head_dim, width, rotary",
    [(9, 3, 64, 1, True), (4, 2, 16, 1, False), (8, 8, 128, 4, True), (6, 2, 24, 3, True), (4, 1, 64, 8, False)],
    ids=["gqa-d64-decode-rope", "gqa-d16", "mha-d128-verify4-rope", "gqa-d24-generic-rope", "mqa-d64-verify8"],
)
def test_paged_attention_kernel_equals_the_gather_path(heads, kv_heads, head_dim, width, rotary):
    """The C++ op takes the fused [q | k | v] projection: it applies RoPE, writes the new K/V
    into the pool and reads every row's K/V through the slot table. The torch path rotates
    with apply_rope, writes with index_copy_, gathers and runs SDPA with the key mask. Same
    outputs on scattered slots, rows of different lengths and padded rows (num_new < width),
    and the same K/V in the pool."""
    from tritonlm.engine.kernels import kernels_available
    from tritonlm.engine.kv_cache import KVPool
    from tritonlm.engine.runners.base import kv_rows, plan_step
    from tritonlm.engine.runners.layers import StepContext, apply_rope, paged_attention, rope_cos_sin

    assert kernels_available() == (True, "built for this CPU")
    g = torch.Generator().manual_seed(heads * 100 + head_dim + width)
    bsz, slots = 5, 400
    past = [0, 37, 120, 5, 64][:bsz]
    new = [min(width, n) for n in (width, 1, width, max(1, width - 1), 1)]
    perm = (torch.randperm(slots - 1, generator=g) + 1).tolist()  # scattered, never the scratch slot 0
    rows, at = [], 0
    for p, n in zip(past, new):
        rows.append(perm[at:at + p + n])
        at += p + n
    batch = StepBatch.build([[0] * n for n in new], past, rows)
    plan = plan_step(batch, torch.device("cpu"))
    qkv = torch.randn(bsz, width, (heads + 2 * kv_heads) * head_dim, generator=g)  # [B, T, (H + 2 Hkv) D]
    q, k, v = qkv.view(bsz, width, heads + 2 * kv_heads, head_dim).split([heads, kv_heads, kv_heads], dim=2)
    cos = sin = None
    if rotary:
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        cos, sin = rope_cos_sin(plan.positions, inv_freq, 1.0, torch.float32)  # [B, T, 1, D]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    pools = [KVPool.allocate(slots, 1, kv_heads, head_dim, torch.float32, torch.device("cpu")) for _ in range(2)]
    for pool in pools:  # the same random past in both
        pool.k[0].copy_(torch.randn(slots, kv_heads, head_dim, generator=torch.Generator().manual_seed(1)))
        pool.v[0].copy_(torch.randn(slots, kv_heads, head_dim, generator=torch.Generator().manual_seed(2)))
    scale = head_dim**-0.5
    gather_ctx = StepContext(plan=plan, mask=plan.key_mask().unsqueeze(1), rows=kv_rows(plan.slot_table, kv_heads),
                             k_buf=None, v_buf=None, rope=None)
    want = paged_attention(q, k, v, pools[0].k[0], pools[0].v[0], gather_ctx, scale)  # [B, T, H*D]
    got = torch.ops.tritonlm.paged_attention_qkv(qkv, pools[1].k[0], pools[1].v[0], plan.write_slots,
                                                 plan.slot_table.contiguous(), plan.positions, cos, sin, heads, scale)
    valid = plan.valid.unsqueeze(-1)  # padded rows' outputs are don't-care
    diff = ((got - want) * valid).abs().max().item()
    assert diff < 2e-6, f"kernel vs gather path: max abs diff {diff:.3g}"
    written = plan.write_slots[plan.valid]  # the new tokens' slots: RoPE's products may round differently (FMA)
    assert (pools[0].k[0][written] - pools[1].k[0][written]).abs().max().item() < 1e-6
    others = torch.ones(slots, dtype=torch.bool)
    others[written] = False
    others[SCRATCH_SLOT] = False  # padding rows write there
    assert torch.equal(pools[0].k[0][others], pools[1].k[0][others])
    real = torch.arange(slots) != SCRATCH_SLOT
    assert torch.equal(pools[0].v[0][real], pools[1].v[0][real])  # values are copied as they are


def test_paged_attention_kernel_gives_a_row_the_same_bits_alone_in_a_batch_and_among_new_tokens():
    """With AVX-512 a row's keys go 16 at a time (their dot products summed together) and its
    last < 16 one at a time: which keys take which way depends on the row alone, so its output
    may not change with the rows beside it. Two new tokens: the second sees 48 keys (three
    blocks), the first 47 (two blocks and 15 keys one at a time)."""
    from tritonlm.engine.kernels import kernels_available

    assert kernels_available()[0]
    op = torch.ops.tritonlm.paged_attention_qkv
    g = torch.Generator().manual_seed(7)
    H, Hkv, D, S = 9, 3, 64, 700
    W = (H + 2 * Hkv) * D
    k_pool, v_pool = torch.randn(S, Hkv, D, generator=g), torch.randn(S, Hkv, D, generator=g)
    perm = torch.randperm(S - 1, generator=g) + 1
    cos_at, sin_at = torch.randn(128, D, generator=g), torch.randn(128, D, generator=g)  # per position
    n, L = 48, 80  # the row under test: positions 0..47, the last two new
    table = perm[:L]
    q_new, q_before = torch.randn(W, generator=g), torch.randn(W, generator=g)

    def call(tables, positions, rows, k, v):  # tables [B, L], positions [B, T], rows [B, T, W]
        pos = torch.tensor(positions)
        ws = torch.gather(torch.stack(tables), 1, pos).contiguous()
        return op(torch.stack(rows).contiguous(), k, v, ws, torch.stack(tables).contiguous(), pos,
                  cos_at[pos].contiguous(), sin_at[pos].contiguous(), H, D**-0.5)

    # two new tokens (positions 35, 36) in one call: it writes both keys
    k, v = k_pool.clone(), v_pool.clone()
    among = call([table], [[n - 2, n - 1]], [torch.stack([q_before, q_new])], k, v)[0]  # [2, H * D]
    # each alone, over the pool that call left (both new keys are there)
    alone = call([table], [[n - 1]], [q_new.unsqueeze(0)], k.clone(), v.clone())[0, 0]
    alone_before = call([table], [[n - 2]], [q_before.unsqueeze(0)], k.clone(), v.clone())[0, 0]
    # in a batch of rows with 5, 16 and 70 keys
    others = [perm[L * i:L * (i + 1)] for i in (1, 2, 3)]
    rows = [torch.randn(1, W, generator=g) for _ in range(3)]
    batch = call([others[0], others[1], table, others[2]], [[4], [15], [n - 1], [69]],
                 [rows[0], rows[1], q_new.unsqueeze(0), rows[2]], k.clone(), v.clone())[2, 0]
    assert torch.equal(alone, among[1]), f"max abs diff {(alone - among[1]).abs().max().item():.3g}"
    assert torch.equal(alone_before, among[0]), f"max abs diff {(alone_before - among[0]).abs().max().item():.3g}"
    assert torch.equal(alone, batch), f"max abs diff {(alone - batch).abs().max().item():.3g}"


def test_paged_attention_kernel_refuses_bad_tensors_naming_them():
    from tritonlm.engine.kernels import kernels_available

    assert kernels_available()[0]
    qkv, cache = torch.randn(1, 1, 4 * 8), torch.randn(4, 1, 8)  # 2 query heads, 1 kv head of 8
    slots, pos, write = torch.tensor([[1, 2]]), torch.tensor([[1]]), torch.tensor([[2]])
    op = torch.ops.tritonlm.paged_attention_qkv
    with pytest.raises(RuntimeError, match="float32 only"):
        op(qkv.double(), cache, cache, write, slots, pos, None, None, 2, 1.0)
    with pytest.raises(RuntimeError, match=r"slot 9 outside the pool \[0, 4\)"):
        op(qkv, cache, cache, write, torch.tensor([[1, 9]]), pos, None, None, 2, 1.0)
    with pytest.raises(RuntimeError, match=r"write slot 7 outside the pool \[0, 4\)"):
        op(qkv, cache, cache, torch.tensor([[7]]), slots, pos, None, None, 2, 1.0)
    with pytest.raises(RuntimeError, match=r"position 2 outside the slot table \[0, 2\)"):
        op(qkv, cache, cache, write, slots, torch.tensor([[2]]), None, None, 2, 1.0)
    with pytest.raises(RuntimeError, match="qkv's last dim is 32; 3 query heads and 1 kv heads of 8 need 40"):
        op(qkv, cache, cache, write, slots, pos, None, None, 3, 1.0)
    with pytest.raises(RuntimeError, match="cos and sin must be float32, contiguous, B \\* T \\* D values"):
        op(qkv, cache, cache, write, slots, pos, torch.ones(1, 1, 4), torch.ones(1, 1, 4), 2, 1.0)


@pytest.mark.parametrize("shape", [(1, 1, 576), (3, 5, 40), (700, 96)], ids=["decode-row", "tail-lanes", "many-rows"])
def test_fused_norm_and_activation_ops_equal_the_torch_math(shape):
    """rms_norm / add_rms_norm against transformers' LlamaRMSNorm math in float32, silu_mul
    against F.silu(gate) * up, int8_linear against Int8Linear's torch ops: one row, widths that are not a multiple of the
    vector width (the scalar tail), and enough rows to be split over threads."""
    from tritonlm.engine.kernels import kernels_available

    assert kernels_available()[0]
    g = torch.Generator().manual_seed(sum(shape))
    x, delta = torch.randn(*shape, generator=g) * 3, torch.randn(*shape, generator=g)
    w, eps = torch.randn(shape[-1], generator=g), 1e-5

    def hf_rms(t):  # LlamaRMSNorm.forward, float32
        return w * (t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps))

    ops = torch.ops.tritonlm
    torch.testing.assert_close(ops.rms_norm(x, w, eps), hf_rms(x), rtol=1e-5, atol=1e-5)
    total, normed = ops.add_rms_norm(x, delta, w, eps)
    assert torch.equal(total, x + delta)
    torch.testing.assert_close(normed, hf_rms(x + delta), rtol=1e-5, atol=1e-5)
    gate_up = torch.randn(*shape[:-1], 2 * shape[-1], generator=g) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(ops.silu_mul(gate_up), torch.nn.functional.silu(gate) * up, rtol=1e-5, atol=1e-6)
    # int8 linear (row scaling, fbgemm's kernel, rescale, bias in one op): the same bits as Int8Linear's torch ops
    from tritonlm.engine.runners.layers import FloatLinear
    from tritonlm.engine.runners.quant import quantize_linear

    width = shape[-1]
    for s, b in ((None, None), (torch.rand(width, generator=g) + 0.5, torch.randn(24, generator=g))):
        proj = quantize_linear(FloatLinear(torch.randn(width, 24, generator=g), b), s)  # smooth divides at run time
        with_bias, without = proj(x), proj.matmul(x)  # torch ops
        proj.fused_op = True
        assert proj(x).shape == (*shape[:-1], 24)
        assert torch.equal(proj(x), with_bias) and torch.equal(proj.matmul(x), without)
    big = torch.tensor([[-100.0, -30.0, 0.0, 30.0, 100.0, 1e4, -1e4, 1.0]])  # e^-x at its clamps
    torch.testing.assert_close(ops.silu_mul(torch.cat([big, torch.ones_like(big)], -1)),
                               torch.nn.functional.silu(big), rtol=1e-5, atol=1e-6)


def test_fused_ops_refuse_bad_tensors_naming_them():
    from tritonlm.engine.kernels import kernels_available

    assert kernels_available()[0]
    ops, x = torch.ops.tritonlm, torch.randn(2, 8)
    with pytest.raises(RuntimeError, match="rms_norm: x must be a contiguous float32 CPU tensor"):
        ops.rms_norm(x.double(), torch.ones(8), 1e-5)
    with pytest.raises(RuntimeError, match="rms_norm: w has 4 values; x's rows have 8"):
        ops.rms_norm(x, torch.ones(4), 1e-5)
    with pytest.raises(RuntimeError, match=r"add_rms_norm: delta \[2, 4\] must have x's shape \[2, 8\]"):
        ops.add_rms_norm(x, torch.randn(2, 4), torch.ones(8), 1e-5)
    with pytest.raises(RuntimeError, match=r"silu_mul: gate_up's last dim \(7\) must be even"):
        ops.silu_mul(torch.randn(2, 7))
    with pytest.raises(RuntimeError, match="silu_mul: gate_up must be a contiguous float32 CPU tensor"):
        ops.silu_mul(torch.randn(8, 2).t())
    from tritonlm.engine.runners.layers import INT8_REDUCE_RANGE, FloatLinear
    from tritonlm.engine.runners.quant import quantize_linear

    packed = quantize_linear(FloatLinear(torch.randn(8, 6), None)).packed
    with pytest.raises(RuntimeError, match=r"int8_linear: buf must be \[>= 3, 8\] \(the pinned row and x's rows\), not \[2, 8\]"):
        ops.int8_linear(x, None, None, packed, torch.zeros(2, 8), INT8_REDUCE_RANGE)
    with pytest.raises(RuntimeError, match="int8_linear: smooth has 4 values; x's rows have 8"):
        ops.int8_linear(x, torch.ones(4), None, packed, torch.zeros(3, 8), INT8_REDUCE_RANGE)
    with pytest.raises(RuntimeError, match="int8_linear: bias has 5 values; the weights have 6 outputs"):
        ops.int8_linear(x, None, torch.ones(5), packed, torch.zeros(3, 8), INT8_REDUCE_RANGE)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("int8", [False, True], ids=["float32", "int8"])
@pytest.mark.parametrize("widths", [[1] * 5, [3, 1, 8]], ids=["decode", "mixed"])
def test_decoder_stack_gives_the_python_loops_bits(arch, int8, widths):
    """The C++ DecoderStack (every layer of a decode-width step in one call) against
    run_layers' Python loop of the same ops: equal logits, bit for bit, over three steps.
    Llama with biased q/k/v projections (Qwen-style) so the bias paths run too; GPT-2:
    LayerNorm, biases everywhere, gelu over fc, learned positions."""
    model = tiny_llama(attention_bias=True) if arch == "llama" else build_tiny("tiny-gpt2")[0]
    runner = TorchRunner(model, int8=int8)
    tr = runner.transformer
    stack = tr.decoder_stack
    assert stack is not None and stack.num_layers() == 2
    logits = []
    for use in (False, True):
        tr.decoder_stack = stack if use else None
        mgr = manager(runner, blocks=60)
        pasts = [5 + 7 * i for i in range(len(widths))]
        for sid, past in enumerate(pasts):
            mgr.allocate(sid, past + 3 * widths[sid])
            step(runner, mgr, [(sid, 0, tokens(past, seed=sid))])  # prefill (over 8 wide: the Python loop)
        out = []
        for t in range(3):
            rows = [(sid, pasts[sid] + t * w, tokens(w, seed=100 * t + sid)) for sid, w in enumerate(widths)]
            out.append(step(runner, mgr, rows, all_logits=True))
        logits.append(out)
    for a, b in zip(*logits):
        assert torch.equal(a, b), f"max abs diff {(a - b).abs().max().item():.3g}"


def test_decoder_stack_only_where_its_ops_cover_the_layers(hf_models):
    from tritonlm.engine.kernels.decoder_stack import build_decoder_stack

    assert load_runner("torch", hf_models["llama"]).transformer.decoder_stack is not None
    assert load_runner("torch", hf_models["gpt2"]).transformer.decoder_stack is not None
    assert load_runner("torch", hf_models["llama"], dtype=torch.bfloat16).transformer.decoder_stack is None
    relu = load_runner("torch", hf_models["llama"])
    relu.transformer.act = torch.nn.functional.relu  # an activation the stack does not have
    assert build_decoder_stack(relu.transformer) is None


def test_decoder_stack_refuses_an_unfinished_layer_naming_it():
    from tritonlm.engine.kernels import kernels_available

    assert kernels_available()[0]
    stack = torch.classes.tritonlm.DecoderStack(4)
    with pytest.raises(RuntimeError, match=r"add_layer: a layer takes 4 projections \(qkv, o, gate_up or fc, down\); 0 were added"):
        stack.add_layer(torch.ones(8), None, 1e-5, torch.ones(8), None, 1e-5, True, "silu_mul", 1.0)
    w = torch.randn(8, 8).contiguous()
    for _ in range(4):
        stack.add_float(torch.ops.mkldnn._reorder_linear_weight(w, None), None)
    with pytest.raises(RuntimeError, match="add_layer: act must be 'silu_mul' or 'gelu_tanh', not 'relu'"):
        stack.add_layer(torch.ones(8), None, 1e-5, torch.ones(8), None, 1e-5, True, "relu", 1.0)
    with pytest.raises(RuntimeError, match="decoder_stack: the stack must hold whole layers"):
        x = torch.zeros(1, 1, 8)
        torch.ops.tritonlm.decoder_stack(stack, x, [], [], torch.zeros(1, 1, dtype=torch.long),
                                         torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long),
                                         None, None, 1)


def test_attention_backend_falls_back_where_the_kernel_cannot_run(hf_models):
    half = load_runner("torch", hf_models["llama"], dtype=torch.bfloat16)
    assert half.attention == "gather" and "float32 on the CPU" in half.attention_why
    with pytest.raises(ValueError, match="attention: 'flash'"):
        load_runner("torch", hf_models["llama"], attention="flash")


def test_a_kernel_build_lock_left_by_a_dead_process_is_removed_a_fresh_one_kept(tmp_path):
    """torch's build lock would make every later model load wait forever after a process
    died mid-build; one older than any build is removed, a live build's is left alone."""
    import os
    import time

    from tritonlm.engine.kernels import STALE_LOCK_S, _remove_stale_lock

    lock = tmp_path / "lock"
    lock.write_text("")
    _remove_stale_lock(lock)
    assert lock.exists()  # a build in progress
    old = time.time() - STALE_LOCK_S - 5
    os.utime(lock, (old, old))
    _remove_stale_lock(lock)
    assert not lock.exists()
    _remove_stale_lock(lock)  # nothing there: no error
