"""int8 weights for a Transformer: residual rotation, calibration, SmoothQuant, quantization.

TorchRunner's int8 path, in this order, on the plain float32 weights (before blocking):

    rotate_residual(model)     Llama family: x -> x @ Q in the residual stream (exact), so
                               its few huge channels spread over all of them
    calibrate(model)           one float pass over seeded random tokens; every projection
                               records its input's max |x| per channel (ActivationObserver)
    quantize_int8(model)       SmoothQuant's factors from those ranges, folded into the norms
                               and `up` where exact, then every projection to Int8Linear
                               (or kept float, keep_float=: for measuring where int8's
                               error comes from, perf/int8_sensitivity.py)

What each step buys is in docs/architecture.md, "int8 accuracy: what was measured".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from tritonlm.engine.runners.layers import PROJECTION_NAMES, FloatLinear, Int8Linear, Linear, Norm, PinnedRows, owned_copy
from tritonlm.engine.runners.moe import refuse_precision

if TYPE_CHECKING:
    from tritonlm.engine.runners.model import Transformer


@dataclass(eq=False)
class ActivationObserver(FloatLinear):
    """A float projection that records the largest |x| it saw per input channel (calibration)."""

    observed: torch.Tensor  # [in]

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        torch.maximum(self.observed, x.detach().abs().reshape(-1, x.shape[-1]).amax(0), out=self.observed)
        return super().apply(x, bias)


def observe_activations(model: Transformer) -> None:
    """Every projection replaced by an observer of it (the same weights, ranges zeroed)."""
    for layer in model.layers:
        for name in PROJECTION_NAMES:
            p = getattr(layer, name)
            if p is not None:
                setattr(layer, name, _observer(p, model.device))
    if model.lm_head is not None:
        model.lm_head = _observer(model.lm_head, model.device)


def _observer(p: Linear, device: torch.device) -> ActivationObserver:
    p = p.plain()
    return ActivationObserver(p.w, p.b, observed=torch.zeros(p.w.shape[0], device=device))


def calibrate(model: Transformer, rows: int = 8, length: int = 64, seed: int = 0) -> None:
    """One float pass over seeded random tokens, recording each projection's input range per
    channel for SmoothQuant (quantize_int8). LLMs' outlier channels are properties of the
    weights, present whatever the text, so no dataset is needed. The observers stay in
    place until quantize_int8 replaces them."""
    from tritonlm.engine.batch import StepBatch
    from tritonlm.engine.kv_cache import KVCacheManager
    from tritonlm.engine.runners.base import plan_step

    spec = model.spec
    ids = torch.randint(0, spec.vocab_size, (rows, length), generator=torch.Generator().manual_seed(seed))
    length = min(length, model.max_positions or length)
    cache = KVCacheManager(spec, (rows * (length // 16 + 2) + 1) * 16 * spec.bytes_per_token, 16,
                           allocate_kv=model.allocate_kv)
    for b in range(rows):
        cache.allocate(b, length)
    observe_activations(model)
    batch = StepBatch.build(ids[:, :length].tolist(), [0] * rows, [cache.slots(b, length) for b in range(rows)])
    model.forward(plan_step(batch, model.device, model.max_positions), batch.all_logits, cache.pool)


def smoothing_factor(p: Linear, alpha: float = 0.5) -> torch.Tensor | None:
    """SmoothQuant's per-input-channel factor s [in] from calibration, or None (not observed).

    LLMs' activations have a few input channels hundreds of times larger than the rest,
    which per-token int8 would flatten to zero; dividing channel c of x by
    s_c = max|x_c|^alpha / max|w_c|^(1-alpha) and multiplying the weight's row c by it
    leaves x @ w unchanged and moves the outliers' range into the weights, which are
    quantized per output channel."""
    if not isinstance(p, ActivationObserver):
        return None
    w = p.w.float()  # [in, out]
    s = p.observed.clamp(min=1e-5).pow(alpha) / w.abs().amax(dim=1).clamp(min=1e-5).pow(1 - alpha)
    return s.clamp(min=1e-5)  # [in]


def quantize_linear(p: Linear, s: torch.Tensor | None = None, folded: bool = False) -> Int8Linear:
    """p with int8 weights (Int8Linear.from_float). s: SmoothQuant's factor; the weight's rows
    are multiplied by it, and x must be divided by it: by whatever produces x when `folded`
    (quantize_int8 folds it into the norm before, or into `up`), else by this projection at
    run time."""
    p = p.plain()
    w = p.w.float()  # [in, out]
    if s is not None:
        w = w * s.unsqueeze(1)
    return Int8Linear.from_float(w, p.b, smooth=None if s is None or folded else 1.0 / s)


def kept_float(p: Linear, s: torch.Tensor | None = None, folded: bool = False) -> FloatLinear:
    """What quantize_linear(p, s, folded) would compute, with the float weights: where s was
    folded upstream (x arrives divided by s), the weight's rows are multiplied by it, so the
    function is the same; otherwise nothing divides x and the weight stays as it is."""
    p = p.plain()
    w = p.w.float() * s.unsqueeze(1) if s is not None and folded else p.w
    return FloatLinear(w.to(p.w.dtype).contiguous(), owned_copy(p.b))


def _fold_into_norm(norm: Norm | None, s: torch.Tensor | None) -> None:
    """norm(x) / s, exactly: its weight (and bias) divided by s, per channel, in place of a copy."""
    if norm is None or s is None:
        return
    norm.w = norm.w / s.to(norm.w.dtype)
    if norm.b is not None:
        norm.b = norm.b / s.to(norm.b.dtype)


def quantize_int8(model: Transformer, alpha: float = 0.3, keep_float: Callable[[str], bool] | None = None) -> None:
    """Every projection of the layers and the LM head to int8 weights, in place.
    Embeddings, norms, biases and the KV cache stay float32, the compute dtype.
    keep_float(name) -> True leaves that projection in float32 ("layers.3.down",
    "lm_head"; names as in Transformer.projection_names), computing what it did before
    (kept_float).

    Projections observed by calibrate() are smoothed (smoothing_factor). Dividing x by s
    costs a pass over x per call, so it is folded, exactly, into what makes x where that is
    linear per channel: the norm before qkv / fc / gate_up / the LM head (its weight and
    bias), and the `up` half of gate_up before down (x = act(gate) * up). Only o and
    GPT-2's down divide at run time."""
    refuse_precision(model.layers, "int8")
    if model.dtype != torch.float32 or model.device.type != "cpu":
        raise ValueError(f"int8 weights need float32 compute on the CPU, not {model.dtype} on {model.device}")

    def convert(name: str, proj: Linear, factor: torch.Tensor | None, folded: bool) -> Linear:
        if keep_float is not None and keep_float(name):
            return kept_float(proj, factor, folded=folded)
        return quantize_linear(proj, factor, folded=folded)

    for i, layer in enumerate(model.layers):
        s = {name: smoothing_factor(getattr(layer, name), alpha) for name in PROJECTION_NAMES
             if getattr(layer, name) is not None}  # all from the float weights, before any fold
        pre = layer.block.norm in ("pre", "sandwich")  # post-norm blocks (OLMo 2): no norm makes qkv's or the MLP's input
        if pre:
            _fold_into_norm(layer.ln_attn, s["qkv"])
            _fold_into_norm(layer.ln_mlp, s.get("fc", s.get("gate_up")))
        down_folded = layer.gate_up is not None and s["down"] is not None
        if down_folded:  # up's output channels feed down's input channels one to one
            gate_up = layer.gate_up.plain()
            inner = layer.down.plain().w.shape[0]
            gate_up.w[:, inner:] /= s["down"]
            if gate_up.b is not None:
                gate_up.b[inner:] /= s["down"]
        for name, factor in s.items():
            folded = (pre and name in ("qkv", "fc", "gate_up")) or (name == "down" and down_folded)
            setattr(layer, name, convert(f"layers.{i}.{name}", getattr(layer, name), factor, folded))
    if model.lm_head is not None:
        s_head = smoothing_factor(model.lm_head, alpha) if model.ln_f is not None else None
        _fold_into_norm(model.ln_f, s_head)
        model.lm_head = convert("lm_head", model.lm_head, s_head, s_head is not None)
    pinned = PinnedRows()  # one set of input buffers for all of the model's int8 projections
    for p in model.projections():
        if isinstance(p, Int8Linear):
            p.pinned = pinned


