"""Rotary position embeddings: a config's RoPE as frequency tables, and each token's cos / sin.

    rope_inv_freq(config, D)       (inv_freq [D/2], scaling): the table every fast path takes
    rotary_order(config, D)        the head-dim order that makes a partial or interleaved RoPE
                                   a plain rotate-half one (None where it already is)
    qkv_columns(order, H, Hkv)     that order over the fused q/k/v projection's columns
    LengthRope.from_config(...)    longrope / dynamic: frequencies that change with the length
    rope_cos_sin(positions, ...)   cos, sin [B, T, 1, D] of position-only tables
    apply_rope(x, cos, sin)        x * cos + rotate_half(x) * sin

Every attention path (the gather path, the C++ paged kernel, the Triton decode kernel, the
C++ decoder stack) rotates each head's D values by halves: dim j pairs with dim j + D/2 at
frequency inv_freq[j]. Two RoPE layouts differ from that, and both are a fixed reordering of
q's and k's head dims away from it, which is done to the weights once, at load
(runners.model.Transformer.from_hf), so that no kernel needs to know:

    partial rotary  (Phi-4-mini, GLM) only the first R = D * partial_rotary_factor dims
                    rotate; the other D - R pass through. They are split into two halves
                    placed after each rotating half, at frequency 0 (cos 1, sin 0), and an
                    attention scaling is kept off them by a per-dim scaling vector.
    interleaved     (GLM) dims 2i and 2i + 1 pair up instead of i and i + R/2.

q . k sums over the head dims, so the same order on q and k leaves every attention score as
it was; v and the output projection keep theirs.

Length-dependent RoPE follows transformers' rule per forward pass (the frequencies of a pass
are those of its longest row, seq_len = max position + 1), made per token and independent of
how a prompt is chunked: a token at position p of a request whose prompt has P tokens is
rotated as transformers' generate() rotates it, by the tables of length max(P, p + 1):

    longrope   the long factors where that length > original_max_position_embeddings,
               the short ones below it
    dynamic    NTK-scaled frequencies of that length where it > max_position_embeddings
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tritonlm.engine.runners.families import rope_parameters, rope_tables

ROTATE_HALF_FAMILIES = ("phi3",)  # transformers rotates the first R dims by halves, the rest pass through
INTERLEAVED_FAMILIES = ("glm", "glm4")  # transformers pairs dims (2i, 2i + 1) of the first R
RECOMPUTE_FAMILIES = ("phi3",)  # generate() recomputes the cache when a sequence passes longrope's threshold


def rotary_dims(config, head_dim: int, layer_type: str | None = None) -> int:
    """R: how many of a head's D dims rotate (D unless partial_rotary_factor < 1)."""
    _, _, params = rope_parameters(config, layer_type)
    factor = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) or 1.0
    return int(head_dim * factor)


def rotary_order(config, head_dim: int) -> torch.Tensor | None:
    """[D] int64: new dim j holds the model's dim order[j], so that RoPE is a rotate-half over
    all D dims (the module docstring); None where the model's own order already is."""
    rot = rotary_dims(config, head_dim, (rope_tables(config) or [None])[0])  # Gemma 3: its tables agree on R
    interleaved = getattr(config, "model_type", "") in INTERLEAVED_FAMILIES
    if rot == head_dim and not interleaved:
        return None
    if rot % 2 or (head_dim - rot) % 2:
        raise ValueError(f"partial rotary over {rot} of {head_dim} head dims is not supported (both must be even)")
    half, rest = rot // 2, (head_dim - rot) // 2
    i = torch.arange(half)
    first, second = (2 * i, 2 * i + 1) if interleaved else (i, half + i)  # each rotating pair's two dims
    passing = torch.arange(rot, head_dim)
    return torch.cat([first, passing[:rest], second, passing[rest:]])  # [D]


def _table(config, layer_type: str | None, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """transformers' own (inv_freq [R/2], attention scaling) of the config's RoPE."""
    rope_type, theta, _ = rope_parameters(config, layer_type)  # ValueError for what is not served
    if rope_type == "default" and seq_len is None:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        rot = rotary_dims(config, head_dim, layer_type)
        return 1.0 / (theta ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot)), 1.0  # [R/2]
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    kwargs = {} if layer_type is None else {"layer_type": layer_type}
    if seq_len is not None:
        kwargs["seq_len"] = seq_len
    inv, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, None, **kwargs)
    return inv.float(), float(scaling)


