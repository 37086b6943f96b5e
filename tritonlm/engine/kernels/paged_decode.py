"""Paged-attention decode on CUDA as a Triton kernel that reads the KV pool in place.

    available(device) -> (bool, why)
    paged_decode_attention(q, k_cache, v_cache, block_table, seq_lens, block_size, scale, out=None,
                           *, window=0, softcap=0.0, sinks=None,
                           num_splits=None, block_n=None, num_warps=None)
        one decode step's attention: every row's single query against its keys, read from
        the pool through its block table; optionally a sliding window, logit soft-capping
        and attention sinks (each off at its default); num_splits, block_n and num_warps
        tune (None = defaults)
    default_num_splits(batch, kv_heads, device) -> int

Its micro-benchmark for a GPU is perf/bench_paged_decode.py.

Why a kernel: the torch path (runners/layers.py `paged_attention`) first gathers every
row's K and V out of the pool into dense [B, Hkv, L, D] buffers and then runs SDPA over
them, so each step moves the whole context through memory three times (read the pool,
write the buffers, read them again) and pads every row to the batch's longest. Decode is
bound by memory traffic, so this kernel reads each row's keys once, straight from the
pool slots its block table names, and only up to its own length.

Why Triton (and not the C++ op next to it, which is CPU-only): it compiles for the GPU
the engine runs on, without a CUDA toolchain at install time, and its interpreter
(TRITON_INTERPRET=1) runs the same kernel source on CPU tensors, which is how the unit
tests check it on machines without a GPU.

Launch design (no host read of any tensor value, so the call can be captured in a CUDA
graph and replayed with other lengths and block tables):
    main kernel, grid (B, Hkv, num_splits): one program per (row, kv head, split). It
        takes all G = H // Hkv query heads of its kv head as the rows of one tile, so each
        key block is loaded once per kv head (GQA), and loops over its share of the row's
        keys, BLOCK_N at a time, with an online (running max) softmax in float32. The
        loop bound comes from seq_lens in memory; a split's share is the row's keys (the
        last `window` of them with a sliding window) cut into num_splits chunks (multiples
        of BLOCK_N), so short rows leave later splits empty and those programs exit at once.
    combine kernel, grid (B, H), only when num_splits > 1 ("flash-decoding" split-K): the
        splits' partial (max, sum, unnormalized output) merged into the final row.
The attention options, each a constexpr switch, so a call without them compiles as before:
    window   keys at positions p - window < j <= p only, p = seq_len - 1 (transformers'
             sliding_window_overlay); keys before the window are not read
    softcap  scores s -> softcap * tanh(s / softcap) after the scale (Gemma 2)
    sinks    [H] a logit per query head that joins the softmax's denominator and weighs
             no value (gpt-oss): merged after the last key block (or in the combine kernel)
num_splits depends only on B, Hkv and the GPU's SM count (host metadata): it spreads
small batches over the SMs, which a (B, Hkv) grid would leave mostly idle.

Under the interpreter the kernel source is the same except for bfloat16 products, which
it widens to float32 first (the interpreter's tl.dot cannot multiply bfloat16), rounding
the probabilities to bfloat16 as the tensor-core path does.

The pool layout is KVPool's (kv_cache.py): per layer [num_slots, Hkv, D], the slot of
position p of row b being block_table[b, p // block_size] * block_size + p % block_size.
Inputs must be contiguous (checked); entries of the block table past a row's length and
pool slots outside a row's blocks are never read.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from tritonlm.engine.kernels.triton_device import available, built, interpreting  # noqa: F401 - available is this module's API too

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_INDEX_DTYPES = (torch.int32, torch.int64)
_MAX_SPLITS = 32  # a power of two: the combine kernel's tile covers them without padding
_LOG2E = 1.4426950408889634  # softmax runs in base 2: exp(x) = exp2(x * log2(e))

# The jitted kernels, built on first use per interpreter setting (triton_device.built says why)
_KERNELS: dict[bool, tuple[Any, Any]] = {}


def _kernels() -> tuple[Any, Any]:
    return built(_KERNELS, _build_kernels)


def _build_kernels() -> tuple[Any, Any]:
    # Bound as module globals, not locals: the compiler and the interpreter both resolve the
    # names a kernel uses through its function's __globals__.
    global tl, _max_combine, _sum_combine
    import triton
    import triton.language as tl

    # The kernels use no function of triton.language.standard (tl.max, tl.sum, tl.zeros,
    # tl.cdiv): those are jitted when triton is imported, so a process that imported triton
    # before setting TRITON_INTERPRET (pytest, collecting other tests) holds compiled-mode
    # versions that the interpreter cannot call. Reductions go through tl.reduce with the
    # standard library's combine functions instead: the interpreter recognizes them and
    # reduces with numpy without calling them, and the compiler gets exactly what tl.max and
    # tl.sum expand to for float32.
    _max_combine = tl.standard._elementwise_max
    _sum_combine = tl.standard._sum_combine

    @triton.jit
    def decode_kernel(
        q_ptr,  # [B, H, D]
        k_ptr,  # [S, Hkv, D]
        v_ptr,  # [S, Hkv, D]
        table_ptr,  # [B, M]
        lens_ptr,  # [B]
        sinks_ptr,  # [H] (SINKS only)
        out_ptr,  # [B, H, D] when SPLIT is off, else the partial outputs [B, H, num_splits, D] float32
        max_ptr,  # [B, H, num_splits] float32 (SPLIT only): running max, base-2 logits
        sum_ptr,  # [B, H, num_splits] float32 (SPLIT only): sum of exp2(logit - max)
        stride_qb,
        stride_qh,
        stride_ks,
        stride_kh,
        stride_vs,
        stride_vh,
        stride_tb,
        stride_ob,
        stride_oh,
        stride_os,  # out's split stride (SPLIT only)
        stride_mb,
        stride_mh,
        num_splits,
        scale_log2,  # the softmax scale times log2(e)
        window,  # keys of a row's sliding window (HAS_WINDOW only)
        cap_in,  # scale / softcap (SOFTCAP only): the scores' tanh argument per q . k
        cap_out,  # softcap * log2(e) (SOFTCAP only)
        GROUP: tl.constexpr,
        GROUP_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        DIM_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        BLOCK_N: tl.constexpr,
        SPLIT: tl.constexpr,
        EXACT: tl.constexpr,  # float32 inputs
        WIDEN: tl.constexpr,  # bfloat16 under the interpreter, whose tl.dot cannot multiply bfloat16
        HAS_WINDOW: tl.constexpr,
        SOFTCAP: tl.constexpr,
        SINKS: tl.constexpr,
    ):
        row = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)

        offs_g = tl.arange(0, GROUP_PAD)  # query heads of this kv head, padded for tl.dot
        offs_d = tl.arange(0, DIM_PAD)
        g_mask = offs_g < GROUP
        d_mask = offs_d < HEAD_DIM
        heads = kv_head * GROUP + offs_g

        q = tl.load(
            q_ptr + row * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
            mask=g_mask[:, None] & d_mask[None, :],
            other=0.0,
        )  # [GROUP_PAD, DIM_PAD]

        seq_len = tl.load(lens_ptr + row)
        first = seq_len * 0  # the row's first key: 0, or its window's
        if HAS_WINDOW:
            first = tl.maximum(seq_len - window, 0)
        chunk = (seq_len - first + num_splits - 1) // num_splits
        chunk = (chunk + BLOCK_N - 1) // BLOCK_N * BLOCK_N
        start = first + split * chunk
        end = tl.minimum(start + chunk, seq_len)

        m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.full([GROUP_PAD], 0.0, tl.float32)
        acc = tl.full([GROUP_PAD, DIM_PAD], 0.0, tl.float32)
        table_row = table_ptr + row * stride_tb
        k_head = k_ptr + kv_head * stride_kh
        v_head = v_ptr + kv_head * stride_vh
        for n0 in range(start, end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            n_mask = offs_n < end
            # Masked lanes load nothing: table entries and pool slots past the row's length
            # may hold anything (NaN, another row's keys, an out-of-range block).
            block = tl.load(table_row + offs_n // BLOCK_SIZE, mask=n_mask, other=0)
            # int64: slot * stride overflows int32 on large pools
            slot = block.to(tl.int64) * BLOCK_SIZE + offs_n % BLOCK_SIZE  # [BLOCK_N]
            kv_mask = n_mask[:, None] & d_mask[None, :]
            # V is loaded with K, before the scores need K: both reads are in flight together
            k = tl.load(k_head + slot[:, None] * stride_ks + offs_d[None, :], mask=kv_mask, other=0.0)
            v = tl.load(v_head + slot[:, None] * stride_vs + offs_d[None, :], mask=kv_mask, other=0.0)
            k = k.to(q.dtype)  # [BLOCK_N, DIM_PAD]
            v = v.to(q.dtype)  # [BLOCK_N, DIM_PAD]
            if EXACT:
                # float32 inputs: full-precision products (no tf32), to match a float32 reference
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            elif WIDEN:
                s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            if SOFTCAP:
                # softcap * tanh(scale * s / softcap) in base 2; tanh through exp2 (no tanh in
                # triton.language), from |x| so that exp2 only ever underflows
                x = s * cap_in
                e = tl.exp2(tl.abs(x) * -2.8853900817779268)  # e^(-2|x|)
                t = (1.0 - e) / (1.0 + e)
                s = tl.where(x < 0, -t, t) * cap_out
            else:
                s = s * scale_log2
            s = tl.where(n_mask[None, :], s, float("-inf"))  # [GROUP_PAD, BLOCK_N]
            # every block holds at least one key of the row, so m_new is finite
            m_new = tl.maximum(m_i, tl.reduce(s, 1, _max_combine))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.reduce(p, 1, _sum_combine)
            if EXACT:
                pv = tl.dot(p, v, input_precision="ieee")
            elif WIDEN:
                # the probabilities rounded to bfloat16 first, as the tensor-core path does
                pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m_i = m_new

        out_mask = g_mask[:, None] & d_mask[None, :]
        if SINKS and not SPLIT:  # the sink joins the denominator (split: in the combine kernel)
            sink = tl.load(sinks_ptr + heads, mask=g_mask, other=0.0).to(tl.float32) * 1.4426950408889634
            m_new = tl.maximum(m_i, sink)
            alpha = tl.exp2(m_i - m_new)  # 0 for a row without keys (m_i = -inf)
            l_i = l_i * alpha + tl.exp2(sink - m_new)
            acc = acc * alpha[:, None]
            m_i = m_new
        if SPLIT:
            base = row * stride_ob + split * stride_os
            tl.store(out_ptr + base + heads[:, None] * stride_oh + offs_d[None, :], acc, mask=out_mask)
            stat = row * stride_mb + heads * stride_mh + split
            tl.store(max_ptr + stat, m_i, mask=g_mask)
            tl.store(sum_ptr + stat, l_i, mask=g_mask)
        else:
            # l_i is 0 only for a row without keys (seq_len 0), whose acc is 0: zeros, not 0 / 0
            res = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            res = res.to(out_ptr.dtype.element_ty)
            tl.store(out_ptr + row * stride_ob + heads[:, None] * stride_oh + offs_d[None, :], res, mask=out_mask)

    @triton.jit
    def combine_kernel(
        part_ptr,  # [B, H, NUM_SPLITS, D] float32
        max_ptr,  # [B, H, NUM_SPLITS] float32
        sum_ptr,  # [B, H, NUM_SPLITS] float32
        sinks_ptr,  # [H] (SINKS only)
        out_ptr,  # [B, H, D]
        stride_pb,
        stride_ph,
        stride_ps,
        stride_mb,
        stride_mh,
        stride_ob,
        stride_oh,
        NUM_SPLITS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        DIM_PAD: tl.constexpr,
        SINKS: tl.constexpr,
    ):
        row = tl.program_id(0)
        head = tl.program_id(1)
        offs_s = tl.arange(0, NUM_SPLITS)
        offs_d = tl.arange(0, DIM_PAD)
        d_mask = offs_d < HEAD_DIM

        stat = row * stride_mb + head * stride_mh + offs_s
        maxes = tl.load(max_ptr + stat)  # [NUM_SPLITS]; -inf for an empty split
        sums = tl.load(sum_ptr + stat)
        m_max = tl.reduce(maxes, 0, _max_combine)
        if SINKS:
            sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634
            m_max = tl.maximum(m_max, sink)
        # -inf only for a row without keys; 0 then keeps exp2 away from -inf - -inf
        m_max = tl.where(m_max > float("-inf"), m_max, 0.0)
        w = tl.exp2(maxes - m_max)  # empty splits weigh exp2(-inf) = 0
        part = tl.load(
            part_ptr + row * stride_pb + head * stride_ph + offs_s[:, None] * stride_ps + offs_d[None, :],
            mask=d_mask[None, :],
            other=0.0,
        )  # [NUM_SPLITS, DIM_PAD]
        num = tl.reduce(part * w[:, None], 0, _sum_combine)  # [DIM_PAD]
        den = tl.reduce(sums * w, 0, _sum_combine)
        if SINKS:
            den += tl.exp2(sink - m_max)
        res = num / tl.where(den > 0, den, 1.0)  # zeros for a row without keys
        tl.store(out_ptr + row * stride_ob + head * stride_oh + offs_d, res.to(out_ptr.dtype.element_ty), mask=d_mask)

    return decode_kernel, combine_kernel


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def default_num_splits(batch: int, kv_heads: int, device: torch.device) -> int:
    """Splits per (row, kv head): enough programs to cover the GPU's SMs when B * Hkv alone
    does not, as a power of two (one combine kernel variant per value) up to _MAX_SPLITS.
    1 off CUDA (the interpreter), where more programs only cost time."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    programs = batch * kv_heads
    if programs >= sms:
        return 1
    return min(_MAX_SPLITS, _next_pow2(math.ceil(sms / programs)))


