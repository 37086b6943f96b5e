"""A PEFT LoRA adapter folder (adapter_config.json + adapter_model.safetensors) as the
low-rank updates of one tritonlm Transformer's fused projections, checked against it.

    load_adapter(folder, model, name, max_rank) -> LoraAdapter   ValueError naming what is refused
    check_adapter(folder, base, name, max_rank)                  the same checks, from the weights'
                                                                 shapes alone (BaseShape.of_hf_config:
                                                                 the OpenAI frontend, before a load)

PEFT's per-module A [r, in] and B [out, r] land on tritonlm's fused projections: q/k/v on
`qkv`, gate/up on `gate_up`, each target in its own column block. One adapter's targets on
one projection become one LoraDelta: their A's side by side (a [in, R], R the sum of their
ranks) and their B's, scale folded in, each in its own rows and its target's columns, zeros
elsewhere (b [R, out]), so a row's update is one (x @ a) @ b; the zeros add exact zeros.

Honoured: r, lora_alpha, use_rslora (alpha / sqrt(r)), rank_pattern and alpha_pattern (PEFT's
rule: the first pattern that matches the end of the module's key), target_modules (a list, a
regex, "all-linear": the weights say which modules were targeted, each checked against the
config's choice), layers_to_transform, exclude_modules and modules_to_save (a replacement
embedding and / or LM head). Refused, by name, when the adapter is loaded: what changes the
arithmetic beyond x @ A @ B (DoRA, LoRA biases, aLoRA, ...), a target tritonlm does not map, a
layer or module the base model does not have, shapes of another base model, and ranks over
max_rank.

Shapes: C hidden, H / Hkv query / key-value heads, D head_dim, F MLP width, V vocab, r one
target's rank, R the ranks of one projection's targets together.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tritonlm.engine.runners.layers import FloatLinear

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
DIGEST_PERSON = b"tritonlm.lora"  # BLAKE2b personalization: an adapter digest is no other kind of digest

# the Llama-shaped families whose projections are exactly transformers' modules' outputs, up
# to the q/k head-dim order a partial or interleaved RoPE sets (Transformer.qkv_order, which
# the updates follow); Granite's multipliers scale o / down and the ends, which a LoRA update
# would have to follow
LORA_FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "ministral", "phi3", "smollm3", "olmo2", "glm", "glm4", "gemma", "gemma2",
                 "gemma3_text", "mixtral", "qwen3_moe", "olmoe", "qwen2_moe")

# PEFT module name -> (tritonlm projection, which column block of it: index among the parts)
TARGETS: dict[str, tuple[str, str]] = {
    "q_proj": ("qkv", "q"), "k_proj": ("qkv", "k"), "v_proj": ("qkv", "v"),
    "qkv_proj": ("qkv", "all"),  # Phi-3 ships q/k/v fused
    "o_proj": ("o", "all"),
    "gate_proj": ("gate_up", "gate"), "up_proj": ("gate_up", "up"),
    "gate_up_proj": ("gate_up", "all"),  # Phi-3
    "down_proj": ("down", "all"),
}
SAVED_MODULES = {"lm_head": "lm_head.weight", "embed_tokens": "model.embed_tokens.weight"}

# adapter_config.json fields that are read, or that only shape training / initialization
KNOWN_FIELDS = {
    "r", "lora_alpha", "use_rslora", "rank_pattern", "alpha_pattern", "target_modules", "exclude_modules",
    "layers_to_transform", "layers_pattern", "modules_to_save", "peft_type", "bias", "use_dora", "fan_in_fan_out",
    "lora_dropout", "init_lora_weights", "inference_mode", "task_type", "base_model_name_or_path", "revision",
    "auto_mapping", "peft_version", "loftq_config", "eva_config", "corda_config", "lora_ga_config",
    "megatron_core", "qalora_group_size", "lora_bias", "ensure_weight_tying",
}
# fields that change what the adapter computes, with why each is refused (any truthy value)
REFUSED_FIELDS = {
    "use_dora": "DoRA (weight-decomposed LoRA) is not supported",
    "lora_bias": "LoRA biases (lora_bias) are not supported",
    "fan_in_fan_out": "fan_in_fan_out applies to GPT-2's Conv1D, and GPT-2 takes no adapters yet",
    "megatron_config": "Megatron-parallel LoRA is not supported",
    "layer_replication": "layer_replication is not supported",
    "trainable_token_indices": "trainable_token_indices is not supported",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens) is not supported",
    "use_qalora": "QA-LoRA (use_qalora) is not supported",
    "target_parameters": "target_parameters (LoRA on parameters, e.g. MoE experts) is not supported",
    "ensure_weight_tying": "ensure_weight_tying is not supported (modules_to_save replaces the embedding or the "
                           "LM head alone)",
    "use_bdlora": "use_bdlora is not supported",
    "arrow_config": "Arrow routing is not supported",
    "kasa_config": "kasa_config is not supported",
    "velora_config": "velora_config is not supported",
    "monteclora_config": "monteclora_config is not supported",
    "runtime_config": None,  # runtime options only (ephemeral GPU offload): read, not refused
}

_KEY = re.compile(r"model\.layers\.(\d+)\.(self_attn|mlp)\.([A-Za-z_]+)\.lora_([AB])\.weight")


@dataclass(eq=False)
class LoraDelta:
    """One adapter's update of one fused projection: delta = (x @ a) @ b, float32."""

    a: torch.Tensor  # [in, R]
    b: torch.Tensor  # [R, out], each target's B^T * scale in its rows and columns, zeros elsewhere


