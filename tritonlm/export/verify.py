"""Check an exported decoder against the PyTorch model before it is written.

Every case is compared with an independent reference: the PyTorch model run on each
sequence ALONE, without padding and without a cache (one full forward over all its
tokens). So the check covers the cache plumbing, left padding, and the engine's
mid-padded pasts (a pool of right-padded caches: mask [1..1 0..0 | 1 ..]) at once.

Cases:
    decode       prefill from an empty past, several decode steps feeding back the
                 returned cache, then a chunk of several tokens on top of the cache
    left_padded  a batch of different prompt lengths, left-padded, then decode steps
    mid_padded   sequences prefilled alone, their caches right-padded into one batch,
                 decode steps with explicit position_ids
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from tritonlm.engine.model_shape import ModelShape
from tritonlm.export.wrapper import DecoderInputs, model_shape

# (inputs) -> [logits, present.0.key, present.0.value, ...] as float32 numpy
DecoderFn = Callable[[DecoderInputs], list[np.ndarray]]


@dataclass(frozen=True)
class Tolerance:
    max_rel_diff: float  # max |logit diff| / max(1, max |reference logit|)
    min_top1: float  # fraction of positions whose argmax agrees (near-ties forgiven)


TOLERANCES = {
    "onnx": Tolerance(max_rel_diff=1e-4, min_top1=1.0),
    "torchscript": Tolerance(max_rel_diff=1e-4, min_top1=1.0),
    "onnx-fp16": Tolerance(max_rel_diff=5e-2, min_top1=0.95),
    # int8 (blockwise weights, see onnx_export.quantize_int8): a bounded logit scale, above
    # what correct blockwise int8 gives and well below a wrong quantization scale's errors,
    # which are of the order of the logits themselves (docs/performance-notes.md); top-1 as
    # fp16's, with a tight tie margin. One threshold for every family: a defect may show in
    # one family only, and a per-family threshold would hide it there.
    "onnx-int8": Tolerance(max_rel_diff=0.15, min_top1=0.95),
}


@dataclass
class CaseResult:
    name: str
    positions: int = 0
    max_abs_diff: float = 0.0
    max_ref_abs: float = 0.0
    top1_agree: int = 0
    top1_tie_ok: int = 0  # disagreements where the two choices are within noise in the reference
    nonfinite: int = 0


@dataclass
class VerifyReport:
    fmt: str
    tolerance: dict
    cases: list[CaseResult] = field(default_factory=list)
    seed: int = 0

    @property
    def positions(self) -> int:
        return sum(c.positions for c in self.cases)

    @property
    def max_abs_diff(self) -> float:
        return max((c.max_abs_diff for c in self.cases), default=0.0)

    @property
    def max_rel_diff(self) -> float:
        ref = max((c.max_ref_abs for c in self.cases), default=0.0)
        return self.max_abs_diff / max(1.0, ref)

    @property
    def top1_agreement(self) -> float:
        return sum(c.top1_agree for c in self.cases) / max(1, self.positions)

    @property
    def top1_agreement_tie_aware(self) -> float:
        return sum(c.top1_agree + c.top1_tie_ok for c in self.cases) / max(1, self.positions)

    @property
    def nonfinite(self) -> int:
        return sum(c.nonfinite for c in self.cases)

    def failure(self) -> str | None:
        """None when within tolerance, else why not (one line)."""
        tol = Tolerance(**self.tolerance)
        if self.nonfinite:
            return f"{self.nonfinite} logits are NaN/inf"
        if self.max_rel_diff > tol.max_rel_diff:
            return f"max relative logit diff {self.max_rel_diff:.3g} > {tol.max_rel_diff:.3g}"
        if self.top1_agreement_tie_aware < tol.min_top1:
            return f"top-1 agreement {self.top1_agreement_tie_aware:.3f} < {tol.min_top1}"
        return None

    def summary(self) -> str:
        return (
            f"{self.fmt}: max |logit diff| {self.max_abs_diff:.3g} (relative {self.max_rel_diff:.3g}), "
            f"top-1 agreement {self.top1_agreement:.3f} over {self.positions} positions"
        )

    def to_json(self) -> dict:
        return {
            "format": self.fmt,
            "passed": self.failure() is None,
            "failure": self.failure(),
            "max_abs_logit_diff": self.max_abs_diff,
            "max_rel_logit_diff": self.max_rel_diff,
            "top1_agreement": self.top1_agreement,
            "top1_agreement_tie_aware": self.top1_agreement_tie_aware,
            "positions": self.positions,
            "tolerance": self.tolerance,
            "seed": self.seed,
            "cases": [asdict(c) for c in self.cases],
        }

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n")


class Reference:
    """Full-sequence logits of the PyTorch model, one sequence at a time, memoized."""

    def __init__(self, model):
        self.model = model
        self._memo: dict[tuple[int, ...], np.ndarray] = {}

    def logits(self, tokens: Sequence[int]) -> np.ndarray:
        key = tuple(int(t) for t in tokens)
        if key not in self._memo:
            with torch.no_grad():
                ids = torch.tensor([key], dtype=torch.long)
                out = self.model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
            self._memo[key] = out.logits[0].float().numpy()
        return self._memo[key]


def _compare(case: CaseResult, got: np.ndarray, ref: np.ndarray, tie_eps: float) -> None:
    """got, ref: [n, V] logits at the same positions."""
    got = got.astype(np.float32)
    case.positions += got.shape[0]
    finite = np.isfinite(got)
    case.nonfinite += int((~finite).sum())
    if not finite.all():
        got = np.where(finite, got, 0.0)
    case.max_abs_diff = max(case.max_abs_diff, float(np.abs(got - ref).max()))
    case.max_ref_abs = max(case.max_ref_abs, float(np.abs(ref).max()))
    g, r = got.argmax(-1), ref.argmax(-1)
    agree = g == r
    case.top1_agree += int(agree.sum())
    rows = np.arange(ref.shape[0])
    gap = ref[rows, r] - ref[rows, g]
    case.top1_tie_ok += int(((~agree) & (gap <= tie_eps)).sum())


class _Seqs:
    """Token bookkeeping per sequence for the checks."""

    def __init__(self, rng: np.random.Generator, vocab: int):
        self.rng = rng
        self.vocab = vocab

    def tokens(self, n: int) -> list[int]:
        return self.rng.integers(0, self.vocab, size=n).tolist()


def _mask_positions(mask: torch.Tensor, t: int) -> torch.Tensor:
    return (mask.long().cumsum(-1) - 1).clamp(min=0)[:, -t:]


def verify_decoder(
    fn: DecoderFn,
    model,
    fmt: str,
    *,
    seed: int = 0,
    decode_steps: int = 4,
    past_dtype: torch.dtype = torch.float32,
    tolerance: Tolerance | None = None,
    reference: Reference | None = None,
) -> VerifyReport:
    """Run the three cases on `fn` (an artifact) and on the PyTorch model; report diffs.
    Pass one `reference` to several calls with the same seed to compute PyTorch's side once."""
    spec: ModelShape = model_shape(model)
    tol = tolerance or TOLERANCES[fmt]
    report = VerifyReport(fmt=fmt, tolerance=asdict(tol), seed=seed)
    ref = reference if reference is not None and reference.model is model else Reference(model)
    rng = np.random.default_rng(seed)
    seqs = _Seqs(rng, spec.vocab_size)
    max_len = spec.max_positions
    # noise level for tie forgiveness: a few times the allowed fp32 error
    tie_eps = 1e-3 if fmt == "onnx-int8" or math.isinf(tol.max_rel_diff) else max(1e-4, tol.max_rel_diff * 5)

    def to_torch(arrays: list[np.ndarray]) -> tuple[torch.Tensor, ...]:
        return tuple(torch.from_numpy(np.ascontiguousarray(a)).to(past_dtype) for a in arrays)

    def empty(batch: int):
        return tuple(torch.zeros((batch, spec.num_kv_heads, 0, spec.head_dim), dtype=past_dtype)
                     for _ in range(2 * spec.num_layers))

    # --- decode: prefill, decode steps, then a chunk on top of the cache -------------
    case = CaseResult("decode")
    plen = min(7, max_len // 4)
    toks = seqs.tokens(plen)
    ids = torch.tensor([toks])
    mask = torch.ones(1, plen, dtype=torch.long)
    out = fn(DecoderInputs(ids, mask, _mask_positions(mask, plen), empty(1)))
    _compare(case, out[0][0], ref.logits(toks)[:plen], tie_eps)
    past = to_torch(out[1:])
    steps = [1] * decode_steps + [3]
    for t in steps:
        if len(toks) + t > max_len:
            break
        new = seqs.tokens(t)
        toks = toks + new
        mask = torch.ones(1, len(toks), dtype=torch.long)
        pos = torch.arange(len(toks) - t, len(toks)).unsqueeze(0)
        out = fn(DecoderInputs(torch.tensor([new]), mask, pos, past))
        _compare(case, out[0][0], ref.logits(toks)[-t:], tie_eps)
        past = to_torch(out[1:])
    report.cases.append(case)

    # --- left-padded batch of different lengths --------------------------------------
    case = CaseResult("left_padded")
    lengths = [min(5, max_len // 4), min(2, max_len // 4), min(8, max_len // 4)]
    width = max(lengths)
    prompts = [seqs.tokens(n) for n in lengths]
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, width - len(p):] = torch.tensor(p)
        mask[b, width - len(p):] = 1
    out = fn(DecoderInputs(ids, mask, _mask_positions(mask, width), empty(len(lengths))))
    for b, p in enumerate(prompts):
        _compare(case, out[0][b, width - len(p):], ref.logits(p), tie_eps)
    past = to_torch(out[1:])
    for _ in range(decode_steps):
        if width + 1 > max_len:
            break
        new = [seqs.tokens(1) for _ in prompts]
        prompts = [p + n for p, n in zip(prompts, new)]
        mask = torch.cat([mask, torch.ones(len(lengths), 1, dtype=torch.long)], dim=1)
        width += 1
        out = fn(DecoderInputs(torch.tensor(new), mask, _mask_positions(mask, 1), past))
        for b, p in enumerate(prompts):
            _compare(case, out[0][b], ref.logits(p)[-1:], tie_eps)
        past = to_torch(out[1:])
    report.cases.append(case)

    # --- mid-padded: caches of different lengths right-padded into one pool ----------
    case = CaseResult("mid_padded")
    lengths = [min(3, max_len // 4), min(6, max_len // 4), min(1, max_len // 4)]
    prompts = [seqs.tokens(n) for n in lengths]
    caches = []
    for p in prompts:  # each prefilled alone by the artifact itself
        m1 = torch.ones(1, len(p), dtype=torch.long)
        o = fn(DecoderInputs(torch.tensor([p]), m1, _mask_positions(m1, len(p)), empty(1)))
        _compare(case, o[0][0], ref.logits(p), tie_eps)
        caches.append(to_torch(o[1:]))
    pool = max(lengths)
    past_list = []
    for j in range(2 * spec.num_layers):
        layer = torch.zeros((len(prompts), spec.num_kv_heads, pool, spec.head_dim), dtype=past_dtype)
        for b, c in enumerate(caches):
            # garbage, not zeros, in the padding: the mask alone must hide it
            layer[b, :, lengths[b]:] = 7.0
            layer[b, :, : lengths[b]] = c[j][0]
        past_list.append(layer)
    past = tuple(past_list)
    mask = torch.zeros(len(prompts), pool, dtype=torch.long)
    for b, n in enumerate(lengths):
        mask[b, :n] = 1
    lens = list(lengths)
    for step in range(decode_steps):
        t = 2 if step == 1 else 1  # one multi-token step: speculative verification shape
        if pool + t > max_len or max(lens) + t > max_len:
            break
        new = [seqs.tokens(t) for _ in prompts]
        prompts = [p + n for p, n in zip(prompts, new)]
        mask = torch.cat([mask, torch.ones(len(prompts), t, dtype=torch.long)], dim=1)
        pos = torch.tensor([[n + k for k in range(t)] for n in lens])
        out = fn(DecoderInputs(torch.tensor(new), mask, pos, past))
        for b, p in enumerate(prompts):
            _compare(case, out[0][b], ref.logits(p)[-t:], tie_eps)
        past = to_torch(out[1:])
        pool += t
        lens = [n + t for n in lens]
    report.cases.append(case)
    return report


# ---- artifact runners ------------------------------------------------------------------

def onnx_decoder_fn(path: Path, threads: int | None = None) -> DecoderFn:
    import onnxruntime as ort

    from tritonlm.engine.runners import onnx_session_options

    opts = onnx_session_options(threads or 0)
    opts.log_severity_level = 3
    sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    in_types = {i.name: i.type for i in sess.get_inputs()}
    num_layers = sum(1 for n in in_types if n.startswith("past_key_values.")) // 2

    def run(inp: DecoderInputs) -> list[np.ndarray]:
        feed = inp.as_feed(num_layers)
        for name, arr in feed.items():
            if in_types[name] == "tensor(float16)":
                feed[name] = arr.astype(np.float16)
            elif in_types[name] == "tensor(float)":
                feed[name] = arr.astype(np.float32)
        return [np.asarray(o, dtype=np.float32) for o in sess.run(None, feed)]

    return run


def torchscript_decoder_fn(path: Path) -> DecoderFn:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch.jit.load's nudge towards torch.export
        module = torch.jit.load(str(path), map_location="cpu").eval()

    def run(inp: DecoderInputs) -> list[np.ndarray]:
        # the profiling executor re-specializes for every new shape: slow for a decoder
        with torch.no_grad(), torch.jit.optimized_execution(False):
            outs = module(*inp.as_tuple())
        return [o.float().numpy() for o in outs]

    return run


def eager_decoder_fn(model) -> DecoderFn:
    from tritonlm.export.wrapper import FlatCacheDecoder

    dec = FlatCacheDecoder(model).eval()

    def run(inp: DecoderInputs) -> list[np.ndarray]:
        with torch.no_grad():
            outs = dec(*inp.as_tuple())
        return [o.float().numpy() for o in outs]

    return run
