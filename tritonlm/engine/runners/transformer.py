"""One transformer (GPT-2 or Llama): plain weight tensors and a handful of layer functions.

gpt-fast style: the weights are pulled out of a loaded HF model into Proj / Norm / Layer
tensors (GPT-2 Conv1D and Llama Linear layouts unified to `y = x @ w + b`, w [in, out]);
the forward pass is the few functions below. The same code runs everywhere:

    whole model     Transformer.from_hf(model, device, dtype)        (TorchRunner)
    tensor parallel .tensor_slice(rank, world), Megatron style: column-parallel q/k/v
                    (heads [h0, h1), kv heads [g0, g1)) and fc / gate / up; row-parallel
                    o / down followed by an ALL-REDUCE, their biases added once after it;
                    vocab-parallel embedding (ids outside the rank's rows give zeros) and an
                    ALL-REDUCE; vocab-parallel LM head whose columns are GATHERED to rank 0
    pipeline        .layer_slice(stage, stages): layers [l0, l1); stage 0 also holds the
                    embeddings, the last stage ln_f and the LM head
A slice holds copies of its share only, so the full model can be freed after slicing.
`Comm` is the no-op world of one rank; parallel.comm.ProcessComm does the real collectives.

Per layer, attention writes the new keys/values into the pool in place (`index_copy_`
on the flat slot index), gathers each sequence's keys through its slot table into
[B, Hkv, L, D] (one `index_select` into a reused Workspace buffer) and runs
`scaled_dot_product_attention` with a boolean mask (key exists AND causal). With
tritonlm's C++ ops on (use_paged_kernel: CPU, float32), decode-width steps do RoPE, the
write and attention in one op reading the pool in place (paged_attention_qkv), and the
residual add + RMSNorm, SwiGLU and int8 projections are one op each; decode-width
steps run all the layers in one C++ call (build_decoder_stack). The LM head
runs only on the rows whose logits are wanted: each row's last valid token, or every
new token with all_logits.

A padded batch (prefill chunks of different widths) runs packed: norms, projections and
the MLP see only the N real tokens (ForwardBatch.packed), attention the padded [B, T] layout.

Shapes: B batch, T new tokens per row (padded width), L keys per row (max past+new),
N real tokens of a padded batch, C hidden, H query heads, Hkv key/value heads, D head_dim,
V vocab, S pool slots.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from tritonlm.engine.kv_cache import KVPool
from tritonlm.engine.runners.base import ForwardBatch, Workspace, gather_kv, kv_rows
from tritonlm.engine.model_shape import ModelShape

# ---------------------------------------------------------------------------- weights


# Dynamic int8 (fbgemm) quantizes activations to uint8 per call. Without VNNI its AVX2
# kernel sums pairs of u8*s8 products in int16 and can saturate, so activations are then
# limited to 7 bits (reduce_range), as torch.ao's dynamic Linear does; VNNI accumulates
# in int32 and keeps all 8.
_REDUCE_RANGE = not (hasattr(torch.cpu, "_is_vnni_supported") and torch.cpu._is_vnni_supported())


BLOCKED_DTYPES = (torch.float32, torch.bfloat16)  # what oneDNN's prepacked linear runs on any x86 CPU


def blocked_rows(rows: int) -> int:
    """The row count a blocked matmul runs with: `rows` rounded up to a bucket.

    oneDNN compiles kernels per matmul shape, the row count included, and keeps them
    (~0.3 MB each, beyond its primitive cache's reach): a server sees every row count from 1
    to its token budget (batch sizes, prefill chunks), and RSS grew ~120 MB per projection
    shape over 400 row counts. Buckets bound the shapes (about 70 up to 8192 rows) and cost
    little: small-M steps are bound by streaming the weights, not by the rows.
        1-8 exact, then multiples of 8 to 64, of 16 to 256, of 64 to 1024, of 256 beyond."""
    for limit, step in ((8, 1), (64, 8), (256, 16), (1024, 64)):
        if rows <= limit:
            return -(-rows // step) * step
    return -(-rows // 256) * 256


class PinnedRows:
    """int8 projections' input buffers (Proj._int8): [>= 1 + rows, in], row 0 pinned to
    (1, -1, 0, ...). One per input width, shared by all of a model's projections (they run
    one at a time): one per projection held ~6.7 MB per SmolLM2 layer at 512-row steps."""

    def __init__(self) -> None:
        self._bufs: dict[int, torch.Tensor] = {}

    def take(self, rows: int, width: int) -> torch.Tensor:
        buf = self._bufs.get(width)
        if buf is None or buf.shape[0] < rows + 1:
            buf = torch.zeros(max(rows + 1, 0 if buf is None else buf.shape[0] * 3 // 2), width)
            buf[0, 0], buf[0, 1] = 1.0, -1.0
            self._bufs[width] = buf
        return buf


@dataclass
class Proj:
    """y = x @ w + b with w stored [in, out], contiguous (GPT-2's Conv1D layout; nn.Linear
    weights are transposed once at load: x @ w.t() through a view ran at half the speed on
    the CPU). int8: w is None and `packed` holds per-output-channel int8 weights prepacked
    for PyTorch's dynamic quantized linear (fbgemm); b stays float and outside the pack
    (row-parallel adds it after the all-reduce)."""

    w: torch.Tensor | None  # [in, out]
    b: torch.Tensor | None  # [out]
    packed: object | None = None  # torch.ops.quantized LinearPackedParams (int8 [out, in] + scales)
    packed_bytes: int = 0  # of `packed` or `blocked` (opaque tensors: no storage to measure)
    blocked: torch.Tensor | None = None  # CPU float: w as oneDNN's blocked [out, in] (see blocked_for_cpu)
    pin_width: int = 0  # int8: input features (the pinned row's width, see matmul)
    pinned: "PinnedRows" = field(default_factory=lambda: PinnedRows(), repr=False)  # int8: shared by the model's projections
    smooth: torch.Tensor | None = None  # [in] int8: 1/s of SmoothQuant's migration, when not folded upstream
    int8_op: bool = False  # int8: through torch.ops.tritonlm.int8_linear (scaling, kernel, rescale: one op)
    observed: torch.Tensor | None = None  # [in] calibration: max |x| seen per input channel

    def matmul(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out], no bias
        if self.blocked is not None:
            return self._blocked(x, None)
        if self.packed is None:
            if self.observed is not None:
                torch.maximum(self.observed, x.detach().abs().reshape(-1, x.shape[-1]).amax(0), out=self.observed)
            return x @ self.w
        return self._int8(x, None)

    def _int8(self, x: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:  # [..., in] -> [..., out]
        # The kernel quantizes its whole input with one range (min..max of the tensor), so
        # one row's outliers would coarsen every other row's, and a request's output would
        # depend on what shares its batch. Each row is scaled to max |x| = 1 and a pinned
        # row (1, -1, 0, ...) fixes the range to [-1, 1]: every token is quantized alone,
        # the same in any batch. The pinned row is row 0 of a reused buffer, the scaled rows
        # are written after it (no concatenation). [M, in] -> [1 + M, in] -> [M, out]
        # SmoothQuant's division where it could not be folded upstream is applied here too.
        # With the C++ ops (`int8_op`) all of it, the rescale and the bias are one op.
        flat = x.reshape(-1, x.shape[-1])
        rows = flat.shape[0]
        buf = self.pinned.take(rows, self.pin_width)
        if self.int8_op:
            y = torch.ops.tritonlm.int8_linear(flat.contiguous(), self.smooth, b, self.packed, buf, _REDUCE_RANGE)
            return y.view(*x.shape[:-1], y.shape[-1])
        if self.smooth is not None:
            flat = flat * self.smooth
        scale = flat.abs().amax(dim=-1, keepdim=True).clamp_(min=1e-30)  # [M, 1] (vector_norm(inf): 10x slower)
        torch.div(flat, scale, out=buf[1 : rows + 1])
        y = torch.ops.quantized.linear_dynamic(buf[: rows + 1], self.packed, _REDUCE_RANGE)
        y = (y[1:] * scale).view(*x.shape[:-1], y.shape[-1])
        return y if b is None else y + b

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        if self.blocked is not None:
            return self._blocked(x, self.b)  # the bias inside the kernel: no second pass over y
        if self.packed is not None:
            return self._int8(x, self.b)
        y = self.matmul(x)
        return y if self.b is None else y + self.b

    def _blocked(self, x: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:  # [..., in] -> [..., out]
        flat = x.reshape(-1, x.shape[-1])  # [M, in]
        rows = flat.shape[0]
        padded = blocked_rows(rows)
        if padded != rows:  # zero rows up to the bucket; their outputs are dropped
            flat = F.pad(flat, (0, 0, 0, padded - rows))
        y = torch.ops.mkldnn._linear_pointwise(flat, self.blocked, b, "none", [], "")  # [M', out]
        return y[:rows].view(*x.shape[:-1], y.shape[-1])

    def blocked_for_cpu(self) -> "Proj":
        """This projection with its float weight reordered once into oneDNN's blocked layout
        (what inductor's CPU weight prepacking does). The step streams every weight from
        memory once; plain `x @ w` reads the [in, out] rows at ~6 GB/s on the 2-core test
        host, the blocked kernel at ~11: the float32 decode step at batch 8-32 is 1.5-2x
        faster, the same values up to summation order (within 1e-5 of `x @ w` in the tests).
        The [in, out] copy is dropped (no second copy of the weights)."""
        _check_float(self)
        w = self.w.t().contiguous()  # [out, in]
        blocked = torch.ops.mkldnn._reorder_linear_weight(w, None)  # None: any batch size
        return Proj(None, _copy(self.b), blocked=blocked, packed_bytes=w.numel() * w.element_size())

    def smoothing(self, alpha: float = 0.5) -> torch.Tensor | None:
        """SmoothQuant's per-input-channel factor s [in] from calibration (`observed`), or None.

        LLMs' activations have a few input channels hundreds of times larger than the rest,
        which per-token int8 would flatten to zero; dividing channel c of x by
        s_c = max|x_c|^alpha / max|w_c|^(1-alpha) and multiplying the weight's row c by it
        leaves x @ w unchanged and moves the outliers' range into the weights, which are
        quantized per output channel."""
        if self.observed is None:
            return None
        w = self.w.float()  # [in, out]
        s = self.observed.clamp(min=1e-5).pow(alpha) / w.abs().amax(dim=1).clamp(min=1e-5).pow(1 - alpha)
        return s.clamp(min=1e-5)  # [in]

    def quantized_int8(self, s: torch.Tensor | None = None, folded: bool = False) -> "Proj":
        """This projection with int8 weights, one scale per output channel (symmetric:
        scale = max |w| of the channel / 127), float32 activations. s: SmoothQuant's factor
        (smoothing()); the weight's rows are multiplied by it, and x must be divided by it:
        by whatever produces x when `folded` (Transformer.quantize_int8 folds it into the
        norm before, or into `up`), else by this projection at run time."""
        _check_float(self)
        w = self.w.float()  # [in, out]
        if s is not None:
            w = w * s.unsqueeze(1)
        w = w.t().contiguous()  # [out, in]
        scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12).double()  # [out]
        zero = torch.zeros(w.shape[0], dtype=torch.long)
        with warnings.catch_warnings():  # quantized tensor creation warns of deprecation; the kernel needs it
            warnings.simplefilter("ignore")
            q = torch.quantize_per_channel(w, scale, zero, 0, torch.qint8)
            packed = torch.ops.quantized.linear_prepack(q, None)
        smooth = None if s is None or folded else 1.0 / s
        return Proj(None, _copy(self.b), packed=packed, packed_bytes=w.numel() + 8 * w.shape[0],
                    pin_width=w.shape[1], smooth=smooth)

    def kept_float(self, s: torch.Tensor | None = None, folded: bool = False) -> "Proj":
        """What quantized_int8(s, folded) would compute, with the float weights: where s was
        folded upstream (x arrives divided by s), the weight's rows are multiplied by it, so
        the function is the same; otherwise nothing divides x and the weight stays as it is."""
        _check_float(self)
        w = self.w.float() * s.unsqueeze(1) if s is not None and folded else self.w
        return Proj(w.to(self.w.dtype).contiguous(), _copy(self.b))


@dataclass
class Norm:
    w: torch.Tensor  # [C]
    b: torch.Tensor | None  # [C] (LayerNorm) / None (RMSNorm)
    eps: float
    rms: bool

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [..., C] -> [..., C]
        if not self.rms:
            return F.layer_norm(x, (x.shape[-1],), self.w, self.b, self.eps)
        if x.dtype == torch.float32 and self.w.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.w, self.eps)  # one kernel, not six (same math in float32)
        # RMSNorm as HF computes it: in float32, back to the input dtype, then the weight
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.w * x32.to(x.dtype)


@dataclass
class Layer:
    ln_attn: Norm
    ln_mlp: Norm
    qkv: Proj  # fused [q | k | v]: [C, (H + 2 Hkv) D], column-parallel under TP
    o: Proj  # [H*D, C] row-parallel under TP
    down: Proj  # [F, C] row-parallel under TP
    # GPT-2: fc [C, F] -> act; Llama: act(gate(x)) * up(x) with gate | up fused: [C, 2F]
    fc: Proj | None = None
    gate_up: Proj | None = None
    attn_scale: float = 1.0


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")  # GPT-2's tanh approximation


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    table = {
        "gelu_new": gelu_tanh,
        "gelu_pytorch_tanh": gelu_tanh,
        "gelu_fast": gelu_tanh,
        "gelu": F.gelu,
        "silu": F.silu,
        "swish": F.silu,
        "relu": F.relu,
    }
    if name not in table:
        raise ValueError(f"unsupported activation {name!r} (supported: {sorted(table)})")
    return table[name]


def split_range(n: int, parts: int, index: int) -> tuple[int, int]:
    """[lo, hi) of part `index` when n items are cut into `parts` near-equal consecutive parts."""
    base, extra = divmod(n, parts)
    lo = index * base + min(index, extra)
    return lo, lo + base + (1 if index < extra else 0)


def _copy(t: torch.Tensor | None) -> torch.Tensor | None:
    """A contiguous copy (never a view: the full model's storage must be freeable)."""
    return None if t is None else t.clone(memory_format=torch.contiguous_format)


def _take(t: torch.Tensor, dim: int, spans: list[tuple[int, int]]) -> torch.Tensor:
    """A contiguous copy of t's [lo, hi) spans along dim, concatenated."""
    parts = [t.narrow(dim, lo, hi - lo) for lo, hi in spans]
    return torch.cat(parts, dim) if len(parts) > 1 else _copy(parts[0])


def _cols(p: Proj, spans: list[tuple[int, int]]) -> Proj:
    """Column-parallel slice: output features in spans (bias sliced with them)."""
    _check_float(p)
    return Proj(_take(p.w, 1, spans), None if p.b is None else _take(p.b, 0, spans))


def _rows(p: Proj, spans: list[tuple[int, int]]) -> Proj:
    """Row-parallel slice: input features in spans; the whole bias, added once after the all-reduce."""
    _check_float(p)
    return Proj(_take(p.w, 0, spans), _copy(p.b))


def _fold_into_norm(norm: Norm | None, s: torch.Tensor | None) -> None:
    """norm(x) / s, exactly: its weight (and bias) divided by s, per channel, in place of a copy."""
    if norm is None or s is None:
        return
    norm.w = norm.w / s.to(norm.w.dtype)
    if norm.b is not None:
        norm.b = norm.b / s.to(norm.b.dtype)


def _check_float(p: Proj) -> None:
    if p.packed is not None:
        raise ValueError("int8 weights cannot be sliced: slice the float model, then quantize each share")
    if p.blocked is not None:
        raise ValueError("blocked weights cannot be sliced or quantized: slice or quantize the plain model, then block")


def _clone(o):
    """Copy of a Proj / Norm / Layer (other fields as they are)."""
    if isinstance(o, Proj):
        _check_float(o)
        return Proj(_copy(o.w), _copy(o.b))
    if isinstance(o, Norm):
        return Norm(_copy(o.w), _copy(o.b), o.eps, o.rms)
    if isinstance(o, Layer):
        return Layer(**{k: _clone(v) for k, v in vars(o).items()})
    return o


def tensor_bytes(*objs) -> int:
    """Bytes of the distinct tensor storages reachable from objs (Proj/Norm/Layer/KVPool/lists/tensors)."""
    seen: dict[int, int] = {}

    def visit(o) -> None:
        if isinstance(o, torch.Tensor):
            seen.setdefault(o.untyped_storage().data_ptr(), o.untyped_storage().nbytes())
        elif isinstance(o, Proj) and (o.packed is not None or o.blocked is not None):
            seen[id(o.packed if o.packed is not None else o.blocked)] = o.packed_bytes
            visit(o.b)
        elif isinstance(o, (list, tuple)):
            for x in o:
                visit(x)
        elif isinstance(o, (Proj, Norm, Layer, KVPool)):
            for x in vars(o).values():
                visit(x)

    for o in objs:
        visit(o)
    return sum(seen.values())


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


# The paged-attention kernel reads every key once per query row in plain loops: for
# decode steps (T = 1) and speculative verification (T = K + 1) that beats copying K/V;
# a long prefill chunk is matmul work that SDPA's blocked kernel does better.
PAGED_KERNEL_MAX_WIDTH = 8


@dataclass
class StepContext:
    """What every layer of one step shares. With the paged-attention kernel (`kernel`),
    only plan and rope are used; otherwise the gather path's index, buffers and mask."""

    plan: ForwardBatch
    mask: torch.Tensor | None  # [B, 1, T, L] bool
    rows: torch.Tensor | None  # [B*Hkv*L] gather index (kv_rows)
    k_buf: torch.Tensor | None  # [B, Hkv, L, D] workspace for the gathered keys, reused by every layer
    v_buf: torch.Tensor | None  # [B, Hkv, L, D]
    rope: tuple[torch.Tensor, torch.Tensor] | None  # cos, sin [B, T, 1, D] (Llama)
    kernel: bool = False  # torch.ops.tritonlm.paged_attention reads the pool directly
    slot_table: torch.Tensor | None = None  # [B, L] int64 contiguous, for the kernel
    # gather path, padded batch: [N] plan.packed, the valid tokens' rows of [B*T]; the
    # layers' row-wise work runs on those N rows, attention on the padded [B, T] layout
    packed: torch.Tensor | None = None


def write_kv(cache: torch.Tensor, slots: torch.Tensor, new: torch.Tensor) -> None:
    """cache [S, Hkv, D] <- new [B, T, Hkv, D] at slots [B, T] (padding slots are scratch 0)."""
    cache.index_copy_(0, slots.reshape(-1), new.reshape(-1, *new.shape[2:]).to(cache.dtype))


def paged_attention(
    q: torch.Tensor,  # [B, T, H, D]
    k: torch.Tensor,  # [B, T, Hkv, D]
    v: torch.Tensor,  # [B, T, Hkv, D]
    k_cache: torch.Tensor,  # [S, Hkv, D]
    v_cache: torch.Tensor,  # [S, Hkv, D]
    ctx: StepContext,
    scale: float,
) -> torch.Tensor:  # [B, T, H*D]
    bsz = q.shape[0]
    write_kv(k_cache, ctx.plan.write_slots, k)
    write_kv(v_cache, ctx.plan.write_slots, v)
    keys = gather_kv(k_cache, ctx.rows, bsz, out=ctx.k_buf).to(q.dtype)  # [B, Hkv, L, D]
    values = gather_kv(v_cache, ctx.rows, bsz, out=ctx.v_buf).to(q.dtype)  # [B, Hkv, L, D]
    _, width, heads, dim = q.shape
    kv_heads = k.shape[2]
    group = heads // kv_heads
    if group == 1:
        out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=ctx.mask, scale=scale)
        return out.transpose(1, 2).reshape(bsz, width, heads * dim)  # [B, H, T, D] -> [B, T, H*D]
    # GQA: the `group` query heads that share a kv head become query rows of that head
    # (query head h reads kv head h // group), so each key block is loaded once per kv
    # head, not once per query head. [B, T, Hkv, G, D] -> [B, Hkv, G*T, D]; the mask
    # [B, 1, T, L] repeats over the group: [B, 1, G*T, L].
    q_rows = q.view(bsz, width, kv_heads, group, dim).permute(0, 2, 3, 1, 4).reshape(bsz, kv_heads, group * width, dim)
    mask = ctx.mask if width == 1 else ctx.mask.unsqueeze(2).expand(-1, -1, group, -1, -1).reshape(bsz, 1, group * width, -1)
    out = F.scaled_dot_product_attention(q_rows, keys, values, attn_mask=mask, scale=scale)  # [B, Hkv, G*T, D]
    return out.view(bsz, kv_heads, group, width, dim).permute(0, 3, 1, 2, 4).reshape(bsz, width, heads * dim)


# ---------------------------------------------------------------------------- collectives


class Comm:
    """The collectives a tensor-parallel shard needs; this base is the world of one rank
    (no-op all-reduce, identity gather). parallel.comm.ProcessComm implements them."""

    rank = 0
    world = 1

    def allreduce(self, t: torch.Tensor) -> None:  # in place, sum over ranks
        pass

    def gather_cols(self, t: torch.Tensor, widths: list[int]) -> torch.Tensor | None:
        return t  # [..., widths[r]] of every rank r -> [..., sum(widths)] on rank 0 (None elsewhere)


ONE_RANK = Comm()


def row_parallel(p: Proj, x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """x @ w summed over ranks, then the bias once. World 1: exactly p(x)."""
    y = p.matmul(x)  # [..., out], this rank's partial sum
    comm.allreduce(y)
    return y if p.b is None else y + p.b


# ---------------------------------------------------------------------------- the model


@dataclass(eq=False)
class Transformer:
    """Weights and forward pass of a whole model, a tensor-parallel rank's or a stage's share.

    forward() = embed -> run_layers -> head under torch.inference_mode(); a pipeline stage
    calls the parts it holds itself, under inference_mode too (entered once per step: the
    context costs a few microseconds, measurable on small models)."""

    spec: ModelShape  # the whole model's shape; spec.dtype is the compute and KV dtype
    layers: list[Layer]  # the layers held (a stage: layers [l0, l1) of the model)
    wte: torch.Tensor | None  # [V', C] embedding rows [vocab_lo, vocab_lo + V'); None past stage 0
    wpe: torch.Tensor | None  # [P', C] GPT-2's learned positions, rows [pos_lo, pos_lo + P')
    ln_f: Norm | None  # None before the last stage
    lm_head: Proj | None  # [C, V'] (tied: a view of wte)
    act: Callable[[torch.Tensor], torch.Tensor]
    inv_freq: torch.Tensor | None  # [D/2] Llama's RoPE
    rope_scaling: float
    max_positions: int | None  # GPT-2's learned positions are a hard limit; RoPE has none
    device: torch.device
    heads: int  # query heads held (a TP rank: heads [h0, h1))
    kv_heads: int  # key/value heads held, and in this shard's KV pool
    vocab_lo: int = 0
    pos_lo: int = 0
    head_widths: list[int] = field(default_factory=list)  # TP: LM head columns of every rank, for the gather
    # tritonlm's C++ ops (use_paged_kernel): decode-width steps' attention (paged_attention_qkv),
    # and for float32 RMSNorm / SwiGLU models the fused norms and activation at every width
    paged_kernel: bool = False
    # with the C++ ops, float32 / int8 layers (Llama family, GPT-2) also as one torch.classes.tritonlm.DecoderStack
    # (decoder_stack.cpp): decode-width steps run every layer in one call (build_decoder_stack)
    decoder_stack: object | None = field(default=None, repr=False)
    workspace: Workspace = field(default_factory=Workspace, repr=False)  # gathered K/V, reused step to step

    @property
    def dtype(self) -> torch.dtype:
        return self.spec.dtype

    @property
    def hidden(self) -> int:
        return int(self.layers[0].ln_attn.w.shape[0])

    @property
    def vocab_parallel(self) -> bool:
        return len(self.head_widths) > 1

    def _tied(self) -> bool:
        """The LM head is a view of the embedding (tied weights share one tensor)."""
        w = None if self.lm_head is None else self.lm_head.w
        return (
            w is not None and self.wte is not None and self.lm_head.b is None and w.shape[1] == self.wte.shape[0]
            and w.untyped_storage().data_ptr() == self.wte.untyped_storage().data_ptr()
        )

    # ---- from a Hugging Face model ----------------------------------------------------
    @staticmethod
    def from_hf(model, device: str | torch.device = "cpu", dtype: torch.dtype | None = None) -> "Transformer":
        """The weights of a loaded GPT2LMHeadModel / LlamaForCausalLM (shared, not copied,
        when device and dtype already match). ValueError for other architectures."""
        cfg = model.config
        device = torch.device(device)
        if dtype is None:
            dtype = next(model.parameters()).dtype
        spec = ModelShape.from_hf_config(cfg, dtype=dtype)

        def t(p: torch.Tensor | None) -> torch.Tensor | None:
            return None if p is None else p.detach().to(device, dtype)

        def lin(*ms) -> Proj:  # nn.Linear weights [out, in], side by side -> [in, sum(out)], contiguous
            w = torch.cat([t(m.weight) for m in ms], dim=0).t().contiguous()
            if all(m.bias is None for m in ms):
                return Proj(w, None)
            return Proj(w, torch.cat([t(m.bias) if m.bias is not None else w.new_zeros(m.out_features) for m in ms]))

        def conv(m) -> Proj:  # GPT-2 Conv1D: weight already [in, out]
            return Proj(t(m.weight), t(m.bias))

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
        else:
            base, eps = model.model, cfg.rms_norm_eps
            for blk in base.layers:
                at, mlp = blk.self_attn, blk.mlp
                layers.append(Layer(
                    ln_attn=Norm(t(blk.input_layernorm.weight), None, eps, rms=True),
                    ln_mlp=Norm(t(blk.post_attention_layernorm.weight), None, eps, rms=True),
                    qkv=lin(at.q_proj, at.k_proj, at.v_proj), o=lin(at.o_proj),  # one matmul for q, k and v
                    gate_up=lin(mlp.gate_proj, mlp.up_proj), down=lin(mlp.down_proj),
                    attn_scale=spec.head_dim**-0.5,
                ))
            wte, wpe = t(base.embed_tokens.weight), None
            ln_f = Norm(t(base.norm.weight), None, eps, rms=True)
            inv_freq, scaling = rope_inv_freq(cfg, spec.head_dim)
            act, inv_freq, max_positions = activation(cfg.hidden_act), inv_freq.to(device), None
        return Transformer(
            spec=spec, layers=layers, wte=wte, wpe=wpe, ln_f=ln_f,
            # the LM head stays a view [C, V] of whatever lm_head holds (of wte when tied): no second copy
            lm_head=Proj(t(model.lm_head.weight).t(), t(model.lm_head.bias)),
            act=act, inv_freq=inv_freq, rope_scaling=scaling, max_positions=max_positions,
            device=device, heads=spec.num_heads, kv_heads=spec.num_kv_heads,
        )

    # ---- shares of it -------------------------------------------------------------------
    def tensor_slice(self, rank: int, world: int) -> "Transformer":
        """Rank `rank` of `world`'s copy of its weights (see the module docstring)."""
        if self.layers:
            _check_float(self.layers[0].qkv)  # int8 or blocked weights: refused, saying which
        s, d = self.spec, self.spec.head_dim
        h0, h1 = split_range(s.num_heads, world, rank)
        g0, g1 = split_range(s.num_kv_heads, world, rank)
        q_span, kv_span = (h0 * d, h1 * d), (g0 * d, g1 * d)
        layers = []
        for L in self.layers:
            k0, v0 = s.num_heads * d, (s.num_heads + s.num_kv_heads) * d  # fused [q | k | v] columns
            inner = L.down.w.shape[0]
            f_lo, f_hi = split_range(inner, world, rank)
            layers.append(Layer(
                ln_attn=_clone(L.ln_attn), ln_mlp=_clone(L.ln_mlp),
                qkv=_cols(L.qkv, [q_span, (k0 + kv_span[0], k0 + kv_span[1]), (v0 + kv_span[0], v0 + kv_span[1])]),
                o=_rows(L.o, [q_span]), down=_rows(L.down, [(f_lo, f_hi)]),
                fc=None if L.fc is None else _cols(L.fc, [(f_lo, f_hi)]),
                # fused [gate | up] columns: this rank's span of each
                gate_up=None if L.gate_up is None else _cols(L.gate_up, [(f_lo, f_hi), (inner + f_lo, inner + f_hi)]),
                attn_scale=L.attn_scale,
            ))
        v0, v1 = split_range(self.wte.shape[0], world, rank)
        wte = _copy(self.wte[v0:v1])
        p0, wpe = 0, None
        if self.wpe is not None:
            p0, p1 = split_range(self.wpe.shape[0], world, rank)
            wpe = _copy(self.wpe[p0:p1])
        vocab = self.lm_head.w.shape[1]
        # tied embeddings stay tied: the LM head slice is a view of this rank's wte rows
        head = Proj(wte.t(), None) if self._tied() else _cols(self.lm_head, [split_range(vocab, world, rank)])
        widths = [hi - lo for lo, hi in (split_range(vocab, world, i) for i in range(world))]
        return Transformer(
            spec=s, layers=layers, wte=wte, wpe=wpe, ln_f=_clone(self.ln_f), lm_head=head,
            act=self.act, inv_freq=_copy(self.inv_freq), rope_scaling=self.rope_scaling,
            max_positions=self.max_positions, device=self.device, heads=h1 - h0, kv_heads=g1 - g0,
            vocab_lo=v0, pos_lo=p0, head_widths=widths,
        )

    def layer_slice(self, stage: int, stages: int) -> "Transformer":
        """Pipeline stage `stage` of `stages`' copy of its layers (and embeddings / head)."""
        l0, l1 = split_range(len(self.layers), stages, stage)
        first, last = stage == 0, stage == stages - 1
        wte = _copy(self.wte) if first else None
        head = None
        if last:
            head = Proj(wte.t(), None) if first and self._tied() else _clone(self.lm_head)
        return Transformer(
            spec=self.spec, layers=[_clone(L) for L in self.layers[l0:l1]],
            wte=wte, wpe=_copy(self.wpe) if first else None,
            ln_f=_clone(self.ln_f) if last else None, lm_head=head,
            act=self.act, inv_freq=_copy(self.inv_freq), rope_scaling=self.rope_scaling,
            max_positions=self.max_positions, device=self.device, heads=self.heads, kv_heads=self.kv_heads,
        )

    # ---- int8 -------------------------------------------------------------------------------
    def rotate_residual(self, seed: int = 0) -> bool:
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
        norms = [n for L in self.layers for n in (L.ln_attn, L.ln_mlp)] + [self.ln_f]
        whole = self.wte is not None and self.ln_f is not None and self.lm_head is not None and not self.vocab_parallel
        if not (whole and self.wpe is None and self.layers and all(n is not None and n.rms for n in norms)):
            return False
        for p in self.projections():
            _check_float(p)
        width = self.hidden
        g = torch.Generator().manual_seed(seed)
        q, r = torch.linalg.qr(torch.randn(width, width, generator=g, dtype=torch.float64))
        q = (q * torch.sign(torch.diagonal(r))).to(self.device, torch.float32)  # [C, C] orthogonal (Haar)

        def reads(norm: Norm, proj: Proj) -> Proj:  # proj(norm(x)) -> proj'(norm'(x @ Q)), new tensors
            w = q.t() @ (norm.w.float().unsqueeze(1) * proj.w.float())  # [C, out]
            norm.w = torch.ones_like(norm.w)
            return Proj(w.to(self.dtype).contiguous(), _copy(proj.b))

        def writes(proj: Proj) -> Proj:  # [in, C] -> [in, C] @ Q
            b = None if proj.b is None else (proj.b.float() @ q).to(self.dtype)
            return Proj((proj.w.float() @ q).to(self.dtype).contiguous(), b)

        for layer in self.layers:
            layer.qkv = reads(layer.ln_attn, layer.qkv)
            if layer.gate_up is not None:
                layer.gate_up = reads(layer.ln_mlp, layer.gate_up)
            else:
                layer.fc = reads(layer.ln_mlp, layer.fc)
            layer.o, layer.down = writes(layer.o), writes(layer.down)
        self.lm_head = reads(self.ln_f, self.lm_head)  # a tied head becomes its own (rotated) copy
        self.wte = (self.wte.float() @ q).to(self.dtype).contiguous()
        return True

    def quantize_int8(self, alpha: float = 0.3, keep_float: Callable[[str], bool] | None = None) -> None:
        """Every projection of the layers and the LM head to int8 weights, in place.
        Embeddings, norms, biases and the KV cache stay float32, the compute dtype.
        keep_float(name) -> True leaves that projection in float32 ("layers.3.down",
        "lm_head"; names as in `projection_names`), computing what it did before: for
        measuring where int8's error comes from (perf/int8_sensitivity.py).

        Projections whose inputs were observed (observe_activations, then a forward pass)
        are smoothed (Proj.smoothing). Dividing x by s costs a pass over x per call, so it is
        folded, exactly, into what makes x where that is linear per channel: the norm before
        qkv / fc / gate_up / the LM head (its weight and bias), and the `up` half of gate_up
        before down (x = act(gate) * up). Only o and GPT-2's down divide at run time."""
        if self.dtype != torch.float32 or self.device.type != "cpu":
            raise ValueError(f"int8 weights need float32 compute on the CPU, not {self.dtype} on {self.device}")

        def convert(name: str, proj: Proj, factor: torch.Tensor | None, folded: bool) -> Proj:
            if keep_float is not None and keep_float(name):
                return proj.kept_float(factor, folded=folded)
            return proj.quantized_int8(factor, folded=folded)

        for i, layer in enumerate(self.layers):
            s = {name: getattr(layer, name).smoothing(alpha) for name in ("qkv", "o", "down", "fc", "gate_up")
                 if getattr(layer, name) is not None}  # all from the float weights, before any fold
            _fold_into_norm(layer.ln_attn, s["qkv"])
            _fold_into_norm(layer.ln_mlp, s.get("fc", s.get("gate_up")))
            down_folded = layer.gate_up is not None and s["down"] is not None
            if down_folded:  # up's output channels feed down's input channels one to one
                inner = layer.down.w.shape[0]
                layer.gate_up.w[:, inner:] /= s["down"]
                if layer.gate_up.b is not None:
                    layer.gate_up.b[inner:] /= s["down"]
            for name, factor in s.items():
                folded = name in ("qkv", "fc", "gate_up") or (name == "down" and down_folded)
                setattr(layer, name, convert(f"layers.{i}.{name}", getattr(layer, name), factor, folded))
        if self.lm_head is not None:
            s_head = self.lm_head.smoothing(alpha) if self.ln_f is not None else None
            _fold_into_norm(self.ln_f, s_head)
            head, self.lm_head = self.lm_head, convert("lm_head", self.lm_head, s_head, s_head is not None)
            head.observed = None  # a tied head is a view of wte: nothing of it may stay in observe mode
        pinned = PinnedRows()
        for p in self.projections():
            p.pinned = pinned

    def block_weights(self) -> bool:
        """Every float projection and the LM head in oneDNN's blocked layout, in place
        (Proj.blocked_for_cpu). Only on the CPU, for the dtypes oneDNN's linear takes, when
        torch has oneDNN, and after any slicing, calibration or int8 quantization (they
        need the plain weights); int8 projections stay as they are, and in an int8 model
        only those quantize_int8 kept float are blocked. Returns whether it could run."""
        if not (self.device.type == "cpu" and self.dtype in BLOCKED_DTYPES and torch.backends.mkldnn.is_available()):
            return False
        if self.dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return False  # oneDNN's bf16 reorder needs AVX512-BW/VL/DQ or AVX-NE-CONVERT: plain x @ w
        for layer in self.layers:
            for name in ("qkv", "o", "down", "fc", "gate_up"):
                proj = getattr(layer, name)
                if proj is not None and proj.blocked is None and proj.packed is None:  # int8 stays packed
                    setattr(layer, name, proj.blocked_for_cpu())
        if self.lm_head is not None and self.lm_head.blocked is None and self.lm_head.packed is None:
            # a tied head was a view of wte: the blocked copy is its own (the embedding lookup keeps wte)
            self.lm_head = self.lm_head.blocked_for_cpu()
        return True

    def projections(self) -> list[Proj]:
        """Every projection that int8 quantizes: the layers' and the LM head."""
        return list(self.projection_names().values())

    def projection_names(self) -> dict[str, Proj]:
        """The projections by name: "layers.{i}.{qkv|o|fc|gate_up|down}" and "lm_head"."""
        out = {f"layers.{i}.{n}": getattr(L, n) for i, L in enumerate(self.layers)
               for n in ("qkv", "o", "down", "fc", "gate_up") if getattr(L, n) is not None}
        if self.lm_head is not None:
            out["lm_head"] = self.lm_head
        return out

    def observe_activations(self, on: bool) -> None:
        """Start (zeroed) or stop recording each projection's max |input| per channel."""
        for p in self.projections():
            p.observed = torch.zeros(p.w.shape[0], device=self.device) if on else None

    @property
    def weights_int8(self) -> bool:
        return any(p.packed is not None for p in self.projections())

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
        if self.wpe is not None:
            x = x + self._lookup(self.wpe, plan.positions, self.pos_lo)
        return x

    def use_paged_kernel(self) -> tuple[bool, str]:
        """Turn on tritonlm's C++ ops (the paged-attention kernel for decode-width steps, the
        fused norms and activation) when they can run here: float32 on the CPU, and the
        kernels build. Returns (on, why)."""
        if self.device.type != "cpu" or self.dtype != torch.float32:
            return False, f"the kernel runs float32 on the CPU; this model computes {self.dtype} on {self.device}"
        from tritonlm.engine.kernels import kernels_available

        self.paged_kernel, why = kernels_available()
        for p in self.projections():
            p.int8_op = self.paged_kernel and p.packed is not None
        self.decoder_stack = self.build_decoder_stack() if self.paged_kernel else None
        return self.paged_kernel, why

    def build_decoder_stack(self) -> object | None:
        """The layers as one C++ DecoderStack (decoder_stack.cpp), or None where its ops do not
        cover them. It takes Llama-family layers (RMSNorm, silu(gate) * up) and GPT-2's
        (LayerNorm, gelu tanh over fc) whose projections are all oneDNN-blocked float32 or
        int8 through the int8 op, and references their weights. At batch 1 the Python
        loop's ~250 op calls were ~a quarter of an int8 step."""
        if not self.layers:
            return None
        rms = self.layers[0].ln_attn.rms
        if self.act is F.silu:
            act = "silu_mul"
        elif self.act is gelu_tanh:
            act = "gelu_tanh"
        else:
            return None
        for L in self.layers:
            mlp_in = L.gate_up if act == "silu_mul" else L.fc
            if mlp_in is None or L.ln_attn.rms != rms or L.ln_mlp.rms != rms:
                return None
            if any(p.blocked is None and not p.int8_op for p in (L.qkv, L.o, mlp_in, L.down)):
                return None
            norms = [t for n in (L.ln_attn, L.ln_mlp) for t in (n.w, n.b) if t is not None]
            if any(t.dtype != torch.float32 for t in norms):
                return None
        stack = torch.classes.tritonlm.DecoderStack(self.heads)
        for L in self.layers:
            for p in (L.qkv, L.o, L.gate_up if act == "silu_mul" else L.fc, L.down):
                if p.blocked is not None:
                    stack.add_float(p.blocked, p.b)
                else:
                    stack.add_int8(p.packed, p.smooth, p.b, _REDUCE_RANGE)
            a, m = L.ln_attn, L.ln_mlp
            stack.add_layer(a.w, a.b, a.eps, m.w, m.b, m.eps, rms, act, L.attn_scale)
        return stack

    def _context(self, plan: ForwardBatch, pool: KVPool) -> StepContext:
        rope = None
        if self.inv_freq is not None:
            rope = rope_cos_sin(plan.positions, self.inv_freq, self.rope_scaling, self.dtype)
        if self.paged_kernel and plan.width <= PAGED_KERNEL_MAX_WIDTH and pool.k[0].dtype == torch.float32:
            return StepContext(plan=plan, mask=None, rows=None, k_buf=None, v_buf=None, rope=rope, kernel=True,
                               slot_table=plan.slot_table.contiguous())
        shape = (plan.batch_size, self.kv_heads, plan.max_total, self.spec.head_dim)  # [B, Hkv, L, D]
        return StepContext(
            plan=plan,
            mask=plan.key_mask().unsqueeze(1),
            rows=kv_rows(plan.slot_table, self.kv_heads),
            k_buf=self.workspace.take("k", shape, pool.k[0].dtype, self.device),
            v_buf=self.workspace.take("v", shape, pool.v[0].dtype, self.device),
            rope=rope,
            packed=plan.packed,
        )

    def self_attention(self, x: torch.Tensor, layer: Layer, li: int, ctx: StepContext, pool: KVPool) -> torch.Tensor:
        """x [B, T, C] -> [B, T, heads*D], before the out-projection; packed (ctx.packed):
        x [N, C] -> [N, heads*D], only attention itself sees the padded [B, T] layout."""
        d = self.spec.head_dim
        qkv = layer.qkv(x)  # [B, T, (H + 2 Hkv) D] or [N, (H + 2 Hkv) D]
        if ctx.kernel:  # RoPE, the K/V write and attention read in place through the slot table: one op
            cos, sin = ctx.rope if ctx.rope is not None else (None, None)
            return torch.ops.tritonlm.paged_attention_qkv(
                qkv.contiguous(), pool.k[li], pool.v[li], ctx.plan.write_slots, ctx.slot_table, ctx.plan.positions,
                cos, sin, self.heads, layer.attn_scale)
        bsz, width = ctx.plan.batch_size, ctx.plan.width
        if ctx.packed is not None:  # zeros at the padding: finite keys and values, written to scratch only
            qkv = qkv.new_zeros(bsz * width, qkv.shape[-1]).index_copy_(0, ctx.packed, qkv)
        qkv = qkv.view(bsz, width, -1)
        qk_width = (self.heads + self.kv_heads) * d
        qk = qkv[..., :qk_width].view(bsz, width, self.heads + self.kv_heads, d)  # [B, T, H + Hkv, D]
        if ctx.rope is not None:  # q and k rotated in one pass (half the small ops of two)
            qk = apply_rope(qk, *ctx.rope)
        q, k = qk.split([self.heads, self.kv_heads], dim=2)  # [B, T, H, D], [B, T, Hkv, D]
        v = qkv[..., qk_width:].view(bsz, width, self.kv_heads, d)  # [B, T, Hkv, D]
        out = paged_attention(q, k, v, pool.k[li], pool.v[li], ctx, layer.attn_scale)  # [B, T, H*D]
        if ctx.packed is None:
            return out
        return out.view(bsz * width, -1).index_select(0, ctx.packed)  # [N, H*D]

    def mlp_inner(self, x: torch.Tensor, layer: Layer) -> torch.Tensor:
        """x [..., C] -> [..., F] ([B, T] or packed [N] rows), everything before the down projection."""
        if layer.fc is not None:
            return self.act(layer.fc(x))
        gate_up = layer.gate_up(x)  # [B, T, 2F]
        if self.paged_kernel and self.act is F.silu and gate_up.dtype == torch.float32:
            return torch.ops.tritonlm.silu_mul(gate_up.contiguous())  # one pass, no [B, T, F] temporaries
        gate, up = gate_up.chunk(2, dim=-1)  # [B, T, F] each
        return self.act(gate) * up

    def _fused_norm(self, norm: Norm, x: torch.Tensor) -> bool:
        return self.paged_kernel and norm.rms and x.dtype == torch.float32 and norm.w.dtype == torch.float32

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
        if ctx.kernel and self.decoder_stack is not None and comm.world == 1:  # every layer in one call
            cos, sin = ctx.rope if ctx.rope is not None else (None, None)
            return torch.ops.tritonlm.decoder_stack(
                self.decoder_stack, x, pool.k, pool.v, plan.write_slots, ctx.slot_table, plan.positions, cos, sin,
                blocked_rows(x.shape[0] * x.shape[1]))
        shape = x.shape
        if ctx.packed is not None:  # [B, T, C] -> [N, C]: the padding never reaches a matmul
            x = x.reshape(-1, shape[-1]).index_select(0, ctx.packed)
        delta = None  # what the last block adds to the residual stream, added with the next norm
        for li, layer in enumerate(self.layers):
            x, h = (x, self.norm(layer.ln_attn, x)) if delta is None else self.add_norm(x, delta, layer.ln_attn)
            delta = row_parallel(layer.o, self.self_attention(h, layer, li, ctx, pool), comm)
            x, h = self.add_norm(x, delta, layer.ln_mlp)
            delta = row_parallel(layer.down, self.mlp_inner(h, layer), comm)
        x = x if delta is None else x + delta
        if ctx.packed is None:
            return x
        return x.new_zeros(shape[0] * shape[1], shape[-1]).index_copy_(0, ctx.packed, x).view(shape)  # [B, T, C]

    def head(self, plan: ForwardBatch, x: torch.Tensor, all_logits: bool) -> torch.Tensor:
        """x [B, T, C] -> float32 logits [B, V'] (last valid token of each row) or [B, T, V']."""
        if not all_logits:
            rows = torch.arange(plan.batch_size, device=x.device)
            x = x[rows, plan.num_new - 1]  # [B, C]: only the rows whose logits are wanted
        return self.lm_head(self.norm(self.ln_f, x)).float()

    @torch.inference_mode()
    def forward(self, plan: ForwardBatch, all_logits: bool, pool: KVPool, comm: Comm = ONE_RANK) -> torch.Tensor | None:
        """Logits (float32, [B, V] or [B, T, V]) on rank 0; None on the other TP ranks."""
        x = self.embed(plan)
        comm.allreduce(x)
        x = self.run_layers(plan, x, pool, comm)
        return comm.gather_cols(self.head(plan, x, all_logits), self.head_widths)