@dataclass(eq=False)
class LoraAdapter:
    """A loaded adapter: its updates per (layer, projection) and its replacement ends."""

    name: str
    digest: bytes  # BLAKE2b-128 of its config and weights (DIGEST_PERSON): the prefix cache keys blocks by it
    rank: int  # its largest r
    deltas: dict[tuple[int, str], LoraDelta] = field(default_factory=dict)  # (layer, "qkv" | "o" | ...) ->
    embed: torch.Tensor | None = None  # [V, C] modules_to_save's embedding, looked up instead of the base's
    head: FloatLinear | None = None  # [C, V] modules_to_save's LM head
    targets: tuple[str, ...] = ()  # the PEFT module keys it updates, sorted
    # its updates as the C++ kernels take them (torch.classes.tritonlm.LoraWeights), made at
    # its first step on the CPU kernels (lora.apply.cpp_weights)
    cpp: object | None = field(default=None, repr=False)

    def __repr__(self) -> str:
        return f"LoraAdapter({self.name!r}, rank {self.rank}, {len(self.targets)} targets)"


def _refuse(name: str, what: str) -> ValueError:
    return ValueError(f"LoRA adapter {name!r}: {what}")


def _pattern_value(patterns: dict, key: str, default):
    """PEFT's rank_pattern / alpha_pattern rule: the first pattern matching the end of the
    module's key (at a dot boundary) gives the value, else the default."""
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", key):
            return value
    return default


def _targeted(config: dict, key: str, layer: int) -> bool:
    """Whether the config targets module `key` ("model.layers.0.self_attn.q_proj") of `layer`:
    PEFT's rule for a list (the name or a dotted suffix) or a regex (a full match), and its layer
    filter (layers_to_transform). "all-linear" is every linear layer but the output layer."""
    excluded = config.get("exclude_modules")
    if isinstance(excluded, str) and re.fullmatch(excluded, key):
        return False
    if isinstance(excluded, list) and any(key == e or key.endswith("." + e) for e in excluded):
        return False
    targets = config.get("target_modules")
    if targets == "all-linear":
        found = True
    elif isinstance(targets, str):
        return re.fullmatch(targets, key) is not None  # PEFT applies no layer filter to a regex
    else:
        found = any(key == t or key.endswith("." + t) for t in targets or [])
    layers = config.get("layers_to_transform")
    if found and layers is not None and layers != []:
        return layer in ([layers] if isinstance(layers, int) else layers)
    return found