def rotate_residual(model: Transformer, seed: int = 0) -> bool:
    """Turn the residual stream x into x @ Q (Q a seeded random orthogonal [C, C]); the
    model computes the same function, up to float rounding. Returns whether it did.

    Why: the residual stream has a few channels far larger than the rest; per-token
    int8 activations and per-output-channel int8 weights both spend their range on
    them. A random rotation spreads every channel over all (QuaRot's observation), so
    the inputs of qkv, gate_up and the LM head quantize with less error. Exact because
    RMSNorm only divides by the vector's norm, which Q keeps: each norm's weight is
    folded into the projection that reads it (W -> Q^T diag(w) W, the norm's weight
    becomes 1), projections that write to the stream (o, down) become W @ Q, and the
    embedding wte @ Q. Only whole RMSNorm models without learned positions (Llama
    family); GPT-2's LayerNorm subtracts the mean, which a rotation does not keep."""
    norms = [n for L in model.layers for n in (L.ln_attn, L.ln_mlp)] + [model.ln_f]
    whole = model.wte is not None and model.ln_f is not None and model.lm_head is not None and not model.vocab_parallel
    if not (whole and model.wpe is None and model.layers and all(n is not None and n.rms for n in norms)):
        return False
    if any(L.moe is not None for L in model.layers):
        return False  # quantize_int8 refuses mixture-of-experts layers
    if any(L.block.norm != "pre" for L in model.layers):
        return False  # a norm on a block's output has its weight on the stream's side: no reader to fold it into
    for p in model.projections():
        p.plain()  # int8 or blocked weights: refused, saying which
    width = model.hidden
    g = torch.Generator().manual_seed(seed)
    q, r = torch.linalg.qr(torch.randn(width, width, generator=g, dtype=torch.float64))
    q = (q * torch.sign(torch.diagonal(r))).to(model.device, torch.float32)  # [C, C] orthogonal (Haar)

    def reads(norm: Norm, proj: Linear) -> FloatLinear:  # proj(norm(x)) -> proj'(norm'(x @ Q)), new tensors
        proj = proj.plain()
        w = q.t() @ (norm.w.float().unsqueeze(1) * proj.w.float())  # [C, out]
        norm.w = torch.ones_like(norm.w)
        return FloatLinear(w.to(model.dtype).contiguous(), owned_copy(proj.b))

    def writes(proj: Linear) -> FloatLinear:  # [in, C] -> [in, C] @ Q
        proj = proj.plain()
        b = None if proj.b is None else (proj.b.float() @ q).to(model.dtype)
        return FloatLinear((proj.w.float() @ q).to(model.dtype).contiguous(), b)

    for layer in model.layers:
        layer.qkv = reads(layer.ln_attn, layer.qkv)
        if layer.gate_up is not None:
            layer.gate_up = reads(layer.ln_mlp, layer.gate_up)
        else:
            layer.fc = reads(layer.ln_mlp, layer.fc)
        layer.o, layer.down = writes(layer.o), writes(layer.down)
    model.lm_head = reads(model.ln_f, model.lm_head)  # a tied head becomes its own (rotated) copy
    model.wte = (model.wte.float() @ q).to(model.dtype).contiguous()
    return True
