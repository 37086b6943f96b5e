"""KV cache memory inside a byte budget: the pool's tensors and the block accounting.

The pool is paged: memory is cut into blocks of `block_size` token slots, and each
sequence owns a list of blocks (its block table), so memory is held by actual
length, not by the model's maximum context. Admission reserves every block a
sequence can ever need (prompt + max_tokens) up front: a running sequence never
runs out of cache and nothing is ever preempted; when the pool is full, new
requests wait in the scheduler's queue instead.

Who touches what:
    KVPool           the tensors; allocated by the runner (`runner.allocate_kv`), which
                     knows its device, its KV dtype and, split over ranks, its share;
                     written only by runners during a forward pass.
    KVCacheManager   the block accounting (which blocks are free, each sequence's block
                     table); owned by the Scheduler, the only component that allocates
                     and frees. How many tokens of a sequence are in the cache is
                     `Sequence.num_computed`, not kept here a second time.

Tensors (per layer, one for K and one for V):
    [num_blocks * block_size, num_kv_heads, head_dim]   ("slots": one token each)
Slot 0 is reserved as a scratch slot that padding entries point at.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from tritonlm.engine.spec import ModelSpec

SCRATCH_SLOT = 0  # block 0 is kept out of circulation: padding writes land in its slot 0


class CacheBudgetError(ValueError):
    """The budget cannot hold what was asked (config error, not a runtime wait)."""


@dataclass
class KVPool:
    k: list[torch.Tensor]  # num_layers x [num_slots, num_kv_heads, head_dim]
    v: list[torch.Tensor]

    @staticmethod
    def allocate(
        num_slots: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
    ) -> "KVPool":
        """The one place KV tensors are made (whole model, a TP rank's heads or a PP stage's layers)."""
        shape = (num_slots, num_kv_heads, head_dim)
        return KVPool(
            k=[torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)],
            v=[torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)],
        )

    @staticmethod
    def for_spec(spec: ModelSpec, num_slots: int, device: str | torch.device = "cpu") -> "KVPool":
        return KVPool.allocate(num_slots, spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.dtype, device)

    @property
    def num_slots(self) -> int:
        return int(self.k[0].shape[0])

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


PoolFactory = Callable[[int], "KVPool | None"]  # num_slots -> the runner's pool (None: held by worker ranks)


class KVCacheManager:
    def __init__(self, spec: ModelSpec, budget_bytes: int, block_size: int = 16, allocate_kv: PoolFactory | None = None):
        """budget_bytes counts the whole model's K/V (spec.bytes_per_token per token).
        allocate_kv: the runner's `allocate_kv`, called once with the number of slots;
        None keeps the accounting only (`pool` is None)."""
        if block_size <= 0:
            raise CacheBudgetError(f"kv_block_size must be positive, got {block_size}")
        self.spec = spec
        self.block_size = block_size
        self.block_bytes = spec.bytes_per_token * block_size
        # one extra block: slot 0 lives in block 0, kept out of circulation as scratch
        num_blocks = budget_bytes // self.block_bytes
        if num_blocks < 2:
            raise CacheBudgetError(
                f"kv_cache_bytes={budget_bytes} holds {num_blocks} block(s) of {block_size} tokens "
                f"({self.block_bytes} bytes each at {spec.bytes_per_token} bytes/token); raise it"
            )
        self.num_blocks = num_blocks
        self.pool: KVPool | None = allocate_kv(self.num_slots) if allocate_kv is not None else None
        self._free: list[int] = list(range(num_blocks - 1, 0, -1))  # block 0 reserved
        self._tables: dict[int, list[int]] = {}  # seq id -> its blocks, in position order

    # ---- accounting -------------------------------------------------------
    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def total_bytes(self) -> int:
        return self.usable_blocks * self.block_bytes

    @property
    def used_bytes(self) -> int:
        """Bytes reserved by live sequences."""
        return (self.usable_blocks - self.free_blocks) * self.block_bytes

    @property
    def max_tokens_per_sequence(self) -> int:
        return self.usable_blocks * self.block_size

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) <= self.free_blocks

    def live_sequences(self) -> int:
        return len(self._tables)

    # ---- per sequence -----------------------------------------------------
    def allocate(self, seq_id: int, num_tokens: int) -> None:
        """Reserve room for num_tokens tokens. Raises if it does not fit now (check can_allocate)."""
        if seq_id in self._tables:
            raise KeyError(f"sequence {seq_id} already has a cache")
        need = self.blocks_for(num_tokens)
        if need > self.free_blocks:
            raise CacheBudgetError(f"need {need} blocks, {self.free_blocks} free")
        self._tables[seq_id] = [self._free.pop() for _ in range(need)]

    def free(self, seq_id: int) -> None:
        blocks = self._tables.pop(seq_id, None)
        if blocks is not None:
            self._free.extend(reversed(blocks))

    def capacity(self, seq_id: int) -> int:
        """Tokens reserved for the sequence."""
        return len(self._tables[seq_id]) * self.block_size

    def slots(self, seq_id: int, upto: int) -> list[int]:
        """Slot of each position 0..upto-1 of the sequence."""
        return self.slot_table([seq_id], [upto])[0, :upto].tolist()

    def slot_table(self, seq_ids: list[int], lengths: list[int]) -> torch.Tensor:
        """[B, L] int64: slot of position p < lengths[b] of sequence seq_ids[b]
        (L = max(lengths); entries past a row's length are SCRATCH_SLOT).

        Built from the block tables with tensor arithmetic, not a Python loop per token."""
        bs = self.block_size
        width = max(lengths)
        nblk = -(-width // bs)
        table = torch.zeros(len(seq_ids), max(nblk, 1), dtype=torch.int64)  # [B, blocks]
        for b, (sid, n) in enumerate(zip(seq_ids, lengths)):
            blocks = self._tables[sid]
            if n > len(blocks) * bs:
                raise IndexError(f"sequence {sid}: position {n - 1} beyond its reservation of {len(blocks) * bs}")
            need = -(-n // bs)
            table[b, :need] = torch.tensor(blocks[:need], dtype=torch.int64)
        pos = torch.arange(width, dtype=torch.int64)  # [L]
        slots = table[:, pos // bs] * bs + pos % bs  # [B, L]
        valid = pos.unsqueeze(0) < torch.tensor(lengths, dtype=torch.int64).unsqueeze(1)
        return torch.where(valid, slots, torch.full_like(slots, SCRATCH_SLOT))