def read_config(folder: Path, name: str) -> dict:
    """adapter_config.json, with every field that changes the arithmetic checked."""
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise _refuse(name, f"no {CONFIG_FILE} in {folder} (a PEFT LoRA adapter folder holds {CONFIG_FILE} and "
                            f"{WEIGHTS_FILE})")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise _refuse(name, f"{CONFIG_FILE} is not JSON: {e}") from None
    if config.get("peft_type", "LORA") != "LORA":
        raise _refuse(name, f"peft_type {config.get('peft_type')!r}: only LORA adapters are served")
    for key, why in REFUSED_FIELDS.items():
        if why is not None and config.get(key):
            raise _refuse(name, f"{key}={config[key]!r}: {why}")
    if config.get("bias", "none") != "none":
        raise _refuse(name, f"bias={config['bias']!r}: only bias='none' is supported (the base model's biases "
                            "stay as they are)")
    unknown = sorted(k for k, v in config.items() if k not in KNOWN_FIELDS and k not in REFUSED_FIELDS and v)
    if unknown:
        raise _refuse(name, f"{CONFIG_FILE} sets {', '.join(unknown)}, which tritonlm does not know: "
                            "refused rather than ignored")
    for key in ("r", "lora_alpha"):
        if not isinstance(config.get(key), (int, float)) or config[key] <= 0:
            raise _refuse(name, f"{key}={config.get(key)!r}: a positive number is needed")
    targets = config.get("target_modules")
    if isinstance(targets, list):
        known = set(TARGETS)
        bad = sorted(t for t in targets if t.rsplit(".", 1)[-1] not in known)
        if bad:
            raise _refuse(name, f"target_modules {bad} not supported; LoRA targets tritonlm maps: {sorted(known)} "
                                "(the LM head and embedding only through modules_to_save)")
    saved = config.get("modules_to_save") or []
    bad = sorted(m for m in saved if m not in SAVED_MODULES)
    if bad:
        raise _refuse(name, f"modules_to_save {bad} not supported; allowed: {sorted(SAVED_MODULES)}")
    return config


MOE_FAMILIES = ("mixtral", "qwen3_moe", "olmoe", "qwen2_moe")  # MLPs a config alone does not describe


@dataclass(frozen=True)
class BaseShape:
    """What an adapter is checked against: the base model's shape, from the loaded model
    (the engine) or from its config.json alone (the OpenAI frontend, before anything loads)."""

    family: str  # the config's model_type
    num_layers: int
    heads: int
    kv_heads: int
    head_dim: int
    embed: tuple[int, int]  # [V, C] of the embedding (and of a modules_to_save replacement)
    widths: dict[tuple[int, str], tuple[int, int]]  # {(layer, projection): (inputs, outputs)}
    whole: bool = True  # False: split over tensor-parallel ranks or pipeline stages
    mlp_known: bool = True  # False: the MLP projections' widths are not known (a config of MoE layers)

    @staticmethod
    def of_model(model) -> "BaseShape":
        """A runners.model.Transformer's shape; an attached model's widths were taken at attach."""
        state = getattr(model, "lora", None)
        whole = not model.vocab_parallel and len(model.layers) == model.spec.num_layers and model.wte is not None
        return BaseShape(model.spec.family, len(model.layers), model.heads, model.kv_heads, model.spec.head_dim,
                         tuple(model.wte.shape) if model.wte is not None else (0, 0),
                         state.widths if state is not None else projection_widths(model), whole)

    @staticmethod
    def of_hf_config(config) -> "BaseShape":
        """A transformers config's shape (ValueError for a family tritonlm does not run). MoE
        families' MLPs are left to the engine's check at load."""
        from tritonlm.engine.model_shape import ModelShape

        shape = ModelShape.from_hf_config(config)
        hidden = getattr(config, "hidden_size", None) or getattr(config, "n_embd", 0)
        q, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
        moe = shape.family in MOE_FAMILIES
        widths = {}
        for layer in range(shape.num_layers):
            widths[layer, "qkv"] = (hidden, q + 2 * kv)
            widths[layer, "o"] = (q, hidden)
            if not moe and getattr(config, "intermediate_size", None):
                widths[layer, "gate_up"] = (hidden, 2 * config.intermediate_size)
                widths[layer, "down"] = (config.intermediate_size, hidden)
        return BaseShape(shape.family, shape.num_layers, shape.num_heads, shape.num_kv_heads, shape.head_dim,
                         (shape.vocab_size, hidden), widths, mlp_known=not moe)


