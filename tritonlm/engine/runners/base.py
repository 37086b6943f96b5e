"""The runner protocol: one forward pass for a batch of sequences over a paged KV pool.

A runner turns a `StepBatch` (K new tokens per sequence on top of a cached past) into
logits, and writes the new tokens' keys/values into the `KVPool` in place:

    allocate_kv(num_slots) -> KVPool | None
        the pool this runner reads and writes (its device, its KV dtype); None when the
        runner's ranks hold the tensors themselves (ParallelRunner)
    forward(batch, pool) -> logits
        writes  pool.k[l][slot_table[b, past_len[b] + t]] (and .v) for every layer l and
                every VALID new token t < num_new[b]; padding entries (t >= num_new[b])
                write nothing but the scratch slot 0
        returns float32 [B, V]     logits of each row's last valid new token (all_logits False)
                float32 [B, T, V]  logits of every new token (all_logits True; rows past
                                   num_new[b] are don't-care)
    close()
        frees what the runner holds outside this process (worker processes); no-op otherwise

`ForwardBatch` is the per-step bookkeeping every runner shares (computed once, on the host,
from the batch's CPU tensors, then moved to the runner's device).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from tritonlm.engine.batch import StepBatch
from tritonlm.engine.block_table import position_slots, slot_mapping
from tritonlm.engine.kv_cache import SCRATCH_SLOT, KVPool
from tritonlm.engine.model_shape import ModelShape


@runtime_checkable
class Runner(Protocol):
    spec: ModelShape  # spec.dtype: the KV pool's dtype
    device: torch.device

    def allocate_kv(self, num_slots: int) -> KVPool | None:  # pragma: no cover - protocol
        ...

    def forward(self, batch: StepBatch, pool: KVPool | None) -> torch.Tensor:  # pragma: no cover - protocol
        ...

    def close(self) -> None:  # pragma: no cover - protocol
        ...


def check_pool(spec: ModelShape, device: torch.device, pool: KVPool) -> None:
    """The pool must have the model's layers, kv heads and head size, on the runner's device."""
    if len(pool.k) != spec.num_layers or len(pool.v) != spec.num_layers:
        raise ValueError(f"KVPool has {len(pool.k)} layers, the model {spec.num_layers}")
    want = (spec.num_kv_heads, spec.head_dim)
    if tuple(pool.k[0].shape[1:]) != want:
        raise ValueError(f"KVPool slots are {tuple(pool.k[0].shape[1:])}, the model needs {want}")
    if pool.k[0].device.type != device.type:
        raise ValueError(f"KVPool is on {pool.k[0].device}, the runner on {device}")


@dataclass(frozen=True)
class ForwardBatch:
    """Index tensors for one step, on the runner's device."""

    input_ids: torch.Tensor  # [B, T] int64
    positions: torch.Tensor  # [B, T] int64 absolute position of each new token (padding clamps to last valid)
    valid: torch.Tensor  # [B, T] bool, t < num_new[b]
    write_slots: torch.Tensor  # [B, T] int64 pool slot of each new token; SCRATCH_SLOT for padding
    slot_table: torch.Tensor | None  # [B, L] int64 trimmed to L = max(past_len + num_new); None in a captured decode step
    past_len: torch.Tensor  # [B] int64
    num_new: torch.Tensor  # [B] int64
    total_len: torch.Tensor  # [B] int64 past_len + num_new
    max_past: int  # max(past_len), a host int
    max_total: int  # L, a host int
    # [N] the valid tokens' rows of the batch flattened to [B*T], ascending; None when no
    # row is padded. Row-wise work (norms, projections, MLP) runs on these N rows only.
    packed: torch.Tensor | None = None
    # the rows' block tables [B, M] int32 and key counts [B] int32 (past_len + num_new) on the
    # device, when the batch came with block tables: what the CUDA paged kernel reads
    block_table: torch.Tensor | None = None
    seq_lens: torch.Tensor | None = None
    block_size: int = 0
    # [B] int64 on the host: each row's prompt tokens (StepBatch.prompt_lens), which a
    # length-dependent RoPE reads (runners.rope.LengthRope); None: not given
    prompt_lens: torch.Tensor | None = None
    # sliding_window_kv 'window' (window_kv.py): the same step over the windowed layers' own
    # tables (its write_slots, slot_table and block_table are theirs); None: one set of tables
    window: "ForwardBatch | None" = None

    @property
    def batch_size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def width(self) -> int:
        return int(self.input_ids.shape[1])

    def key_mask(self) -> torch.Tensor:
        """[B, T, L] bool: new token t of row b may attend to position j.

        j < past_len + num_new (the key exists) AND j <= past_len + t (causal). Padding
        rows keep at least key 0, so no softmax row is ever fully masked (no NaN)."""
        j = torch.arange(self.max_total, device=self.total_len.device)  # [L]
        exists = j.view(1, 1, -1) < self.total_len.view(-1, 1, 1)  # [B, 1, L]
        causal = j.view(1, 1, -1) <= self.positions.unsqueeze(-1)  # [B, T, L]
        return exists & causal


