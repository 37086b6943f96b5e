"""tritonlm/engine/host_tensors.py: int lists as CPU tensors, against torch.tensor's own."""

from __future__ import annotations

import pytest
import torch

from tritonlm.engine.host_tensors import int64_tensor, padded_int64


@pytest.mark.parametrize("values", [[], [7], [0, -1, 2**62, -(2**62), 5], list(range(300))])
def test_int64_tensor_equals_torch_tensor(values):
    got = int64_tensor(values)
    assert got.dtype == torch.int64 and got.device.type == "cpu"
    assert torch.equal(got, torch.tensor(values, dtype=torch.int64))


def test_int64_tensor_is_writable_and_owns_its_values():
    values = [1, 2, 3]
    got = int64_tensor(values)
    values[0] = 99  # the list is packed, not referenced
    got[1] = 5
    assert got.tolist() == [1, 5, 3]


@pytest.mark.parametrize("rows,width", [
    ([[3], [4], [5]], 1),  # decoding rows
    ([[1, 2, 3], [4], [5, 6]], 3),  # chunks of differing lengths
    ([[1, 2], [3, 4]], 2),
    ([[1]], 4),  # wider than every row
    ([], 3),
])
def test_padded_int64_equals_padding_by_hand(rows, width):
    expected = torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int64).reshape(len(rows), width)
    got = padded_int64(rows, width)
    assert got.shape == (len(rows), width)
    assert torch.equal(got, expected)


def test_padded_int64_fill():
    assert padded_int64([[1], [2, 3]], 3, fill=-1).tolist() == [[1, -1, -1], [2, 3, -1]]
