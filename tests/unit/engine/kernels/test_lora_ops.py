"""tritonlm/engine/kernels/lora_ops.cpp (torch.ops.tritonlm.lora_apply, LoraWeights, LoraBatch):
each adapter's (x @ a) @ b added to its own rows, against a float64 reference; adapters of
different ranks in one call, b's zero column blocks (a fused projection's other targets) left
out; a row's bits independent of the rows beside it; bad input refused by name."""

from __future__ import annotations

import pytest
import torch

from tritonlm.engine.kernels import kernels_available

pytestmark = pytest.mark.skipif(not kernels_available()[0], reason="tritonlm's C++ kernels do not load here")

IN, OUT, LAYERS = 40, 56, 2


def weights(rank: int, seed: int, blocks: list[tuple[int, int]] | None = None, layer: int = 1, proj: int = 2):
    """(LoraWeights with one update at (layer, proj), a [IN, rank], b [rank, OUT]); blocks:
    per rank row, its non-zero columns [lo, hi) (zeros elsewhere, as a fused projection's b)."""
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(IN, rank, generator=g), torch.randn(rank, OUT, generator=g)
    if blocks is not None:
        mask = torch.zeros_like(b)
        for r, (lo, hi) in enumerate(blocks):
            mask[r, lo:hi] = 1
        b = b * mask
    w = torch.classes.tritonlm.LoraWeights(LAYERS)
    w.set(layer, proj, a, b)
    return w, a, b


def batch(*groups) -> object:
    out = torch.classes.tritonlm.LoraBatch()
    for w, rows in groups:
        out.add(w, torch.tensor(rows, dtype=torch.int64))
    return out


def test_each_adapters_rows_get_its_update_at_its_own_rank():
    """Ranks 4, 8 (b in two column blocks, as q and v of a fused qkv) and 16 over 11 rows, 3
    of them base rows: each row is y + (x @ a) @ b of its adapter (float64 reference), base rows
    keep their bits; another (layer, projection) or an adapter without that update adds nothing."""
    w4, a4, b4 = weights(4, 1)
    w8, a8, b8 = weights(8, 2, blocks=[(0, 20)] * 4 + [(36, 56)] * 4)
    w16, a16, b16 = weights(16, 3)
    rows = {0: [1, 7], 1: [0, 2, 3, 9, 10], 2: [5, 8]}
    g = torch.Generator().manual_seed(4)
    x, y0 = torch.randn(11, IN, generator=g), torch.randn(11, OUT, generator=g)
    y = y0.clone()
    torch.ops.tritonlm.lora_apply(y, x, batch((w4, rows[0]), (w8, rows[1]), (w16, rows[2])), 1, 2)
    want = y0.double().clone()
    for (a, b), idx in zip(((a4, b4), (a8, b8), (a16, b16)), rows.values()):
        want[idx] += (x[idx].double() @ a.double()) @ b.double()
    assert (y.double() - want).abs().max().item() < 1e-4
    base = [4, 6]
    assert torch.equal(y[base], y0[base])
    assert (y[rows[1]] - y0[rows[1]])[:, 20:36].abs().max().item() == 0  # b8's zero columns add nothing
    for layer, proj in ((0, 2), (1, 0)):  # no update there
        same = y0.clone()
        torch.ops.tritonlm.lora_apply(same, x, batch((w4, rows[0]), (w16, rows[2])), layer, proj)
        assert torch.equal(same, y0)


