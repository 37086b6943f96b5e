"""Which decoder families tritonlm serves, and what each layer of one does, read from its config.

    FAMILIES                     model_type -> what the family is (the supported list)
    REFUSED                      model_type -> why a known family is not served (yet)
    check_config(config)         ValueError naming the family and the feature it cannot serve
    block_specs(config)          per layer, a BlockSpec: the config's choices the forward pass reads
    multipliers(config)          Granite's scalar multipliers (1.0 elsewhere), folded into weights at load
    gemma_ends(config)           Gemma's embedding scale and final logit soft-cap (None elsewhere)
    rope_tables(config)          the layer types with a RoPE of their own (Gemma 3), [] elsewhere
    fast_paths(blocks, ends)     which of the C++ / Triton fast paths cover those layers, and why not

Every served family is GPT-2 or a Llama-shaped decoder (RMSNorm, rotary q/k, grouped query
attention, a gated MLP). Gemma's (1 + w) RMSNorm is an RMSNorm whose weight is 1 + w, folded
at load. What sets the Llama-shaped ones apart is a handful of config fields,
so the forward pass reads a BlockSpec per layer instead of branching per family: biases and
fused projections are the weights' business (runners.model.Transformer.from_hf), scalar
multipliers are folded into the weights, and what remains changes the block:

    qk_norm         "per_head": an RMSNorm over each head's D values of q and of k, before
                    RoPE (Qwen3); "whole": over all of q's H*D values, and k's Hkv*D (OLMo 2)
    norm            "pre": each block's input normed (Llama); "post": each block's output
                    normed before the residual add, the input as it is (OLMo 2); "sandwich":
                    both, the input and the output (Gemma 2 / 3)
    rope            False for a NoPE layer (SmolLM3: positions reach it only through the mask)
    rope_table      which of the model's RoPE tables the layer rotates by: "" the one table,
                    else its layer type (Gemma 3: a base per layer type)
    softcap         attention logits c * tanh(s / c) before the mask (Gemma 2)
    mlp             "silu": silu(gate) * up; "gelu": GeGLU, the config's GELU(gate) * up (Gemma)
    sliding_window  keys at positions p - window < j <= p only (Mistral, Phi-3, Qwen2 / Qwen3 /
                    SmolLM3 layers typed "sliding_attention"): transformers' sliding_window_overlay
    moe             the MLP is a mixture of experts (runners.moe: Mixtral, Qwen3-MoE, OLMoE,
                    Qwen2-MoE, gpt-oss; Qwen-MoE layers in mlp_only_layers or off decoder_sparse_step are dense)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# model_type -> the family, as users know it (the supported list every refusal prints)
FAMILIES: dict[str, str] = {
    "gpt2": "GPT-2 (gpt2, distilgpt2, ...)",
    "llama": "Llama (Llama 2/3, SmolLM2, TinyLlama, ...)",
    "qwen2": "Qwen2 / Qwen2.5 (q/k/v biases)",
    "qwen3": "Qwen3 dense (per-head q/k RMSNorm)",
    "mistral": "Mistral (sliding window attention)",
    "ministral": "Ministral (Ministral-8B: sliding and full attention layers alternating, layer_types)",
    "phi3": "Phi-3 / Phi-4-mini (fused qkv and gate_up; partial rotary, longrope)",
    "granite": "Granite 3 dense (embedding, attention, residual and logits multipliers)",
    "smollm3": "SmolLM3 (NoPE layers)",
    "olmo2": "OLMo 2 (norms after attention and MLP, q/k RMSNorm over the whole projection)",
    "mixtral": "Mixtral (mixture of experts: softmax top-k, renormalized; sliding window)",
    "qwen3_moe": "Qwen3-MoE (mixture of experts, norm_topk_prob; per-head q/k RMSNorm)",
    "olmoe": "OLMoE (mixture of experts, norm_topk_prob; q/k RMSNorm over the whole projection)",
    "qwen2_moe": "Qwen2-MoE (mixture of experts plus a sigmoid-gated shared expert; q/k/v biases)",
    "gpt_oss": "gpt-oss (mixture of experts with a router bias and clamped SwiGLU; attention sinks, "
               "alternating sliding windows, q/k/v/o biases; float weights: MXFP4 experts as transformers dequantizes them)",
    "glm": "GLM-4 (Glm: interleaved partial rotary, q/k/v biases, fused gate_up)",
    "glm4": "GLM-4-0414 (Glm4: as GLM-4, with norms around attention and MLP)",
    "gemma": "Gemma (GeGLU, (1 + w) RMSNorm, scaled embeddings)",
    "gemma2": "Gemma 2 (attention and final logit soft-capping, sandwich norms, alternating sliding windows)",
    "gemma3_text": "Gemma 3 text (Gemma3ForCausalLM: a RoPE base per layer type, q/k norm, sandwich norms)",
}

GEMMA_FAMILIES = ("gemma", "gemma2", "gemma3_text")

# Llama-shaped families: the same weight names, one forward pass (GPT-2 has its own layout)
ROTARY_FAMILIES = tuple(k for k in FAMILIES if k != "gpt2")

# known families that are not served, and what they need that the decoder block does not do
REFUSED: dict[str, str] = {
    "gemma3": "Gemma 3 multimodal (Gemma3ForConditionalGeneration): the vision tower is not served; "
              "serve its text model instead, a Gemma3ForCausalLM folder (model_type gemma3_text, "
              "e.g. google/gemma-3-1b-it)",
    "gemma3n": "Gemma 3n: per-layer embeddings, AltUp",
    "gemma4": "Gemma 4",
    "ministral3": "Ministral 3: a query scaling by position (llama_4_scaling_beta)",
    "mistral3": "Mistral 3 / Ministral 3 multimodal (Mistral3ForConditionalGeneration): the vision tower is not served",
    "qwen3_next": "Qwen3-Next: hybrid linear attention, mixture of experts",
    "olmo": "OLMo: non-parametric LayerNorm",
    "olmo3": "OLMo 3: post-norm, alternating sliding windows",
    "phimoe": "Phi-MoE: mixture of experts",
    "phi": "Phi-1/Phi-2: parallel attention and MLP, partial rotary",
    "granitemoe": "Granite MoE: mixture of experts",
    "granitemoehybrid": "Granite 4 hybrid: Mamba layers, mixture of experts",
    "deepseek_v2": "DeepSeek-V2: multi-head latent attention, mixture of experts",
    "deepseek_v3": "DeepSeek-V3: multi-head latent attention, mixture of experts",
    "llama4": "Llama 4: mixture of experts, chunked attention, multimodal",
    "jamba": "Jamba: hybrid Mamba",
    "mamba": "Mamba: state-space model",
    "mamba2": "Mamba-2: state-space model",
    "falcon_h1": "Falcon-H1: hybrid Mamba",
    "falcon": "Falcon: parallel attention, multi-query layouts",
}


@dataclass(frozen=True)
class BlockSpec:
    """What one Llama-shaped layer does beyond Llama's own block (the defaults are Llama's)."""

    qk_norm: str = "none"  # "none" | "per_head" (over each head's D values) | "whole" (over H*D): before RoPE
    norm: str = "pre"  # "pre": Layer.ln_attn / ln_mlp norm the block's input; "post": its output
    rope: bool = True  # False: a NoPE layer
    sliding_window: int | None = None  # attend to the last `sliding_window` positions (itself included)
    moe: bool = False  # the MLP is a mixture of experts (Layer.moe), not gate_up / down
    rope_table: str = ""  # "" the model's one RoPE table, else the layer type whose table rotates q/k
    softcap: float | None = None  # attention logits c * tanh(s / c), s already scaled (Gemma 2)
    mlp: str = "silu"  # "silu": silu(gate) * up; "gelu": the model's GELU(gate) * up (Gemma's GeGLU)


@dataclass(frozen=True)
class Multipliers:
    """Granite's scalars, applied at load (Transformer.from_hf) so that no fast path needs to
    know of them: embeddings x embedding and each block's output x residual are folded into
    the embedding table and the o / down weights, logits / logits into the LM head, and the
    attention multiplier replaces 1/sqrt(D) as the layers' attn_scale, which every path takes."""

    embedding: float = 1.0
    residual: float = 1.0
    attention: float | None = None
    logits: float = 1.0


