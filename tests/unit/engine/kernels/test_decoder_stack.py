"""tritonlm/engine/kernels/decoder_stack.cpp: the C++ DecoderStack (a decode step's layers in
one call) against the Python loop of the same ops, and its refusals; and
decode_step (a whole decode step in one call: Transformer.decode_step) against the Python
path around the stack."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.models import (
    block_table_rows,
    decode_step_and_python_logits,
    paged_cache,
    stack_and_loop_logits,
    tiny_llama,
)
from tritonlm.engine.runners.torch_runner import TorchRunner
from tritonlm.models.builtin import build_tiny


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("dtype", ["float32", "int8_fbgemm", "int8_tritonlm"])
@pytest.mark.parametrize("widths", [[1] * 5, [3, 1, 8]], ids=["decode", "mixed"])
def test_decoder_stack_gives_the_python_loops_bits(arch, dtype, widths, monkeypatch):
    """The C++ DecoderStack (every layer of a decode-width step in one call) against
    run_layers' Python loop of the same ops: equal logits, bit for bit, over three steps.
    Llama with biased q/k/v projections (Qwen-style) so the bias paths run too; GPT-2:
    LayerNorm, biases everywhere, gelu over fc, learned positions. int8 through either
    kernel: fbgemm's packs and tritonlm's own panels (i8_linear)."""
    if dtype.startswith("int8"):
        monkeypatch.setenv("TRITONLM_INT8_KERNEL", dtype.removeprefix("int8_"))
    model = tiny_llama(attention_bias=True) if arch == "llama" else build_tiny("tiny-gpt2")[0]
    runner = TorchRunner(model, int8=dtype.startswith("int8"))
    if dtype == "int8_tritonlm":
        assert runner.transformer.layers[0].qkv.act8 is not None
    stack = runner.transformer.decoder_stack
    assert stack is not None and stack.num_layers() == 2
    logits = stack_and_loop_logits(runner, widths, first_past=5, blocks=60)
    for a, b in zip(*logits):
        assert torch.equal(a, b), f"max abs diff {(a - b).abs().max().item():.3g}"


def test_decoder_stack_refuses_an_unfinished_layer_naming_it():
    from tritonlm.engine.kernels import kernels_available

    assert kernels_available()[0]
    stack = torch.classes.tritonlm.DecoderStack(4)
    with pytest.raises(RuntimeError, match=r"add_layer: a layer takes 4 projections \(qkv, o, gate_up or fc, down\); 0 were added"):
        stack.add_layer(torch.ones(8), None, 1e-5, torch.ones(8), None, 1e-5, True, "silu_mul", 1.0)
    with pytest.raises(RuntimeError, match=r"add_i8: panel must be a contiguous int8 CPU tensor \[P, in4, 16, 4\]"):
        stack.add_i8(torch.zeros(1, 2, 16, 4), torch.zeros(16), None, None, 16, "auto")
    with pytest.raises(RuntimeError, match=r"add_i8: wscale must be float32 \[16\]"):
        stack.add_i8(torch.zeros(1, 2, 16, 4, dtype=torch.int8), torch.zeros(8), None, None, 16, "auto")
    w = torch.randn(8, 8).contiguous()
    for _ in range(4):
        stack.add_float(torch.ops.mkldnn._reorder_linear_weight(w, None), None)
    with pytest.raises(RuntimeError, match="add_layer: act must be 'silu_mul' or 'gelu_tanh', not 'relu'"):
        stack.add_layer(torch.ones(8), None, 1e-5, torch.ones(8), None, 1e-5, True, "relu", 1.0)
    with pytest.raises(RuntimeError, match="decoder_stack: the stack must hold whole layers"):
        x = torch.zeros(1, 1, 8)
        torch.ops.tritonlm.decoder_stack(stack, x, [], [], torch.zeros(1, 1, dtype=torch.long),
                                         torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long),
                                         None, None, 1)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("dtype", ["float32", "int8_fbgemm", "int8_tritonlm", "int8_weight_only"])
def test_decode_step_gives_the_python_paths_bits(arch, dtype, monkeypatch):
    """A decode step in one C++ call (the slots from the block tables, the embedding, RoPE or
    learned positions, the layers, the final norm, the LM head) against plan_step and
    Transformer.forward: equal logits, bit for bit, one row alone and three rows of different
    lengths together, over steps that cross block boundaries."""
    if dtype in ("int8_fbgemm", "int8_tritonlm"):
        monkeypatch.setenv("TRITONLM_INT8_KERNEL", dtype.removeprefix("int8_"))
    model = tiny_llama(attention_bias=True) if arch == "llama" else build_tiny("tiny-gpt2")[0]
    runner = TorchRunner(model, int8=dtype in ("int8_fbgemm", "int8_tritonlm"),
                         int8_weight_only=dtype == "int8_weight_only")
    assert runner.transformer.decode_step_ready
    (python, native), through_forward = decode_step_and_python_logits(runner, pasts=[5, 12, 3], steps=6, blocks=60)
    assert through_forward == [6, 0]  # the native path never went through Transformer.forward
    assert [tuple(t.shape) for t in native] == [(1, runner.spec.vocab_size)] + [(3, runner.spec.vocab_size)] * 5
    for a, b in zip(python, native):
        assert torch.equal(a, b), f"max abs diff {(a - b).abs().max().item():.3g}"


@pytest.mark.parametrize("lean", [True, False], ids=["native", "python"])
def test_decode_step_refuses_a_position_past_gpt2s_table_as_the_python_path_does(lean):
    """GPT-2's learned positions are a hard limit: both paths refuse a step past it with the
    same ValueError, and the pool is left as it was."""
    runner = TorchRunner(build_tiny("tiny-gpt2")[0])
    assert runner.transformer.decode_step_ready
    runner.lean_decode = lean
    limit = runner.max_positions
    mgr = paged_cache(runner, blocks=limit // 4 + 4)
    mgr.allocate(0, limit + 1)
    before = [k.clone() for k in mgr.pool.k]
    with pytest.raises(ValueError, match=f"sequence length {limit + 1} exceeds the model's max_positions={limit}"):
        block_table_rows(runner, mgr, [(0, limit, [5])])
    assert all(torch.equal(a, b) for a, b in zip(before, mgr.pool.k))


def test_decode_step_refuses_bad_batches_naming_the_input():
    runner = TorchRunner(tiny_llama())
    tr = runner.transformer
    mgr = paged_cache(runner, blocks=8)
    mgr.allocate(0, 8)
    table = mgr.device_table.gather([0])  # [1, M]: 8 positions' blocks
    step = torch.ops.tritonlm.decode_step
    ids, past = torch.tensor([[5]]), torch.tensor([3])
    with pytest.raises(ValueError, match=r"input_ids must be int64 \[B, 1\]"):
        step(tr.decoder_stack, torch.tensor([[5, 6]]), past, table, 4, mgr.pool.k, mgr.pool.v, 1)
    with pytest.raises(ValueError, match="past_len must be >= 0, got -1 in row 0"):
        step(tr.decoder_stack, ids, torch.tensor([-1]), table, 4, mgr.pool.k, mgr.pool.v, 1)
    with pytest.raises(ValueError, match=r"past_len must be int64 \[1\]"):
        step(tr.decoder_stack, ids, torch.tensor([3, 4]), table, 4, mgr.pool.k, mgr.pool.v, 1)
    past = table.shape[1] * 4  # one position past the table's blocks
    with pytest.raises(ValueError, match=f"block_table holds {table.shape[1]} blocks; {past + 1} positions need more"):
        step(tr.decoder_stack, ids, torch.tensor([past]), table, 4, mgr.pool.k, mgr.pool.v, 1)