def test_a_rows_bits_do_not_depend_on_the_rows_beside_it():
    """A row under an adapter alone and among 9 others (its adapter's and others'): the same bits,
    so a sequence's logits do not depend on its batch."""
    w8, _, _ = weights(8, 5)
    w16, _, _ = weights(16, 6)
    g = torch.Generator().manual_seed(7)
    x, y0 = torch.randn(10, IN, generator=g), torch.randn(10, OUT, generator=g)
    together = y0.clone()
    torch.ops.tritonlm.lora_apply(together, x, batch((w8, [0, 1, 2, 3, 4, 5]), (w16, [6, 7, 8, 9])), 1, 2)
    for row, w in ((0, w8), (5, w8), (9, w16)):
        alone = y0[row:row + 1].clone()
        torch.ops.tritonlm.lora_apply(alone, x[row:row + 1].contiguous(), batch((w, [0])), 1, 2)
        assert torch.equal(alone[0], together[row]), row


def test_bad_input_is_refused_by_name():
    w, _, _ = weights(4, 8)
    x, y = torch.randn(3, IN), torch.zeros(3, OUT)
    with pytest.raises(RuntimeError, match="row 1 is named twice"):
        torch.ops.tritonlm.lora_apply(y, x, batch((w, [0, 1]), (weights(8, 9)[0], [1])), 1, 2)
    with pytest.raises(RuntimeError, match="row 3 of the batch is outside the projection's 3 rows"):
        torch.ops.tritonlm.lora_apply(y, x, batch((w, [3])), 1, 2)
    with pytest.raises(RuntimeError, match=r"the adapter's update is \[40, 56\]"):
        torch.ops.tritonlm.lora_apply(torch.zeros(3, 5), x, batch((w, [0])), 1, 2)
    with pytest.raises(RuntimeError, match="must be contiguous float32"):
        torch.ops.tritonlm.lora_apply(y.double(), x, batch((w, [0])), 1, 2)
    with pytest.raises(ValueError, match="proj must be 0 .qkv., 1 .o., 2 .gate_up or fc. or 3 .down., not 4"):
        torch.ops.tritonlm.lora_apply(y, x, batch((w, [0])), 1, 4)
    with pytest.raises(RuntimeError, match="layer 2 is outside the adapter's 2 layers"):
        torch.ops.tritonlm.lora_apply(y, x, batch((w, [0])), 2, 2)
    with pytest.raises(ValueError, match="rows must be >= 0"):
        batch((w, [-1]))
    with pytest.raises(ValueError, match="rows must be an int64 CPU vector"):
        torch.classes.tritonlm.LoraBatch().add(w, torch.tensor([0], dtype=torch.int32))
    with pytest.raises(ValueError, match="a must be float32 CPU \\[in, R\\] and b float32 CPU \\[R, out\\]"):
        torch.classes.tritonlm.LoraWeights(LAYERS).set(0, 0, torch.randn(IN, 4), torch.randn(5, OUT))
    with pytest.raises(ValueError, match="layer 2 is outside"):
        torch.classes.tritonlm.LoraWeights(LAYERS).set(2, 0, torch.randn(IN, 4), torch.randn(4, OUT))


def test_a_wide_step_over_torchs_threads_gives_the_same_bits():
    """Enough rows that the kernel splits them over torch's threads (a wide prefill): the float64
    reference, and each row the bits it gets alone (on the calling thread)."""
    g = torch.Generator().manual_seed(12)
    n_in, out, rows = 512, 1024, 320
    a, b = torch.randn(n_in, 16, generator=g), torch.randn(16, out, generator=g)
    w = torch.classes.tritonlm.LoraWeights(1)
    w.set(0, 3, a, b)
    x, y0 = torch.randn(rows, n_in, generator=g), torch.randn(rows, out, generator=g)
    y = y0.clone()
    torch.ops.tritonlm.lora_apply(y, x, batch((w, list(range(rows)))), 0, 3)
    want = y0.double() + (x.double() @ a.double()) @ b.double()
    assert (y.double() - want).abs().max().item() < 1e-3
    for row in (0, 157, rows - 1):
        alone = y0[row:row + 1].clone()
        torch.ops.tritonlm.lora_apply(alone, x[row:row + 1].contiguous(), batch((w, [0])), 0, 3)
        assert torch.equal(alone[0], y[row]), row
