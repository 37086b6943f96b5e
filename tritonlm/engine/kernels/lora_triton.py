"""LoRA adapters' updates on CUDA as Triton kernels: every row under its own adapter, adapters
of different ranks in one launch (the SGMV / BGMV kind, as in Punica and S-LoRA).

    available(device) -> (bool, why)
    pack_deltas(deltas, device) -> LoraPack
        one projection's updates of a step's adapters (deltas[s]: slot s's (a, b), or None),
        copied into two flat float32 buffers with each slot's offsets and rank
    lora_apply(y, x, slots, pack, *, block_k=None, block_r=None, block_n=None, num_warps=None)
        y[m] += (x[m] @ a_s) @ b_s for every row m with slot s = slots[m] >= 0, in place;
        rows with slot -1 (the base) are not touched

Why a kernel: the torch path (lora.apply.LoraLinear) gathers each adapter's rows, multiplies
them in two matmuls and index-adds them back: per adapter a handful of launches and two
copies of its rows, so a decode step of many adapters is bound by launches. Here one
projection's update is two launches whatever the number of adapters, each reading its rows
in place.

Why Triton: as kernels/paged_decode.py (it compiles for the GPU the engine runs on, and its
interpreter, TRITON_INTERPRET=1, runs the same source on CPU tensors, which is how the unit
tests check it on machines without a GPU). On the CPU, kernels/lora_ops.cpp does this job.

Launch design (no host read of any tensor value):
    shrink, grid (M, cdiv(max_rank, BLOCK_R)): one program per (row, BLOCK_R columns of the
        row's rank); h[m, r] = x[m] @ a_s[:, r], looping over the inputs BLOCK_K at a time,
        float32. A program whose columns start at or past its adapter's own rank (or whose row
        is a base row) exits at once: no work is padded to the largest rank.
    expand, grid (M, cdiv(out, BLOCK_N)): one program per (row, BLOCK_N output columns);
        y[m, cols] += h[m, :r_s] @ b_s[:, cols], looping over the row's own rank BLOCK_R at a
        time (the loop bound is the rank read in the kernel), accumulated in float32 and
        added to y once, in y's dtype.
max_rank (host metadata of the pack) bounds only h's width, an allocation. Per-row programs
fit decode, whose rows are few and whose update reads every adapter's weights once per
row; a prefill's tokens are more rows of the same launch.

Products are elementwise and summed with tl.reduce (no tl.dot): a row is one vector, and
tl.dot needs 16 rows; kernels/paged_decode.py says why the kernels call no function of
triton.language.standard.

Shapes: M rows, K inputs (in), N outputs (out), S adapters (slots), R_s slot s's rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from tritonlm.engine.kernels.triton_device import available, built, interpreting  # noqa: F401 - available is this module's API too

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# The jitted kernels, built on first use per interpreter setting (triton_device.built says why)
_KERNELS: dict[bool, tuple[Any, Any]] = {}


@dataclass(eq=False)
class LoraPack:
    """One projection's updates of a step's S adapters, as the kernels read them: slot s's
    a [K, R_s] at a_all[a_offsets[s]:], row-major, and its b [R_s, N] at b_all[b_offsets[s]:];
    a slot without an update of this projection has rank 0."""

    a_all: torch.Tensor  # [sum_s K * R_s] float32
    b_all: torch.Tensor  # [sum_s R_s * N] float32
    a_offsets: torch.Tensor  # [S] int64
    b_offsets: torch.Tensor  # [S] int64
    ranks: torch.Tensor  # [S] int32
    in_features: int  # K
    out_features: int  # N
    max_rank: int  # the largest R_s (h's width); 0 when no slot has an update

    @property
    def slots(self) -> int:
        return int(self.ranks.shape[0])


def pack_deltas(deltas: Sequence[tuple[torch.Tensor, torch.Tensor] | None], in_features: int, out_features: int,
                device: str | torch.device) -> LoraPack:
    """deltas[s]: slot s's (a [K, R_s], b [R_s, N]), float32 (LoraDelta's dense a and b), or
    None (rank 0). Copies them into one LoraPack on `device`; reads shapes only."""
    device = torch.device(device)
    a_parts, b_parts, a_offsets, b_offsets, ranks = [], [], [], [], []
    a_at = b_at = 0
    for s, delta in enumerate(deltas):
        if delta is None:
            a_offsets.append(a_at)
            b_offsets.append(b_at)
            ranks.append(0)
            continue
        a, b = delta
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != in_features or b.shape[1] != out_features \
                or a.shape[1] != b.shape[0]:
            raise ValueError(f"deltas[{s}] must be a [K={in_features}, R] and b [R, N={out_features}], got "
                             f"{tuple(a.shape)} and {tuple(b.shape)}")
        if a.dtype != torch.float32 or b.dtype != torch.float32:
            raise ValueError(f"deltas[{s}] must be float32, got {a.dtype} and {b.dtype}")
        rank = int(a.shape[1])
        a_offsets.append(a_at)
        b_offsets.append(b_at)
        ranks.append(rank)
        a_parts.append(a.reshape(-1))
        b_parts.append(b.reshape(-1))
        a_at += a.numel()
        b_at += b.numel()
    empty = torch.zeros(1, dtype=torch.float32, device=device)  # a valid pointer when nothing is packed
    a_all = torch.cat([p.to(device) for p in a_parts]) if a_parts else empty
    b_all = torch.cat([p.to(device) for p in b_parts]) if b_parts else empty
    return LoraPack(
        a_all=a_all,
        b_all=b_all,
        a_offsets=torch.tensor(a_offsets, dtype=torch.int64).to(device),
        b_offsets=torch.tensor(b_offsets, dtype=torch.int64).to(device),
        ranks=torch.tensor(ranks, dtype=torch.int32).to(device),
        in_features=in_features,
        out_features=out_features,
        max_rank=max(ranks, default=0),
    )


def _kernels() -> tuple[Any, Any]:
    return built(_KERNELS, _build_kernels)


def _build_kernels() -> tuple[Any, Any]:
    # Module globals, not locals: kernels resolve names through their function's __globals__.
    global tl, _sum_combine
    import triton
    import triton.language as tl

    _sum_combine = tl.standard._sum_combine

    @triton.jit
    def shrink_kernel(
        x_ptr,  # [M, K]
        slots_ptr,  # [M] int32
        a_ptr,  # a_all, float32
        a_off_ptr,  # [S] int64
        ranks_ptr,  # [S] int32
        h_ptr,  # [M, max_rank] float32
        in_features,
        stride_xm,
        stride_hm,
        BLOCK_K: tl.constexpr,
        BLOCK_R: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)  # int64: row * stride overflows int32 on long prefills
        r0 = tl.program_id(1) * BLOCK_R
        slot = tl.load(slots_ptr + row)
        if slot < 0:
            return
        rank = tl.load(ranks_ptr + slot)
        if r0 >= rank:
            return
        a_base = a_ptr + tl.load(a_off_ptr + slot)
        offs_r = r0 + tl.arange(0, BLOCK_R)
        r_mask = offs_r < rank
        acc = tl.full([BLOCK_K, BLOCK_R], 0.0, tl.float32)
        x_row = x_ptr + row * stride_xm
        for k0 in range(0, in_features, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < in_features
            x = tl.load(x_row + offs_k, mask=k_mask, other=0.0).to(tl.float32)  # [BLOCK_K]
            a = tl.load(a_base + offs_k.to(tl.int64)[:, None] * rank + offs_r[None, :],
                        mask=k_mask[:, None] & r_mask[None, :], other=0.0)  # [BLOCK_K, BLOCK_R]
            acc += x[:, None] * a
        h = tl.reduce(acc, 0, _sum_combine)  # [BLOCK_R]
        tl.store(h_ptr + row * stride_hm + offs_r, h, mask=r_mask)

    @triton.jit
    def expand_kernel(
        h_ptr,  # [M, max_rank] float32
        slots_ptr,  # [M] int32
        b_ptr,  # b_all, float32
        b_off_ptr,  # [S] int64
        ranks_ptr,  # [S] int32
        y_ptr,  # [M, N]
        out_features,
        stride_hm,
        stride_ym,
        BLOCK_R: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        n0 = tl.program_id(1) * BLOCK_N
        slot = tl.load(slots_ptr + row)
        if slot < 0:
            return
        rank = tl.load(ranks_ptr + slot)
        if rank == 0:
            return
        b_base = b_ptr + tl.load(b_off_ptr + slot)
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < out_features
        acc = tl.full([BLOCK_R, BLOCK_N], 0.0, tl.float32)
        h_row = h_ptr + row * stride_hm
        for r0 in range(0, rank, BLOCK_R):
            offs_r = r0 + tl.arange(0, BLOCK_R)
            r_mask = offs_r < rank
            h = tl.load(h_row + offs_r, mask=r_mask, other=0.0)  # [BLOCK_R]
            b = tl.load(b_base + offs_r.to(tl.int64)[:, None] * out_features + offs_n[None, :],
                        mask=r_mask[:, None] & n_mask[None, :], other=0.0)  # [BLOCK_R, BLOCK_N]
            acc += h[:, None] * b
        delta = tl.reduce(acc, 0, _sum_combine)  # [BLOCK_N]
        y_at = y_ptr + row * stride_ym + offs_n
        y = tl.load(y_at, mask=n_mask, other=0.0)
        tl.store(y_at, (y.to(tl.float32) + delta).to(y_ptr.dtype.element_ty), mask=n_mask)

    return shrink_kernel, expand_kernel


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _check(y: torch.Tensor, x: torch.Tensor, slots: torch.Tensor, pack: LoraPack) -> None:
    """Shapes, dtypes, devices and contiguity: host metadata only, no tensor values (a slot
    index past the pack's slots cannot be seen here: the caller's plan makes the slots)."""
    if x.dim() != 2 or x.shape[1] != pack.in_features:
        raise ValueError(f"x must be [M, K={pack.in_features}] (the pack's inputs), got shape {tuple(x.shape)}")
    rows = x.shape[0]
    if y.dim() != 2 or y.shape != (rows, pack.out_features):
        raise ValueError(f"y must be [M={rows}, N={pack.out_features}] (x's rows, the pack's outputs), "
                         f"got shape {tuple(y.shape)}")
    if x.dtype not in _FLOAT_DTYPES or y.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"x and y must be float32, float16 or bfloat16, got {x.dtype} and {y.dtype}")
    if slots.shape != (rows,) or slots.dtype != torch.int32:
        raise ValueError(f"slots must be [M={rows}] int32 (each row's adapter slot, -1 for the base), "
                         f"got {tuple(slots.shape)} {slots.dtype}")
    for name in ("a_all", "b_all"):
        t = getattr(pack, name)
        if t.dim() != 1 or t.dtype != torch.float32:
            raise ValueError(f"pack.{name} must be a flat float32 buffer, got {tuple(t.shape)} {t.dtype}")
    count = pack.slots
    for name, dtype in (("a_offsets", torch.int64), ("b_offsets", torch.int64), ("ranks", torch.int32)):
        t = getattr(pack, name)
        if t.shape != (count,) or t.dtype != dtype:
            raise ValueError(f"pack.{name} must be [S={count}] {dtype}, got {tuple(t.shape)} {t.dtype}")
    if pack.max_rank < 0:
        raise ValueError(f"pack.max_rank must be >= 0, got {pack.max_rank}")
    tensors = {"y": y, "x": x, "slots": slots, "pack.a_all": pack.a_all, "pack.b_all": pack.b_all,
               "pack.a_offsets": pack.a_offsets, "pack.b_offsets": pack.b_offsets, "pack.ranks": pack.ranks}
    for name, t in tensors.items():
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x on {x.device}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous (the kernels assume the innermost dim has stride 1)")


def lora_apply(
    y: torch.Tensor,  # [M, N] updated in place
    x: torch.Tensor,  # [M, K]
    slots: torch.Tensor,  # [M] int32: row m's slot in the pack, -1 for a base row
    pack: LoraPack,
    *,
    block_k: int | None = None,
    block_r: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:  # y
    """y[m] += (x[m] @ a_s) @ b_s, s = slots[m], for rows with s >= 0, computed in float32 and
    added in y's dtype; base rows (s = -1) and slots of rank 0 are left bitwise as they were.
    Every slot index must be -1 or below pack.slots (not checked: no tensor value is read on
    the host). Tuning (None: defaults, each a power of two >= 16): block_k, the inputs per
    shrink step; block_r, the rank per step; block_n, the output columns per program."""
    _check(y, x, slots, pack)
    for kernel, grid, args, consts in _launches(y, x, slots, pack, block_k, block_r, block_n, num_warps):
        kernel[grid](*args, **consts)
    return y


def _launches(
    y: torch.Tensor,  # [M, N]
    x: torch.Tensor,  # [M, K]
    slots: torch.Tensor,  # [M]
    pack: LoraPack,
    block_k: int | None,
    block_r: int | None,
    block_n: int | None,
    num_warps: int | None,
) -> list[tuple[Any, tuple[int, ...], list[Any], dict[str, Any]]]:
    """The kernel launches of one call, in order: (jitted kernel, grid, positional args,
    keyword constexprs and launch options). Allocates h; reads no values."""
    rows = x.shape[0]
    if rows == 0 or pack.max_rank == 0 or pack.out_features == 0:
        return []
    block_r = block_r or min(64, max(16, _next_pow2(pack.max_rank)))
    block_k = block_k or 64
    block_n = block_n or 128
    for name, value in (("block_k", block_k), ("block_r", block_r), ("block_n", block_n)):
        if value < 16 or value & (value - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {value}")
    shrink_kernel, expand_kernel = _kernels()
    h = torch.empty((rows, pack.max_rank), dtype=torch.float32, device=x.device)  # [M, max_rank]
    warps = num_warps or 4
    shrink = (shrink_kernel, (rows, -(-pack.max_rank // block_r)),
              [x, slots, pack.a_all, pack.a_offsets, pack.ranks, h, pack.in_features, x.stride(0), h.stride(0)],
              dict(BLOCK_K=block_k, BLOCK_R=block_r, num_warps=warps))
    expand = (expand_kernel, (rows, -(-pack.out_features // block_n)),
              [h, slots, pack.b_all, pack.b_offsets, pack.ranks, y, pack.out_features, h.stride(0), y.stride(0)],
              dict(BLOCK_R=block_r, BLOCK_N=block_n, num_warps=warps))
    return [shrink, expand]
