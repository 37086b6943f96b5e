"""StepBatch: the contract between the scheduler and a runner for one forward pass.

Every sequence in the batch brings `num_new[b]` new tokens (1 when decoding, a
chunk when prefilling, K+1 when verifying a speculative draft) on top of
`past_len[b]` tokens whose keys/values are already in the KV pool.

KV pool layout (see kv_cache.KVPool): per layer one K and one V tensor of shape
[num_slots, num_kv_heads, head_dim]; a "slot" holds one token of one sequence.
`slot_table[b, p]` is the slot of position p of sequence b (p < past_len + num_new;
entries past that are padding and point at slot 0, never read unmasked).

When the KV cache keeps device block tables (KVCacheManager's `device_table`), the batch
carries each row's block table instead (`block_table`, gathered from the persistent
block_table.DeviceBlockTable where the pool lives) and the runner maps the slots itself
(runners.base.plan_step, runners.decode_graphs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tritonlm.engine.host_tensors import int64_tensor, padded_int64


@dataclass
class StepBatch:
    input_ids: torch.Tensor  # [B, T] int64, new tokens right-padded (pad value irrelevant)
    num_new: torch.Tensor  # [B] int64, valid new tokens per row, 1 <= num_new[b] <= T
    past_len: torch.Tensor  # [B] int64, tokens already cached per row
    slot_table: torch.Tensor | None  # [B, L] int64, L >= max(past_len + num_new); None: from block_table
    all_logits: bool = False  # True: logits for every new token (speculative verify); False: last valid one only
    block_table: torch.Tensor | None = None  # [B, M] int32 on the pool's device, each row's blocks in order
    block_size: int = 0  # tokens per block, with block_table
    # per row: the lora.LoraAdapter it runs under, or None for the base model; None: every row
    # is the base (runners.torch_runner applies them; other runners take none)
    adapters: list | None = None
    # [B] int64: each row's prompt tokens, which fix a length-dependent RoPE's tables token by
    # token however the prompt is chunked (runners.rope); None: each row's longest position
    prompt_lens: torch.Tensor | None = None
    # sliding_window_kv 'window' (window_kv.py): the windowed layers' own tables, rings of
    # blocks, in the same form as the main ones (block_table [B, M'] or slot_table [B, L]);
    # None: every layer reads the main tables
    window_block_table: torch.Tensor | None = None
    window_slot_table: torch.Tensor | None = None
    # scheduled ahead (Engine's schedule_ahead) on a GPU: (rows [k] int64, tokens [k] int64),
    # both on the device: row rows[i] of a width-1 batch feeds tokens[i], a token the last
    # step sampled there and the host has not seen, in place of input_ids[rows[i], 0] (a
    # placeholder). The runner writes them in on the device (apply_fed); None: input_ids is whole
    fed: tuple[torch.Tensor, torch.Tensor] | None = None

    def apply_fed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B, T] (input_ids, moved to the device) with the fed tokens written into column 0."""
        if self.fed is not None:
            rows, tokens = self.fed
            ids.select(1, 0).index_copy_(0, rows, tokens)
        return ids

    @property
    def batch_size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def width(self) -> int:
        return int(self.input_ids.shape[1])

    def position_ids(self) -> torch.Tensor:
        """[B, T] absolute positions of the new tokens (padding rows clamp to the last valid one)."""
        t = torch.arange(self.width, dtype=torch.int64).unsqueeze(0)
        t = torch.minimum(t, (self.num_new - 1).unsqueeze(1))
        return self.past_len.unsqueeze(1) + t

    @staticmethod
    def from_block_table(
        new_tokens: list[list[int]], past_lens: list[int], block_table: torch.Tensor, block_size: int,
        all_logits: bool = False,
    ) -> "StepBatch":
        """From new_tokens[b], past_lens[b] and the rows' block tables [B, M] on the device."""
        batch = StepBatch.from_slot_table(new_tokens, past_lens, None, all_logits)
        batch.block_table, batch.block_size = block_table, block_size
        return batch

    @staticmethod
    def build(
        new_tokens: list[list[int]], past_lens: list[int], slot_rows: list[list[int]], all_logits: bool = False
    ) -> "StepBatch":
        """From plain lists: new_tokens[b] (non-empty), past_lens[b], slot_rows[b] (>= past+new slots)."""
        total = max(p + len(t) for p, t in zip(past_lens, new_tokens))
        slots = torch.zeros(len(new_tokens), total, dtype=torch.int64)
        for b, (toks, past, row) in enumerate(zip(new_tokens, past_lens, slot_rows)):
            slots[b, : past + len(toks)] = torch.tensor(row[: past + len(toks)], dtype=torch.int64)
        return StepBatch.from_slot_table(new_tokens, past_lens, slots, all_logits)

    @staticmethod
    def from_slot_table(
        new_tokens: list[list[int]], past_lens: list[int], slot_table: torch.Tensor | None, all_logits: bool = False
    ) -> "StepBatch":
        """From new_tokens[b] (non-empty), past_lens[b] and a ready [B, L] slot table
        (KVCacheManager.slot_table), L >= past_lens[b] + len(new_tokens[b])."""
        lengths = [len(t) for t in new_tokens]
        width = max(lengths)
        return StepBatch(
            input_ids=padded_int64(new_tokens, width),
            num_new=int64_tensor(lengths),
            past_len=int64_tensor(past_lens),
            slot_table=slot_table,
            all_logits=all_logits,
        )
