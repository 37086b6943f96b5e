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

Prefix caching: a FULL block is identified by a chain digest of the model (and the request's
LoRA adapter: `chain_root`), its token ids and the digest of the block before it (`block_digest`). Once a sequence's cache holds a
full block, the scheduler registers it; a later request whose prompt starts with the same
blocks shares them (a reference count per block) and its prefill starts after them.
A block whose references drop to 0 stays cached, unreferenced, until a new allocation
needs room (least recently used first). Shared blocks are never written: the block a
sequence writes into is always its own (a prompt shares at most its full blocks before
its last token).

Tensors (per layer, one for K and one for V):
    [num_blocks * block_size, num_kv_heads, head_dim]   ("slots": one token each)
Slot 0 is reserved as a scratch slot that padding entries point at.

Rings (`ring_blocks`): a manager for layers that only ever read their last `window` keys
(window_kv.py) gives a sequence at most `ring_blocks` blocks of its own and a block table
that repeats them, entry m = ring[m % R], as long as a full reservation: a position maps
to a slot of the ring, so the slot tables, device block tables and kernels work unchanged.
"""

from __future__ import annotations

import collections
import hashlib
from dataclasses import dataclass
from typing import Callable

import torch

from tritonlm.engine.block_table import SCRATCH_SLOT, DeviceBlockTable
from tritonlm.engine.model_shape import ModelShape


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
    def allocate_layers(
        layer_slots: list[int], num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: str | torch.device = "cpu",
    ) -> "KVPool":
        """A pool whose layer li has layer_slots[li] slots (layers of two block groups: window_kv.py)."""
        return KVPool(
            k=[torch.zeros((n, num_kv_heads, head_dim), dtype=dtype, device=device) for n in layer_slots],
            v=[torch.zeros((n, num_kv_heads, head_dim), dtype=dtype, device=device) for n in layer_slots],
        )

    @staticmethod
    def for_shape(spec: ModelShape, num_slots: int, device: str | torch.device = "cpu") -> "KVPool":
        return KVPool.allocate(num_slots, spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.dtype, device)

    @property
    def num_slots(self) -> int:
        return int(self.k[0].shape[0])

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


LORA_ROOT_PERSON = b"tritonlm.kvlora"  # BLAKE2b personalization of a chain root under a LoRA adapter
ROPE_ROOT_PERSON = b"tritonlm.kvrope"  # ... and of one under a length-dependent RoPE's long tables

PoolFactory = Callable[[int], "KVPool | None"]  # num_slots -> the runner's pool (None: held by worker ranks)


def block_digest(parent: bytes, tokens: list[int] | tuple[int, ...]) -> bytes:
    """Chain digest of one full block: BLAKE2b-128 over the parent block's digest and the
    block's token ids. A cryptographic digest: two different prefixes do not meet by
    accident, nor by a client's design, so equal digests mean equal prefixes (the block's
    own token ids are compared on every hit as well)."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(b"".join(t.to_bytes(4, "little", signed=False) for t in tokens))
    return h.digest()


