"""Weight-only int8 for a Transformer (`dtype: int8_weight_only`): 8-bit weight codes with a
float16 scale and offset per group of inputs of each output channel, float32 activations
(rounded to 16-bit codes per block inside the kernel: layers.WeightOnlyInt8Linear).

    calibration_ids(hf_model)  seeded random token ids to calibrate on
    quantize_weight_only(model, calibration_ids=None)
        every projection (and the LM head) to WeightOnlyInt8Linear, in place: each weight
        to the nearest level of the best of three grids for its group (rtn_round: what
        `dtype: int8_weight_only` serves), or, given
        calibration_ids, rounded by GPTQ (gptq_round) against the inputs it saw on them
        (perf/bench_precision.py's `int8_weight_only-gptq` row measures it)

Rounding each weight to its nearest value (RTN) leaves errors that add up along every dot
product. GPTQ (Frantar et al., 2022) rounds the inputs of a projection one at a time and
moves each rounding error onto the inputs not rounded yet, in proportion to how the
calibration inputs correlate (H = sum of x x^T), so the output error on inputs like those
is what it minimizes. On SmolLM2 it did not pay for itself as served: what each choice
measured is in docs/configuration.md, "Precision".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tritonlm.engine.runners.layers import PROJECTION_NAMES, FloatLinear, Linear, WeightOnlyInt8Linear

if TYPE_CHECKING:
    from tritonlm.engine.runners.model import Transformer

# inputs per scale and offset: one per output channel is too coarse for greedy output to
# stay with float32's; 32 is also the block of GGUF's 4- and 8-bit formats, so a file's
# blocks map onto groups one to one (rtn_round)
GROUP = 32
GPTQ_BLOCK = 128  # inputs whose errors are carried inside one block before the rest is updated
GPTQ_DAMP = 0.01  # H + damp * mean(diag H) * I: keeps the inverse stable for inputs that barely vary
CALIBRATION_ROWS, CALIBRATION_TOKENS = 16, 128


def calibration_ids(hf_model, rows: int = CALIBRATION_ROWS, tokens: int = CALIBRATION_TOKENS,
                    seed: int = 0) -> list[list[int]]:
    """`rows` sequences of `tokens` seeded random token ids: one forward pass at load, no
    dataset to ship or download. What GPTQ needs from them is how a projection's input
    channels vary together, which the weights (norms, outlier channels) shape as much as
    the text does."""
    cfg = hf_model.config
    tokens = min(tokens, getattr(cfg, "max_position_embeddings", None) or tokens)
    ids = torch.randint(0, cfg.vocab_size, (rows, tokens), generator=torch.Generator().manual_seed(seed))
    return ids.tolist()


@dataclass(eq=False)
class InputCovariance(FloatLinear):
    """A float projection that sums x x^T over the inputs it computes on (calibration)."""

    xtx: torch.Tensor  # [in, in] float32

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        flat = x.detach().reshape(-1, x.shape[-1]).float()  # [N, in]
        self.xtx.addmm_(flat.t(), flat)
        return super().apply(x, bias)


def collect_covariances(model: Transformer, ids: list[list[int]]) -> dict[str, torch.Tensor]:
    """One float pass over `ids` (rows of token ids), every projection's x x^T summed: {name: [in, in]}."""
    from tritonlm.engine.batch import StepBatch
    from tritonlm.engine.kv_cache import KVCacheManager
    from tritonlm.engine.runners.base import plan_step

    observed: dict[str, InputCovariance] = {}

    def observe(name: str, p: Linear) -> InputCovariance:
        p = p.plain()
        observed[name] = InputCovariance(p.w, p.b, xtx=torch.zeros(p.w.shape[0], p.w.shape[0]))
        return observed[name]

    originals = {}
    for i, layer in enumerate(model.layers):
        for name in PROJECTION_NAMES:
            if getattr(layer, name) is not None:
                originals[(i, name)] = getattr(layer, name)
                setattr(layer, name, observe(f"layers.{i}.{name}", getattr(layer, name)))
    head = model.lm_head
    if head is not None:
        model.lm_head = observe("lm_head", head)
    try:
        spec = model.spec
        longest = max(map(len, ids))
        cache = KVCacheManager(spec, (len(ids) * (longest // 16 + 2) + 1) * 16 * spec.bytes_per_token, 16,
                               allocate_kv=model.allocate_kv)
        for b, row in enumerate(ids):
            cache.allocate(b, len(row))
        batch = StepBatch.build(ids, [0] * len(ids), [cache.slots(b, len(row)) for b, row in enumerate(ids)])
        with torch.inference_mode():
            model.forward(plan_step(batch, model.device, model.max_positions), batch.all_logits, cache.pool)
    finally:
        for (i, name), p in originals.items():
            setattr(model.layers[i], name, p)
        model.lm_head = head
    return {name: obs.xtx for name, obs in observed.items()}


def group_size(width: int) -> int:
    """GROUP where it splits `width` inputs evenly, else the whole width (one scale per channel)."""
    return GROUP if width % GROUP == 0 else width


# A float16 scale below its smallest value would be 0 (a group of equal weights)
MIN_SCALE = 2.0 ** -24


def _round_on(grouped: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, high: int):
    """grouped [out, G, n] to codes of the grid offset + q * scale, q in [0, high], with the
    float16 scale and offset [out, G, 1] as stored: (q, squared error per group [out, G, 1])."""
    s, o = scale.float(), offset.float()
    q = torch.round((grouped - o) / s).clamp_(0, high)
    return q, ((q * s + o) - grouped).square().sum(dim=2, keepdim=True)


def rtn_round(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [out, in] float32 to 8-bit codes per group of inputs: (q [out, in] uint8, scale
    [out, in / group] float16, offset [out, in / group] float16), w ~ q * scale + offset. Each
    group takes the nearest, by squared error, of three grids:
        256 steps  from the group's minimum to its maximum (the finest over its range)
        240 steps  the same range: every 16th level is a GGUF Q4_1 block's (min + k d, k < 16)
                   with both of the file's float16 values kept exactly
        symmetric  steps of max|w| / 127 around 0 (offset -128 scale): a Q8_0 block's
                   (d k, |k| <= 127) exactly
    Most groups of float weights take the first. A model loaded from a GGUF file's Q4_1 or
    Q8_0 blocks of 32 comes back exactly (Q4_1 while d >= 2^-10, where d / 16 is a normal
    float16; a Q4_0 block only where it spans all 16 levels, which llama.cpp's rounding does
    not ensure)."""
    out, width = w.shape
    grouped = w.reshape(out, width // group, group)  # [out, G, n]
    lo, hi = grouped.amin(dim=2, keepdim=True), grouped.amax(dim=2, keepdim=True)  # [out, G, 1]
    low = lo.half()
    half_range = (grouped.abs().amax(dim=2, keepdim=True) / 127.0).clamp(min=MIN_SCALE).half()
    grids = [
        (((hi - lo) / 255.0).clamp(min=MIN_SCALE).half(), low, 255),
        (((hi - lo) / 240.0).clamp(min=MIN_SCALE).half(), low, 255),
        (half_range, -128 * half_range, 255),
    ]
    rounded = [(_round_on(grouped, s, o, high), s, o) for s, o, high in grids]
    errors = torch.stack([err for (_, err), _, _ in rounded])  # [3, out, G, 1]
    best = errors.argmin(dim=0)  # the first of equal errors
    q = torch.zeros_like(grouped)
    scale, offset = torch.zeros_like(low), torch.zeros_like(low)
    for i, ((codes, _), s, o) in enumerate(rounded):
        take = best == i
        q = torch.where(take, codes, q)
        scale, offset = torch.where(take, s, scale), torch.where(take, o, offset)
    return q.to(torch.uint8).reshape(out, width).contiguous(), scale.squeeze(2).contiguous(), offset.squeeze(2).contiguous()


def symmetric_codes(q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Symmetric int8 codes q [out, in] in [-127, 127] with scale [out, G] -> the stored form
    (q + 128 as uint8, scale and offset -128 scale in float16)."""
    scale = scale.clamp(min=MIN_SCALE).half()
    return (q.to(torch.int16) + 128).to(torch.uint8), scale, -128 * scale


def gptq_round(w: torch.Tensor, xtx: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] float32 rounded by GPTQ against H = xtx [in, in] to symmetric codes:
    (q [out, in] int8, scale [out, in / group]; stored through symmetric_codes). A group's
    scale is taken from its weights as they stand when its first input is reached (after the
    errors moved onto them)."""
    w = w.clone().float()
    out, width = w.shape
    h = xtx.clone().float()
    dead = torch.diagonal(h) == 0  # inputs that were always 0: nothing to fit
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    h += GPTQ_DAMP * torch.diagonal(h).mean() * torch.eye(width)
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)  # [in, in]
    q = torch.zeros(out, width, dtype=torch.int8)
    scales = torch.zeros(out, width // group)
    scale = torch.ones(out)
    for b0 in range(0, width, GPTQ_BLOCK):
        b1 = min(b0 + GPTQ_BLOCK, width)
        block = w[:, b0:b1].clone()  # [out, n]
        errors = torch.zeros_like(block)
        hb = hinv[b0:b1, b0:b1]
        for i in range(b1 - b0):
            col = b0 + i
            if col % group == 0:  # the group's scale, from its weights as they stand now
                ahead = torch.cat([block[:, i:], w[:, b1:]], dim=1)[:, :group]
                # as stored (float16), so the errors carried onward are the stored weights'
                scale = (ahead.abs().amax(dim=1) / 127.0).clamp(min=MIN_SCALE).half().float()
                scales[:, col // group] = scale
            x = block[:, i]
            qi = torch.round(x / scale).clamp_(-127, 127)
            q[:, col] = qi.to(torch.int8)
            err = (x - qi * scale) / hb[i, i]
            block[:, i:] -= err.unsqueeze(1) * hb[i, i:].unsqueeze(0)
            errors[:, i] = err
        w[:, b1:] -= errors @ hinv[b0:b1, b1:]
    return q, scales


def quantize_weight_only(model: Transformer, calibration_ids: list[list[int]] | None = None,
                         head: bool = True) -> None:
    """Every projection of the layers (and the LM head when `head`) to WeightOnlyInt8Linear, in
    place: GPTQ against the inputs seen on calibration_ids, or nearest-value rounding without
    them. Embeddings, norms, biases and the KV cache stay float32. A tied LM head becomes its
    own int8 copy (the embedding lookup keeps the float table).

    No rotation or smoothing: those exist to make activations quantizable to 8 bits, and here
    the kernel keeps 16 (a scale per block of at most 256 inputs)."""
    if model.dtype != torch.float32 or model.device.type != "cpu":
        raise ValueError(f"int8_weight_only needs float32 compute on the CPU, not {model.dtype} on {model.device}")
    xtx = collect_covariances(model, calibration_ids) if calibration_ids else {}

    def convert(name: str, p: Linear) -> WeightOnlyInt8Linear:
        p = p.plain()
        w = p.w.float().t()  # [out, in]
        if not bool(torch.isfinite(w).all()):
            raise ValueError(f"int8_weight_only: {name} holds weights that are not finite (NaN or inf)")
        group = group_size(w.shape[1])
        q, scale, offset = symmetric_codes(*gptq_round(w, xtx[name], group)) if name in xtx else rtn_round(w, group)
        if not (bool(torch.isfinite(scale).all()) and bool(torch.isfinite(offset).all())):
            raise ValueError(f"int8_weight_only: {name} holds weights beyond float16's range (|w| > 65504), which "
                             "its scales and offsets cannot express; serve it as float32")
        bias = None if p.b is None else p.b.clone()
        return WeightOnlyInt8Linear.from_rows(q, scale, offset, bias)

    for i, layer in enumerate(model.layers):
        for name in PROJECTION_NAMES:
            if getattr(layer, name) is not None:
                setattr(layer, name, convert(f"layers.{i}.{name}", getattr(layer, name)))
        if layer.moe is not None:  # every expert's projections (calibration observes none of them: nearest rounding)
            layer.moe.convert(lambda p, i=i: convert(f"layers.{i}.moe", p))
    if head and model.lm_head is not None:
        model.lm_head = convert("lm_head", model.lm_head)