def column_blocks(base: BaseShape, proj: str, out: int) -> dict[str, tuple[int, int]]:
    """{part: (first column, end)} of a fused projection's output: q / k / v of qkv, gate / up of
    gate_up, "all" for the whole of any projection."""
    blocks = {"all": (0, out)}
    if proj == "qkv":
        q, kv = base.heads * base.head_dim, base.kv_heads * base.head_dim
        blocks.update(q=(0, q), k=(q, q + kv), v=(q + kv, q + 2 * kv))
    elif proj == "gate_up":
        blocks.update(gate=(0, out // 2), up=(out // 2, out))
    return blocks


def projection_widths(model) -> dict[tuple[int, str], tuple[int, int]]:
    """{(layer, projection): (inputs, outputs)} of every dense projection the layers hold, in
    any weight format: each run once on zeros (the packed formats keep no plain shape)."""
    out = {}
    with torch.inference_mode():
        for li, layer in enumerate(model.layers):
            hidden = int(layer.ln_attn.w.shape[0])
            ins = {"qkv": hidden, "gate_up": hidden, "o": model.heads * model.spec.head_dim}
            for proj in ("qkv", "o", "gate_up"):
                p = getattr(layer, proj)
                if p is not None:
                    out[li, proj] = (ins[proj], int(p.matmul(torch.zeros(1, ins[proj], dtype=model.dtype,
                                                                         device=model.device)).shape[-1]))
            if layer.down is not None and (li, "gate_up") in out:
                mlp = out[li, "gate_up"][1] // 2
                out[li, "down"] = (mlp, int(layer.down.matmul(torch.zeros(1, mlp, dtype=model.dtype,
                                                                         device=model.device)).shape[-1]))
    return out


def check_base(base: BaseShape, name: str) -> None:
    """The model takes adapters: a whole Llama-shaped model of a family in LORA_FAMILIES."""
    if base.family not in LORA_FAMILIES:
        raise _refuse(name, f"the base model's family {base.family!r} takes no LoRA adapters yet (those that do: "
                            f"{', '.join(LORA_FAMILIES)})")
    if not base.whole:
        raise _refuse(name, "the base model is split over ranks or stages; adapters run on a whole model only")


def content_digest(config: dict, tensors: dict[str, torch.Tensor]) -> bytes:
    """BLAKE2b-128 of the config (canonical JSON) and every tensor's name, dtype, shape and
    bytes: equal digests, equal adapters, whatever their names."""
    h = hashlib.blake2b(digest_size=16, person=DIGEST_PERSON)
    h.update(json.dumps(config, sort_keys=True).encode())
    for key in sorted(tensors):
        t = tensors[key].contiguous()
        h.update(f"\0{key}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.digest()


@dataclass(frozen=True)
class TargetPlan:
    """One PEFT module an adapter updates, checked: where its update lands and how it scales."""

    module: str  # "model.layers.0.self_attn.q_proj"
    layer: int
    proj: str  # the fused projection: qkv, o, gate_up, down
    part: str  # its column block there (column_blocks)
    rank: int
    scale: float


def plan_targets(name: str, config: dict, shapes: dict[str, tuple[int, ...]], base: BaseShape,
                 max_rank: int) -> list[TargetPlan]:
    """Every check an adapter's weights meet, from their shapes alone (a file's header is
    enough): each A / B pair a layer's projection the config targets, of the base's shapes,
    its rank the config's and within max_rank; modules_to_save of the base's shape."""
    pairs: dict[str, dict[str, tuple[int, ...]]] = {}
    for key, shape in shapes.items():
        local = key.removeprefix("base_model.model.")
        if local in SAVED_MODULES.values():
            continue  # the replacement ends, checked below
        m = _KEY.fullmatch(local)
        if m is None:
            raise _refuse(name, f"weight {key!r} is not a LoRA A / B of a layer's projection nor a supported "
                                f"modules_to_save ({sorted(SAVED_MODULES)}); LoRA targets: {sorted(TARGETS)}")
        pairs.setdefault(local.rsplit(".lora_", 1)[0], {})[m.group(4)] = tuple(shape)
    plans = []
    for module, ab in sorted(pairs.items()):
        m = _KEY.fullmatch(module + ".lora_A.weight")
        layer, target = int(m.group(1)), m.group(3)
        if set(ab) != {"A", "B"}:
            raise _refuse(name, f"{module} has lora_{next(iter(ab))} without its pair")
        if target not in TARGETS:
            raise _refuse(name, f"target module {target!r} ({module}) is not supported; LoRA targets tritonlm "
                                f"maps: {sorted(TARGETS)}")
        if layer >= base.num_layers:
            raise _refuse(name, f"{module}: layer {layer} is not there, the base model has {base.num_layers} "
                                "layers (an adapter for another base model?)")
        if not _targeted(config, module, layer):
            raise _refuse(name, f"{module} has weights, but target_modules={config.get('target_modules')!r} / "
                                f"layers_to_transform={config.get('layers_to_transform')!r} do not target it")
        proj, part = TARGETS[target]
        a, b = ab["A"], ab["B"]  # [r, in], [out, r]
        if len(a) != 2 or len(b) != 2 or b[1] != a[0]:
            raise _refuse(name, f"{module}: A {a} and B {b} are not a rank-r pair ([r, in] and [out, r])")
        r = int(a[0])
        if (layer, proj) in base.widths:
            n_in, n_out = base.widths[layer, proj]
            blocks = column_blocks(base, proj, n_out)
            if part not in blocks:
                raise _refuse(name, f"{module}: this base model fuses {proj} another way")
            lo, hi = blocks[part]
            if a[1] != n_in or b[0] != hi - lo:
                raise _refuse(name, f"{module}: A {a} and B {b} do not fit the base model's {target}, which maps "
                                    f"{n_in} inputs to {hi - lo} outputs (an adapter for another base model?)")
        elif base.mlp_known or proj not in ("gate_up", "down"):
            raise _refuse(name, f"{module}: layer {layer} has no {proj} projection of that kind here "
                                "(a mixture-of-experts MLP takes no LoRA yet)")
        want_r = _pattern_value(config.get("rank_pattern") or {}, module, config["r"])
        if r != want_r:
            raise _refuse(name, f"{module}: its weights have rank {r}, its config (r / rank_pattern) says {want_r}")
        if r > max_rank:
            raise _refuse(name, f"{module}: rank {r} is over max_lora_rank={max_rank}")
        alpha = _pattern_value(config.get("alpha_pattern") or {}, module, config["lora_alpha"])
        scale = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
        plans.append(TargetPlan(module, layer, proj, part, r, scale))
    for module in config.get("modules_to_save") or []:
        key = "base_model.model." + SAVED_MODULES[module]
        if key not in shapes:
            raise _refuse(name, f"modules_to_save names {module!r}, but {WEIGHTS_FILE} has no {key}")
        if tuple(shapes[key]) != tuple(base.embed):
            raise _refuse(name, f"modules_to_save {module!r} is {tuple(shapes[key])}; the base model's is "
                                f"{tuple(base.embed)} (an adapter for another base model?)")
        if key.replace(".weight", ".bias") in shapes:
            raise _refuse(name, f"modules_to_save {module!r} has a bias; only a bias-free one is supported")
    return plans


def _weights_path(folder: Path, name: str) -> Path:
    path = folder / WEIGHTS_FILE
    if not path.is_file():
        raise _refuse(name, f"no {WEIGHTS_FILE} in {folder} (adapter_model.bin, pickled, is not read)")
    return path


def check_adapter(folder: str | Path, base: BaseShape, name: str | None = None, max_rank: int = 64) -> list[TargetPlan]:
    """The checks load_adapter makes, without loading the weights (their file's header is
    read): ValueError naming the adapter, the field and what is allowed."""
    from safetensors import safe_open

    folder = Path(folder)
    name = name or folder.name
    check_base(base, name)
    config = read_config(folder, name)
    path = _weights_path(folder, name)
    try:
        with safe_open(str(path), framework="pt") as f:
            shapes = {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}
    except Exception as e:  # noqa: BLE001 - safetensors' own errors name no common type
        raise _refuse(name, f"{WEIGHTS_FILE} cannot be read as safetensors: {e}") from None
    return plan_targets(name, config, shapes, base, max_rank)


def load_adapter(folder: str | Path, model, name: str | None = None, max_rank: int = 64) -> LoraAdapter:
    """The adapter in `folder` for the runners.model.Transformer `model`, on its device:
    ValueError naming the adapter, the field and what is allowed, for anything refused.
    Loading runs nothing on the model (an attached model's widths were taken at attach), so it
    may happen off the engine's thread while steps run."""
    folder = Path(folder)
    name = name or folder.name
    base = BaseShape.of_model(model)
    check_base(base, name)
    config = read_config(folder, name)
    from safetensors.torch import load_file

    tensors = load_file(str(_weights_path(folder, name)))
    plans = plan_targets(name, config, {k: tuple(t.shape) for k, t in tensors.items()}, base, max_rank)
    adapter = LoraAdapter(name=name, digest=content_digest(config, tensors), rank=max((p.rank for p in plans), default=0))
    by_proj: dict[tuple[int, str], list[TargetPlan]] = {}
    for plan in plans:
        by_proj.setdefault((plan.layer, plan.proj), []).append(plan)
    prefix = "base_model.model."
    for (layer, proj), targets in by_proj.items():
        n_in, n_out = base.widths[layer, proj]
        blocks = column_blocks(base, proj, n_out)
        total = sum(p.rank for p in targets)
        a_all = torch.zeros(n_in, total, dtype=torch.float32)  # [in, R]
        b_all = torch.zeros(total, n_out, dtype=torch.float32)  # [R, out]
        at = 0
        for p in sorted(targets, key=lambda t: blocks[t.part]):  # in column order: q, k, v
            lo, hi = blocks[p.part]
            a = tensors[prefix + p.module + ".lora_A.weight"]  # [r, in]
            b = tensors[prefix + p.module + ".lora_B.weight"]  # [out, r]
            a_all[:, at : at + p.rank] = a.float().t()
            b_all[at : at + p.rank, lo:hi] = b.float().t() * p.scale
            at += p.rank
        order = getattr(model, "qkv_order", None)
        if proj == "qkv" and order is not None:  # the base's q/k head dims are reordered for its RoPE
            b_all = b_all[:, order]
        adapter.deltas[layer, proj] = LoraDelta(a_all.to(model.device), b_all.to(model.device))
    adapter.targets = tuple(p.module for p in plans)
    _saved_modules(adapter, config, tensors, model)
    return adapter


def _saved_modules(adapter: LoraAdapter, config: dict, tensors: dict[str, torch.Tensor], model) -> None:
    """modules_to_save: the replacement embedding / LM head (plan_targets checked their shapes)."""
    for module in config.get("modules_to_save") or []:
        w = tensors["base_model.model." + SAVED_MODULES[module]].to(model.device, model.dtype)  # [V, C]
        if module == "embed_tokens":
            adapter.embed = w
        else:
            if model.lm_head is None or getattr(model.lm_head, "b", None) is not None:
                raise _refuse(adapter.name, "modules_to_save 'lm_head' over a base LM head with a bias is not supported")
            adapter.head = FloatLinear(w.t().contiguous(), None)  # [C, V]
