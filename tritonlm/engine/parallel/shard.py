"""One rank's share of a model and its forward pass (the same code runs in every process).

Weights come from TorchRunner's extraction (the same Proj / Norm / Layer tensors, GPT-2
Conv1D and Llama Linear layouts already unified to `y = x @ w + b` with w [in, out]);
each rank keeps a COPY of its slice only, so the full model can be freed after loading.

Tensor parallel (TPShard), Megatron style, for a rank r of N:
    embedding      vocab-parallel: rows [v0, v1) of wte (and rows [p0, p1) of GPT-2's
                   wpe); ids outside the range contribute zeros; ALL-REDUCE -> x
    attention      column-parallel q/k/v (heads [h0, h1), kv heads [g0, g1)); the rank's
                   KV pool holds only its kv heads; row-parallel out-proj; ALL-REDUCE; + bias
    MLP            column-parallel fc (gate/up); row-parallel down; ALL-REDUCE; + bias
    LM head        vocab-parallel columns [v0, v1): each rank's logits slice is GATHERED
                   to rank 0 (padded to one width, trimmed there)
    norms, biases of the row-parallel projections: replicated (a few KiB)
So one all-reduce per sublayer (2 per layer) plus one for the embedding and one gather.

Pipeline parallel (StageShard): stage s holds layers [l0, l1) and their KV pool; stage 0
also the embeddings, the last stage ln_f and the LM head.

Shapes: B batch, T new tokens per row, L keys per row, C hidden, V vocab, D head_dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tritonlm.engine.kv_cache import KVPool
from tritonlm.engine.runners.base import StepPlan
from tritonlm.engine.runners.torch_runner import Layer, Norm, Proj, apply_rope, rope_cos_sin
from tritonlm.engine.spec import ModelSpec


def split_range(n: int, parts: int, index: int) -> tuple[int, int]:
    """[lo, hi) of part `index` when n items are cut into `parts` near-equal consecutive parts."""
    base, extra = divmod(n, parts)
    lo = index * base + min(index, extra)
    return lo, lo + base + (1 if index < extra else 0)


def _copy(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.clone(memory_format=torch.contiguous_format)


def _cols(p: Proj, idx: torch.Tensor) -> Proj:
    """Column-parallel slice: output features idx."""
    return Proj(p.w.index_select(1, idx).contiguous(), None if p.b is None else p.b.index_select(0, idx).contiguous())


def _rows(p: Proj, idx: torch.Tensor) -> Proj:
    """Row-parallel slice: input features idx (the bias is kept apart, added once after the all-reduce)."""
    return Proj(p.w.index_select(0, idx).contiguous(), None)


def _norm(n: Norm) -> Norm:
    return Norm(_copy(n.w), _copy(n.b), n.eps, n.rms)


def _heads(lo: int, hi: int, dim: int, offset: int = 0) -> torch.Tensor:
    return torch.arange(offset + lo * dim, offset + hi * dim)


def tensor_bytes(*objs) -> int:
    """Bytes of the distinct tensors reachable from objs (Proj/Norm/Layer/KVPool/lists/tensors)."""
    seen: dict[int, int] = {}

    def visit(o):
        if o is None:
            return
        if isinstance(o, torch.Tensor):
            seen.setdefault(o.untyped_storage().data_ptr(), o.untyped_storage().nbytes())
        elif isinstance(o, (list, tuple)):
            for x in o:
                visit(x)
        elif isinstance(o, (Proj, Norm, Layer, KVPool)):
            for x in vars(o).values():
                visit(x)

    for o in objs:
        visit(o)
    return sum(seen.values())


@dataclass
class ModelParts:
    """What TorchRunner extracted, referenced (not copied) for slicing."""

    spec: ModelSpec
    layers: list[Layer]
    wte: torch.Tensor  # [V, C]
    wpe: torch.Tensor | None  # [P, C] (GPT-2)
    ln_f: Norm
    lm_head: Proj  # [C, V]
    act: object
    inv_freq: torch.Tensor | None
    rope_scaling: float
    max_positions: int | None

    @staticmethod
    def from_model(model, device: torch.device, dtype: torch.dtype | None) -> "ModelParts":
        from tritonlm.engine.runners.torch_runner import TorchRunner

        r = TorchRunner(model, device=device, dtype=dtype)
        return ModelParts(
            spec=r.spec,
            layers=r.layers,
            wte=r.wte,
            wpe=r.wpe,
            ln_f=r.ln_f,
            lm_head=r.lm_head,
            act=r.act,
            inv_freq=getattr(r, "inv_freq", None),
            rope_scaling=getattr(r, "rope_scaling", 1.0),
            max_positions=r.max_positions,
        )


def load_parts(hf_dir, device: str | torch.device, dtype: torch.dtype | None = None) -> ModelParts:
    from transformers import AutoModelForCausalLM

    kwargs = {"dtype": dtype} if dtype is not None else {}
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), **kwargs)
    model.eval()
    return ModelParts.from_model(model, torch.device(device), dtype)


class Comm:
    """The collectives a shard needs (implemented in comm.py; a no-op stand-in for world 1)."""

    rank = 0
    world = 1

    def allreduce(self, t: torch.Tensor) -> None:  # in place, sum
        pass

    def gather_cols(self, t: torch.Tensor, widths: list[int]) -> torch.Tensor | None:
        return t

    def send(self, t: torch.Tensor, dst: int, tag: int):
        raise NotImplementedError

    def recv(self, t: torch.Tensor, src: int, tag: int) -> None:
        raise NotImplementedError


# ---------------------------------------------------------------------------- shared layer math


def paged_attention(q, k, v, k_cache, v_cache, plan: StepPlan, mask, scale: float) -> torch.Tensor:
    """Write the new K/V at plan.write_slots, attend over each row's slots; [B, T, H*D].

    The same math as TorchRunner's attention, kept here so the shards do not depend on
    that runner's internal step context: q [B, T, H, D], k/v [B, T, Hkv, D], caches
    [S, Hkv, D] (this rank's kv heads only), mask [B, 1, T, L]."""
    bsz, width, heads, dim = q.shape
    slots = plan.write_slots.reshape(-1)
    k_cache.index_copy_(0, slots, k.reshape(-1, *k.shape[2:]).to(k_cache.dtype))
    v_cache.index_copy_(0, slots, v.reshape(-1, *v.shape[2:]).to(v_cache.dtype))
    table = plan.slot_table.reshape(-1)
    length = plan.slot_table.shape[1]
    keys = k_cache.index_select(0, table).view(bsz, length, *k_cache.shape[1:]).transpose(1, 2).to(q.dtype)
    values = v_cache.index_select(0, table).view(bsz, length, *v_cache.shape[1:]).transpose(1, 2).to(q.dtype)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), keys, values, attn_mask=mask, scale=scale, enable_gqa=heads != k.shape[2]
    )  # [B, H, T, D]
    return out.transpose(1, 2).reshape(bsz, width, heads * dim)


