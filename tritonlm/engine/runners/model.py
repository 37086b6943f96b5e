"""One transformer (GPT-2, or a Llama-shaped family: runners.families): its weights as plain
tensors and its forward pass. What a Llama-shaped layer does beyond Llama's block (q/k norm,
post-norm, a sliding window, no RoPE) is its Layer.block, read from the config at load.

gpt-fast style: the weights are pulled out of a loaded HF model (from_hf) into the pieces
of runners.layers (GPT-2 Conv1D and Llama Linear layouts unified to `y = x @ w + b`,
w [in, out], Llama's q/k/v fused into one `qkv` and gate/up into one `gate_up`), and
forward() = embed -> run_layers -> head. The same code runs everywhere:

    whole model     Transformer.from_hf(model, device, dtype)                    (TorchRunner)
    tensor parallel parallel.shard.tensor_slice(model, rank, world), with a ProcessComm
    pipeline        parallel.shard.layer_slice(model, stage, stages); stages call embed,
                    run_layers and head themselves (parallel/steps.py)
    int8            runners.quant (rotate_residual, calibrate, quantize_int8) on the plain weights
    CPU float       block_weights(): tritonlm's float32 panels (else oneDNN's blocked layout),
                    after all of the above

Per layer, attention writes the new keys/values into the pool in place and reads them
through each row's slot table (layers.paged_attention; with tritonlm's C++ ops on,
decode-width steps take torch.ops.tritonlm.paged_attention_qkv, and run all the layers
in one C++ call: runners/decoder_stack.py). The LM head runs only on the rows whose logits
are wanted: each row's last valid token, or every new token with all_logits.

A padded batch (prefill chunks of different widths) runs packed: norms, projections and
the MLP see only the N real tokens (ForwardBatch.packed), attention the padded [B, T] layout.

Shapes: B batch, T new tokens per row (padded width), L keys per row (max past+new),
N real tokens of a padded batch, C hidden, H query heads, Hkv key/value heads, D head_dim,
F MLP width, V vocab (V' a rank's share).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from tritonlm.engine.batch import StepBatch
from tritonlm.engine.kv_cache import KVPool
from tritonlm.engine.model_shape import ModelShape
from tritonlm.engine.parallel.comm import ONE_RANK, Comm, row_parallel
from tritonlm.engine.runners.base import ForwardBatch, Workspace, kv_rows
from tritonlm.engine.runners.families import (
    GEMMA_FAMILIES,
    FastPaths,
    GemmaEnds,
    Multipliers,
    block_specs,
    check_config,
    fast_paths,
    gemma_activation,
    gemma_ends,
    multipliers,
    rope_tables,
)
from tritonlm.engine.runners.layers import (
    BLOCKED_DTYPES,
    PAGED_KERNEL_MAX_WIDTH,
    PROJECTION_NAMES,
    BlockedLinear,
    FloatLinear,
    Int8Linear,
    Layer,
    Linear,
    Norm,
    PanelLinear,
    StepContext,
    WeightOnlyInt8Linear,
    activation,
    blocked_rows,
    decode_attention,
    i8_path,
    int8_kernel,
    paged_attention,
    panels_available,
)
from tritonlm.engine.runners.moe import MoE
from tritonlm.engine.runners.rope import (
    LengthRope,
    apply_rope,
    qkv_columns,
    rope_cos_sin,
    rope_inv_freq,
    rotary_order,
)


def reordered_norm(norm: Norm, order: torch.Tensor) -> Norm:
    """A q / k RMSNorm whose weight follows head dims reordered by order [D]: a per-head
    weight [D], or one over the whole projection [H*D] reordered head by head."""
    w = norm.w
    d = order.numel()
    w = w[order] if w.numel() == d else w.view(-1, d)[:, order].reshape(-1)
    return dataclasses.replace(norm, w=w.contiguous())


def tensor_bytes(*objs) -> int:
    """Bytes of the distinct tensor storages reachable from objs (Linear/Norm/Layer/KVPool/lists/tensors)."""
    seen: dict[int, int] = {}

    def visit(o) -> None:
        if isinstance(o, torch.Tensor):
            seen.setdefault(o.untyped_storage().data_ptr(), o.untyped_storage().nbytes())
        elif isinstance(o, Linear) and o.opaque_weight() is not None:
            weight, nbytes = o.opaque_weight()
            seen[id(weight)] = nbytes
            visit(o.b)
        elif isinstance(o, (list, tuple)):
            for x in o:
                visit(x)
        elif isinstance(o, (Linear, Norm, Layer, KVPool, MoE)):
            for x in vars(o).values():
                visit(x)

    for o in objs:
        visit(o)
    return sum(seen.values())


@dataclass(eq=False)
class Transformer:
    """Weights and forward pass of a whole model, a tensor-parallel rank's or a stage's share.

    forward() = embed -> run_layers -> head under torch.inference_mode(); a pipeline stage
    calls the parts it holds itself, under inference_mode too (entered once per step, as
    entering it has a cost that shows on small models)."""

    spec: ModelShape  # the whole model's shape; spec.dtype is the compute and KV dtype
    layers: list[Layer]  # the layers held (a stage: layers [l0, l1) of the model)
    wte: torch.Tensor | None  # [V', C] embedding rows [vocab_lo, vocab_lo + V'); None past stage 0
    wpe: torch.Tensor | None  # [P', C] GPT-2's learned positions, rows [pos_lo, pos_lo + P')
    ln_f: Norm | None  # None before the last stage
    lm_head: Linear | None  # [C, V'] (tied: a view of wte)
    act: Callable[[torch.Tensor], torch.Tensor]
    inv_freq: torch.Tensor | None  # [D/2] Llama's RoPE (runners.rope: partial rotary at frequency 0)
    rope_scaling: float | torch.Tensor  # cos / sin times this: a float, or [D] (a partial rotary's)
    max_positions: int | None  # GPT-2's learned positions are a hard limit; RoPE has none
    device: torch.device
    heads: int  # query heads held (a TP rank: heads [h0, h1))
    kv_heads: int  # key/value heads held, and in this shard's KV pool
    vocab_lo: int = 0
    pos_lo: int = 0
    head_widths: list[int] = field(default_factory=list)  # TP: LM head columns of every rank, for the gather
    # tritonlm's C++ ops (use_paged_kernel): decode-width steps' attention (paged_attention_qkv),
    # and for float32 RMSNorm / SwiGLU models the fused norms and activation at every width
    cpp_ops: bool = False
    # with the C++ ops, float32 / int8 layers (Llama family, GPT-2) also as one torch.classes.tritonlm.DecoderStack:
    # decode-width steps run every layer in one call (runners.decoder_stack.build_decoder_stack)
    decoder_stack: object | None = field(default=None, repr=False)
    # the paged-attention kernels may run this model's layers (families.fast_paths), each layer's
    # window, soft-cap and sinks passed per call
    attention_kernel: bool = True
    workspace: Workspace = field(default_factory=Workspace, repr=False)  # gathered K/V, reused step to step
    # CUDA: decode steps whose batch brings block tables read the pool in place through the
    # Triton kernel (layers.decode_attention) instead of gathering K/V (use_decode_kernel)
    decode_kernel: bool = False
    _ends_of: object | None = field(default=None, repr=False)  # the stack decode_step_ready last asked
    # Gemma: the embedding times sqrt(C) at lookup (the tied head stays unscaled), logits soft-capped
    ends: GemmaEnds = GemmaEnds()
    # {layer type: (inv_freq [D/2], scaling)} where each layer type has its own RoPE (Gemma 3;
    # a layer's BlockSpec.rope_table names its table); empty: inv_freq serves every layer
    rope_tables: dict[str, tuple[torch.Tensor, float | torch.Tensor]] = field(default_factory=dict)
    # longrope / dynamic: each token's frequencies follow its sequence's length (runners.rope);
    # inv_freq is then the table of a short sequence
    length_rope: LengthRope | None = None
    # [(H + 2 Hkv) D] the qkv output columns' order against the model's own q/k/v projections
    # (a partial or interleaved RoPE's head dims reordered, runners.rope.rotary_order): what
    # a LoRA adapter's q / k updates are reordered by; None: the model's own order
    qkv_order: torch.Tensor | None = field(default=None, repr=False)
    _has_ends: bool = field(default=False, repr=False)
    # LoRA adapters (lora.apply.attach_lora): the running step's rows per adapter, read by the
    # wrapped projections and by embed(); None: no adapters attached
    lora: object | None = field(default=None, repr=False)
    # sliding_window_kv 'window' with full layers too: two groups of blocks, two slot tables a
    # step (window_kv.py), which the one-call decoder stack and the decode graphs cannot take
    window_groups: bool = False

    @property
    def dtype(self) -> torch.dtype:
        return self.spec.dtype

    @property
    def hidden(self) -> int:
        return int(self.layers[0].ln_attn.w.shape[0])

    @property
    def vocab_parallel(self) -> bool:
        return len(self.head_widths) > 1

    @property
    def tied_head(self) -> bool:
        """The LM head is a view of the embedding (tied weights share one tensor)."""
        head = self.lm_head
        if not isinstance(head, FloatLinear) or self.wte is None:
            return False
        w = head.w
        return (
            head.b is None and w.shape[1] == self.wte.shape[0]
            and w.untyped_storage().data_ptr() == self.wte.untyped_storage().data_ptr()
        )

    # ---- from a Hugging Face model ----------------------------------------------------
    @staticmethod
    def from_hf(model, device: str | torch.device = "cpu", dtype: torch.dtype | None = None) -> "Transformer":
        """The weights of a loaded GPT-2 or Llama-shaped causal LM (runners.families.FAMILIES;
        shared, not copied, when device and dtype already match). ValueError for other
        architectures, and for a config asking what the block does not do, naming it."""
        cfg = model.config
        device = torch.device(device)
        if dtype is None:
            dtype = next(model.parameters()).dtype
        spec = ModelShape.from_hf_config(cfg, dtype=dtype)

        def t(p: torch.Tensor | None) -> torch.Tensor | None:
            return None if p is None else p.detach().to(device, dtype)

        def lin(*ms) -> FloatLinear:  # nn.Linear weights [out, in], side by side -> [in, sum(out)], contiguous
            w = torch.cat([t(m.weight) for m in ms], dim=0).t().contiguous()
            if all(m.bias is None for m in ms):
                return FloatLinear(w, None)
            return FloatLinear(w, torch.cat([t(m.bias) if m.bias is not None else w.new_zeros(m.out_features) for m in ms]))

        def conv(m) -> FloatLinear:  # GPT-2 Conv1D: weight already [in, out]
            return FloatLinear(t(m.weight), t(m.bias))

        def scaled(p: FloatLinear, s: float) -> FloatLinear:  # y * s, folded into the weights (new tensors)
            return p if s == 1.0 else FloatLinear(p.w * s, None if p.b is None else p.b * s)

        layers = []
        if spec.architecture == "gpt2":
            if getattr(cfg, "add_cross_attention", False):
                raise ValueError("GPT-2 with add_cross_attention=True is not supported")
            tr, eps = model.transformer, cfg.layer_norm_epsilon
            for i, blk in enumerate(tr.h):
                scale = spec.head_dim**-0.5 if cfg.scale_attn_weights else 1.0
                if cfg.scale_attn_by_inverse_layer_idx:
                    scale /= float(i + 1)
                layers.append(Layer(
                    ln_attn=Norm(t(blk.ln_1.weight), t(blk.ln_1.bias), eps, rms=False),
                    ln_mlp=Norm(t(blk.ln_2.weight), t(blk.ln_2.bias), eps, rms=False),
                    qkv=conv(blk.attn.c_attn), o=conv(blk.attn.c_proj),
                    fc=conv(blk.mlp.c_fc), down=conv(blk.mlp.c_proj),
                    attn_scale=scale,
                ))
            wte, wpe = t(tr.wte.weight), t(tr.wpe.weight)  # [V, C], [P, C]
            ln_f = Norm(t(tr.ln_f.weight), t(tr.ln_f.bias), eps, rms=False)
            act, inv_freq, scaling, max_positions = activation(cfg.activation_function), None, 1.0, spec.max_positions
            length_rope, qkv_order = None, None
            mult = Multipliers()
        else:
            check_config(cfg)  # ValueError naming the family and what it asks for that is not done
            base, eps = model.model, cfg.rms_norm_eps
            mult = multipliers(cfg)  # Granite's scalars, folded into the weights below (1.0 elsewhere)
            attn_scale = spec.head_dim**-0.5 if mult.attention is None else mult.attention
            gemma = cfg.model_type in GEMMA_FAMILIES
            if gemma and cfg.model_type != "gemma":
                attn_scale = float(cfg.query_pre_attn_scalar) ** -0.5

            def rms(m, eps: float) -> Norm:  # [C] or [D]; Gemma's (1 + w) folded into its weight
                if not gemma:  # gpt-oss's RMSNorm multiplies by its weight before the cast back, as Gemma's
                    return Norm(t(m.weight), None, eps, rms=True, weight_first=cfg.model_type == "gpt_oss")
                # 1 + w in float32 from w at the compute dtype, as transformers' 1.0 + weight.float()
                return Norm(1.0 + t(m.weight).float(), None, eps, rms=True, weight_first=True)
            order = rotary_order(cfg, spec.head_dim)  # [D] or None: RoPE as a rotate-half over all D dims
            qkv_order = None if order is None else qkv_columns(order, spec.num_heads, spec.num_kv_heads)
            for blk, block in zip(base.layers, block_specs(cfg)):
                at, mlp = blk.self_attn, blk.mlp
                # Phi-3 ships q/k/v and gate/up fused already, in the order the fused layout wants
                qkv = lin(at.qkv_proj) if hasattr(at, "qkv_proj") else lin(at.q_proj, at.k_proj, at.v_proj)
                if qkv_order is not None:  # q's and k's head dims in rotate-half order
                    qkv = FloatLinear(qkv.w[:, qkv_order].contiguous(), None if qkv.b is None else qkv.b[qkv_order])
                moe = MoE.from_hf(mlp, cfg, t) if block.moe else None  # router and stacked experts instead
                gate_up = (None if moe else lin(mlp.gate_up_proj) if hasattr(mlp, "gate_up_proj")
                           else lin(mlp.gate_proj, mlp.up_proj))
                qk = {}
                if block.qk_norm != "none":  # weights [D] (per head) or [H*D] / [Hkv*D] (whole)
                    qk_eps = at.q_norm.eps if gemma else at.q_norm.variance_epsilon
                    qk = dict(q_norm=rms(at.q_norm, qk_eps), k_norm=rms(at.k_norm, qk_eps))
                    if order is not None:  # their weights follow the head dims they scale
                        qk = {k: reordered_norm(n, order) for k, n in qk.items()}
                if block.norm == "sandwich" and gemma:  # Gemma 2 / 3: both blocks' inputs and outputs normed
                    qk.update(post_attn=rms(blk.post_attention_layernorm, eps),
                              post_mlp=rms(blk.post_feedforward_layernorm, eps))
                elif block.norm == "sandwich":  # GLM-4-0414: the same norms, other names
                    qk.update(post_attn=rms(blk.post_self_attn_layernorm, eps), post_mlp=rms(blk.post_mlp_layernorm, eps))
                # the norm of each block: on its input (pre, sandwich), or on its output (OLMo 2's post)
                if block.norm == "post":
                    attn_norm, mlp_norm = blk.post_attention_layernorm, blk.post_feedforward_layernorm
                elif block.norm == "sandwich" and gemma:
                    attn_norm, mlp_norm = blk.input_layernorm, blk.pre_feedforward_layernorm
                else:
                    attn_norm, mlp_norm = blk.input_layernorm, blk.post_attention_layernorm
                if getattr(at, "sinks", None) is not None:  # gpt-oss: [H] a learned logit per query head
                    qk["sinks"] = t(at.sinks).float()
                layers.append(Layer(
                    ln_attn=rms(attn_norm, eps),
                    ln_mlp=rms(mlp_norm, eps),
                    qkv=qkv, o=scaled(lin(at.o_proj), mult.residual),  # one matmul for q, k and v
                    gate_up=gate_up, down=None if moe else scaled(lin(mlp.down_proj), mult.residual), moe=moe,
                    attn_scale=attn_scale, block=block, **qk,
                ))
            wte, wpe = t(base.embed_tokens.weight), None
            ln_f = rms(base.norm, eps)
            tables = {k: rope_inv_freq(cfg, spec.head_dim, k) for k in rope_tables(cfg)}
            tables = {k: (inv.to(device), scale) for k, (inv, scale) in tables.items()}
            # with a table per layer type, inv_freq is any one of them (every layer names its own; a
            # small Gemma 3 may have sliding layers only)
            inv_freq, scaling = (tables.get("full_attention") or next(iter(tables.values()))) if tables \
                else rope_inv_freq(cfg, spec.head_dim)
            act = activation(gemma_activation(cfg) if gemma else cfg.hidden_act)
            inv_freq, max_positions = inv_freq.to(device), None
            if isinstance(scaling, torch.Tensor):
                scaling = scaling.to(device)
            length_rope = LengthRope.from_config(cfg, spec.head_dim)
            if length_rope is not None:
                length_rope = length_rope.to(device)
        # the LM head stays a view [C, V] of whatever lm_head holds (of wte when tied): no second copy
        lm_head = FloatLinear(t(model.lm_head.weight).t(), t(model.lm_head.bias))
        if mult != Multipliers():
            # Granite: a new embedding table and LM head (the model's own stay as they are)
            wte = wte * mult.embedding  # [V, C]: the same products transformers' embed * multiplier makes
            lm_head = FloatLinear(lm_head.w / mult.logits, None if lm_head.b is None else lm_head.b / mult.logits)
        return Transformer(
            spec=spec, layers=layers, wte=wte, wpe=wpe, ln_f=ln_f, lm_head=lm_head,
            act=act, inv_freq=inv_freq, rope_scaling=scaling, max_positions=max_positions,
            device=device, heads=spec.num_heads, kv_heads=spec.num_kv_heads,
            ends=GemmaEnds() if spec.architecture == "gpt2" else gemma_ends(cfg, dtype),
            rope_tables={} if spec.architecture == "gpt2" else tables,
            length_rope=length_rope, qkv_order=qkv_order,
        )

    # ---- weights ------------------------------------------------------------------------
    def block_weights(self, layout: str = "auto") -> bool:
        """Every float projection and the LM head in a layout for the CPU's kernels, in place:
        float32 in tritonlm's output panels where its kernel is built (AVX-512 or AVX2: PanelLinear),
        else oneDNN's blocked layout (BlockedLinear). Only on the CPU, for the dtypes those
        take, and after any slicing, calibration or int8 quantization (they need the plain
        weights); int8 projections stay as they are, and in an int8 model only those
        quantize_int8 kept float are packed. layout: "auto", or "blocked" for oneDNN's even
        where panels could run (tests compare the two). Returns whether it could run."""
        if layout not in ("auto", "blocked"):
            raise ValueError(f"layout: {layout!r}; use 'auto' or 'blocked'")
        if layout == "auto" and self.device.type == "cpu" and self.dtype == torch.float32 and panels_available():
            for layer in self.layers:
                for name in PROJECTION_NAMES:
                    proj = getattr(layer, name)
                    if isinstance(proj, FloatLinear):
                        setattr(layer, name, PanelLinear.from_float(proj))
                if layer.moe is not None:  # each expert's projections, as the dense MLP's
                    layer.moe.convert(lambda p: PanelLinear.from_float(p) if isinstance(p, FloatLinear) else p)
            if isinstance(self.lm_head, FloatLinear):  # a tied head: its own copy (the lookup keeps wte)
                self.lm_head = PanelLinear.from_float(self.lm_head)
            return True
        if not (self.device.type == "cpu" and self.dtype in BLOCKED_DTYPES and torch.backends.mkldnn.is_available()):
            return False
        if self.dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return False  # oneDNN's bf16 reorder needs AVX512-BW/VL/DQ or AVX-NE-CONVERT: plain x @ w
        for layer in self.layers:
            for name in PROJECTION_NAMES:
                proj = getattr(layer, name)
                if isinstance(proj, FloatLinear):  # int8 stays packed
                    setattr(layer, name, BlockedLinear.from_float(proj))
            if layer.moe is not None:
                layer.moe.convert(lambda p: BlockedLinear.from_float(p) if isinstance(p, FloatLinear) else p)
        if isinstance(self.lm_head, FloatLinear):
            # a tied head was a view of wte: the blocked copy is its own (the embedding lookup keeps wte)
            self.lm_head = BlockedLinear.from_float(self.lm_head)
        return True

    def projections(self) -> list[Linear]:
        """Every projection that int8 quantizes: the layers' and the LM head."""
        return list(self.projection_names().values())

    def projection_names(self) -> dict[str, Linear]:
        """The projections by name: "layers.{i}.{qkv|o|fc|gate_up|down}", a mixture-of-experts
        layer's "layers.{i}.moe.{experts.{e}.gate_up|...}" (MoE.projections) and "lm_head"."""
        out = {f"layers.{i}.{n}": getattr(L, n) for i, L in enumerate(self.layers)
               for n in PROJECTION_NAMES if getattr(L, n) is not None}
        for i, L in enumerate(self.layers):
            if L.moe is not None:
                out.update({f"layers.{i}.moe.{n}": p for n, p in L.moe.projections().items()})
        if self.lm_head is not None:
            out["lm_head"] = self.lm_head
        return out

    @property
    def weights_int8(self) -> bool:
        return any(isinstance(p, Int8Linear) for p in self.projections())

    # ---- memory -------------------------------------------------------------------------
    def allocate_kv(self, num_slots: int) -> KVPool:
        """A pool for the layers and kv heads this shard holds."""
        return KVPool.allocate(num_slots, len(self.layers), self.kv_heads, self.spec.head_dim, self.dtype, self.device)

    def weight_bytes(self) -> int:
        return tensor_bytes(self.layers, self.wte, self.wpe, self.ln_f, self.lm_head, self.inv_freq)

    # ---- forward ------------------------------------------------------------------------
    def _lookup(self, table: torch.Tensor, idx: torch.Tensor, lo: int) -> torch.Tensor:  # idx [B, T] -> [B, T, C]
        if not self.vocab_parallel:
            return F.embedding(idx, table)
        local = idx - lo  # rows outside [lo, lo + rows) belong to another rank: zeros here
        inside = (local >= 0) & (local < table.shape[0])
        out = F.embedding(local.clamp(0, table.shape[0] - 1), table)
        return out * inside.unsqueeze(-1).to(out.dtype)

    def embed(self, plan: ForwardBatch) -> torch.Tensor:  # [B, T, C] (TP: this rank's part of the sum)
        x = self._lookup(self.wte, plan.input_ids, self.vocab_lo)
        if self.lora is not None:  # adapters' replacement embeddings (modules_to_save) at their rows
            x = self.lora.embed(x, plan.input_ids)
        if self.wpe is not None:
            x = x + self._lookup(self.wpe, plan.positions, self.pos_lo)
        if self.ends.embed_scale is not None:  # Gemma (rounded to the compute dtype at load)
            x = x * self.ends.embed_scale
        return x

    def use_paged_kernel(self) -> tuple[bool, str]:
        """Turn on tritonlm's C++ ops (the paged-attention kernel for decode-width steps, the
        fused norms and activation, the fused int8 projection, the decoder stack) when they
        can run here: float32 on the CPU, and the kernels build. Returns (on, why)."""
        if self.device.type != "cpu" or self.dtype != torch.float32:
            return False, f"the kernel runs float32 on the CPU; this model computes {self.dtype} on {self.device}"
        from tritonlm.engine.kernels import kernels_available
        from tritonlm.engine.runners.decoder_stack import build_decoder_stack

        self.cpp_ops, why = kernels_available()
        for p in self.projections():
            if isinstance(p, Int8Linear):
                p.cpp_op = self.cpp_ops
                if self.cpp_ops and int8_kernel() == "tritonlm":  # 8 bits on every CPU, the same bits
                    p.use_act8()
            elif isinstance(p, WeightOnlyInt8Linear):
                p.cpp_op = self.cpp_ops
        paths = self.fast_paths()
        self.attention_kernel = paths.attention_kernel
        self.decoder_stack = build_decoder_stack(self) if self.cpp_ops and paths.decoder_stack else None
        if self.cpp_ops and paths.why:
            why = f"{why}; {self.spec.family}: {paths.why}"
        return self.cpp_ops and paths.attention_kernel, why

    def int8_path(self) -> str | None:
        """Which kernel the int8 projections run and with how many activation bits, for the
        startup log; None without int8 projections."""
        ps = [p for p in self.projections() if isinstance(p, Int8Linear)]
        if not ps:
            return None
        a = ps[0].act8
        if a is not None:
            return f"tritonlm's i8_linear, {i8_path(a.isa)} path, 8-bit activations"
        return f"fbgemm, {7 if ps[0].reduce_range else 8}-bit activations"

    def fast_paths(self) -> FastPaths:
        """Which fast paths these layers' BlockSpecs allow (families.fast_paths): the one place
        a family's features switch the C++ / Triton paths off, at load."""
        return fast_paths([L.block for L in self.layers], self.ends, self.length_rope is not None, self.window_groups)

    def use_window_groups(self) -> FastPaths:
        """The windowed layers keep blocks of their own (window_kv.py): the paths that take one
        slot table for every layer go off. Returns the fast paths left."""
        self.window_groups = True
        self.decoder_stack = None
        return self.fast_paths()

    def use_decode_kernel(self) -> tuple[bool, str]:
        """Turn on the Triton paged decode kernel where it runs: a CUDA device with the
        `triton` package (or triton's interpreter, TRITON_INTERPRET=1, for tests on the
        CPU). Returns (on, why)."""
        from tritonlm.engine.kernels.paged_decode import available

        self.decode_kernel, why = available(self.device)
        paths = self.fast_paths()
        if self.decode_kernel and not paths.attention_kernel:
            self.decode_kernel, why = False, f"{self.spec.family}: {paths.why}"
        return self.decode_kernel, why

    def _context(self, plan: ForwardBatch, pool: KVPool) -> StepContext:
        rope = None
        if self.length_rope is not None:
            # each row's prompt length; without one (a pass outside the engine), transformers'
            # rule for one forward pass: the row's longest position
            lengths = plan.prompt_lens if plan.prompt_lens is not None else plan.total_len
            rope = self.length_rope.cos_sin(plan.positions, lengths, self.inv_freq, self.rope_scaling, self.dtype)
        elif self.inv_freq is not None and not self.rope_tables:  # with tables (Gemma 3) every layer names one
            rope = rope_cos_sin(plan.positions, self.inv_freq, self.rope_scaling, self.dtype)
        ropes = {k: rope_cos_sin(plan.positions, inv, scale, self.dtype) for k, (inv, scale) in self.rope_tables.items()}
        if self.decode_kernel and plan.width == 1 and plan.block_table is not None:
            return StepContext(plan=plan, mask=None, rows=None, k_buf=None, v_buf=None, rope=rope, ropes=ropes,
                               triton=True)
        if (self.cpp_ops and self.attention_kernel and plan.width <= PAGED_KERNEL_MAX_WIDTH
                and pool.k[0].dtype == torch.float32):
            return StepContext(plan=plan, mask=None, rows=None, k_buf=None, v_buf=None, rope=rope, ropes=ropes,
                               kernel=True, slot_table=plan.slot_table.contiguous())
        shape = (plan.batch_size, self.kv_heads, plan.max_total, self.spec.head_dim)  # [B, Hkv, L, D]
        mask = plan.key_mask().unsqueeze(1)  # [B, 1, T, L]
        return StepContext(
            plan=plan,
            mask=mask,
            window_masks=self._window_masks(plan, mask),
            rows=kv_rows(plan.slot_table, self.kv_heads),
            k_buf=self.workspace.take("k", shape, pool.k[0].dtype, self.device),
            v_buf=self.workspace.take("v", shape, pool.v[0].dtype, self.device),
            rope=rope,
            ropes=ropes,
            packed=plan.packed,
        )

    def _window_masks(self, plan: ForwardBatch, mask: torch.Tensor) -> dict[int, torch.Tensor]:
        """{window: mask [B, 1, T, L] and keys at positions p - window < j <= p} for the windows
        the layers use; each query's own position always stays visible, so no row is empty."""
        windows = {L.block.sliding_window for L in self.layers} - {None}
        j = torch.arange(plan.max_total, device=mask.device)  # [L]
        start = plan.positions.unsqueeze(1).unsqueeze(-1)  # [B, 1, T, 1]
        return {w: mask & (j > start - w) for w in sorted(windows)}

    def self_attention(self, x: torch.Tensor, layer: Layer, li: int, ctx: StepContext, pool: KVPool) -> torch.Tensor:
        """x [B, T, C] -> [B, T, heads*D], before the out-projection; packed (ctx.packed):
        x [N, C] -> [N, heads*D], only attention itself sees the padded [B, T] layout."""
        d = self.spec.head_dim
        qkv = layer.qkv(x)  # [B, T, (H + 2 Hkv) D] or [N, (H + 2 Hkv) D]
        if layer.q_norm is not None:
            qkv = self.qk_norm(qkv, layer)
        rope = None  # a NoPE layer: no rotation
        if layer.block.rope:
            rope = ctx.ropes[layer.block.rope_table] if layer.block.rope_table else ctx.rope
        if ctx.kernel:  # RoPE, the K/V write and attention read in place through the slot table: one op
            cos, sin = rope if rope is not None else (None, None)
            return torch.ops.tritonlm.paged_attention_qkv(
                qkv.contiguous(), pool.k[li], pool.v[li], ctx.plan.write_slots, ctx.slot_table, ctx.plan.positions,
                cos, sin, self.heads, layer.attn_scale, layer.block.sliding_window or 0, layer.block.softcap or 0.0,
                layer.sinks)
        bsz, width = ctx.plan.batch_size, ctx.plan.width
        if ctx.packed is not None:  # zeros at the padding: finite keys and values, written to scratch only
            qkv = qkv.new_zeros(bsz * width, qkv.shape[-1]).index_copy_(0, ctx.packed, qkv)
        qkv = qkv.view(bsz, width, -1)
        qk_width = (self.heads + self.kv_heads) * d
        qk = qkv[..., :qk_width].view(bsz, width, self.heads + self.kv_heads, d)  # [B, T, H + Hkv, D]
        if rope is not None:  # q and k rotated in one pass (half the small ops of two)
            qk = apply_rope(qk, *rope)
        q, k = qk.split([self.heads, self.kv_heads], dim=2)  # [B, T, H, D], [B, T, Hkv, D]
        v = qkv[..., qk_width:].view(bsz, width, self.kv_heads, d)  # [B, T, Hkv, D]
        if ctx.triton:
            return decode_attention(q, k, v, pool.k[li], pool.v[li], ctx, layer.attn_scale, layer.block.sliding_window,
                                    layer.block.softcap, layer.sinks)  # [B, 1, H*D]
        window = layer.block.sliding_window
        mask = None if window is None else ctx.window_masks[window]
        out = paged_attention(q, k, v, pool.k[li], pool.v[li], ctx, layer.attn_scale, mask,
                              layer.block.softcap, layer.sinks)  # [B, T, H*D]
        if ctx.packed is None:
            return out
        return out.view(bsz * width, -1).index_select(0, ctx.packed)  # [N, H*D]

    def qk_norm(self, qkv: torch.Tensor, layer: Layer) -> torch.Tensor:
        """[..., (H + 2 Hkv) D] with q and k RMS-normed before RoPE, v as it was: per head
        (Qwen3) or over the whole projection (OLMo 2)."""
        d = self.spec.head_dim
        q, k, v = qkv.split([self.heads * d, self.kv_heads * d, self.kv_heads * d], dim=-1)
        if layer.block.qk_norm == "whole":
            return torch.cat([self.norm(layer.q_norm, q), self.norm(layer.k_norm, k), v], dim=-1)
        q = self.norm(layer.q_norm, q.unflatten(-1, (self.heads, d))).flatten(-2)  # [..., H*D]
        k = self.norm(layer.k_norm, k.unflatten(-1, (self.kv_heads, d))).flatten(-2)  # [..., Hkv*D]
        return torch.cat([q, k, v], dim=-1)

    def mlp_inner(self, x: torch.Tensor, layer: Layer) -> torch.Tensor:
        """x [..., C] -> [..., F] ([B, T] or packed [N] rows), everything before the down projection."""
        if layer.fc is not None:
            return self.act(layer.fc(x))
        return self.glu(layer.gate_up(x))  # gate_up [B, T, 2F]

    def mlp(self, x: torch.Tensor, layer: Layer, comm: Comm) -> torch.Tensor:
        """x [..., C] -> [..., C]: the layer's MLP, dense (row-parallel down) or a mixture of experts."""
        if layer.moe is not None:
            return layer.moe(x.reshape(-1, x.shape[-1]), self.glu).view(x.shape)
        return row_parallel(layer.down, self.mlp_inner(x, layer), comm)

    def glu(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[..., 2F] -> [..., F]: act(gate) * up; for float32 SiLU with the kernels on, one C++
        pass with no [..., F] temporaries (dense MLPs and each expert's rows alike)."""
        if self.cpp_ops and self.act is F.silu and gate_up.dtype == torch.float32:
            return torch.ops.tritonlm.silu_mul(gate_up.contiguous())
        gate, up = gate_up.chunk(2, dim=-1)  # [..., F] each
        return self.act(gate) * up

    def _fused_norm(self, norm: Norm, x: torch.Tensor) -> bool:
        return self.cpp_ops and norm.rms and x.dtype == torch.float32 and norm.w.dtype == torch.float32

    def norm(self, norm: Norm, x: torch.Tensor) -> torch.Tensor:  # [..., C] -> [..., C]
        if self._fused_norm(norm, x):
            return torch.ops.tritonlm.rms_norm(x.contiguous(), norm.w, norm.eps)
        return norm(x)

    def add_norm(self, x: torch.Tensor, delta: torch.Tensor, norm: Norm) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, norm(x + delta)): the residual add and the next norm, one op with the kernels."""
        if self._fused_norm(norm, x):
            return torch.ops.tritonlm.add_rms_norm(x.contiguous(), delta.contiguous(), norm.w, norm.eps)
        x = x + delta
        return x, norm(x)

    def run_layers(self, plan: ForwardBatch, x: torch.Tensor, pool: KVPool, comm: Comm = ONE_RANK) -> torch.Tensor:
        """x [B, T, C] through this shard's layers (pool: their K/V); two all-reduces per layer under TP.
        A padded batch runs packed ([N, C] between the layers) and comes back [B, T, C], zeros at the padding."""
        ctx = self._context(plan, pool)
        # sliding_window_kv 'window': the windowed layers read and write their own rings (window_kv.py)
        ring_ctx = ctx if plan.window is None else self._context(plan.window, pool)
        # every layer in one call (the stack holds one slot table: not for a step whose layers
        # keep two groups of blocks); a step's adapters go with it, on the whole [B, T] rows
        lora_step = getattr(self.lora, "step", None)
        if (ctx.kernel and self.decoder_stack is not None and comm.world == 1 and plan.window is None
                and (lora_step is None or lora_step.cpp_layers)):
            cos, sin = ctx.rope if ctx.rope is not None else (None, None)
            rows = x.shape[0] * x.shape[1]
            lora = None
            if lora_step is not None:
                lora = lora_step.cpp_batch(rows)
                self.lora.stack_steps += 1
            return torch.ops.tritonlm.decoder_stack(
                self.decoder_stack, x, pool.k, pool.v, plan.write_slots, ctx.slot_table, plan.positions, cos, sin,
                blocked_rows(rows), lora)
        shape, full_ctx = x.shape, ctx
        if ctx.packed is not None:  # [B, T, C] -> [N, C]: the padding never reaches a matmul
            x = x.reshape(-1, shape[-1]).index_select(0, ctx.packed)
        delta = None  # what the last block adds to the residual stream, added with the next norm
        for li, layer in enumerate(self.layers):
            ctx = ring_ctx if layer.block.sliding_window is not None else full_ctx
            if layer.block.norm == "post":  # OLMo 2: the blocks see x itself, their outputs are normed
                x = x if delta is None else x + delta
                x = x + self.norm(layer.ln_attn, row_parallel(layer.o, self.self_attention(x, layer, li, ctx, pool), comm))
                delta = self.norm(layer.ln_mlp, self.mlp(x, layer, comm))
                continue
            x, h = (x, self.norm(layer.ln_attn, x)) if delta is None else self.add_norm(x, delta, layer.ln_attn)
            delta = row_parallel(layer.o, self.self_attention(h, layer, li, ctx, pool), comm)
            if layer.post_attn is not None:  # sandwich norms (Gemma 2 / 3): the output normed too
                delta = self.norm(layer.post_attn, delta)
            x, h = self.add_norm(x, delta, layer.ln_mlp)
            delta = self.mlp(h, layer, comm)
            if layer.post_mlp is not None:
                delta = self.norm(layer.post_mlp, delta)
        x = x if delta is None else x + delta
        if ctx.packed is None:
            return x
        return x.new_zeros(shape[0] * shape[1], shape[-1]).index_copy_(0, ctx.packed, x).view(shape)  # [B, T, C]

    def head(self, plan: ForwardBatch, x: torch.Tensor, all_logits: bool) -> torch.Tensor:
        """x [B, T, C] -> float32 logits [B, V'] (last valid token of each row) or [B, T, V']."""
        if not all_logits:
            rows = torch.arange(plan.batch_size, device=x.device)
            x = x[rows, plan.num_new - 1]  # [B, C]: only the rows whose logits are wanted
        logits = self.lm_head(self.norm(self.ln_f, x))
        cap = self.ends.logit_softcap
        if cap is not None:  # Gemma 2's final soft-cap, in the compute dtype as transformers rounds it (bf16 ties)
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    @property
    def decode_step_ready(self) -> bool:
        """The whole model is in the C++ decoder stack, ends included: decode_step can run.
        Asked every decode step, so the stack's answer is kept until the stack changes."""
        stack = self.decoder_stack
        if stack is None:
            return False
        if self._ends_of is not stack:
            self._ends_of, self._has_ends = stack, bool(stack.has_ends())
        return self._has_ends

    @torch.inference_mode()
    def decode_step(self, batch: StepBatch, pool: KVPool, lora: object | None = None) -> torch.Tensor:
        """forward() of a decode batch (one new token per row, its last logits; block tables
        on the CPU) in one C++ call (the DecoderStack, runners/decoder_stack.py): its index tensors, the embedding,
        RoPE, the layers, the final norm and the LM head, the same ops as plan_step and
        forward run, so the same logits, bit for bit. lora: the rows' adapters
        (lora.apply.decode_batch; none of them replacing the embedding or the LM head), applied
        after each projection as the Python path applies them. -> float32 [B, V]."""
        if lora is not None:
            self.lora.stack_steps += 1
        return torch.ops.tritonlm.decode_step(
            self.decoder_stack, batch.input_ids, batch.past_len, batch.block_table, batch.block_size, pool.k, pool.v,
            blocked_rows(batch.input_ids.shape[0]), lora)

    @torch.inference_mode()
    def forward(self, plan: ForwardBatch, all_logits: bool, pool: KVPool, comm: Comm = ONE_RANK) -> torch.Tensor | None:
        """Logits (float32, [B, V] or [B, T, V]) on rank 0; None on the other TP ranks."""
        x = self.embed(plan)
        comm.allreduce(x)
        x = self.run_layers(plan, x, pool, comm)
        return comm.gather_cols(self.head(plan, x, all_logits), self.head_widths)
