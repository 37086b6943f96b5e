"""A rank's share of a Transformer: tensor slices (Megatron style) and layer ranges (pipeline).

    tensor_slice(model, rank, world)
        column-parallel q/k/v (heads [h0, h1), kv heads [g0, g1)) and fc / gate / up;
        row-parallel o / down, whose partial sums the forward pass all-reduces
        (parallel.comm.row_parallel) before adding their biases once; vocab-parallel
        embedding (ids outside the rank's rows give zeros, then an all-reduce) and LM head
        (its columns gathered to rank 0)
    layer_slice(model, stage, stages)
        layers [l0, l1); stage 0 also holds the embeddings, the last stage ln_f and the LM head

A share holds copies of its part only, so the full model can be freed after slicing. Only
plain float weights can be sliced: slice first, then quantize or block each share.
"""

from __future__ import annotations

import copy

import torch

from tritonlm.engine.runners.layers import FloatLinear, Layer, Linear, Norm, owned_copy
from tritonlm.engine.runners.model import Transformer
from tritonlm.engine.runners.moe import MoE


def split_range(n: int, parts: int, index: int) -> tuple[int, int]:
    """[lo, hi) of part `index` when n items are cut into `parts` near-equal consecutive parts."""
    base, extra = divmod(n, parts)
    lo = index * base + min(index, extra)
    return lo, lo + base + (1 if index < extra else 0)


def _take(t: torch.Tensor, dim: int, spans: list[tuple[int, int]]) -> torch.Tensor:
    """A contiguous copy of t's [lo, hi) spans along dim, concatenated."""
    parts = [t.narrow(dim, lo, hi - lo) for lo, hi in spans]
    return torch.cat(parts, dim) if len(parts) > 1 else owned_copy(parts[0])


def column_slice(p: Linear, spans: list[tuple[int, int]]) -> FloatLinear:
    """Column-parallel slice: output features in spans (bias sliced with them)."""
    p = p.plain()
    return FloatLinear(_take(p.w, 1, spans), None if p.b is None else _take(p.b, 0, spans))


def row_slice(p: Linear, spans: list[tuple[int, int]]) -> FloatLinear:
    """Row-parallel slice: input features in spans; the whole bias, added once after the all-reduce."""
    p = p.plain()
    return FloatLinear(_take(p.w, 0, spans), owned_copy(p.b))


def _clone(o):
    """Copy of a Linear / Norm / Layer / MoE (other fields as they are)."""
    if isinstance(o, Linear):
        p = o.plain()
        return FloatLinear(owned_copy(p.w), owned_copy(p.b))
    if isinstance(o, Norm):
        return Norm(owned_copy(o.w), owned_copy(o.b), o.eps, o.rms, o.weight_first)
    if isinstance(o, Layer):
        return Layer(**{k: _clone(v) for k, v in vars(o).items()})
    if isinstance(o, MoE):  # the router and every expert's projections copied
        moe = copy.copy(o)
        moe.router, moe.router_bias = owned_copy(o.router), owned_copy(o.router_bias)
        moe.convert(_clone)
        return moe
    return o


def tensor_slice(model: Transformer, rank: int, world: int) -> Transformer:
    """Rank `rank` of `world`'s copy of its weights (see the module docstring)."""
    if model.layers:
        model.layers[0].qkv.plain()  # int8 or blocked weights: refused, saying which
    if any(L.moe is not None for L in model.layers):  # experts are not split (nor assigned) across ranks
        raise ValueError(f"{model.spec.family}: mixture-of-experts layers are not split across tensor-parallel ranks")
    if any(L.block.qk_norm == "whole" for L in model.layers):  # its RMS spans every rank's heads
        raise ValueError(f"{model.spec.family}: q/k norm over the whole projection is not split across tensor-parallel ranks")
    s, d = model.spec, model.spec.head_dim
    h0, h1 = split_range(s.num_heads, world, rank)
    g0, g1 = split_range(s.num_kv_heads, world, rank)
    q_span, kv_span = (h0 * d, h1 * d), (g0 * d, g1 * d)
    layers = []
    for L in model.layers:
        k0, v0 = s.num_heads * d, (s.num_heads + s.num_kv_heads) * d  # fused [q | k | v] columns
        inner = L.down.plain().w.shape[0]
        f_lo, f_hi = split_range(inner, world, rank)
        layers.append(Layer(
            ln_attn=_clone(L.ln_attn), ln_mlp=_clone(L.ln_mlp),
            qkv=column_slice(L.qkv, [q_span, (k0 + kv_span[0], k0 + kv_span[1]), (v0 + kv_span[0], v0 + kv_span[1])]),
            o=row_slice(L.o, [q_span]), down=row_slice(L.down, [(f_lo, f_hi)]),
            fc=None if L.fc is None else column_slice(L.fc, [(f_lo, f_hi)]),
            # fused [gate | up] columns: this rank's span of each
            gate_up=None if L.gate_up is None else column_slice(L.gate_up, [(f_lo, f_hi), (inner + f_lo, inner + f_hi)]),
            attn_scale=L.attn_scale, block=L.block, q_norm=_clone(L.q_norm), k_norm=_clone(L.k_norm),
            post_attn=_clone(L.post_attn), post_mlp=_clone(L.post_mlp),
            sinks=None if L.sinks is None else owned_copy(L.sinks[h0:h1]),  # [H'] this rank's heads' sinks
        ))
    v0, v1 = split_range(model.wte.shape[0], world, rank)
    wte = owned_copy(model.wte[v0:v1])
    p0, wpe = 0, None
    if model.wpe is not None:
        p0, p1 = split_range(model.wpe.shape[0], world, rank)
        wpe = owned_copy(model.wpe[p0:p1])
    vocab = model.lm_head.plain().w.shape[1]
    # tied embeddings stay tied: the LM head slice is a view of this rank's wte rows
    head = FloatLinear(wte.t(), None) if model.tied_head else column_slice(model.lm_head, [split_range(vocab, world, rank)])
    widths = [hi - lo for lo, hi in (split_range(vocab, world, i) for i in range(world))]
    return Transformer(
        spec=s, layers=layers, wte=wte, wpe=wpe, ln_f=_clone(model.ln_f), lm_head=head,
        act=model.act, inv_freq=owned_copy(model.inv_freq), rope_scaling=model.rope_scaling,
        max_positions=model.max_positions, device=model.device, heads=h1 - h0, kv_heads=g1 - g0,
        vocab_lo=v0, pos_lo=p0, head_widths=widths, ends=model.ends, rope_tables=model.rope_tables,
        length_rope=model.length_rope,
    )


def layer_slice(model: Transformer, stage: int, stages: int) -> Transformer:
    """Pipeline stage `stage` of `stages`' copy of its layers (and embeddings / head)."""
    l0, l1 = split_range(len(model.layers), stages, stage)
    first, last = stage == 0, stage == stages - 1
    wte = owned_copy(model.wte) if first else None
    head = None
    if last:
        head = FloatLinear(wte.t(), None) if first and model.tied_head else _clone(model.lm_head)
    return Transformer(
        spec=model.spec, layers=[_clone(L) for L in model.layers[l0:l1]],
        wte=wte, wpe=owned_copy(model.wpe) if first else None,
        ln_f=_clone(model.ln_f) if last else None, lm_head=head,
        act=model.act, inv_freq=owned_copy(model.inv_freq), rope_scaling=model.rope_scaling,
        max_positions=model.max_positions, device=model.device, heads=model.heads, kv_heads=model.kv_heads,
        ends=model.ends, rope_tables=model.rope_tables, length_rope=model.length_rope, qkv_order=model.qkv_order,
    )
