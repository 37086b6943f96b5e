"""TorchRunner: our own forward pass over a Hugging Face model's weights, paged KV cache.

gpt-fast style: the weights are pulled out of a loaded `GPT2LMHeadModel` or
`LlamaForCausalLM` into plain tensors (shared, not copied, when device and dtype
already match), and the forward pass is a handful of small functions.

Per layer, attention writes the new keys/values into the pool in place
(`index_copy_` on the flat slot index), gathers each sequence's keys through its slot
table (`pool[slot_table]` -> [B, L, Hkv, D]) and runs `scaled_dot_product_attention`
with a boolean mask (key exists AND causal). The LM head runs only on the rows whose
logits are wanted: each row's last valid token, or every new token with all_logits.

Shapes in comments: B batch, T new tokens per row (padded width), L keys per row
(max past+new), C hidden, H query heads, Hkv key/value heads, D head_dim, V vocab.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from tritonlm.engine.batch import StepBatch
from tritonlm.engine.kv_cache import KVPool
from tritonlm.engine.runners.base import StepPlan, Workspace, check_pool, gather_kv, kv_rows, plan_step
from tritonlm.engine.spec import ModelSpec

# ---------------------------------------------------------------------------- weights


@dataclass
class Proj:
    """y = x @ w + b with w stored [in, out] (GPT-2 Conv1D layout; nn.Linear weights are a .t() view)."""

    w: torch.Tensor  # [in, out]
    b: torch.Tensor | None  # [out]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        y = x @ self.w
        return y if self.b is None else y + self.b


@dataclass
class Norm:
    w: torch.Tensor  # [C]
    b: torch.Tensor | None  # [C] (LayerNorm) / None (RMSNorm)
    eps: float
    rms: bool

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [..., C] -> [..., C]
        if not self.rms:
            return F.layer_norm(x, (x.shape[-1],), self.w, self.b, self.eps)
        # RMSNorm as HF computes it: in float32, back to the input dtype, then the weight
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.w * x32.to(x.dtype)


@dataclass
class Layer:
    ln_attn: Norm
    ln_mlp: Norm
    o: Proj  # [H*D, C]
    # GPT-2: fused qkv [C, 3C]; Llama: separate q [C, H*D], k/v [C, Hkv*D]
    qkv: Proj | None = None
    q: Proj | None = None
    k: Proj | None = None
    v: Proj | None = None
    # GPT-2: fc [C, F] -> act -> down [F, C]; Llama: down(act(gate(x)) * up(x))
    fc: Proj | None = None
    gate: Proj | None = None
    up: Proj | None = None
    down: Proj | None = None
    attn_scale: float = 1.0


def _act(name: str):
    table = {
        "gelu_new": lambda x: F.gelu(x, approximate="tanh"),  # GPT-2's tanh approximation
        "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
        "gelu_fast": lambda x: F.gelu(x, approximate="tanh"),
        "gelu": F.gelu,
        "silu": F.silu,
        "swish": F.silu,
        "relu": F.relu,
    }
    if name not in table:
        raise ValueError(f"unsupported activation {name!r} (supported: {sorted(table)})")
    return table[name]


# ---------------------------------------------------------------------------- rotary


def rope_inv_freq(config, head_dim: int) -> tuple[torch.Tensor, float]:
    """(inv_freq [D/2] float32, attention_scaling) for the config's RoPE.

    Static RoPE variants only: default, linear, llama3, yarn. Length-dependent ones
    (dynamic, longrope) change the frequencies with the sequence length and are refused."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    legacy = getattr(config, "rope_scaling", None)
    if not params and isinstance(legacy, dict):
        params = dict(legacy)
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    theta = params.get("rope_theta", getattr(config, "rope_theta", None) or 10000.0)
    partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) or 1.0
    if partial != 1.0:
        raise ValueError(f"rope partial_rotary_factor={partial} is not supported (only 1.0)")
    if rope_type == "default":
        inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))  # [D/2]
        return inv, 1.0
    if rope_type in ("linear", "llama3", "yarn"):
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, None)
        return inv.float(), float(scaling)
    raise ValueError(
        f"rope_type {rope_type!r} is not supported by TorchRunner (supported: default, linear, llama3, yarn)"
    )


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float, dtype: torch.dtype):
    """positions [B, T] -> cos, sin [B, T, 1, D] (broadcast over heads)."""
    freqs = positions.unsqueeze(-1).float() * inv_freq  # [B, T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [B, T, D]
    cos = (emb.cos() * scaling).to(dtype).unsqueeze(2)
    sin = (emb.sin() * scaling).to(dtype).unsqueeze(2)
    return cos, sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, H, D] rotated by half: x*cos + rotate_half(x)*sin."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


# ---------------------------------------------------------------------------- attention


def write_kv(cache: torch.Tensor, slots: torch.Tensor, new: torch.Tensor) -> None:
    """cache [S, Hkv, D] <- new [B, T, Hkv, D] at slots [B, T] (padding slots are scratch 0)."""
    cache.index_copy_(0, slots.reshape(-1), new.reshape(-1, *new.shape[2:]).to(cache.dtype))


