"""tritonlm/engine/kernels/paged_attention.cpp's attention options: a sliding window, logit
soft-capping and attention sinks in torch.ops.tritonlm.paged_attention_qkv, against the same
attention computed in float64 from the pool the op wrote (transformers' semantics); a row's
bits alone, in a batch and among new tokens with the options on; and their refusals.
(tests/unit/engine/kernels/test_kernels.py holds the op's tests without options.)"""

from __future__ import annotations

import pytest
import torch

from tritonlm.engine.batch import StepBatch


@pytest.fixture(scope="module", autouse=True)
def kernels() -> None:
    from tritonlm.engine.kernels import kernels_available

    ok, why = kernels_available()
    assert ok, why


def reference(qkv, k_pool, v_pool, slot_table, positions, heads, scale, window=0, softcap=0.0, sinks=None):
    """[B, T, H * D] float64 from the pool after the op's write (no RoPE): query (b, t) at
    position p reads keys j <= p, and only p - window < j with a window (transformers'
    sliding_window_overlay); scores soft-capped before the mask (Gemma 2's c tanh(s / c));
    the sink logits appended to each softmax and their probabilities dropped (gpt-oss)."""
    bsz, width, _ = qkv.shape
    kv_heads, dim = k_pool.shape[1], k_pool.shape[2]
    group = heads // kv_heads
    q = qkv[..., : heads * dim].double().view(bsz, width, heads, dim)
    out = torch.zeros(bsz, width, heads, dim, dtype=torch.float64)
    for b in range(bsz):
        for t in range(width):
            p = int(positions[b, t])
            j = torch.arange(p + 1)
            slots = slot_table[b, : p + 1]
            keys = k_pool[slots].double().repeat_interleave(group, dim=1)  # [p + 1, H, D]
            values = v_pool[slots].double().repeat_interleave(group, dim=1)
            scores = torch.einsum("hd,jhd->hj", q[b, t], keys) * scale  # [H, p + 1]
            if softcap:
                scores = softcap * torch.tanh(scores / softcap)
            if window:
                scores = scores.masked_fill(j <= p - window, float("-inf"))
            if sinks is not None:
                probs = torch.cat([scores, sinks.double()[:, None]], dim=-1).softmax(-1)[:, :-1]
            else:
                probs = scores.softmax(-1)
            out[b, t] = torch.einsum("hj,jhd->hd", probs, values)
    return out.view(bsz, width, heads * dim)


OPTIONS = {
    "window-1": dict(window=1),
    "window-16": dict(window=16),
    "window-across-key-blocks": dict(window=21),
    "window-past-the-context": dict(window=1000),
    "softcap": dict(softcap=2.0),
    "sinks": dict(sinks=True),
    "all-three": dict(window=21, softcap=2.0, sinks=True),
}