def plan_step(batch: StepBatch, device: torch.device, max_positions: int | None = None) -> ForwardBatch:
    """Validate the batch and build its index tensors (host-side checks, one transfer each);
    with the windowed layers' own tables, those planned too (ForwardBatch.window)."""
    if batch.window_block_table is None and batch.window_slot_table is None:
        return _plan_tables(batch, device, max_positions)
    plan = _plan_tables(dataclasses.replace(batch, window_block_table=None, window_slot_table=None), device, max_positions)
    ring = dataclasses.replace(batch, slot_table=batch.window_slot_table, block_table=batch.window_block_table,
                               window_block_table=None, window_slot_table=None)
    return dataclasses.replace(plan, window=_plan_tables(ring, device, max_positions))


def _plan_tables(batch: StepBatch, device: torch.device, max_positions: int | None = None) -> ForwardBatch:
    """plan_step over one set of tables (the batch's slot_table or block_table)."""
    ids = batch.input_ids
    if ids.dim() != 2:
        raise ValueError(f"StepBatch.input_ids must be [B, T], got shape {tuple(ids.shape)}")
    bsz, width = ids.shape
    num_new = batch.num_new.to("cpu", torch.int64)
    past_len = batch.past_len.to("cpu", torch.int64)
    if num_new.shape != (bsz,) or past_len.shape != (bsz,):
        raise ValueError(
            f"StepBatch.num_new {tuple(num_new.shape)} and past_len {tuple(past_len.shape)} must both be [{bsz}]"
        )
    if bsz == 0 or width == 0:
        raise ValueError(f"StepBatch is empty: input_ids shape {tuple(ids.shape)}")
    if int(num_new.min()) < 1 or int(num_new.max()) > width:
        raise ValueError(f"StepBatch.num_new must be in [1, {width}], got {num_new.tolist()}")
    if int(past_len.min()) < 0:
        raise ValueError(f"StepBatch.past_len must be >= 0, got {past_len.tolist()}")
    total = past_len + num_new
    max_total = int(total.max())
    if batch.slot_table is None:
        if batch.block_table is None or batch.block_table.shape[0] != bsz or batch.block_size <= 0:
            raise ValueError("StepBatch needs a slot_table, or a [B, M] block_table with its block_size")
        if batch.block_table.shape[1] * batch.block_size < max_total:
            raise ValueError(f"StepBatch.block_table holds {batch.block_table.shape[1]} blocks; {max_total} positions need more")
    elif batch.slot_table.shape[0] != bsz or batch.slot_table.shape[1] < max_total:
        raise ValueError(
            f"StepBatch.slot_table is {tuple(batch.slot_table.shape)}; needs [{bsz}, >= {max_total}] "
            "(one slot per past and new position)"
        )
    if max_positions is not None and max_total > max_positions:
        raise ValueError(f"sequence length {max_total} exceeds the model's max_positions={max_positions}")

    positions = batch.position_ids()  # [B, T] clamped to the last valid position
    valid = torch.arange(width).unsqueeze(0) < num_new.unsqueeze(1)  # [B, T]
    packed = None if bool(valid.all()) else valid.reshape(-1).nonzero().squeeze(1)  # [N]
    ids = batch.input_ids.to(torch.int64)
    if batch.slot_table is None and device.type != "cpu":
        return _device_plan(batch, device, ids, positions, valid, past_len, num_new, total, max_total, packed)
    if batch.slot_table is None:  # block tables on the host: slots mapped with tensor ops, no loop per row
        slot_table = slot_mapping(batch.block_table, total, max_total, batch.block_size)  # [B, L]
    else:
        slot_table = batch.slot_table[:, :max_total].to(torch.int64)  # [B, L]
    new_slots = torch.gather(slot_table, 1, positions)  # [B, T]
    # positions clamp padding to the last valid slot: a padding write there would race
    # the real token's write, so padding goes to scratch.
    write_slots = torch.where(valid, new_slots, torch.full_like(new_slots, SCRATCH_SLOT))

    def dev(t: torch.Tensor) -> torch.Tensor:
        return t.to(device, non_blocking=True)

    return ForwardBatch(
        input_ids=batch.apply_fed(dev(ids)),
        positions=dev(positions),
        valid=dev(valid),
        write_slots=dev(write_slots),
        slot_table=dev(slot_table),
        past_len=dev(past_len),
        num_new=dev(num_new),
        total_len=dev(total),
        max_past=int(past_len.max()),
        max_total=max_total,
        packed=None if packed is None else dev(packed),
        prompt_lens=batch.prompt_lens,
    )


