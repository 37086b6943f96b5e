"""KV memory for sliding-window layers: two block groups, the windowed layers' in rings.

A layer with a sliding window reads only the keys of its last `window` positions, so a
sequence's older K/V in that layer is dead weight (`sliding_window_kv: window`, vLLM's
hybrid allocator does the same). The layers split into two groups, each with its own
KVCacheManager over a budget share:

    full group     layers without a window: a block per block_size positions, as ever
    window group   windowed layers: each sequence holds a RING of R blocks (fewer when the
                   sequence needs fewer), its block table the ring repeated, entry m =
                   ring[m % R], as long as a full reservation (kv_cache.KVCacheManager's
                   ring_blocks)

Position p of a windowed layer lands in ring slot ring[(p // bs) % R] * bs + p % bs, so
slot tables, device block tables, slot_mapping and every attention kernel run unchanged:
one step writes at most T new positions per row, and its queries read back at most
window - 1 positions before the first of them, so R * bs >= window + T - 1 slots never let
a write land on a key a query of the same or a later step still reads (the extra block of
`ring_blocks` keeps that true however the window straddles block edges). Older positions
map to slots newer tokens took over; the windowed layers never read them (the gather
path's window mask hides them, the kernels skip them).

The pool holds one K and one V tensor per layer (KVPool), each sized by its group's slots;
a step carries both groups' tables (StepBatch.window_block_table / window_slot_table,
ForwardBatch.window) and Transformer.run_layers gives each layer its group's. A model whose
layers are all windowed has the window group alone: its tables are the step's only ones.

HybridKVCache is what the Scheduler holds in this mode: the KVCacheManager calls the
scheduler, executor, engine and metrics make, answered over both groups (a request is
admitted when both have room; used and total bytes add up).
"""

from __future__ import annotations

import dataclasses
import sys

import torch

from tritonlm.engine.block_table import DeviceBlockTable
from tritonlm.engine.kv_cache import CacheBudgetError, KVCacheManager, KVPool
from tritonlm.engine.model_shape import ModelShape


