"""Which decoder families tritonlm serves, and what each layer of one does, read from its config.

    FAMILIES                     model_type -> what the family is (the supported list)
    REFUSED                      model_type -> why a known family is not served (yet)
    check_config(config)         ValueError naming the family and the feature it cannot serve
    block_specs(config)          per layer, a BlockSpec: the config's choices the forward pass reads
    multipliers(config)          Granite's scalar multipliers (1.0 elsewhere), folded into weights at load
    fast_paths(blocks)           which of the C++ / Triton fast paths cover those layers, and why not

Every served family is GPT-2 or a Llama-shaped decoder (RMSNorm, rotary q/k, grouped query
attention, SwiGLU MLP). What sets the Llama-shaped ones apart is a handful of config fields,
so the forward pass reads a BlockSpec per layer instead of branching per family: biases and
fused projections are the weights' business (runners.model.Transformer.from_hf), scalar
multipliers are folded into the weights, and what remains changes the block:

    qk_norm         "per_head": an RMSNorm over each head's D values of q and of k, before
                    RoPE (Qwen3); "whole": over all of q's H*D values, and k's Hkv*D (OLMo 2)
    norm            "pre": each block's input normed (Llama); "post": each block's output
                    normed before the residual add, the input as it is (OLMo 2)
    rope            False for a NoPE layer (SmolLM3: positions reach it only through the mask)
    sliding_window  keys at positions p - window < j <= p only (Mistral, Phi-3, Qwen2 / Qwen3 /
                    SmolLM3 layers typed "sliding_attention"): transformers' sliding_window_overlay
"""

from __future__ import annotations

from dataclasses import dataclass

# model_type -> the family, as users know it (the supported list every refusal prints)
FAMILIES: dict[str, str] = {
    "gpt2": "GPT-2 (gpt2, distilgpt2, ...)",
    "llama": "Llama (Llama 2/3, SmolLM2, TinyLlama, ...)",
    "qwen2": "Qwen2 / Qwen2.5 (q/k/v biases)",
    "qwen3": "Qwen3 dense (per-head q/k RMSNorm)",
    "mistral": "Mistral (sliding window attention)",
    "phi3": "Phi-3 (fused qkv and gate_up; not partial rotary: Phi-4-mini)",
    "granite": "Granite 3 dense (embedding, attention, residual and logits multipliers)",
    "smollm3": "SmolLM3 (NoPE layers)",
    "olmo2": "OLMo 2 (norms after attention and MLP, q/k RMSNorm over the whole projection)",
}

# Llama-shaped families: the same weight names, one forward pass (GPT-2 has its own layout)
ROTARY_FAMILIES = tuple(k for k in FAMILIES if k != "gpt2")