@dataclass(frozen=True)
class FastPaths:
    """Which fast paths can run a model's layers; chosen once at load (Transformer.use_paged_kernel
    and use_decode_kernel), named in the runner's attention_why."""

    attention_kernel: bool  # C++ paged_attention_qkv (CPU) and the Triton decode kernel (CUDA): every layer's
    decoder_stack: bool  # C++ DecoderStack: all layers in one call, and decode_step
    why: str  # what switched a path off; "" when none is
    cuda_graphs: bool = True  # decode steps may be captured as CUDA graphs (runners.decode_graphs)


def family_name(model_type: str) -> str:
    """The family's short name: "Qwen3 dense", "Gemma 2"; the model_type where it is unknown."""
    if model_type in FAMILIES:
        return FAMILIES[model_type].split(" (")[0]
    return REFUSED.get(model_type, model_type or "unknown").split(":")[0]


def supported_list() -> str:
    return "; ".join(f"{k}: {v}" for k, v in FAMILIES.items())


def refusal(model_type: str) -> str:
    """Why model_type is not served, naming it and the supported families ('' when it is served)."""
    if model_type in FAMILIES:
        return ""
    what = f"architecture {model_type or 'unknown'!r}"
    if model_type in REFUSED:
        what += f" ({REFUSED[model_type]})"
    return f"{what} is not supported; supported: {supported_list()}"