def paged_attention(
    q: torch.Tensor,  # [B, T, H, D]
    k: torch.Tensor,  # [B, T, Hkv, D]
    v: torch.Tensor,  # [B, T, Hkv, D]
    k_cache: torch.Tensor,  # [S, Hkv, D]
    v_cache: torch.Tensor,  # [S, Hkv, D]
    ctx: "StepContext",
    scale: float,
) -> torch.Tensor:  # [B, T, H*D]
    bsz = q.shape[0]
    write_kv(k_cache, ctx.plan.write_slots, k)
    write_kv(v_cache, ctx.plan.write_slots, v)
    keys = gather_kv(k_cache, ctx.rows, bsz, out=ctx.k_buf).to(q.dtype)  # [B, Hkv, L, D]
    values = gather_kv(v_cache, ctx.rows, bsz, out=ctx.v_buf).to(q.dtype)  # [B, Hkv, L, D]
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),  # [B, H, T, D]
        keys,
        values,
        attn_mask=ctx.mask,  # [B, 1, T, L]
        scale=scale,
        enable_gqa=q.shape[2] != k.shape[2],
    )  # [B, H, T, D]
    _, heads, width, dim = out.shape
    return out.transpose(1, 2).reshape(bsz, width, heads * dim)


@dataclass
class StepContext:
    """What every layer of one step shares."""

    plan: StepPlan
    mask: torch.Tensor  # [B, 1, T, L] bool
    rows: torch.Tensor  # [B*Hkv*L] gather index (kv_rows)
    k_buf: torch.Tensor  # workspace for the gathered keys, reused by every layer
    v_buf: torch.Tensor
    rope: tuple[torch.Tensor, torch.Tensor] | None  # cos, sin [B, T, 1, D] (Llama)


# ---------------------------------------------------------------------------- the runner