@pytest.mark.parametrize("options", list(OPTIONS.values()), ids=list(OPTIONS))
@pytest.mark.parametrize(
    "heads, kv_heads, head_dim, width",
    [(8, 2, 64, 1), (4, 4, 128, 4), (6, 2, 24, 3), (4, 4, 16, 1), (4, 2, 80, 2), (2, 1, 96, 1), (2, 2, 256, 3)],
    ids=["gqa-d64-decode", "mha-d128-verify4", "gqa-d24-generic-verify3", "mha-d16-decode", "gqa-d80-verify2",
         "gqa-d96-decode", "mha-d256-verify3"],
)
def test_options_match_float64_reference(options, heads, kv_heads, head_dim, width):
    """Rows with pasts of 0 to 120 keys on scattered slots, decode and verification widths
    (a row's new tokens see windows that start at different keys), padded rows (num_new <
    width), head sizes of the unrolled AVX-512 paths (64, 128), of the run-time sized ones
    that take 16 keys and up to 96 columns at a time (16, 80, 96, 256) and of the generic one (24):
    the float64 reference, and an answer that differs from plain attention where the option
    changes anything."""
    from tritonlm.engine.runners.base import plan_step

    g = torch.Generator().manual_seed(heads * 100 + head_dim + width)
    past = [0, 37, 120, 5, 64]
    new = [min(width, n) for n in (width, 1, width, max(1, width - 1), 1)]
    slots = 400
    perm = (torch.randperm(slots - 1, generator=g) + 1).tolist()
    rows, at = [], 0
    for p, n in zip(past, new):
        rows.append(perm[at:at + p + n])
        at += p + n
    plan = plan_step(StepBatch.build([[0] * n for n in new], past, rows), torch.device("cpu"))
    qkv = torch.randn(len(past), width, (heads + 2 * kv_heads) * head_dim, generator=g) * 2  # scores of a few units
    k_pool = torch.randn(slots, kv_heads, head_dim, generator=g)
    v_pool = torch.randn(slots, kv_heads, head_dim, generator=g)
    kw = dict(options)
    if kw.get("sinks"):
        kw["sinks"] = torch.randn(heads, generator=g) * 3
    scale = head_dim**-0.5
    table = plan.slot_table.contiguous()
    got = torch.ops.tritonlm.paged_attention_qkv(qkv, k_pool, v_pool, plan.write_slots, table, plan.positions,
                                                 None, None, heads, scale, **kw)
    want = reference(qkv, k_pool, v_pool, table, plan.positions, heads, scale, **kw)
    valid = plan.valid.unsqueeze(-1)  # padded rows' outputs are don't-care
    diff = ((got.double() - want) * valid).abs().max().item()
    assert diff < 1e-5, f"kernel vs float64 reference: max abs diff {diff:.3g}"
    if kw.get("window", 0) < 120:
        plain = reference(qkv, k_pool, v_pool, table, plan.positions, heads, scale)
        assert ((want - plain) * valid).abs().max() > 1e-2  # the option was exercised


def test_keys_before_the_window_are_never_read():
    """Every slot before each row's window holds NaN: the output is finite and the window's."""
    heads, kv_heads, dim, window = 4, 2, 64, 20
    g = torch.Generator().manual_seed(3)
    positions = torch.tensor([[50], [19], [100]])
    table = (torch.randperm(399, generator=g)[:3 * 101] + 1).view(3, 101).contiguous()
    k_pool, v_pool = torch.randn(400, kv_heads, dim, generator=g), torch.randn(400, kv_heads, dim, generator=g)
    for b, p in enumerate(positions[:, 0].tolist()):
        before = table[b, : max(0, p + 1 - window)]
        k_pool[before] = float("nan")
        v_pool[before] = float("nan")
    qkv = torch.randn(3, 1, (heads + 2 * kv_heads) * dim, generator=g)
    write = torch.gather(table, 1, positions).contiguous()
    got = torch.ops.tritonlm.paged_attention_qkv(qkv, k_pool, v_pool, write, table, positions, None, None, heads,
                                                 dim**-0.5, window=window)
    assert torch.isfinite(got).all()
    want = reference(qkv, k_pool.nan_to_num(), v_pool.nan_to_num(), table, positions, heads, dim**-0.5, window=window)
    assert (got.double() - want).abs().max().item() < 1e-5


@pytest.mark.parametrize("options", [dict(window=21), dict(window=21, softcap=2.0, sinks=True)],
                         ids=["window", "all-three"])
