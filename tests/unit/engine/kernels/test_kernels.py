"""tritonlm/engine/kernels: the C++ ops the package builds (paged attention, the fused
element-wise ops, int8 linear) against the torch math they replace, their refusals of bad
tensors, and the build lock."""

from __future__ import annotations

import os

import pytest
import torch

from tritonlm.engine.batch import StepBatch
from tritonlm.engine.runners import SCRATCH_SLOT


# ---------------------------------------------------------------------------- paged attention


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
    from tritonlm.engine.runners.layers import StepContext, paged_attention
    from tritonlm.engine.runners.rope import apply_rope, rope_cos_sin

    assert kernels_available()[0]
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


# ---------------------------------------------------------------------------- fused ops


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
        proj.cpp_op = True
        assert proj(x).shape == (*shape[:-1], 24)
        assert torch.equal(proj(x), with_bias) and torch.equal(proj.matmul(x), without)
    big = torch.tensor([[-100.0, -30.0, 0.0, 30.0, 100.0, 1e4, -1e4, 1.0]])  # e^-x at its clamps
    torch.testing.assert_close(ops.silu_mul(torch.cat([big, torch.ones_like(big)], -1)),
                               torch.nn.functional.silu(big), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rows, vocab", [(1, 1), (3, 7), (5, 33), (64, 512), (9, 49152)],
                         ids=["one-value", "tail-only", "lanes-and-tail", "many-rows", "large-vocab"])
def test_greedy_argmax_equals_torch_max(rows, vocab):
    """The first largest index of every row, as torch.max(dim=-1) gives it, on random rows and
    on rows made of ties (the first must win: ties at both ends of a vector and in the tail)."""
    from tritonlm.engine.kernels import kernels_available

    assert kernels_available()[0]
    g = torch.Generator().manual_seed(rows * 7919 + vocab)
    x = torch.randn(rows, vocab, generator=g)
    ties = torch.randint(0, 3, (rows, vocab), generator=g).float()  # many equal maxima per row
    for logits in (x, ties, -ties, x.round()):
        got = torch.ops.tritonlm.greedy_argmax(logits)
        assert got.dtype == torch.int64
        assert got.tolist() == torch.max(logits, dim=-1).indices.tolist()


def test_greedy_argmax_marks_rows_whose_winner_is_not_finite():
    """-1 where torch.max's winning value would not be finite: a NaN anywhere in the row (in
    the vector lanes or the tail), +inf, or a row of -inf; -0.0 ties 0.0 (the first wins)."""
    nan, inf = float("nan"), float("inf")
    rows = [[1.0] * 40 for _ in range(6)]
    rows[0][3] = nan  # in the first vector
    rows[1][38] = nan  # in the tail
    rows[2][20] = inf
    rows[3] = [-inf] * 40
    rows[4][5] = 2.0  # a finite winner
    rows[5] = [-0.0, 0.0] * 20
    got = torch.ops.tritonlm.greedy_argmax(torch.tensor(rows))
    assert got.tolist() == [-1, -1, -1, -1, 5, 0]


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
    with pytest.raises(RuntimeError, match=r"greedy_argmax: logits must be \[n, V\], not \[2, 3, 4\]"):
        ops.greedy_argmax(torch.randn(2, 3, 4))
    with pytest.raises(RuntimeError, match="greedy_argmax: logits must be a contiguous float32 CPU tensor"):
        ops.greedy_argmax(torch.randn(4, 8).half())
    from tritonlm.engine.runners.layers import FloatLinear, int8_reduce_range
    from tritonlm.engine.runners.quant import quantize_linear

    packed = quantize_linear(FloatLinear(torch.randn(8, 6), None)).packed
    with pytest.raises(RuntimeError, match=r"int8_linear: buf must be \[>= 3, 8\] \(the pinned row and x's rows\), not \[2, 8\]"):
        ops.int8_linear(x, None, None, packed, torch.zeros(2, 8), int8_reduce_range())
    with pytest.raises(RuntimeError, match="int8_linear: smooth has 4 values; x's rows have 8"):
        ops.int8_linear(x, torch.ones(4), None, packed, torch.zeros(3, 8), int8_reduce_range())
    with pytest.raises(RuntimeError, match="int8_linear: bias has 5 values; the weights have 6 outputs"):
        ops.int8_linear(x, None, torch.ones(5), packed, torch.zeros(3, 8), int8_reduce_range())