def attention(x, layer: Layer, pool: KVPool, li: int, plan: StepPlan, mask, rope, heads: int, kv_heads: int, dim: int):
    """Self-attention of `heads` query heads over `kv_heads` cached heads; returns the
    pre-out-proj output [B, T, heads*D] (caller applies the out-proj)."""
    bsz, width, _ = x.shape
    if layer.qkv is not None:  # GPT-2 fused [q | k | v]
        q, k, v = layer.qkv(x).split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    else:
        q, k, v = layer.q(x), layer.k(x), layer.v(x)
    q = q.reshape(bsz, width, heads, dim)
    k = k.reshape(bsz, width, kv_heads, dim)
    v = v.reshape(bsz, width, kv_heads, dim)
    if rope is not None:
        cos, sin = rope
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    return paged_attention(q, k, v, pool.k[li], pool.v[li], plan, mask, layer.attn_scale)


def mlp_inner(x, layer: Layer, act):
    """Everything of the MLP before the down projection."""
    if layer.fc is not None:
        return act(layer.fc(x))
    return act(layer.gate(x)) * layer.up(x)


def select_rows(x: torch.Tensor, plan: StepPlan, all_logits: bool) -> torch.Tensor:
    if all_logits:
        return x
    rows = torch.arange(plan.batch_size, device=x.device)
    return x[rows, plan.num_new - 1]  # [B, C]