def check_config(config) -> None:
    """ValueError naming the family and the feature when a config of a served family asks for
    something the decoder block does not do (other RoPE types, other attention layer types)."""
    model_type = getattr(config, "model_type", "")
    reason = refusal(model_type)
    if reason:
        raise ValueError(reason)
    if model_type == "gpt2":
        if getattr(config, "add_cross_attention", False):
            raise ValueError("GPT-2 with add_cross_attention=True is not supported")
        return
    try:
        for layer_type in rope_tables(config) or [None]:
            rope_parameters(config, layer_type)
    except ValueError as e:
        raise ValueError(f"{family_name(model_type)}: {e}") from None
    kinds = set(getattr(config, "layer_types", None) or []) - {"full_attention", "sliding_attention"}
    if kinds:
        raise ValueError(f"{family_name(model_type)}: attention layer types {sorted(kinds)} are not supported "
                         "(only full_attention and sliding_attention)")
    if getattr(config, "mlp_bias", False):
        raise ValueError(f"{family_name(model_type)}: mlp_bias=True is not supported")
    if model_type in GEMMA_FAMILIES:
        _check_gemma(config)
    elif getattr(config, "hidden_act", "silu") not in ("silu", "swish"):
        raise ValueError(f"{family_name(model_type)}: hidden_act {config.hidden_act!r} is not supported (silu only)")
    if model_type in MOE_FAMILIES and getattr(config, "clip_qkv", None) is not None:
        raise ValueError(f"{family_name(model_type)}: clip_qkv={config.clip_qkv} is not supported (q/k/v are not clamped)")


GELU_NAMES = ("gelu_pytorch_tanh", "gelu_new", "gelu_fast", "gelu")  # what Gemma's GeGLU may name (layers.activation)


def gemma_activation(config) -> str:
    """The GELU of Gemma's GeGLU: Gemma 2 / 3 read hidden_activation, Gemma (1) hidden_act."""
    if config.model_type == "gemma":
        return config.hidden_act
    return getattr(config, "hidden_activation", None) or "gelu_pytorch_tanh"


def _check_gemma(config) -> None:
    name = family_name(config.model_type)
    act = gemma_activation(config)
    if act not in GELU_NAMES:
        raise ValueError(f"{name}: activation {act!r} is not supported (one of {', '.join(GELU_NAMES)})")
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError(f"{name}: use_bidirectional_attention=True is not supported (causal attention only)")


ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "dynamic")
LENGTH_ROPE_TYPES = ("longrope", "dynamic")  # frequencies that change with the sequence's length (runners.rope)
# families whose transformers forward rotates only the first partial_rotary_factor of each head
PARTIAL_ROTARY_FAMILIES = ("phi3", "glm", "glm4")


def rope_tables(config) -> list[str]:
    """The layer types with a RoPE table of their own (Gemma 3's rope_parameters per layer type,
    each layer rotating by its type's); [] where one table serves every layer."""
    if getattr(config, "model_type", "") != "gemma3_text":
        return []
    return sorted(set(config.layer_types))