def test_a_row_has_the_same_bits_alone_in_a_batch_and_among_new_tokens(options):
    """With a window the rows of one call start at different keys, so which keys go 16 at a
    time (AVX-512) differs between them: a row's output may still depend on the row alone."""
    op = torch.ops.tritonlm.paged_attention_qkv
    g = torch.Generator().manual_seed(11)
    H, Hkv, D, S = 9, 3, 64, 700
    W = (H + 2 * Hkv) * D
    k_pool, v_pool = torch.randn(S, Hkv, D, generator=g), torch.randn(S, Hkv, D, generator=g)
    perm = torch.randperm(S - 1, generator=g) + 1
    cos_at, sin_at = torch.randn(128, D, generator=g), torch.randn(128, D, generator=g)
    kw = dict(options)
    if kw.get("sinks"):
        kw["sinks"] = torch.randn(H, generator=g)
    n, L = 60, 80
    table = perm[:L]
    q_rows = [torch.randn(W, generator=g) for _ in range(4)]

    def call(tables, positions, rows, k, v):
        pos = torch.tensor(positions)
        ws = torch.gather(torch.stack(tables), 1, pos).contiguous()
        return op(torch.stack(rows).contiguous(), k, v, ws, torch.stack(tables).contiguous(), pos,
                  cos_at[pos].contiguous(), sin_at[pos].contiguous(), H, D**-0.5, **kw)

    k, v = k_pool.clone(), v_pool.clone()
    among = call([table], [[n - 4, n - 3, n - 2, n - 1]], [torch.stack(q_rows)], k, v)[0]  # [4, H * D]
    for i in range(4):
        alone = call([table], [[n - 4 + i]], [q_rows[i].unsqueeze(0)], k.clone(), v.clone())[0, 0]
        assert torch.equal(alone, among[i]), f"token {i}: max abs diff {(alone - among[i]).abs().max().item():.3g}"
    others = [perm[L * i:L * (i + 1)] for i in (1, 2, 3)]
    rows = [torch.randn(1, W, generator=g) for _ in range(3)]
    batch = call([others[0], others[1], table, others[2]], [[4], [15], [n - 1], [69]],
                 [rows[0], rows[1], q_rows[3].unsqueeze(0), rows[2]], k.clone(), v.clone())[2, 0]
    assert torch.equal(batch, among[3]), f"max abs diff {(batch - among[3]).abs().max().item():.3g}"


def test_default_options_give_the_bits_of_a_call_without_them():
    """window=0, softcap=0.0, sinks=None are the op's old behaviour, bit for bit."""
    g = torch.Generator().manual_seed(5)
    qkv = torch.randn(2, 1, 8 * 64, generator=g)
    k, v = torch.randn(50, 2, 64, generator=g), torch.randn(50, 2, 64, generator=g)
    table = (torch.randperm(49, generator=g)[:40] + 1).view(2, 20).contiguous()
    pos = torch.tensor([[19], [7]])
    ws = torch.gather(table, 1, pos).contiguous()
    op = torch.ops.tritonlm.paged_attention_qkv
    a = op(qkv, k.clone(), v.clone(), ws, table, pos, None, None, 4, 0.125)
    b = op(qkv, k.clone(), v.clone(), ws, table, pos, None, None, 4, 0.125, 0, 0.0, None)
    assert torch.equal(a, b)


def test_bad_options_are_refused_naming_them():
    qkv, cache = torch.randn(1, 1, 4 * 8), torch.randn(4, 1, 8)  # 2 query heads, 1 kv head of 8
    slots, pos, write = torch.tensor([[1, 2]]), torch.tensor([[1]]), torch.tensor([[2]])
    op = torch.ops.tritonlm.paged_attention_qkv
    with pytest.raises(RuntimeError, match=r"window must be >= 0 \(0: no sliding window\), not -1"):
        op(qkv, cache, cache, write, slots, pos, None, None, 2, 1.0, window=-1)
    with pytest.raises(RuntimeError, match=r"softcap must be a finite value >= 0"):
        op(qkv, cache, cache, write, slots, pos, None, None, 2, 1.0, softcap=-2.0)
    with pytest.raises(RuntimeError, match="sinks must be a contiguous float32 CPU tensor of the 2 query heads"):
        op(qkv, cache, cache, write, slots, pos, None, None, 2, 1.0, sinks=torch.zeros(3))
    with pytest.raises(RuntimeError, match="sinks must be a contiguous float32 CPU tensor"):
        op(qkv, cache, cache, write, slots, pos, None, None, 2, 1.0, sinks=torch.zeros(2, dtype=torch.float64))