# ---------------------------------------------------------------------------- tensor parallel


@dataclass
class TPShard:
    spec: ModelSpec  # the whole model's
    rank: int
    world: int
    heads: int  # local query heads
    kv_heads: int  # local kv heads
    layers: list[Layer]
    o_bias: list[torch.Tensor | None]
    down_bias: list[torch.Tensor | None]
    wte: torch.Tensor  # [v1 - v0, C]
    vocab_lo: int
    wpe: torch.Tensor | None
    pos_lo: int
    ln_f: Norm
    lm_head: Proj  # [C, v1 - v0]
    head_widths: list[int]  # LM head columns of every rank
    act: object
    inv_freq: torch.Tensor | None
    rope_scaling: float
    max_positions: int | None
    dtype: torch.dtype
    device: torch.device
    pool: KVPool | None = None

    @staticmethod
    def from_parts(parts: ModelParts, rank: int, world: int) -> "TPShard":
        s = parts.spec
        d = s.head_dim
        h0, h1 = split_range(s.num_heads, world, rank)
        g0, g1 = split_range(s.num_kv_heads, world, rank)
        q_cols = _heads(h0, h1, d)
        layers, o_bias, down_bias = [], [], []
        for L in parts.layers:
            new = Layer(ln_attn=_norm(L.ln_attn), ln_mlp=_norm(L.ln_mlp), o=_rows(L.o, q_cols), attn_scale=L.attn_scale)
            if L.qkv is not None:
                cols = torch.cat([
                    q_cols,
                    _heads(g0, g1, d, s.num_heads * d),
                    _heads(g0, g1, d, s.num_heads * d + s.num_kv_heads * d),
                ])
                new.qkv = _cols(L.qkv, cols)
            else:
                new.q = _cols(L.q, q_cols)
                new.k = _cols(L.k, _heads(g0, g1, d))
                new.v = _cols(L.v, _heads(g0, g1, d))
            inner = (L.fc or L.up).w.shape[1]
            f0, f1 = split_range(inner, world, rank)
            f_cols = torch.arange(f0, f1)
            if L.fc is not None:
                new.fc = _cols(L.fc, f_cols)
            else:
                new.gate, new.up = _cols(L.gate, f_cols), _cols(L.up, f_cols)
            new.down = _rows(L.down, f_cols)
            layers.append(new)
            o_bias.append(_copy(L.o.b))
            down_bias.append(_copy(L.down.b))
        v0, v1 = split_range(parts.wte.shape[0], world, rank)
        wpe, p0 = None, 0
        if parts.wpe is not None:
            p0, p1 = split_range(parts.wpe.shape[0], world, rank)
            wpe = _copy(parts.wpe[p0:p1])
        wte = _copy(parts.wte[v0:v1])
        vocab = parts.lm_head.w.shape[1]
        c0, c1 = split_range(vocab, world, rank)
        tied = (
            parts.lm_head.b is None
            and vocab == parts.wte.shape[0]
            and parts.lm_head.w.untyped_storage().data_ptr() == parts.wte.untyped_storage().data_ptr()
        )
        # tied embeddings stay tied: the LM head slice is a view of this rank's wte rows
        head = Proj(wte.t(), None) if tied else _cols(parts.lm_head, torch.arange(c0, c1))
        return TPShard(
            spec=s, rank=rank, world=world, heads=h1 - h0, kv_heads=g1 - g0,
            layers=layers, o_bias=o_bias, down_bias=down_bias,
            wte=wte, vocab_lo=v0, wpe=wpe, pos_lo=p0,
            ln_f=_norm(parts.ln_f), lm_head=head,
            head_widths=[split_range(vocab, world, i)[1] - split_range(vocab, world, i)[0] for i in range(world)],
            act=parts.act, inv_freq=_copy(parts.inv_freq), rope_scaling=parts.rope_scaling,
            max_positions=parts.max_positions, dtype=parts.wte.dtype, device=parts.wte.device,
        )

    # ---- memory ---------------------------------------------------------------------
    @property
    def kv_bytes_per_token(self) -> int:
        elem = torch.empty((), dtype=self.spec.dtype).element_size()
        return 2 * self.spec.num_layers * self.kv_heads * self.spec.head_dim * elem

    def allocate_kv(self, num_slots: int) -> int:
        shape = (num_slots, self.kv_heads, self.spec.head_dim)
        n = self.spec.num_layers
        self.pool = KVPool(
            k=[torch.zeros(shape, dtype=self.spec.dtype, device=self.device) for _ in range(n)],
            v=[torch.zeros(shape, dtype=self.spec.dtype, device=self.device) for _ in range(n)],
        )
        return self.pool.nbytes

    def weight_bytes(self) -> int:
        return tensor_bytes(self.layers, self.o_bias, self.down_bias, self.wte, self.wpe, self.ln_f, self.lm_head, self.inv_freq)

    def kv_bytes(self) -> int:
        return 0 if self.pool is None else self.pool.nbytes

    # ---- forward ---------------------------------------------------------------------
    def _embed(self, plan: StepPlan) -> torch.Tensor:
        def part(table: torch.Tensor, idx: torch.Tensor, lo: int) -> torch.Tensor:
            local = idx - lo
            inside = (local >= 0) & (local < table.shape[0])
            out = F.embedding(local.clamp(0, table.shape[0] - 1), table)
            return out * inside.unsqueeze(-1).to(out.dtype)

        x = part(self.wte, plan.input_ids, self.vocab_lo)
        if self.wpe is not None:
            x = x + part(self.wpe, plan.positions, self.pos_lo)
        return x.contiguous()

    def forward(self, plan: StepPlan, all_logits: bool, comm: Comm) -> torch.Tensor | None:
        """Logits (float32, [B, V] or [B, T, V]) on rank 0; None on the others."""
        assert self.pool is not None, "allocate_kv first"
        s = self.spec
        with torch.inference_mode():
            x = self._embed(plan)
            comm.allreduce(x)
            rope = None
            if self.inv_freq is not None:
                rope = rope_cos_sin(plan.positions, self.inv_freq, self.rope_scaling, self.dtype)
            mask = plan.key_mask().unsqueeze(1)  # [B, 1, T, L]
            for li, layer in enumerate(self.layers):
                y = attention(layer.ln_attn(x), layer, self.pool, li, plan, mask, rope, self.heads, self.kv_heads, s.head_dim)
                h = layer.o(y).contiguous()
                comm.allreduce(h)
                if self.o_bias[li] is not None:
                    h = h + self.o_bias[li]
                x = x + h
                h = layer.down(mlp_inner(layer.ln_mlp(x), layer, self.act)).contiguous()
                comm.allreduce(h)
                if self.down_bias[li] is not None:
                    h = h + self.down_bias[li]
                x = x + h
            x = select_rows(x, plan, all_logits)
            logits = self.lm_head(self.ln_f(x)).float().contiguous()  # [..., this rank's vocab columns]
            return comm.gather_cols(logits, self.head_widths)