def _check(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    out: torch.Tensor | None,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> None:
    """Shapes, dtypes, devices and contiguity, and the attention options: host metadata
    only, no tensor values."""
    if q.dim() != 3:
        raise ValueError(f"q must be [B, H, D], got shape {tuple(q.shape)}")
    bsz, heads, dim = q.shape
    if k_cache.dim() != 3 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache and v_cache must be the same [S, Hkv, D], got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    kv_heads = k_cache.shape[1]
    if k_cache.shape[2] != dim:
        raise ValueError(f"head_dim differs: q has {dim}, the cache {k_cache.shape[2]}")
    if kv_heads == 0 or heads % kv_heads:
        raise ValueError(f"query heads ({heads}) must be a multiple of kv heads ({kv_heads})")
    if q.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"q must be float32, float16 or bfloat16, got {q.dtype}")
    if k_cache.dtype not in _FLOAT_DTYPES or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"k_cache and v_cache must share a float dtype, got {k_cache.dtype} and {v_cache.dtype}")
    if block_table.dim() != 2 or block_table.shape[0] != bsz or block_table.dtype not in _INDEX_DTYPES:
        raise ValueError(
            f"block_table must be [B={bsz}, M] int32 or int64, got {tuple(block_table.shape)} {block_table.dtype}"
        )
    if seq_lens.shape != (bsz,) or seq_lens.dtype not in _INDEX_DTYPES:
        raise ValueError(f"seq_lens must be [B={bsz}] int32 or int64, got {tuple(seq_lens.shape)} {seq_lens.dtype}")
    if block_size < 1 or k_cache.shape[0] % block_size:
        raise ValueError(f"block_size {block_size} must be >= 1 and divide the pool's {k_cache.shape[0]} slots")
    if not isinstance(window, int) or isinstance(window, bool) or window < 0:
        raise ValueError(f"window must be an int >= 0 (0: no sliding window), got {window!r}")
    if not isinstance(softcap, (int, float)) or not math.isfinite(softcap) or softcap < 0:
        raise ValueError(f"softcap must be a finite number >= 0 (0: no soft-capping), got {softcap!r}")
    tensors = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "block_table": block_table, "seq_lens": seq_lens}
    if sinks is not None:
        if sinks.shape != (heads,) or sinks.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"sinks must be [H={heads}] float32, float16 or bfloat16 (a logit per query head), "
                             f"got {tuple(sinks.shape)} {sinks.dtype}")
        tensors["sinks"] = sinks
    if out is not None:
        if out.shape != q.shape or out.dtype != q.dtype:
            raise ValueError(f"out must be {tuple(q.shape)} {q.dtype}, got {tuple(out.shape)} {out.dtype}")
        tensors["out"] = out
    for name, t in tensors.items():
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous (the kernel assumes the innermost dim has stride 1)")


