"""tritonlm/engine/kernels/float_panel.cpp (runners/layers.py's PanelLinear): float32
projections over 16-wide output panels, against a plain matmul; and what the kernel
promises beyond that, bit for bit: a row's result does not depend on the other rows of its
batch, so one sequence decoded alone gives exactly the logits it gets in any batch."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.models import forward_rows, paged_cache, random_tokens, tiny, tiny_llama
from tritonlm.engine.runners.layers import FloatLinear, PanelLinear, panels_available
from tritonlm.engine.runners.torch_runner import TorchRunner

pytestmark = pytest.mark.skipif(not panels_available(), reason="no panel kernel (AVX-512 or AVX2) in this build")


@pytest.mark.parametrize("shape", [(64, 48), (7, 33), (100, 49), (20, 28), (576, 960), (1536, 1)], ids=str)
def test_panel_linear_is_the_matmul_and_rows_do_not_depend_on_the_batch(shape):
    n_in, out = shape  # outputs that fill no panel, part of one (28: part of AVX2's upper half), many; inputs 7-1536
    g = torch.Generator().manual_seed(n_in * 1000 + out)
    w, b = torch.randn(n_in, out, generator=g), torch.randn(out, generator=g)
    for bias in (b, None):
        proj = PanelLinear.from_float(FloatLinear(w, bias))
        assert proj.panel.shape == (-(-out // 16), n_in, 16)
        for rows in (1, 2, 3, 5, 12, 13, 40):  # every tile shape: 1-2 rows x 4 panels, 12-row tiles and tails
            x = torch.randn(rows, n_in, generator=g)
            got = proj(x)
            want = x.double() @ w.double() + (0 if bias is None else bias.double())
            assert got.shape == (rows, out)
            assert (got.double() - want).abs().max().item() <= 1e-5 * n_in ** 0.5 * (1 + want.abs().max().item())
            for r in (0, rows // 2, rows - 1):
                assert torch.equal(proj(x[r:r + 1]), got[r:r + 1]), f"row {r} of {rows} differs alone"
    x3 = torch.randn(2, 3, n_in, generator=g)  # leading dims are kept
    assert torch.equal(proj(x3), proj(x3.reshape(6, n_in)).reshape(2, 3, out))


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_a_row_decoded_alone_gets_the_bits_it_gets_in_a_batch(arch):
    """The whole forward at decode width (every layer in the C++ stack, the paged attention
    kernel, the panel head): row 2 stepped alone and stepped with four other sequences of
    other lengths give the same logits, bit for bit, over several steps."""
    model = tiny_llama() if arch == "llama" else tiny("tiny-gpt2")[0]
    runner = TorchRunner(model)
    assert runner.attention == "paged" and runner.transformer.decoder_stack is not None
    vocab = model.config.vocab_size
    prompts = [random_tokens(n, seed=n, vocab=vocab) for n in (3, 9, 5, 17, 1)]
    alone, batched = paged_cache(runner, blocks=80), paged_cache(runner, blocks=80)
    for mgr in (alone, batched):
        for sid, p in enumerate(prompts):
            mgr.allocate(sid, len(p) + 4)
            forward_rows(runner, mgr, [(sid, 0, p)])
    nxt = [random_tokens(4, seed=100 + sid, vocab=vocab) for sid in range(len(prompts))]
    for step in range(4):
        rows = [(sid, len(p) + step, [nxt[sid][step]]) for sid, p in enumerate(prompts)]
        in_batch = forward_rows(runner, batched, rows)  # [5, V]
        by_itself = forward_rows(runner, alone, [rows[2]])  # [1, V]
        assert torch.equal(by_itself[0], in_batch[2]), f"step {step}: the row's logits depend on its batch"