def _padded(inv: torch.Tensor, head_dim: int) -> torch.Tensor:
    """[R/2] -> [D/2]: the pass-through dims at frequency 0 (rotary_order's layout)."""
    return torch.cat([inv, inv.new_zeros(head_dim // 2 - inv.numel())])


def _scaling(scaling: float, rot: int, head_dim: int) -> float | torch.Tensor:
    """The attention scaling of cos / sin: a float over all D dims, or a [D] vector that keeps
    it off the pass-through dims of a partial rotary."""
    if rot == head_dim or scaling == 1.0:
        return scaling
    half = torch.cat([torch.full((rot // 2,), scaling), torch.ones((head_dim - rot) // 2)])  # [D/2]
    return torch.cat([half, half])  # [D]


def rope_inv_freq(config, head_dim: int, layer_type: str | None = None) -> tuple[torch.Tensor, float | torch.Tensor]:
    """(inv_freq [D/2] float32, scaling: a float or [D]) of the config's RoPE (layer_type's
    table where the config has one per layer type: families.rope_tables), in rotary_order's
    layout. For longrope and dynamic: the table of a short sequence (LengthRope the rest)."""
    inv, scaling = _table(config, layer_type)
    return _padded(inv, head_dim), _scaling(scaling, rotary_dims(config, head_dim, layer_type), head_dim)


@dataclass
class LengthRope:
    """A RoPE whose frequencies depend on the sequence's length (the module docstring)."""

    kind: str  # "longrope" | "dynamic"
    threshold: int  # longer than this: the long / scaled tables
    head_dim: int
    rot: int
    long_inv: torch.Tensor | None  # longrope: [D/2]
    base: float = 0.0  # dynamic: the base, the factor and max_position_embeddings of its NTK rule
    factor: float = 1.0
    # Phi-3: transformers' generate() runs a sequence again whole, with the long factors, when
    # it first passes the threshold (Scheduler.rotate_again); elsewhere earlier keys stay
    recompute: bool = False

    @staticmethod
    def from_config(config, head_dim: int) -> "LengthRope | None":
        """The config's length-dependent RoPE; None for any other (and for GPT-2, and a RoPE per
        layer type, where length-dependent types are refused)."""
        if getattr(config, "model_type", "") == "gpt2" or rope_tables(config):
            return None
        rope_type, theta, params = rope_parameters(config)
        rot = rotary_dims(config, head_dim)
        if rope_type == "longrope":
            threshold = int(params.get("original_max_position_embeddings") or config.max_position_embeddings)
            long_inv, _ = _table(config, None, seq_len=threshold + 1)
            return LengthRope("longrope", threshold, head_dim, rot, _padded(long_inv, head_dim),
                              recompute=config.model_type in RECOMPUTE_FAMILIES)
        if rope_type == "dynamic":
            return LengthRope("dynamic", int(config.max_position_embeddings), head_dim, rot, None,
                              base=float(theta), factor=float(params["factor"]))
        return None

    def key(self, prompt_tokens: int) -> bytes | None:
        """What sets the tables of a sequence with that prompt's tokens apart, for its prefix-cache
        chain: None below the threshold (every such sequence rotates position p alike); above
        it, longrope's long tables, or dynamic's tables of that very length."""
        if prompt_tokens <= self.threshold:
            return None
        return b"long" if self.kind == "longrope" else b"ntk%d" % prompt_tokens

    def to(self, device: torch.device) -> "LengthRope":
        if self.long_inv is not None:
            self.long_inv = self.long_inv.to(device)
        return self

    def inv_freq(self, positions: torch.Tensor, lengths: torch.Tensor, short_inv: torch.Tensor) -> torch.Tensor:
        """positions [B, T], lengths [B] (each row's prompt tokens) -> each token's inv_freq [B, T, D/2]."""
        seq = torch.maximum(lengths.to(positions.device).view(-1, 1), positions + 1)  # [B, T]
        long = (seq > self.threshold).unsqueeze(-1)  # [B, T, 1]
        if self.kind == "longrope":
            return torch.where(long, self.long_inv, short_inv)
        # transformers' dynamic NTK rule, in float32 as it computes it from a tensor seq_len
        s = seq.to(torch.float32).clamp(min=self.threshold)
        base = self.base * ((self.factor * s / self.threshold) - (self.factor - 1)) ** (self.rot / (self.rot - 2))
        exponent = torch.arange(0, self.rot, 2, dtype=torch.int64, device=positions.device).float() / self.rot  # [R/2]
        inv = 1.0 / (base.unsqueeze(-1) ** exponent)  # [B, T, R/2]
        inv = torch.cat([inv, inv.new_zeros(*inv.shape[:-1], self.head_dim // 2 - inv.shape[-1])], dim=-1)
        return torch.where(long, inv, short_inv)

    def cos_sin(self, positions: torch.Tensor, lengths: torch.Tensor, short_inv: torch.Tensor,
                scaling: float | torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, T, 1, D] of each token at its length's frequencies."""
        freqs = positions.unsqueeze(-1).float() * self.inv_freq(positions, lengths, short_inv)  # [B, T, D/2]
        return _cos_sin(freqs, scaling, dtype)


def rope_key(rope: LengthRope | None, prompt_tokens: int) -> bytes | None:
    """LengthRope.key, None without one: what keys a sequence's prefix-cache chain."""
    return None if rope is None else rope.key(prompt_tokens)


def recompute_at(rope: LengthRope | None) -> int | None:
    """Where a sequence runs again whole (Phi-3's longrope threshold), None where none does."""
    return rope.threshold if rope is not None and rope.recompute else None


def _cos_sin(freqs: torch.Tensor, scaling: float | torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    emb = torch.cat((freqs, freqs), dim=-1)  # [B, T, D]
    if isinstance(scaling, torch.Tensor):
        scaling = scaling.to(emb.device)
    cos = (emb.cos() * scaling).to(dtype).unsqueeze(2)
    sin = (emb.sin() * scaling).to(dtype).unsqueeze(2)
    return cos, sin


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float | torch.Tensor, dtype: torch.dtype):
    """positions [B, T] -> cos, sin [B, T, 1, D] (broadcast over heads)."""
    return _cos_sin(positions.unsqueeze(-1).float() * inv_freq, scaling, dtype)  # freqs [B, T, D/2]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, H, D] rotated by half: x*cos + rotate_half(x)*sin."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def qkv_columns(order: torch.Tensor, heads: int, kv_heads: int) -> torch.Tensor:
    """The fused q/k/v output's [(H + 2 Hkv) D] column order: each q and k head's dims by
    order [D], v's as they are."""
    d = order.numel()
    q = (torch.arange(heads).view(-1, 1) * d + order).reshape(-1)  # [H D]
    k = (torch.arange(kv_heads).view(-1, 1) * d + order).reshape(-1) + heads * d  # [Hkv D]
    v = torch.arange((heads + kv_heads) * d, (heads + 2 * kv_heads) * d)  # [Hkv D]
    return torch.cat([q, k, v])
