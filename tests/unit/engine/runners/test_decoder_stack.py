"""tritonlm/engine/runners/decoder_stack.py: which models get a C++ DecoderStack (the ops
cover their layers) and which keep the Python loop; the stack's bits are checked against that
loop in tests/unit/engine/kernels/test_decoder_stack.py."""

from __future__ import annotations

import torch

from tritonlm.engine.runners import load_runner
from tritonlm.engine.runners.decoder_stack import build_decoder_stack


def test_decoder_stack_only_where_its_ops_cover_the_layers(hf_models):
    assert load_runner("torch", hf_models["llama"]).transformer.decoder_stack is not None
    assert load_runner("torch", hf_models["gpt2"]).transformer.decoder_stack is not None
    assert load_runner("torch", hf_models["llama"], dtype=torch.bfloat16).transformer.decoder_stack is None
    relu = load_runner("torch", hf_models["llama"])
    relu.transformer.act = torch.nn.functional.relu  # an activation the stack does not have
    assert build_decoder_stack(relu.transformer) is None


def test_decode_step_only_for_a_whole_model_in_the_stack(hf_models):
    """A model whose head the stack cannot run (a bfloat16 one: no stack at all) or a
    pipeline stage without the embedding keeps the Python path."""
    assert load_runner("torch", hf_models["llama"]).transformer.decode_step_ready
    assert not load_runner("torch", hf_models["llama"], dtype=torch.bfloat16).transformer.decode_step_ready
    stage = load_runner("torch", hf_models["llama"]).transformer
    stage.wte = None  # as a later pipeline stage holds it
    stage.decoder_stack = build_decoder_stack(stage)
    assert stage.decoder_stack is not None and not stage.decode_step_ready


def test_each_layers_attention_options_go_into_the_stack():
    """A layer's sliding window, soft-cap and sinks (Layer.block, Layer.sinks) reach the
    stack's attention (DecoderStack.set_attention): its logits are the Python loop's bits with
    them, and differ from a stack built without them."""
    from dataclasses import replace

    from tests.helpers.models import stack_and_loop_logits, tiny_llama
    from tritonlm.engine.runners.torch_runner import TorchRunner

    runner = TorchRunner(tiny_llama())
    tr = runner.transformer
    plain = stack_and_loop_logits(runner, [1, 3], first_past=20, blocks=60)[1]
    g = torch.Generator().manual_seed(3)
    for i, layer in enumerate(tr.layers):  # a window on layer 0 only; soft-cap and sinks on both
        layer.block = replace(layer.block, sliding_window=5 if i == 0 else None, softcap=0.5)
        layer.sinks = torch.randn(tr.heads, generator=g)
    tr.decoder_stack = build_decoder_stack(tr)
    assert tr.decoder_stack is not None
    loop, stack = stack_and_loop_logits(runner, [1, 3], first_past=20, blocks=60)
    for a, b, c in zip(loop, stack, plain):
        assert torch.equal(a, b), f"max abs diff {(a - b).abs().max().item():.3g}"
        assert (b - c).abs().max() > 1e-3