def paged_decode_attention(
    q: torch.Tensor,  # [B, H, D] the step's one query per row
    k_cache: torch.Tensor,  # [S, Hkv, D]
    v_cache: torch.Tensor,  # [S, Hkv, D]
    block_table: torch.Tensor,  # [B, M] int32: blocks of row b in position order
    seq_lens: torch.Tensor,  # [B] int32: keys of row b, the new token's included
    block_size: int,
    scale: float,
    out: torch.Tensor | None = None,  # [B, H, D] written in place when given
    *,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,  # [H]
    num_splits: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:  # [B, H, D], q's dtype
    """out[b, h] = softmax_j(scale * q[b, h] . K[slot(b, j), h // G]) @ V[slot(b, j), h // G]
    over j < seq_lens[b], G = H // Hkv. The new token's K/V must already be in the pool.
    A cache of another float dtype than q is read as q's dtype (as the gather path does);
    a row with seq_lens 0 (padding) comes out as zeros.
    No tensor value is read on the host: safe inside CUDA graph capture.

    Attention options (each off at its default): window > 0, only the row's last `window`
    keys (j > seq_lens[b] - 1 - window); softcap > 0, each score s (scale included) becomes
    softcap * tanh(s / softcap); sinks [H], a logit per query head added to the softmax's
    denominator: out = sum_j e^(s_j) V_j / (sum_j e^(s_j) + e^(sinks[h])).

    Tuning (None picks the defaults): num_splits, the key-range splits per (row, kv head)
    (default_num_splits; above 1 rounded up to a power of two, at most 32, and the combine
    kernel runs); block_n, the keys per loop step (a power of two >= 16); num_warps."""
    _check(q, k_cache, v_cache, block_table, seq_lens, block_size, out, window, softcap, sinks)
    if out is None:
        out = torch.empty_like(q)
    for kernel, grid, args, consts in _launches(
        q, k_cache, v_cache, block_table, seq_lens, block_size, scale, out, num_splits, block_n, num_warps,
        window, softcap, sinks,
    ):
        kernel[grid](*args, **consts)
    return out


def _launches(
    q: torch.Tensor,  # [B, H, D]
    k_cache: torch.Tensor,  # [S, Hkv, D]
    v_cache: torch.Tensor,  # [S, Hkv, D]
    block_table: torch.Tensor,  # [B, M]
    seq_lens: torch.Tensor,  # [B]
    block_size: int,
    scale: float,
    out: torch.Tensor,  # [B, H, D]
    num_splits: int | None,
    block_n: int | None,
    num_warps: int | None,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,  # [H]
) -> list[tuple[Any, tuple[int, ...], list[Any], dict[str, Any]]]:
    """The kernel launches of one call, in order: (jitted kernel, grid, positional args,
    keyword constexprs and launch options). Allocates the split-K partials; reads no values.
    Kept apart from the launching so a test can compile the same launches for a GPU target."""
    bsz, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    group = heads // kv_heads
    if bsz == 0:
        return []
    if num_splits is None:
        num_splits = default_num_splits(bsz, kv_heads, q.device)
    num_splits = min(_MAX_SPLITS, _next_pow2(max(1, int(num_splits))))
    dim_pad = max(16, _next_pow2(dim))
    if block_n is None:
        # wider heads take fewer keys a step, to keep the K and V tiles' registers in bounds
        block_n = 64 if dim_pad <= 128 else 32
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= 16 (a tl.dot dimension), got {block_n}")

    decode_kernel, combine_kernel = _kernels()
    consts: dict[str, Any] = dict(
        GROUP=group,
        GROUP_PAD=max(16, _next_pow2(group)),  # tl.dot needs >= 16 rows
        HEAD_DIM=dim,
        DIM_PAD=dim_pad,
        BLOCK_SIZE=block_size,
        BLOCK_N=block_n,
        SPLIT=num_splits > 1,
        EXACT=q.dtype == torch.float32,
        WIDEN=q.dtype == torch.bfloat16 and interpreting(),
        HAS_WINDOW=window > 0,
        SOFTCAP=softcap > 0,
        SINKS=sinks is not None,
        num_warps=num_warps or 4,
    )
    strides = [
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        block_table.stride(0),
    ]
    scale_log2 = float(scale) * _LOG2E
    # the options' scalars (unused where their switch is off); softcap: the tanh's argument
    # per q . k and its factor, in base 2 as the softmax runs
    options = [int(window), float(scale) / softcap if softcap > 0 else 0.0, float(softcap) * _LOG2E]
    sinks_arg = out if sinks is None else sinks  # the sinks pointer is unused without sinks: `out` stands in
    inputs = [q, k_cache, v_cache, block_table, seq_lens, sinks_arg]
    if num_splits == 1:
        # the max and sum pointers are unused without splits: `out` stands in for them
        args = [*inputs, out, out, out, *strides, out.stride(0), out.stride(1), 0, 0, 0, 1, scale_log2, *options]
        return [(decode_kernel, (bsz, kv_heads, 1), args, consts)]

    part = torch.empty((bsz, heads, num_splits, dim), dtype=torch.float32, device=q.device)
    stats = torch.empty((2, bsz, heads, num_splits), dtype=torch.float32, device=q.device)
    run_max, run_sum = stats[0], stats[1]  # [B, H, num_splits] each
    part_strides = [part.stride(0), part.stride(1), part.stride(2)]
    stat_strides = [run_max.stride(0), run_max.stride(1)]
    args = [*inputs, part, run_max, run_sum, *strides, *part_strides, *stat_strides, num_splits, scale_log2, *options]
    combine_args = [part, run_max, run_sum, sinks_arg, out, *part_strides, *stat_strides, out.stride(0), out.stride(1)]
    # one warp holds a small [splits, D] tile; larger ones spread over more warps' registers
    combine_warps = 1 if num_splits * dim_pad <= 1024 else 4
    combine_consts: dict[str, Any] = dict(NUM_SPLITS=num_splits, HEAD_DIM=dim, DIM_PAD=dim_pad, SINKS=sinks is not None,
                                          num_warps=combine_warps)
    return [
        (decode_kernel, (bsz, kv_heads, num_splits), args, consts),
        (combine_kernel, (bsz, heads), combine_args, combine_consts),
    ]