# ---------------------------------------------------------------------------- pipeline parallel


@dataclass
class StageShard:
    spec: ModelSpec
    stage: int
    stages: int
    layer_lo: int
    layers: list[Layer]
    wte: torch.Tensor | None  # stage 0
    wpe: torch.Tensor | None
    ln_f: Norm | None  # last stage
    lm_head: Proj | None
    act: object
    inv_freq: torch.Tensor | None
    rope_scaling: float
    max_positions: int | None
    dtype: torch.dtype
    device: torch.device
    pool: KVPool | None = None
    hidden: int = 0

    @staticmethod
    def from_parts(parts: ModelParts, stage: int, stages: int) -> "StageShard":
        l0, l1 = split_range(parts.spec.num_layers, stages, stage)
        first, last = stage == 0, stage == stages - 1

        def copy_layer(L: Layer) -> Layer:
            return Layer(**{
                k: (_norm(v) if isinstance(v, Norm) else Proj(_copy(v.w), _copy(v.b)) if isinstance(v, Proj) else v)
                for k, v in vars(L).items()
            })

        return StageShard(
            spec=parts.spec, stage=stage, stages=stages, layer_lo=l0,
            layers=[copy_layer(L) for L in parts.layers[l0:l1]],
            wte=_copy(parts.wte) if first else None,
            wpe=_copy(parts.wpe) if first else None,
            ln_f=_norm(parts.ln_f) if last else None,
            lm_head=Proj(_copy(parts.lm_head.w), _copy(parts.lm_head.b)) if last else None,
            act=parts.act, inv_freq=_copy(parts.inv_freq), rope_scaling=parts.rope_scaling,
            max_positions=parts.max_positions, dtype=parts.wte.dtype, device=parts.wte.device,
            hidden=parts.wte.shape[1],
        )

    @property
    def kv_bytes_per_token(self) -> int:
        elem = torch.empty((), dtype=self.spec.dtype).element_size()
        return 2 * len(self.layers) * self.spec.num_kv_heads * self.spec.head_dim * elem

    def allocate_kv(self, num_slots: int) -> int:
        shape = (num_slots, self.spec.num_kv_heads, self.spec.head_dim)
        self.pool = KVPool(
            k=[torch.zeros(shape, dtype=self.spec.dtype, device=self.device) for _ in self.layers],
            v=[torch.zeros(shape, dtype=self.spec.dtype, device=self.device) for _ in self.layers],
        )
        return self.pool.nbytes

    def weight_bytes(self) -> int:
        return tensor_bytes(self.layers, self.wte, self.wpe, self.ln_f, self.lm_head, self.inv_freq)

    def kv_bytes(self) -> int:
        return 0 if self.pool is None else self.pool.nbytes

    def embed(self, plan: StepPlan) -> torch.Tensor:
        with torch.inference_mode():
            x = F.embedding(plan.input_ids, self.wte)
            if self.wpe is not None:
                x = x + F.embedding(plan.positions, self.wpe)
            return x

    def run_layers(self, plan: StepPlan, x: torch.Tensor) -> torch.Tensor:
        s = self.spec
        with torch.inference_mode():
            rope = None
            if self.inv_freq is not None:
                rope = rope_cos_sin(plan.positions, self.inv_freq, self.rope_scaling, self.dtype)
            mask = plan.key_mask().unsqueeze(1)
            for li, layer in enumerate(self.layers):
                y = attention(layer.ln_attn(x), layer, self.pool, li, plan, mask, rope, s.num_heads, s.num_kv_heads, s.head_dim)
                x = x + layer.o(y)
                x = x + layer.down(mlp_inner(layer.ln_mlp(x), layer, self.act))
            return x.contiguous()

    def head(self, plan: StepPlan, x: torch.Tensor, all_logits: bool) -> torch.Tensor:
        with torch.inference_mode():
            return self.lm_head(self.ln_f(select_rows(x, plan, all_logits))).float().contiguous()