class KVCacheManager:
    # the sliding-window layers' own blocks when they keep rings of their own (window_kv.HybridKVCache);
    # None: every layer's K/V sits in this manager's blocks
    window_group: "KVCacheManager | None" = None

    def __init__(
        self,
        spec: ModelShape,
        budget_bytes: int,
        block_size: int = 16,
        allocate_kv: PoolFactory | None = None,
        prefix_caching: bool = False,
        device_tables: bool | None = None,
        ring_blocks: int | None = None,
    ):
        """budget_bytes counts the whole model's K/V (spec.bytes_per_token per token).
        allocate_kv: the runner's `allocate_kv`, called once with the number of slots;
        None keeps the accounting only (`pool` is None). prefix_caching: full blocks are
        shared between requests with the same prefix and stay cached once freed.
        device_tables: keep every live sequence's blocks in a DeviceBlockTable on the pool's
        device as well (default: whenever there is a pool), so a step's slots are mapped from
        them with tensor ops where the pool is (Scheduler.batch, runners.base.plan_step)
        instead of built row by row on the host.
        ring_blocks: each sequence holds at most this many blocks, its table repeating them
        (for sliding-window layers, window_kv.py); None: a block per block_size positions."""
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
        if ring_blocks is not None and (ring_blocks < 1 or prefix_caching):
            raise ValueError(f"ring_blocks={ring_blocks}: must be >= 1, and rings share no prefix (prefix_caching off)")
        self.ring_blocks = ring_blocks
        self.prefix_caching = prefix_caching
        self.root_digest = hashlib.blake2b(repr(spec).encode(), digest_size=16).digest()  # "the model" in every chain
        self.pool: KVPool | None = allocate_kv(self.num_slots) if allocate_kv is not None else None
        self._free: list[int] = list(range(num_blocks - 1, 0, -1))  # block 0 reserved; holds nothing reusable
        self._tables: dict[int, list[int]] = {}  # seq id -> its blocks, in position order
        self._refs = [0] * num_blocks  # sequences holding each block
        self._cached: dict[bytes, int] = {}  # digest -> the block holding that content
        self._content: dict[int, tuple[bytes, tuple[int, ...]]] = {}  # block -> (digest, token ids)
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()  # cached, unreferenced; LRU first
        if device_tables is None:
            device_tables = self.pool is not None
        self.device_table = None
        if device_tables:
            device = self.pool.k[0].device if self.pool is not None else torch.device("cpu")
            self.device_table = DeviceBlockTable(device)
        self.hit_tokens = 0  # prefix cache: prompt tokens found cached, and looked up (for metrics)
        self.query_tokens = 0

    # ---- accounting -------------------------------------------------------
    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def free_blocks(self) -> int:
        """Blocks a new allocation may take: never used, or cached but unreferenced."""
        return len(self._free) + len(self._evictable)

    @property
    def cached_blocks(self) -> int:
        """Blocks holding a registered prefix (referenced or not)."""
        return len(self._content)

    @property
    def total_bytes(self) -> int:
        return self.usable_blocks * self.block_bytes

    @property
    def used_bytes(self) -> int:
        """Bytes referenced by live sequences (cached, unreferenced blocks are free to take)."""
        return (self.usable_blocks - self.free_blocks) * self.block_bytes

    @property
    def max_tokens_per_sequence(self) -> int:
        return self.usable_blocks * self.block_size

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def owned_blocks_for(self, num_tokens: int) -> int:
        """Blocks a sequence of num_tokens holds: one per block_size positions, or its ring."""
        need = self.blocks_for(num_tokens)
        return need if self.ring_blocks is None else min(need, self.ring_blocks)

    def can_allocate(self, num_tokens: int, hits: list[int] = ()) -> bool:
        """Room for num_tokens when the blocks `hits` (from find_prefix) are shared."""
        taken_from_free = sum(1 for b in hits if b in self._evictable)
        return self.owned_blocks_for(num_tokens) - len(hits) <= self.free_blocks - taken_from_free

    def live_sequences(self) -> int:
        return len(self._tables)

    # ---- prefix cache -----------------------------------------------------
    def chain_root(self, adapter_digest: bytes | None = None, rope_key: bytes | None = None) -> bytes:
        """The digest a prompt's chain starts from: the model's (root_digest), or, for a request
        under a LoRA adapter, a digest of the model's and the adapter's content digest
        (lora.LoraAdapter.digest) under a personalization of its own. Blocks computed under one
        adapter, another or none are then never shared, whatever the adapters are named, and an
        adapter reloaded with new weights starts new chains (its old blocks age out).
        rope_key: which tables of a length-dependent RoPE rotated the sequence's keys
        (runners.rope.LengthRope.key); None for the tables of short sequences."""
        root = self.root_digest
        if adapter_digest is not None:
            root = hashlib.blake2b(root + adapter_digest, digest_size=16, person=LORA_ROOT_PERSON).digest()
        if rope_key is not None:
            root = hashlib.blake2b(root + rope_key, digest_size=16, person=ROPE_ROOT_PERSON).digest()
        return root

    def prompt_digests(self, prompt: list[int], root: bytes | None = None) -> list[bytes]:
        """Chain digests of the prompt's full blocks that may be shared: those before the
        block of its last token, whose logits the first output token needs. root: the
        chain's start (chain_root); the model's when None."""
        bs, out, parent = self.block_size, [], self.root_digest if root is None else root
        for i in range((len(prompt) - 1) // bs):
            parent = block_digest(parent, prompt[i * bs : (i + 1) * bs])
            out.append(parent)
        return out

    def find_prefix(self, digests: list[bytes], prompt: list[int]) -> list[int]:
        """The cached blocks holding the prompt's leading full blocks (stops at the first miss)."""
        if not self.prefix_caching:
            return []
        bs, hits = self.block_size, []
        for i, digest in enumerate(digests):
            block = self._cached.get(digest)
            if block is None or self._content[block][1] != tuple(prompt[i * bs : (i + 1) * bs]):
                break
            hits.append(block)
        return hits

    def register(self, seq_id: int, index: int, digest: bytes, tokens: list[int]) -> None:
        """Block `index` of the sequence is now full and its K/V final: others may share it."""
        if not self.prefix_caching or digest in self._cached:
            return  # another block holds that content already: this one stays private
        block = self._tables[seq_id][index]
        if block in self._content:
            return
        self._cached[digest] = block
        self._content[block] = (digest, tuple(tokens))

    # ---- per sequence -----------------------------------------------------
    def allocate(self, seq_id: int, num_tokens: int, hits: list[int] = ()) -> None:
        """Reserve room for num_tokens tokens, sharing the blocks `hits` (from find_prefix)
        as the first ones. Raises if it does not fit now (check can_allocate)."""
        if seq_id in self._tables:
            raise KeyError(f"sequence {seq_id} already has a cache")
        if not self.can_allocate(num_tokens, hits):
            raise CacheBudgetError(f"need {self.owned_blocks_for(num_tokens) - len(hits)} new blocks, {self.free_blocks} free")
        for block in hits:
            self._evictable.pop(block, None)
            self._refs[block] += 1
        fresh = [self._take() for _ in range(self.owned_blocks_for(num_tokens) - len(hits))]
        blocks = list(hits) + fresh
        if self.ring_blocks is not None:  # the ring repeated: entry m = ring[m % R], a full table's length
            blocks = [blocks[m % len(blocks)] for m in range(self.blocks_for(num_tokens))]
        self._tables[seq_id] = blocks
        if self.device_table is not None:
            self.device_table.add(seq_id, self._tables[seq_id])

    def _take(self) -> int:
        """A block for new content: a never-used one, else the least recently used cached one."""
        if self._free:
            block = self._free.pop()
        else:
            block, _ = self._evictable.popitem(last=False)
            digest, _ = self._content.pop(block)
            del self._cached[digest]
        self._refs[block] = 1
        return block

    def free(self, seq_id: int) -> None:
        blocks = self._tables.pop(seq_id, None)
        if self.device_table is not None:
            self.device_table.remove(seq_id)
        # a ring's table repeats its blocks: each is given back once
        for block in reversed(list(dict.fromkeys(blocks or []))):  # the tail first: evicted before the prefix it extends
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if block in self._content:
                    self._evictable[block] = None  # most recently used last
                else:
                    self._free.append(block)

    def reserved_bytes(self, seq_id: int) -> int:
        """Bytes of the distinct blocks the sequence holds."""
        return len(set(self._tables[seq_id])) * self.block_bytes

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