def rope_parameters(config, layer_type: str | None = None) -> tuple[str, float, dict]:
    """(rope_type, theta, the parameters) of a config's RoPE (of layer_type's table, where
    rope_tables names it); ValueError for what runners.rope cannot compute: other RoPE types,
    a partial rotary where transformers' own forward of the family has none, and
    length-dependent variants (dynamic, longrope) per layer type."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    legacy = getattr(config, "rope_scaling", None)
    if not params and isinstance(legacy, dict):
        params = dict(legacy)
    if layer_type is not None:
        if not isinstance(params.get(layer_type), dict):
            raise ValueError(f"no rope parameters for layer type {layer_type!r} (rope_parameters: {params})")
        params = dict(params[layer_type])
    nested = sorted(k for k, v in params.items() if isinstance(v, dict))
    if nested:  # RoPE per layer type ({"full_attention": {...}, ...}): not one frequency table
        raise ValueError(f"rope parameters per layer type ({', '.join(nested)}) are not supported "
                         "(one RoPE for every layer; Gemma 3 only reads one per layer type)")
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    theta = params.get("rope_theta", getattr(config, "rope_theta", None) or 10000.0)
    partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) or 1.0
    model_type = getattr(config, "model_type", "")
    if partial != 1.0 and model_type not in PARTIAL_ROTARY_FAMILIES:
        # transformers' own forward of these families rotates every head dim
        raise ValueError(f"rope partial_rotary_factor={partial} is not supported for {model_type or 'this model'} "
                         f"(only 1.0; partial rotary: {', '.join(PARTIAL_ROTARY_FAMILIES)})")
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope_type {rope_type!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
    if rope_type in LENGTH_ROPE_TYPES and (layer_type is not None or rope_tables(config)):
        raise ValueError(f"rope_type {rope_type!r} per layer type is not supported (one RoPE for every layer only)")
    return rope_type, theta, params


MOE_FAMILIES = ("mixtral", "qwen3_moe", "olmoe", "qwen2_moe", "gpt_oss")


def moe_layers(config) -> list[bool]:
    """Per layer, whether its MLP is a mixture of experts: every layer of Mixtral, OLMoE and gpt-oss;
    Qwen2/3-MoE's layer i unless it is in mlp_only_layers, or (i + 1) is off decoder_sparse_step."""
    model_type, layers = config.model_type, config.num_hidden_layers
    if model_type in ("mixtral", "olmoe", "gpt_oss"):
        return [True] * layers
    if model_type in ("qwen2_moe", "qwen3_moe"):
        dense, step = set(config.mlp_only_layers or []), config.decoder_sparse_step
        return [i not in dense and config.num_experts > 0 and (i + 1) % step == 0 for i in range(layers)]
    return [False] * layers


def block_specs(config) -> list[BlockSpec]:
    """One BlockSpec per layer of a Llama-shaped family's config (check_config first)."""
    model_type = config.model_type
    layers = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    if model_type in ("mistral", "phi3", "mixtral", "qwen3_moe"):
        windows = [window] * layers  # one window for every layer (None: none)
    elif model_type == "smollm3":
        use = getattr(config, "use_sliding_window", False)
        types = config.layer_types
        windows = [window if use and types[i] == "sliding_attention" else None for i in range(layers)]
    else:
        types = getattr(config, "layer_types", None) or ["full_attention"] * layers
        windows = [window if types[i] == "sliding_attention" else None for i in range(layers)]
    # SmolLM3's no_rope_layers[i] is 1 where layer i *uses* RoPE (transformers: use_rope = no_rope_layers[i])
    rope = [bool(r) for r in config.no_rope_layers] if model_type == "smollm3" else [True] * layers
    qk_norm = {"qwen3": "per_head", "olmo2": "whole", "gemma3_text": "per_head", "qwen3_moe": "per_head",
               "olmoe": "whole"}.get(model_type, "none")
    norm = {"olmo2": "post", "gemma2": "sandwich", "gemma3_text": "sandwich", "glm4": "sandwich"}.get(model_type, "pre")
    tables = [config.layer_types[i] for i in range(layers)] if rope_tables(config) else [""] * layers
    # Gemma 3 reads attn_logit_softcapping into its attention but never applies it: only Gemma 2's counts
    softcap = getattr(config, "attn_logit_softcapping", None) if model_type == "gemma2" else None
    mlp = "gelu" if model_type in GEMMA_FAMILIES else "silu"
    moe = moe_layers(config)
    return [BlockSpec(qk_norm=qk_norm, norm=norm, rope=rope[i], sliding_window=windows[i], rope_table=tables[i],
                      softcap=softcap, mlp=mlp, moe=moe[i]) for i in range(layers)]