def ring_blocks(window: int, step_tokens: int, block_size: int) -> int:
    """Blocks of a sequence's ring: its window plus one step's new tokens, and one block more
    for where those positions fall against block edges."""
    if window < 1 or step_tokens < 1 or block_size < 1:
        raise ValueError(f"ring_blocks: window {window}, step_tokens {step_tokens}, block_size {block_size} must be >= 1")
    return -(-(window + step_tokens - 1) // block_size) + 1


def split_budget(
    spec: ModelShape, budget_bytes: int, block_size: int, layer_windows: list[int | None], step_tokens: int,
    max_num_seqs: int, max_context: int,
) -> tuple[int, int]:
    """(full group's bytes, window group's bytes) of budget_bytes: the window group gets room
    for max_num_seqs rings (plus its scratch block) where the budget allows after one
    max_context sequence of the full group; everything when no layer is full."""
    windowed = sum(1 for w in layer_windows if w is not None)
    full = len(layer_windows) - windowed
    if windowed == 0:
        raise ValueError("split_budget: no layer has a sliding window")
    window_block = spec.kv_bytes_per_token(num_layers=windowed) * block_size
    if full == 0:
        return 0, budget_bytes
    ring = ring_blocks(max(w for w in layer_windows if w is not None), step_tokens, block_size)
    want = (max_num_seqs * ring + 1) * window_block
    full_floor = (-(-max_context // block_size) + 1) * spec.kv_bytes_per_token(num_layers=full) * block_size
    window_bytes = min(want, max(budget_bytes - full_floor, 2 * window_block))
    return budget_bytes - window_bytes, window_bytes


class HybridKVCache:
    """The KVCacheManager interface the engine uses, over a full group (None when every layer
    is windowed) and a window group of rings. No prefix caching: a ring overwrites its blocks,
    so they cannot be shared."""

    prefix_caching = False  # the Scheduler may set it (recompute mode): it stays off
    hit_tokens = 0
    query_tokens = 0
    cached_blocks = 0

    def __init__(
        self, spec: ModelShape, budget_bytes: int, block_size: int, layer_windows: list[int | None], step_tokens: int,
        max_num_seqs: int, max_context: int, device: str | torch.device | None = None, device_tables: bool | None = None,
    ):
        """layer_windows[li]: layer li's sliding window, None for a full-attention layer.
        step_tokens: the most new tokens one row runs in a step (the ring's headroom).
        device: where the pool lives (None: accounting only, no pool); device_tables: keep
        block tables there too (default: whenever there is a pool)."""
        if len(layer_windows) != spec.num_layers:
            raise ValueError(f"layer_windows has {len(layer_windows)} entries, the model {spec.num_layers} layers")
        windows = [w for w in layer_windows if w is not None]
        if not windows:
            raise ValueError("HybridKVCache: no layer has a sliding window (sliding_window_kv 'window' needs one)")
        self.spec = spec
        self.block_size = block_size
        self.layer_windows = list(layer_windows)
        self.ring_blocks = ring_blocks(max(windows), step_tokens, block_size)
        full_bytes, window_bytes = split_budget(spec, budget_bytes, block_size, layer_windows, step_tokens,
                                                max_num_seqs, max_context)
        num_full = len(layer_windows) - len(windows)
        self.window = KVCacheManager(dataclasses.replace(spec, num_layers=len(windows)), window_bytes, block_size,
                                     device_tables=False, ring_blocks=self.ring_blocks)
        self.full = None
        if num_full:
            try:
                self.full = KVCacheManager(dataclasses.replace(spec, num_layers=num_full), full_bytes, block_size,
                                           device_tables=False)
            except CacheBudgetError as e:
                raise CacheBudgetError(f"full-attention layers: {e}") from None
        self.groups = [g for g in (self.full, self.window) if g is not None]
        # the step's main tables: the full group's; the window group's ride along (window_group)
        self.primary = self.full if self.full is not None else self.window
        self.window_group = self.window if self.full is not None else None
        self.pool: KVPool | None = None
        if device is not None:
            slots = [self.window.num_slots if w is not None else self.full.num_slots for w in layer_windows]
            self.pool = KVPool.allocate_layers(slots, spec.num_kv_heads, spec.head_dim, spec.dtype, device)
        if device_tables is None:
            device_tables = self.pool is not None
        for group in self.groups:
            group.device_table = DeviceBlockTable(device if device is not None else "cpu") if device_tables else None

    # ---- accounting -------------------------------------------------------
    @property
    def device_table(self) -> DeviceBlockTable | None:
        return self.primary.device_table

    @property
    def total_bytes(self) -> int:
        return sum(g.total_bytes for g in self.groups)

    @property
    def used_bytes(self) -> int:
        return sum(g.used_bytes for g in self.groups)

    @property
    def max_tokens_per_sequence(self) -> int:
        """The longest sequence both groups can hold (a ring holds any length once it fits)."""
        ring = sys.maxsize if self.window.usable_blocks >= self.ring_blocks else self.window.max_tokens_per_sequence
        return ring if self.full is None else min(ring, self.full.max_tokens_per_sequence)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_tokens: int, hits: list[int] = ()) -> bool:
        return not hits and all(g.can_allocate(num_tokens) for g in self.groups)

    def live_sequences(self) -> int:
        return self.primary.live_sequences()

    def reserved_bytes(self, seq_id: int) -> int:
        """Bytes the sequence's blocks take in both groups."""
        return sum(g.reserved_bytes(seq_id) for g in self.groups)

    # ---- prefix cache: never (a ring's blocks are rewritten) -------------
    def chain_root(self, adapter_digest: bytes | None = None, rope_key: bytes | None = None) -> bytes:
        return self.primary.chain_root(adapter_digest, rope_key)

    def prompt_digests(self, prompt: list[int], root: bytes | None = None) -> list[bytes]:
        return []

    def find_prefix(self, digests: list[bytes], prompt: list[int]) -> list[int]:
        return []

    def register(self, seq_id: int, index: int, digest: bytes, tokens: list[int]) -> None:
        return None

    # ---- per sequence -----------------------------------------------------
    def allocate(self, seq_id: int, num_tokens: int, hits: list[int] = ()) -> None:
        """Reserve the sequence's blocks in both groups (all or nothing)."""
        if hits:
            raise ValueError("HybridKVCache shares no prefix blocks")
        if not self.can_allocate(num_tokens):
            raise CacheBudgetError(f"no room for {num_tokens} tokens in both KV groups")
        for group in self.groups:
            group.allocate(seq_id, num_tokens)

    def free(self, seq_id: int) -> None:
        for group in self.groups:
            group.free(seq_id)

    def capacity(self, seq_id: int) -> int:
        return self.primary.capacity(seq_id)

    def slots(self, seq_id: int, upto: int) -> list[int]:
        return self.primary.slots(seq_id, upto)

    def slot_table(self, seq_ids: list[int], lengths: list[int]) -> torch.Tensor:
        """[B, L] int64: the main group's slot table (the window group's: window_group.slot_table)."""
        return self.primary.slot_table(seq_ids, lengths)
