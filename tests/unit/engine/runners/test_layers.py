"""tritonlm/engine/runners/layers.py: RoPE variants against transformers' Llama, and the
oneDNN-blocked projections against a plain matmul."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.models import (
    LLAMA_VOCAB,
    assert_close,
    forward_rows,
    hf_logits,
    paged_cache,
    random_tokens,
    tiny_llama,
)
from tritonlm.engine.batch import StepBatch
from tritonlm.engine.kv_cache import KVCacheManager
from tritonlm.engine.runners.torch_runner import TorchRunner


# ---------------------------------------------------------------------------- RoPE (Llama variants)


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
    seq = random_tokens(12, seed=13)
    mgr = paged_cache(runner)
    mgr.allocate(1, 12)
    first = forward_rows(runner, mgr, [(1, 0, seq[:9])], all_logits=True)[0]
    rest = forward_rows(runner, mgr, [(1, 9, seq[9:])], all_logits=True)[0]
    out = torch.cat([first, rest])
    assert_close(out, hf_logits(model, seq))


def test_an_unknown_rope_type_is_refused():
    model = tiny_llama(rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 2.0,
                                        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                        "original_max_position_embeddings": 64})
    model.config.rope_parameters["rope_type"] = "proportional"
    with pytest.raises(ValueError, match="rope_type 'proportional' is not supported"):
        TorchRunner(model)


# ---------------------------------------------------------------------------- blocked weights


def test_blocked_row_buckets_are_few_cover_every_count_and_waste_little():
    from tritonlm.engine.runners.layers import blocked_rows

    padded = [blocked_rows(m) for m in range(1, 8193)]
    assert all(p >= m for m, p in zip(range(1, 8193), padded))
    assert padded[:8] == list(range(1, 9))  # single rows and small batches exactly
    assert len(set(padded)) <= 70  # a bounded set of matmul shapes (oneDNN keeps kernels per shape)
    assert max(p / m for m, p in zip(range(9, 8193), padded[8:])) <= 1.9
    assert all(p / m <= 1.25 for m, p in zip(range(65, 8193), padded[64:]))


@pytest.mark.parametrize("layout", ["auto", "blocked"])
@pytest.mark.parametrize("widths", [[1] * 9, [7, 3], [70, 5, 33]])
def test_packed_weights_give_the_plain_matmul_logits(widths, layout):
    """The CPU float paths (tritonlm's panels where its AVX-512 kernel builds, the default;
    oneDNN-blocked weights with rows padded to a bucket) against the same weights
    multiplied plainly, x @ w [in, out], for row counts inside and across buckets; a packed
    projection refuses to be sliced, naming why."""
    from tritonlm.engine.parallel.shard import tensor_slice
    from tritonlm.engine.runners.layers import BlockedLinear, PanelLinear, panels_available
    from tritonlm.engine.runners.model import Transformer

    model = tiny_llama(tie_word_embeddings=False)
    runner = TorchRunner(model)
    runner.transformer = Transformer.from_hf(model)
    runner.transformer.block_weights(layout)
    runner.transformer.use_paged_kernel()
    kind = PanelLinear if layout == "auto" and panels_available() else BlockedLinear
    assert isinstance(runner.transformer.layers[0].qkv, kind) and isinstance(runner.transformer.lm_head, kind)
    plain = TorchRunner(model)
    plain.transformer = Transformer.from_hf(model)  # not packed
    plain.transformer.use_paged_kernel()  # the same C++ ops as the packed runner: only the matmuls differ
    gen = torch.Generator().manual_seed(sum(widths))
    rows = [torch.randint(0, LLAMA_VOCAB, (w,), generator=gen).tolist() for w in widths]
    outs = []
    for r in (runner, plain):
        cache = KVCacheManager(r.spec, (sum(w // 16 + 2 for w in widths) + 1) * 16 * r.spec.bytes_per_token, 16,
                               allocate_kv=r.allocate_kv)
        for b, w in enumerate(widths):
            cache.allocate(b, w)
        outs.append(r.forward(StepBatch.build(rows, [0] * len(rows), [cache.slots(b, w) for b, w in enumerate(widths)],
                                              all_logits=True), cache.pool))
    for b, w in enumerate(widths):
        assert_close(outs[0][b, :w], outs[1][b, :w], atol=1e-5)
    with pytest.raises(ValueError, match="weights cannot be sliced"):
        tensor_slice(runner.transformer, 0, 2)


@pytest.mark.parametrize("heads, kv_heads, width", [(8, 2, 3), (4, 4, 1)], ids=["gqa-verify3", "mha-decode"])
def test_gather_path_attention_options_equal_the_kernel(heads, kv_heads, width):
    """paged_attention (the gather path) with a sliding window's mask, soft-capping and sinks
    laid out on its GQA query rows (sink_rows) gives what the C++ kernel computes with the
    same options (the kernel is checked against float64 in tests/unit/engine/kernels/test_paged_attention.py)."""
    from tritonlm.engine.kernels import kernels_available
    from tritonlm.engine.kv_cache import KVPool
    from tritonlm.engine.runners.base import kv_rows, plan_step
    from tritonlm.engine.runners.layers import StepContext, paged_attention

    assert kernels_available()[0]
    g = torch.Generator().manual_seed(heads + width)
    dim, slots, window, softcap = 32, 300, 6, 2.0
    past, new = [0, 20, 40], [width, 1, width]
    perm = (torch.randperm(slots - 1, generator=g) + 1).tolist()
    rows, at = [], 0
    for p, n in zip(past, new):
        rows.append(perm[at:at + p + n])
        at += p + n
    plan = plan_step(StepBatch.build([[0] * n for n in new], past, rows), torch.device("cpu"))
    qkv = torch.randn(len(past), width, (heads + 2 * kv_heads) * dim, generator=g) * 2
    q, k, v = qkv.view(len(past), width, heads + 2 * kv_heads, dim).split([heads, kv_heads, kv_heads], dim=2)
    sinks = torch.randn(heads, generator=g) * 2
    pools = [KVPool.allocate(slots, 1, kv_heads, dim, torch.float32, torch.device("cpu")) for _ in range(2)]
    for pool in pools:
        pool.k[0].copy_(torch.randn(slots, kv_heads, dim, generator=torch.Generator().manual_seed(1)))
        pool.v[0].copy_(torch.randn(slots, kv_heads, dim, generator=torch.Generator().manual_seed(2)))
    mask = plan.key_mask().unsqueeze(1)  # [B, 1, T, L]
    j = torch.arange(plan.max_total)
    windowed = mask & (j > plan.positions.unsqueeze(1).unsqueeze(-1) - window)
    ctx = StepContext(plan=plan, mask=mask, rows=kv_rows(plan.slot_table, kv_heads), k_buf=None, v_buf=None, rope=None)
    want = paged_attention(q, k, v, pools[0].k[0], pools[0].v[0], ctx, dim**-0.5, windowed, softcap, sinks)
    got = torch.ops.tritonlm.paged_attention_qkv(qkv, pools[1].k[0], pools[1].v[0], plan.write_slots,
                                                 plan.slot_table.contiguous(), plan.positions, None, None, heads,
                                                 dim**-0.5, window, softcap, sinks)
    valid = plan.valid.unsqueeze(-1)
    assert ((got - want) * valid).abs().max().item() < 2e-6
    plain = paged_attention(q, k, v, pools[0].k[0].clone(), pools[0].v[0].clone(), ctx, dim**-0.5, windowed, softcap)
    assert ((want - plain) * valid).abs().max().item() > 1e-2  # the sinks took their share


# ---- Int8Linear's kernel (TRITONLM_INT8_KERNEL): tritonlm's i8_linear (kernels/int8_act8.cpp,
# 8-bit activations on every x86 level, Int8Linear.act8) by default, or fbgemm's. On the AVX2
# path a tiny Llama's int8 logits are at least as close to float32 as fbgemm's with the 7-bit
# activations an AVX2-only CPU gets from it, and rows stay batch-invariant.


def test_the_int8_kernel_is_tritonlms_on_every_cpu_unless_forced(monkeypatch):
    from tritonlm.engine.runners import layers
    from tritonlm.engine.runners.layers import int8_kernel

    monkeypatch.delenv(layers.INT8_KERNEL_ENV, raising=False)
    for vnni in (True, False):
        monkeypatch.setattr(layers, "INT8_VNNI", vnni)
        assert int8_kernel() == "tritonlm"
        monkeypatch.setenv(layers.INT8_KERNEL_ENV, " ")
        assert int8_kernel() == "tritonlm"  # empty counts as unset
        for forced in ("fbgemm", "tritonlm"):
            monkeypatch.setenv(layers.INT8_KERNEL_ENV, forced)
            assert int8_kernel() == forced
        monkeypatch.setenv(layers.INT8_KERNEL_ENV, "onednn")
        with pytest.raises(ValueError, match=r"TRITONLM_INT8_KERNEL='onednn': tritonlm .* fbgemm"):
            int8_kernel()
        monkeypatch.delenv(layers.INT8_KERNEL_ENV)


def int8_projections(runner: TorchRunner) -> list:
    from tritonlm.engine.runners.layers import Int8Linear

    ps = [p for p in runner.transformer.projections() if isinstance(p, Int8Linear)]
    assert ps
    return ps


def valid_logits(runner: TorchRunner, rows: list[list[int]]) -> torch.Tensor:
    """[sum of row lengths, V]: every real position's logits, the padding dropped."""
    from tests.unit.engine.runners.test_quant import logits_of

    logits = logits_of(runner, rows)
    return torch.cat([logits[b, :len(r)] for b, r in enumerate(rows)])


