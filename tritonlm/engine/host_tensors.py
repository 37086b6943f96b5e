"""Python lists of ints as CPU tensors, made through a typed buffer.

Every step turns a few per-row lists (token ids, lengths, block table rows) into int64
tensors. torch.tensor() reads a Python list element by element through its generic
sequence path, which at hundreds of rows is a visible share of a step's host work;
array.array packs the same ints in one C loop, and torch.frombuffer wraps that memory
without a copy (the tensor keeps the array alive).
"""

from __future__ import annotations

import array
import itertools
from typing import Iterable

import torch


def int64_tensor(values: Iterable[int]) -> torch.Tensor:
    """[n] int64 on the CPU with values, in order (an empty list gives an empty tensor)."""
    packed = array.array("q", values)
    if not packed:
        return torch.empty(0, dtype=torch.int64)
    return torch.frombuffer(packed, dtype=torch.int64)


def padded_int64(rows: list[list[int]], width: int, fill: int = 0) -> torch.Tensor:
    """[len(rows), width] int64: row b is rows[b] then `fill` up to width (each len <= width)."""
    if width == 1:  # decoding rows: one token each, the common step
        packed = array.array("q", [row[0] if row else fill for row in rows])
    else:
        packed = array.array("q", itertools.chain.from_iterable(
            row if len(row) == width else row + [fill] * (width - len(row)) for row in rows))
    if not packed:
        return torch.empty(len(rows), width, dtype=torch.int64)
    return torch.frombuffer(packed, dtype=torch.int64).view(len(rows), width)
