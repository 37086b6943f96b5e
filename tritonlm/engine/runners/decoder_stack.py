"""A model's layers as one C++ DecoderStack (kernels/decoder_stack.cpp), for decode-width steps.

    build_decoder_stack(model) -> torch.classes.tritonlm.DecoderStack | None
    torch.ops.tritonlm.decoder_stack(stack, x, k_caches, v_caches, write_slots, slot_table,
                                     positions, cos, sin, rows, lora)   (Transformer.run_layers)
    torch.ops.tritonlm.decode_step(stack, input_ids, past_len, block_table, block_size,
                                   k_caches, v_caches, rows, lora)     (Transformer.decode_step)
        with the model's ends too (the embedding, the final norm, the LM head: a whole model
        on one rank), a decode step from the rows' block tables to their logits in one call

The stack runs the same ops as Transformer.run_layers' Python loop, in the same order,
through torch's C++ dispatcher, so the logits are the same bits; what it saves is the
interpreter's and torch's Python dispatch per op (docs/performance-notes.md, "The decode
step"). It references the layers' weights, it does not copy them. `lora` (None: the base
alone) is a step's LoRA adapters and their rows (lora.apply.cpp_batch), applied after each
projection by the same kernel the Python loop calls (kernels/lora_ops.cpp).

The builder lives beside the runner, not in kernels/: it reads the model's layers and
projection classes, while kernels/ only compiles and registers the ops. It reads the model
through StackModel (what a Transformer has), so model.py's import of it is not a circle.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch
import torch.nn.functional as F

from tritonlm.engine.runners.layers import (
    BlockedLinear,
    Int8Linear,
    Layer,
    Linear,
    Norm,
    PanelLinear,
    WeightOnlyInt8Linear,
    gelu_tanh,
)


class StackModel(Protocol):
    """The fields of a runners.model.Transformer that the stack is built from."""

    layers: list[Layer]
    act: Callable[[torch.Tensor], torch.Tensor]
    heads: int
    wte: torch.Tensor | None  # [V', C]
    wpe: torch.Tensor | None  # [P', C]
    ln_f: Norm | None
    lm_head: Linear | None  # [C, V']
    inv_freq: torch.Tensor | None  # [D/2]
    rope_scaling: float | torch.Tensor  # a float, or [D] (a partial rotary's)
    length_rope: object | None  # runners.rope.LengthRope: cos / sin that position alone does not give

    @property
    def vocab_parallel(self) -> bool: ...


def build_decoder_stack(model: StackModel) -> object | None:
    """The model's layers as one DecoderStack, or None where its ops do not cover them. It
    takes Llama-family layers (RMSNorm, silu(gate) * up) and GPT-2's (LayerNorm, gelu tanh
    over fc) whose projections are all float32 in panels or oneDNN-blocked, int8 through
    fbgemm's fused op or tritonlm's own i8_linear (Int8Linear.act8), or weight-only int8
    through w8_linear (the C++ kernels must be loaded: Transformer.use_paged_kernel); each layer's sliding window, soft-cap and sinks go with it
    (DecoderStack.set_attention). When the model also holds its float32 embedding and final
    norm and an LM head of those kinds (a whole model, not a pipeline stage or a vocabulary
    shard) and a RoPE of positions alone, the stack gets them too (stack.has_ends()):
    torch.ops.tritonlm.decode_step."""
    if not model.layers:
        return None
    rms = model.layers[0].ln_attn.rms
    if model.act is F.silu:
        act = "silu_mul"
    elif model.act is gelu_tanh:
        act = "gelu_tanh"
    else:
        return None

    def runs_in_stack(p: Linear | None) -> bool:
        return isinstance(p, (BlockedLinear, PanelLinear)) or (isinstance(p, (Int8Linear, WeightOnlyInt8Linear))
                                                              and p.cpp_op)

    for L in model.layers:
        mlp_in = L.gate_up if act == "silu_mul" else L.fc
        if mlp_in is None or L.ln_attn.rms != rms or L.ln_mlp.rms != rms:
            return None
        if not all(runs_in_stack(p) for p in (L.qkv, L.o, mlp_in, L.down)):
            return None
        norms = [t for n in (L.ln_attn, L.ln_mlp) for t in (n.w, n.b) if t is not None]
        if any(t.dtype != torch.float32 for t in norms):
            return None
    stack = torch.classes.tritonlm.DecoderStack(model.heads)

    def add(p: Linear) -> None:
        if isinstance(p, BlockedLinear):
            stack.add_float(p.blocked, p.b)
        elif isinstance(p, PanelLinear):
            stack.add_panel(p.panel, p.b, p.out)
        elif isinstance(p, WeightOnlyInt8Linear):
            stack.add_w8(p.panel, p.scale, p.offset, p.b, p.out)
        elif p.act8 is not None:
            a = p.act8
            stack.add_i8(a.panel, a.wscale, p.smooth, p.b, a.out, a.isa)
        else:
            stack.add_int8(p.packed, p.smooth, p.b, p.reduce_range)

    for L in model.layers:
        for p in (L.qkv, L.o, L.gate_up if act == "silu_mul" else L.fc, L.down):
            add(p)
        a, m = L.ln_attn, L.ln_mlp
        stack.add_layer(a.w, a.b, a.eps, m.w, m.b, m.eps, rms, act, L.attn_scale)
        window, softcap = L.block.sliding_window, L.block.softcap
        if window is not None or softcap is not None or L.sinks is not None:  # as paged_attention_qkv takes them
            stack.set_attention(window or 0, softcap or 0.0, L.sinks)
    # decode_step computes cos / sin from positions, inv_freq and one scaling factor
    position_rope = model.length_rope is None and not isinstance(model.rope_scaling, torch.Tensor)
    if (model.wte is not None and model.ln_f is not None and not model.vocab_parallel and runs_in_stack(model.lm_head)
            and position_rope):
        if all(t is None or t.dtype == torch.float32 for t in (model.wte, model.wpe, model.ln_f.w, model.ln_f.b)):
            add(model.lm_head)
            f = model.ln_f
            stack.set_ends(model.wte, model.wpe, f.w, f.b, f.eps, f.rms, model.inv_freq, model.rope_scaling)
    return stack