class TorchRunner:
    """forward(batch, pool) -> float32 logits; see runners.base for the contract."""

    def __init__(self, model, *, device: str | torch.device = "cpu", dtype: torch.dtype | None = None):
        config = model.config
        if dtype is None:
            dtype = next(model.parameters()).dtype
        self.device = torch.device(device)
        self.dtype = dtype
        self.spec = ModelSpec.from_hf_config(config, dtype=dtype)  # ValueError for other architectures
        self.config = config
        self.workspace = Workspace()  # gathered K/V buffers, reused step to step
        if self.spec.architecture == "gpt2":
            self._load_gpt2(model)
        else:
            self._load_llama(model)

    @classmethod
    def from_pretrained(
        cls, hf_dir: str | Path, *, device: str | torch.device = "cpu", dtype: torch.dtype | None = None, **kwargs
    ) -> "TorchRunner":
        from transformers import AutoModelForCausalLM

        if dtype is not None:
            kwargs["dtype"] = dtype
        model = AutoModelForCausalLM.from_pretrained(str(hf_dir), **kwargs)
        model.eval()
        return cls(model, device=device, dtype=dtype)

    # ---- weight extraction --------------------------------------------------
    def _t(self, p: torch.Tensor | None) -> torch.Tensor | None:
        return None if p is None else p.detach().to(self.device, self.dtype)

    def _lin(self, m) -> Proj:  # nn.Linear: weight [out, in] -> [in, out] view
        return Proj(self._t(m.weight).t(), self._t(m.bias))

    def _conv(self, m) -> Proj:  # GPT-2 Conv1D: weight already [in, out]
        return Proj(self._t(m.weight), self._t(m.bias))

    def _load_gpt2(self, model) -> None:
        cfg = self.config
        if getattr(cfg, "add_cross_attention", False):
            raise ValueError("GPT-2 with add_cross_attention=True is not supported")
        tr = model.transformer
        self.act = _act(cfg.activation_function)
        self.wte = self._t(tr.wte.weight)  # [V, C]
        self.wpe = self._t(tr.wpe.weight)  # [P, C]
        eps = cfg.layer_norm_epsilon
        self.layers = []
        for i, blk in enumerate(tr.h):
            scale = self.spec.head_dim**-0.5 if cfg.scale_attn_weights else 1.0
            if cfg.scale_attn_by_inverse_layer_idx:
                scale /= float(i + 1)
            self.layers.append(
                Layer(
                    ln_attn=Norm(self._t(blk.ln_1.weight), self._t(blk.ln_1.bias), eps, rms=False),
                    ln_mlp=Norm(self._t(blk.ln_2.weight), self._t(blk.ln_2.bias), eps, rms=False),
                    qkv=self._conv(blk.attn.c_attn),
                    o=self._conv(blk.attn.c_proj),
                    fc=self._conv(blk.mlp.c_fc),
                    down=self._conv(blk.mlp.c_proj),
                    attn_scale=scale,
                )
            )
        self.ln_f = Norm(self._t(tr.ln_f.weight), self._t(tr.ln_f.bias), eps, rms=False)
        self.lm_head = self._lin(model.lm_head)  # [C, V] (a view of wte when tied)
        self.max_positions = self.spec.max_positions  # learned positions: a hard limit

    def _load_llama(self, model) -> None:
        cfg = self.config
        self.inv_freq, self.rope_scaling = rope_inv_freq(cfg, self.spec.head_dim)
        self.inv_freq = self.inv_freq.to(self.device)
        self.act = _act(cfg.hidden_act)
        base = model.model
        self.wte = self._t(base.embed_tokens.weight)  # [V, C]
        self.wpe = None
        eps = cfg.rms_norm_eps
        self.layers = []
        for blk in base.layers:
            at, mlp = blk.self_attn, blk.mlp
            self.layers.append(
                Layer(
                    ln_attn=Norm(self._t(blk.input_layernorm.weight), None, eps, rms=True),
                    ln_mlp=Norm(self._t(blk.post_attention_layernorm.weight), None, eps, rms=True),
                    q=self._lin(at.q_proj),
                    k=self._lin(at.k_proj),
                    v=self._lin(at.v_proj),
                    o=self._lin(at.o_proj),
                    gate=self._lin(mlp.gate_proj),
                    up=self._lin(mlp.up_proj),
                    down=self._lin(mlp.down_proj),
                    attn_scale=self.spec.head_dim**-0.5,
                )
            )
        self.ln_f = Norm(self._t(base.norm.weight), None, eps, rms=True)
        self.lm_head = self._lin(model.lm_head)  # tied or not: whatever tensor lm_head holds
        self.max_positions = None  # RoPE has no hard limit (quality degrades past training length)

    # ---- blocks ---------------------------------------------------------------
    def _attn_gpt2(self, x, layer: Layer, li: int, ctx: StepContext, pool: KVPool):  # x [B, T, C] -> [B, T, C]
        bsz, width, _ = x.shape
        s = self.spec
        q, k, v = layer.qkv(x).split(s.num_heads * s.head_dim, dim=-1)  # 3 x [B, T, C]
        q = q.view(bsz, width, s.num_heads, s.head_dim)
        k = k.view(bsz, width, s.num_kv_heads, s.head_dim)
        v = v.view(bsz, width, s.num_kv_heads, s.head_dim)
        y = paged_attention(q, k, v, pool.k[li], pool.v[li], ctx, layer.attn_scale)
        return layer.o(y)

    def _attn_llama(self, x, layer: Layer, li: int, ctx: StepContext, pool: KVPool):
        bsz, width, _ = x.shape
        s = self.spec
        q = layer.q(x).view(bsz, width, s.num_heads, s.head_dim)  # [B, T, H, D]
        k = layer.k(x).view(bsz, width, s.num_kv_heads, s.head_dim)  # [B, T, Hkv, D]
        v = layer.v(x).view(bsz, width, s.num_kv_heads, s.head_dim)
        cos, sin = ctx.rope
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = paged_attention(q, k, v, pool.k[li], pool.v[li], ctx, layer.attn_scale)
        return layer.o(y)

    def _mlp(self, x, layer: Layer):  # [B, T, C] -> [B, T, C]
        if layer.fc is not None:
            return layer.down(self.act(layer.fc(x)))
        return layer.down(self.act(layer.gate(x)) * layer.up(x))

    # ---- forward ----------------------------------------------------------------
    def forward(self, batch: StepBatch, pool: KVPool) -> torch.Tensor:
        check_pool(self.spec, self.device, pool)
        plan = plan_step(batch, self.device, self.max_positions)
        s = self.spec
        with torch.inference_mode():
            x = F.embedding(plan.input_ids, self.wte)  # [B, T, C]
            rope = None
            if self.wpe is not None:
                x = x + F.embedding(plan.positions, self.wpe)
                attn = self._attn_gpt2
            else:
                attn = self._attn_llama
                rope = rope_cos_sin(plan.positions, self.inv_freq, self.rope_scaling, self.dtype)
            kv_shape = (plan.batch_size, s.num_kv_heads, plan.max_total, s.head_dim)  # [B, Hkv, L, D]
            ctx = StepContext(
                plan=plan,
                mask=plan.key_mask().unsqueeze(1),
                rows=kv_rows(plan.slot_table, s.num_kv_heads),
                k_buf=self.workspace.take("k", kv_shape, pool.k[0].dtype, self.device),
                v_buf=self.workspace.take("v", kv_shape, pool.v[0].dtype, self.device),
                rope=rope,
            )
            for li, layer in enumerate(self.layers):
                x = x + attn(layer.ln_attn(x), layer, li, ctx, pool)
                x = x + self._mlp(layer.ln_mlp(x), layer)
            if not batch.all_logits:
                rows = torch.arange(plan.batch_size, device=self.device)
                x = x[rows, plan.num_new - 1]  # [B, C]: only the rows whose logits are wanted
            return self.lm_head(self.ln_f(x)).float()  # [B, V] or [B, T, V]

    __call__ = forward