# known families that are not served, and what they need that the decoder block does not do
REFUSED: dict[str, str] = {
    "gemma": "Gemma: (1 + w) RMSNorm, GeGLU, scaled embeddings",
    "gemma2": "Gemma 2: logit soft-capping, sandwich norms, alternating sliding windows",
    "gemma3": "Gemma 3: multimodal wrapper, per-layer RoPE bases, q/k norm, sandwich norms",
    "gemma3_text": "Gemma 3: per-layer RoPE bases, q/k norm, sandwich norms",
    "gemma3n": "Gemma 3n: per-layer embeddings, AltUp",
    "gemma4": "Gemma 4",
    "gpt_oss": "gpt-oss: mixture of experts, attention sinks",
    "mixtral": "Mixtral: mixture of experts",
    "qwen2_moe": "Qwen2-MoE: mixture of experts",
    "qwen3_moe": "Qwen3-MoE: mixture of experts",
    "qwen3_next": "Qwen3-Next: hybrid linear attention, mixture of experts",
    "olmoe": "OLMoE: mixture of experts",
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

    attention_kernel: bool  # C++ paged_attention_qkv (CPU) and the Triton decode kernel (CUDA)
    decoder_stack: bool  # C++ DecoderStack: all layers in one call, and decode_step
    why: str  # what switched a path off; "" when none is


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
    something the decoder block does not do (partial rotary, length-dependent RoPE, other
    attention layer types)."""
    model_type = getattr(config, "model_type", "")
    reason = refusal(model_type)
    if reason:
        raise ValueError(reason)
    if model_type == "gpt2":
        if getattr(config, "add_cross_attention", False):
            raise ValueError("GPT-2 with add_cross_attention=True is not supported")
        return
    try:
        rope_parameters(config)
    except ValueError as e:
        raise ValueError(f"{family_name(model_type)}: {e}") from None
    kinds = set(getattr(config, "layer_types", None) or []) - {"full_attention", "sliding_attention"}
    if kinds:
        raise ValueError(f"{family_name(model_type)}: attention layer types {sorted(kinds)} are not supported "
                         "(only full_attention and sliding_attention)")
    if getattr(config, "mlp_bias", False):
        raise ValueError(f"{family_name(model_type)}: mlp_bias=True is not supported")
    if getattr(config, "hidden_act", "silu") not in ("silu", "swish"):
        raise ValueError(f"{family_name(model_type)}: hidden_act {config.hidden_act!r} is not supported (silu only)")


ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_parameters(config) -> tuple[str, float, dict]:
    """(rope_type, theta, the parameters) of a config's RoPE; ValueError for what
    layers.rope_inv_freq cannot compute: partial rotary, and length-dependent variants
    (dynamic, longrope), whose frequencies change with the sequence length."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    legacy = getattr(config, "rope_scaling", None)
    if not params and isinstance(legacy, dict):
        params = dict(legacy)
    nested = sorted(k for k, v in params.items() if isinstance(v, dict))
    if nested:  # RoPE per layer type ({"full_attention": {...}, ...}): not one frequency table
        raise ValueError(f"rope parameters per layer type ({', '.join(nested)}) are not supported (one RoPE for every layer)")
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    theta = params.get("rope_theta", getattr(config, "rope_theta", None) or 10000.0)
    partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) or 1.0
    if partial != 1.0:
        raise ValueError(f"rope partial_rotary_factor={partial} is not supported (only 1.0)")
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope_type {rope_type!r} is not supported by TorchRunner (supported: {', '.join(ROPE_TYPES)})")
    return rope_type, theta, params


def block_specs(config) -> list[BlockSpec]:
    """One BlockSpec per layer of a Llama-shaped family's config (check_config first)."""
    model_type = config.model_type
    layers = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    if model_type in ("mistral", "phi3"):
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
    qk_norm = {"qwen3": "per_head", "olmo2": "whole"}.get(model_type, "none")
    norm = "post" if model_type == "olmo2" else "pre"
    return [BlockSpec(qk_norm=qk_norm, norm=norm, rope=rope[i], sliding_window=windows[i]) for i in range(layers)]


def multipliers(config) -> Multipliers:
    if config.model_type != "granite":
        return Multipliers()
    return Multipliers(
        embedding=float(config.embedding_multiplier), residual=float(config.residual_multiplier),
        attention=float(config.attention_multiplier), logits=float(config.logits_scaling),
    )


def fast_paths(blocks: list[BlockSpec]) -> FastPaths:
    """The C++ paged-attention kernel takes q/k as the layer hands them over (q/k norm applied
    before it) and RoPE per call (None for a NoPE layer), but knows no window; the decoder
    stack runs Llama's block only. So: a window switches both off (the gather path's mask
    has it), q/k norm, a NoPE layer or post-norm blocks switch the stack off."""
    reasons = []
    windowed = any(b.sliding_window is not None for b in blocks)
    if windowed:
        reasons.append("sliding-window attention runs on the gather path (the kernels have no window)")
    plain = all(b.qk_norm == "none" and b.rope and b.norm == "pre" for b in blocks)
    if not plain and not windowed:
        reasons.append("q/k norm, NoPE layers or post-norm blocks run the Python layer loop "
                       "(the decoder stack has Llama's block only)")
    return FastPaths(attention_kernel=not windowed, decoder_stack=plain and not windowed, why="; ".join(reasons))