# ---------------------------------------------------------------------------- the build


def test_a_kernel_build_lock_held_by_a_process_that_died_does_not_stop_later_loads(tmp_path):
    """torch waits without limit on its build-lock file; a process killed while holding it
    (a model instance stopped during startup) would hang every later load. Loads of one
    folder hold an OS lock the kernel drops when its holder dies, and remove the file."""
    import fcntl
    import signal
    import subprocess
    import sys

    from tritonlm.engine.kernels import exclusive_build

    holder = subprocess.Popen(
        [sys.executable, "-c", (
            "import sys, time\n"
            "from pathlib import Path\n"
            "from tritonlm.engine.kernels import exclusive_build\n"
            f"with exclusive_build(Path({str(tmp_path)!r})):\n"
            f"    Path({str(tmp_path / 'lock')!r}).write_text('')\n"  # torch's file, mid-build
            "    print('held', flush=True)\n"
            "    time.sleep(3600)\n"
        )],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with open(tmp_path / "tritonlm.flock", "a") as probe, pytest.raises(BlockingIOError):
            fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a live load keeps others out
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    finally:
        holder.kill()
    assert (tmp_path / "lock").exists()  # what the dead process left
    with open(tmp_path / "tritonlm.flock", "a") as probe:
        fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the dead holder's lock went with it
        fcntl.flock(probe, fcntl.LOCK_UN)
    with exclusive_build(tmp_path):
        assert not (tmp_path / "lock").exists()


def test_kernels_load_past_a_build_lock_file_left_behind():
    """A fresh process loads the kernels although torch's lock file is in their build folder
    (the state a killed model instance leaves): the load does not wait on it. The folder is
    the one this session's build came from: the load-time compile's, or the prebuilt one's."""
    import subprocess
    import sys

    from helpers.servers import HANG_GUARD_S
    from tritonlm.engine.kernels import build_directory, kernels_available, loaded_build
    from tritonlm.engine.kernels.build import prebuilt_dir
    from tritonlm.engine.kernels.isa import level

    assert kernels_available()[0]
    built = loaded_build()
    if built.origin == "prebuilt":
        folder = prebuilt_dir() / ".build" / built.path.stem
    else:
        folder = build_directory(None if built.level == "native" else level(built.level))
    made = not folder.exists()
    folder.mkdir(parents=True, exist_ok=True)
    lock = folder / "lock"
    lock.write_text("")
    try:
        out = subprocess.run(
            [sys.executable, "-m", "tritonlm.engine.kernels"], capture_output=True, text=True, timeout=HANG_GUARD_S
        )
    finally:
        lock.unlink(missing_ok=True)
        if made:
            folder.rmdir()
    assert out.returncode == 0, out.stderr
    assert f"ok ({built.describe()})" in out.stdout, out.stdout + out.stderr


def test_every_process_builds_with_the_same_ninja(monkeypatch):
    """Two ninja versions read each other's build log as changed commands and rebuild the
    kernels in turn; the `ninja` package's comes first on PATH whatever PATH held."""
    import shutil

    import ninja

    from tritonlm.engine.kernels.build import put_ninja_on_path

    monkeypatch.setenv("PATH", os.pathsep.join(["/usr/bin", "/bin", ninja.BIN_DIR]))
    put_ninja_on_path()
    assert os.path.dirname(shutil.which("ninja")) == ninja.BIN_DIR
    assert os.environ["PATH"].split(os.pathsep).count(ninja.BIN_DIR) == 1
    put_ninja_on_path()
    assert os.environ["PATH"].split(os.pathsep)[1:3] == ["/usr/bin", "/bin"]