@dataclass(frozen=True)
class GemmaEnds:
    """Gemma's ends: the embedding times sqrt(hidden) (transformers casts the factor to the
    embedding's dtype first; the tied LM head stays unscaled, so it is applied at lookup, not
    folded into the table) and, Gemma 2 / 3, logits c * tanh(logits / c)."""

    embed_scale: float | None = None
    logit_softcap: float | None = None


def gemma_ends(config, dtype: torch.dtype = torch.float32) -> GemmaEnds:
    """The ends of a Gemma config (none elsewhere); the embedding scale rounded to `dtype`,
    the compute dtype, as transformers rounds it to the embedding's."""
    if getattr(config, "model_type", "") not in GEMMA_FAMILIES:
        return GemmaEnds()
    scale = float(torch.tensor(float(config.hidden_size) ** 0.5, dtype=dtype))
    return GemmaEnds(embed_scale=scale, logit_softcap=getattr(config, "final_logit_softcapping", None))


def multipliers(config) -> Multipliers:
    if config.model_type != "granite":
        return Multipliers()
    return Multipliers(
        embedding=float(config.embedding_multiplier), residual=float(config.residual_multiplier),
        attention=float(config.attention_multiplier), logits=float(config.logits_scaling),
    )


def fast_paths(blocks: list[BlockSpec], ends: GemmaEnds = GemmaEnds(), length_rope: bool = False,
               window_groups: bool = False) -> FastPaths:
    """The paged-attention kernels (C++ and Triton) take q/k as the layer hands them over (q/k
    norm applied before it), RoPE per call (None for a NoPE layer), and each layer's sliding
    window, soft-cap and sinks per call: every layer's attention runs on them. The decoder
    stack runs Llama's block only (each layer's window, soft-cap and sinks included): q/k
    norm, a NoPE layer or post-norm blocks switch it off, and Gemma's GeGLU, sandwich norms,
    RoPE table per layer or ends (ends: the model's, which its one-call decode step runs).
    A length-dependent RoPE (longrope, dynamic: each token's tables follow its sequence's
    length) is computed per step in Python: no CUDA graphs (nor the one-call decode step,
    runners.decoder_stack). window_groups: the windowed layers keep rings of blocks of their
    own (sliding_window_kv 'window', window_kv.py), a second slot table each step that the
    decoder stack and the decode graphs (one table for every layer) do not take."""
    reasons = []
    plain = all(b.qk_norm == "none" and b.rope and b.norm == "pre" for b in blocks)
    if not plain:
        reasons.append("q/k norm, NoPE layers or post-norm blocks run the Python layer loop "
                       "(the decoder stack has Llama's block only)")
    gemma = any(b.mlp != "silu" or b.rope_table or b.norm == "sandwich" for b in blocks) or ends != GemmaEnds()
    if gemma and plain:
        reasons.append("GeGLU, sandwich norms, RoPE per layer type, the embedding scale and logit soft-capping "
                       "run the Python layer loop (the decoder stack has Llama's block only)")
    moe = any(b.moe for b in blocks)
    if moe:
        reasons.append("mixture-of-experts layers run the Python layer loop (the decoder stack has dense MLPs only) "
                       "and no CUDA graphs (each step reads its per-expert row counts on the host)")
    if length_rope:
        reasons.append("a longrope / dynamic RoPE's tables follow each sequence's length: cos / sin per step "
                       "in Python, no CUDA graphs and no one-call decode step")
    if window_groups:
        reasons.append("sliding_window_kv 'window': the windowed layers read their own ring of blocks, a second "
                       "slot table per step, which the one-call decoder stack and the CUDA graphs (one table for "
                       "every layer) do not take")
    return FastPaths(attention_kernel=True, decoder_stack=plain and not gemma and not moe and not window_groups,
                     why="; ".join(reasons), cuda_graphs=not moe and not length_rope and not window_groups)
