"""tritonlm/engine/kernels/decoder_stack.py: the C++ DecoderStack (a decode step's layers in
one call) against the Python loop of the same ops, where it is used, and its refusals."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.models import stack_and_loop_logits, tiny_llama
from tritonlm.engine.runners import load_runner
from tritonlm.engine.runners.torch_runner import TorchRunner
from tritonlm.models.builtin import build_tiny


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("int8", [False, True], ids=["float32", "int8"])
@pytest.mark.parametrize("widths", [[1] * 5, [3, 1, 8]], ids=["decode", "mixed"])
def test_decoder_stack_gives_the_python_loops_bits(arch, int8, widths):
    """The C++ DecoderStack (every layer of a decode-width step in one call) against
    run_layers' Python loop of the same ops: equal logits, bit for bit, over three steps.
    Llama with biased q/k/v projections (Qwen-style) so the bias paths run too; GPT-2:
    LayerNorm, biases everywhere, gelu over fc, learned positions."""
    model = tiny_llama(attention_bias=True) if arch == "llama" else build_tiny("tiny-gpt2")[0]
    runner = TorchRunner(model, int8=int8)
    stack = runner.transformer.decoder_stack
    assert stack is not None and stack.num_layers() == 2
    logits = stack_and_loop_logits(runner, widths, first_past=5, blocks=60)
    for a, b in zip(*logits):
        assert torch.equal(a, b), f"max abs diff {(a - b).abs().max().item():.3g}"


def test_decoder_stack_only_where_its_ops_cover_the_layers(hf_models):
    from tritonlm.engine.kernels.decoder_stack import build_decoder_stack

    assert load_runner("torch", hf_models["llama"]).transformer.decoder_stack is not None
    assert load_runner("torch", hf_models["gpt2"]).transformer.decoder_stack is not None
    assert load_runner("torch", hf_models["llama"], dtype=torch.bfloat16).transformer.decoder_stack is None
    relu = load_runner("torch", hf_models["llama"])
    relu.transformer.act = torch.nn.functional.relu  # an activation the stack does not have
    assert build_decoder_stack(relu.transformer) is None


def test_decoder_stack_refuses_an_unfinished_layer_naming_it():
    from tritonlm.engine.kernels import kernels_available

    assert kernels_available()[0]
    stack = torch.classes.tritonlm.DecoderStack(4)
    with pytest.raises(RuntimeError, match=r"add_layer: a layer takes 4 projections \(qkv, o, gate_up or fc, down\); 0 were added"):
        stack.add_layer(torch.ones(8), None, 1e-5, torch.ones(8), None, 1e-5, True, "silu_mul", 1.0)
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
