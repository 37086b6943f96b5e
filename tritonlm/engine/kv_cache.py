"""KV cache memory inside a byte budget.

The pool is paged: memory is cut into blocks of `block_size` token slots, and each
sequence owns a list of blocks (its block table), so memory is held by actual
length, not by the model's maximum context. Admission reserves every block a
sequence can ever need (prompt + max_tokens) up front: a running sequence never
runs out of cache and nothing is ever preempted; when the pool is full, new
requests wait in the scheduler's queue instead.

Tensors (per layer, one for K and one for V):
    [num_blocks * block_size, num_kv_heads, head_dim]   ("slots": one token each)
Slot 0 is reserved as a scratch slot that padding entries point at.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tritonlm.engine.spec import ModelSpec


class CacheBudgetError(ValueError):
    """The budget cannot hold what was asked (config error, not a runtime wait)."""


@dataclass
class KVPool:
    k: list[torch.Tensor]  # num_layers x [num_slots, num_kv_heads, head_dim]
    v: list[torch.Tensor]

    @staticmethod
    def allocate(spec: ModelSpec, num_slots: int, device: str | torch.device = "cpu") -> "KVPool":
        shape = (num_slots, spec.num_kv_heads, spec.head_dim)
        return KVPool(
            k=[torch.zeros(shape, dtype=spec.dtype, device=device) for _ in range(spec.num_layers)],
            v=[torch.zeros(shape, dtype=spec.dtype, device=device) for _ in range(spec.num_layers)],
        )

    @property
    def num_slots(self) -> int:
        return int(self.k[0].shape[0])

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


@dataclass
class SequenceCache:
    """One sequence's view of the pool."""

    blocks: list[int] = field(default_factory=list)
    length: int = 0  # tokens whose K/V are written
    capacity: int = 0  # tokens reserved (len(blocks) * block_size)


class KVCacheManager:
    def __init__(
        self,
        spec: ModelSpec,
        budget_bytes: int,
        block_size: int = 16,
        device: str | torch.device = "cpu",
        allocate_pool: bool = True,
    ):
        # allocate_pool=False: block accounting only, `self.pool` is None. For runners that
        # hold the KV tensors themselves, e.g. sharded over parallel worker processes
        # (tritonlm/engine/parallel): the budget still counts the whole model's K/V
        # (spec.bytes_per_token), and those runners place the slots this manager hands out.
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
        self.pool = KVPool.allocate(spec, num_blocks * block_size, device) if allocate_pool else None
        self._free: list[int] = list(range(num_blocks - 1, 0, -1))  # block 0 reserved
        self._seqs: dict[int, SequenceCache] = {}

    # ---- accounting -------------------------------------------------------
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

    # ---- per sequence -----------------------------------------------------
    def allocate(self, seq_id: int, num_tokens: int) -> SequenceCache:
        """Reserve room for num_tokens tokens. Raises if it does not fit now (check can_allocate)."""
        if seq_id in self._seqs:
            raise KeyError(f"sequence {seq_id} already has a cache")
        need = self.blocks_for(num_tokens)
        if need > self.free_blocks:
            raise CacheBudgetError(f"need {need} blocks, {self.free_blocks} free")
        blocks = [self._free.pop() for _ in range(need)]
        seq = SequenceCache(blocks=blocks, length=0, capacity=need * self.block_size)
        self._seqs[seq_id] = seq
        return seq

    def free(self, seq_id: int) -> None:
        seq = self._seqs.pop(seq_id, None)
        if seq is not None:
            self._free.extend(reversed(seq.blocks))

    def get(self, seq_id: int) -> SequenceCache:
        return self._seqs[seq_id]

    def slots(self, seq_id: int, upto: int) -> list[int]:
        """Slot of each position 0..upto-1 of the sequence."""
        seq = self._seqs[seq_id]
        if upto > seq.capacity:
            raise IndexError(f"sequence {seq_id}: position {upto - 1} beyond its reservation of {seq.capacity}")
        bs = self.block_size
        return [seq.blocks[p // bs] * bs + p % bs for p in range(upto)]

    def advance(self, seq_id: int, num_tokens: int) -> None:
        """Mark num_tokens more positions as written (after a forward pass)."""
        seq = self._seqs[seq_id]
        seq.length += num_tokens
        assert seq.length <= seq.capacity

    def truncate(self, seq_id: int, length: int) -> None:
        """Roll back to `length` tokens (speculative rejection); later writes overwrite."""
        seq = self._seqs[seq_id]
        if not 0 <= length <= seq.length:
            raise ValueError(f"cannot truncate sequence {seq_id} from {seq.length} to {length}")
        seq.length = length

    def live_sequences(self) -> int:
        return len(self._seqs)