def stage(parts: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Host int64 tensors -> the same tensors on `device`, in ONE copy: concatenated into
    one buffer (pinned when the target is a GPU, so the copy does not block the host), moved,
    then split back into views of their own shapes."""
    flat = torch.cat([p.reshape(-1).to(torch.int64) for p in parts])
    if device.type == "cuda":
        flat = flat.pin_memory()
    moved = flat.to(device, non_blocking=True)
    out, at = [], 0
    for p in parts:
        out.append(moved[at : at + p.numel()].view(p.shape))
        at += p.numel()
    return out


def _device_plan(
    batch: StepBatch, device: torch.device, ids: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor,
    past_len: torch.Tensor, num_new: torch.Tensor, total: torch.Tensor, max_total: int, packed: torch.Tensor | None,
) -> ForwardBatch:
    """plan_step for a batch with block tables: the small per-row tensors go over in one
    staged copy and the slots are mapped on the device (block_table.slot_mapping)."""
    parts = [ids, positions, valid.to(torch.int64), past_len, num_new, total] + ([packed] if packed is not None else [])
    moved = stage(parts, device)
    d_ids, d_pos, d_valid, d_past, d_new, d_total = moved[:6]
    batch.apply_fed(d_ids)
    table = batch.block_table.to(device)  # [B, M] int32
    write_slots = torch.where(d_valid.bool(), position_slots(table, d_pos, batch.block_size), SCRATCH_SLOT)  # [B, T]
    return ForwardBatch(
        input_ids=d_ids,
        positions=d_pos,
        valid=d_valid.bool(),
        write_slots=write_slots,
        slot_table=slot_mapping(table, d_total, max_total, batch.block_size),  # [B, L]
        past_len=d_past,
        num_new=d_new,
        total_len=d_total,
        max_past=int(past_len.max()),
        max_total=max_total,
        packed=moved[6] if packed is not None else None,
        block_table=table,
        seq_lens=d_total.to(torch.int32),
        block_size=batch.block_size,
        prompt_lens=batch.prompt_lens,
    )


def kv_rows(slot_table: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """[B, L] slots -> [B*Hkv*L] row index into a cache viewed as [S*Hkv, D], ordered (b, h, l).

    Gathering those rows yields keys already in attention layout [B, Hkv, L, D], contiguous:
    one copy, no permute afterwards."""
    heads = torch.arange(num_kv_heads, device=slot_table.device).view(1, -1, 1)  # [1, Hkv, 1]
    return (slot_table.unsqueeze(1) * num_kv_heads + heads).reshape(-1)  # [B*Hkv*L]


def gather_kv(cache: torch.Tensor, rows: torch.Tensor, bsz: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """cache [S, Hkv, D] gathered at kv_rows(...) -> [B, Hkv, L, D] contiguous.

    This copy is the per-step price of a paged cache without a paged-attention kernel.
    index_select copies whole rows, which is cheaper than advanced indexing
    (cache[slot_table]) on CPU (docs/performance-notes.md); `out` (a Workspace buffer)
    avoids a fresh allocation, whose page faults would add to every large-context copy."""
    num_slots, heads, dim = cache.shape
    flat = cache.view(num_slots * heads, dim)  # [S*Hkv, D]
    if out is None:
        got = flat.index_select(0, rows)
    else:
        got = torch.index_select(flat, 0, rows, out=out.view(-1, dim))
    return got.view(bsz, heads, -1, dim)


class Workspace:
    """Scratch buffers reused from step to step, keyed by name (one runner, one thread).

    A buffer grows by at least 1.5x when a step needs more, so a context that grows by
    one token per decode step does not reallocate every step. Memory held = the largest
    step's need (x1.5 at most); clear() gives it back."""

    def __init__(self) -> None:
        self._bufs: dict[str, torch.Tensor] = {}

    def take(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        numel = 1
        for n in shape:
            numel *= int(n)
        buf = self._bufs.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype or buf.device != device:
            grow = 0 if buf is None else int(buf.numel() * 1.5)
            buf = torch.empty(max(numel, grow), dtype=dtype, device=device)
            self._bufs[name] = buf
        return buf[:numel].view(shape)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._bufs.values())

    def clear(self) -> None:
        self._bufs.clear()