def test_act8_on_the_avx2_path_is_as_close_to_float32_as_7_bit_fbgemm(monkeypatch):
    from tests.unit.engine.runners.test_quant import logits_of, tiny_model
    from tritonlm.engine.kernels import kernels_available
    from tritonlm.engine.runners import layers
    from tritonlm.engine.runners.decoder_stack import build_decoder_stack

    ok, why = kernels_available()
    assert ok, why
    if "avx2" not in torch.ops.tritonlm.i8_isas():
        pytest.skip(f"this build's i8_linear has no AVX2 path: {torch.ops.tritonlm.i8_isas()}")
    model, prompts = tiny_model("llama")
    rows = prompts[:4]
    fp32 = valid_logits(TorchRunner(model), rows).double()

    monkeypatch.setenv(layers.INT8_KERNEL_ENV, "fbgemm")
    monkeypatch.setenv(layers.INT8_REDUCE_RANGE_ENV, "1")  # what fbgemm gives a CPU without VNNI
    act7 = TorchRunner(model, int8=True)
    assert all(p.act8 is None and p.reduce_range for p in int8_projections(act7))
    act7_logits = valid_logits(act7, rows).double()

    monkeypatch.setenv(layers.INT8_KERNEL_ENV, "tritonlm")
    act8 = TorchRunner(model, int8=True)
    for p in int8_projections(act8):
        assert p.act8 is not None and p.packed is None
        p.act8.isa = "avx2"  # forced: this host may have VNNI; every path gives the same bits
    act8.transformer.decoder_stack = build_decoder_stack(act8.transformer)  # the stack takes the path when built
    act8_logits = valid_logits(act8, rows).double()

    def rms(d: torch.Tensor) -> float:
        return d.pow(2).mean().sqrt().item()

    err8, err7 = rms(act8_logits - fp32), rms(act7_logits - fp32)
    print(f"tiny Llama int8 logits, RMS error vs float32: 8-bit (tritonlm, avx2) {err8:.4g}, 7-bit (fbgemm) {err7:.4g}")
    assert 0 < err8 <= err7
    assert rms(act8_logits - act7_logits) > 0  # really another kernel
    assert (act8_logits - fp32).abs().max() < 0.2 * fp32.abs().max()  # near float32: a wrong layout is off by ~100%

    # batch invariance: a row's logits alone are its logits in the batch, bitwise (the
    # longest row: the same attention shapes either way)
    longest = max(range(len(rows)), key=lambda b: len(rows[b]))
    alone = logits_of(act8, [rows[longest]])[0]
    assert torch.equal(alone, logits_of(act8, rows)[longest, :len(rows[longest])])

    # the same bits through the best path this build has
    for p in int8_projections(act8):
        p.act8.isa = "auto"
    act8.transformer.decoder_stack = build_decoder_stack(act8.transformer)
    assert torch.equal(valid_logits(act8, rows).double(), act8_logits)
