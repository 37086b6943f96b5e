"""Block tables kept on the KV pool's device, and slot mapping computed there.

A GPU step must not rebuild each sequence's per-token slot table on the host and copy
it over: that is a Python loop per row and a [B, L] transfer per step, which on a GPU
costs more than the decode step itself. Instead each sequence's block list is written to
a persistent int32 table on the device once, when admission reserves its blocks, and a
step sends only which rows it runs; slots are then derived on the device:

    slot(b, p) = table[row(b), p // block_size] * block_size + p % block_size

DeviceBlockTable   the persistent table: one row per live sequence (rows are reused)
slot_mapping       [B, M] block tables + lengths -> [B, L] slots (KVCacheManager.slot_table's
                   result, computed with device ops only)
"""

from __future__ import annotations

import torch

from tritonlm.engine.host_tensors import int64_tensor

SCRATCH_SLOT = 0  # block 0 is kept out of circulation: padding writes land in its slot 0


class DeviceBlockTable:
    """seq id -> a row of `table` ([rows, width] int32 on `device`) holding its blocks.

    Rows and width grow by doubling when needed (a reallocation outside any captured CUDA
    graph: graphs copy the rows they run into buffers of their own). Unused entries are
    block 0, the pool's scratch block."""

    def __init__(self, device: torch.device | str, rows: int = 64, width: int = 16):
        self.device = torch.device(device)
        self.table = torch.zeros(max(rows, 1), max(width, 1), dtype=torch.int32, device=self.device)  # [R, W]
        self._row_of: dict[int, int] = {}
        self._free_rows: list[int] = list(range(self.table.shape[0] - 1, -1, -1))
        self._width_of: dict[int, int] = {}  # blocks held by each row

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._row_of

    def __len__(self) -> int:
        return len(self._row_of)

    @property
    def width(self) -> int:
        return int(self.table.shape[1])

    def _grow(self, rows: int, width: int) -> None:
        old = self.table
        r, w = old.shape
        new_r, new_w = max(r, rows), max(w, width)
        if (new_r, new_w) == (r, w):
            return
        new_r = max(new_r, 2 * r) if new_r > r else r
        new_w = max(new_w, 2 * w) if new_w > w else w
        table = torch.zeros(new_r, new_w, dtype=torch.int32, device=self.device)
        table[:r, :w] = old
        self._free_rows = list(range(new_r - 1, r - 1, -1)) + self._free_rows
        self.table = table

    def add(self, seq_id: int, blocks: list[int]) -> int:
        """Write the sequence's blocks into a free row (one host-to-device copy); its row."""
        if seq_id in self._row_of:
            raise KeyError(f"sequence {seq_id} already has a device block table row")
        if not self._free_rows or len(blocks) > self.width:
            self._grow(len(self._row_of) + 1, len(blocks))
        row = self._free_rows.pop()
        if blocks:
            self.table[row, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32).to(self.device, non_blocking=True)
        self._row_of[seq_id] = row
        self._width_of[seq_id] = len(blocks)
        return row

    def remove(self, seq_id: int) -> None:
        row = self._row_of.pop(seq_id, None)
        if row is None:
            return
        # back to scratch, so a stale entry can never point a later reader at live blocks
        self.table[row, : self._width_of.pop(seq_id)] = 0
        self._free_rows.append(row)

    def row(self, seq_id: int) -> int:
        return self._row_of[seq_id]

    def rows(self, seq_ids: list[int]) -> list[int]:
        return [self._row_of[s] for s in seq_ids]

    def gather(self, seq_ids: list[int], width: int | None = None) -> torch.Tensor:
        """[B, width] int32 on the device: the block tables of seq_ids, in order."""
        rows = int64_tensor(self.rows(seq_ids)).to(self.device, non_blocking=True)  # [B]
        table = self.table if width is None or width >= self.width else self.table[:, :width]
        out = table.index_select(0, rows)
        if width is not None and width > self.width:
            out = torch.nn.functional.pad(out, (0, width - self.width))
        return out


def slot_mapping(block_table: torch.Tensor, lengths: torch.Tensor, width: int, block_size: int) -> torch.Tensor:
    """block_table [B, M] (int32/int64), lengths [B] -> [B, width] int64 slots on their device:
    the slot of position p < lengths[b]; SCRATCH_SLOT past it (KVCacheManager.slot_table's
    contract). Device ops only: no host read, so it can run inside a CUDA graph."""
    pos = torch.arange(width, device=block_table.device)  # [L]
    blocks = block_table.shape[1]
    index = (pos // block_size).clamp_(max=blocks - 1)  # [L]: positions past the table are masked below
    slots = block_table.index_select(1, index).to(torch.int64) * block_size + pos % block_size  # [B, L]
    valid = pos.unsqueeze(0) < lengths.to(block_table.device).unsqueeze(1)  # [B, L]
    return torch.where(valid, slots, torch.full_like(slots, SCRATCH_SLOT))


def position_slots(block_table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """block_table [B, M], positions [B, T] (int64) -> [B, T] int64: the slot of each position."""
    blocks = torch.gather(block_table, 1, (positions // block_size).to(torch.int64))  # [B, T]
    return blocks.to(torch.int64) * block_size + positions % block_size
