"""The pieces a transformer layer is made of, as plain tensors and functions.

    projections   one class per weight format, each computing y = x @ W + b through the
                  same call, `apply(x, bias)`: FloatLinear (w [in, out], `x @ w`),
                  BlockedLinear (oneDNN's blocked layout, the CPU float default),
                  Int8Linear (per-output-channel int8, every token's activations quantized
                  alone) and WeightOnlyInt8Linear (int8 weights, activations rounded to 16-bit codes). Slicing and quantization read FloatLinear's plain weights
                  (`Linear.plain`); the other formats are made from it last.
    norms         Norm (LayerNorm or RMSNorm)
    attention     paged_attention: the new K/V written into the pool in place, each row's
                  keys and values gathered through its slot table, SDPA with the key mask
                  (the C++ paged_attention_qkv op does the same in one call for
                  decode-width steps; Transformer.self_attention picks the path)
                  (decode_attention: one query per row on CUDA, the Triton kernel reading
                  the pool in place through the rows' block tables)
    activations   activation(name), gelu_tanh
    Layer         one decoder layer's weights

Shapes: B batch, T new tokens per row (padded width), L keys per row (max past+new),
C hidden, H query heads, Hkv key/value heads, D head_dim, S pool slots.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from functools import partial
from typing import Callable

import torch
import torch.nn.functional as F

from tritonlm.engine.runners.base import ForwardBatch, gather_kv
from tritonlm.engine.runners.families import BlockSpec

# ---------------------------------------------------------------------------- projections


# Dynamic int8 (fbgemm) quantizes activations to uint8 per call. Without VNNI its AVX2
# kernel sums pairs of u8*s8 products in int16 and can saturate, so activations are then
# limited to 7 bits (reduce_range), as torch.ao's dynamic Linear does; VNNI accumulates
# in int32 and keeps all 8. The integer sums are exact in both modes, so a VNNI host forced
# to 7 bits computes what a host without VNNI does: int8_reduce_range() is the one place
# that decides, and TRITONLM_INT8_REDUCE_RANGE overrides it (docs/configuration.md).
# fbgemm's own cap (FBGEMM_ENABLE_INSTRUCTIONS, read by fbgemm at its first call) can keep it
# off VNNI on a CPU that has it: only its AVX512_E1 levels run VNNI; an unknown value caps
# nothing (fbgemm runs the CPU's best).
FBGEMM_ISA_ENV = "FBGEMM_ENABLE_INSTRUCTIONS"
FBGEMM_NON_VNNI = ("AVX2", "AVX512", "AVX512_256")


def _fbgemm_runs_vnni() -> bool:
    """fbgemm's int8 kernel runs VNNI here: the CPU has it and FBGEMM_ENABLE_INSTRUCTIONS does not cap it below."""
    cpu = bool(hasattr(torch.cpu, "_is_vnni_supported") and torch.cpu._is_vnni_supported())
    return cpu and os.environ.get(FBGEMM_ISA_ENV, "").upper() not in FBGEMM_NON_VNNI


INT8_VNNI = _fbgemm_runs_vnni()
INT8_REDUCE_RANGE_ENV = "TRITONLM_INT8_REDUCE_RANGE"


def int8_reduce_range() -> bool:
    """Whether int8 activations are quantized to 7 bits (True) or 8 (False): the CPU decides
    (8 with VNNI), unless TRITONLM_INT8_REDUCE_RANGE is 1 (7 bits) or 0 (8 bits). Read at
    the making of each int8 projection (Int8Linear.reduce_range; a DecoderStack takes the
    projection's), so a test can switch modes between models. 8 bits without VNNI is refused: fbgemm's kernel would saturate, silently."""
    value = os.environ.get(INT8_REDUCE_RANGE_ENV, "").strip()
    if not value:
        return not INT8_VNNI
    if value not in ("0", "1"):
        raise ValueError(f"{INT8_REDUCE_RANGE_ENV}={value!r}: 1 (7-bit int8 activations), "
                         "0 (8-bit, CPUs with VNNI only) or unset (chosen by the CPU)")
    if value == "0" and not INT8_VNNI:
        raise ValueError(f"{INT8_REDUCE_RANGE_ENV}=0: fbgemm's int8 kernel runs without VNNI here (the CPU "
                         f"lacks it, or {FBGEMM_ISA_ENV} caps it), where it saturates with 8-bit activations; "
                         "use 1 or leave it unset")
    return value == "1"


# The kernel an int8 projection runs when tritonlm's C++ ops are built: tritonlm's own,
# kernels/int8_act8.cpp's i8_linear, by default. It keeps all 8 bits of the activations on
# every x86 level (no pair of its u8 x s8 products can saturate) and gives the same bits on
# each, so an int8 model answers alike on every CPU; it is also the faster of the two
# (docs/benchmarks.md, "int8 kernel: tritonlm's by default"). fbgemm's (above: 8-bit
# activations with VNNI only) stays a choice.
INT8_KERNEL_ENV = "TRITONLM_INT8_KERNEL"


def int8_kernel() -> str:
    """'fbgemm' or 'tritonlm': TRITONLM_INT8_KERNEL, or 'tritonlm' when unset."""
    value = os.environ.get(INT8_KERNEL_ENV, "").strip()
    if not value:
        return "tritonlm"
    if value not in ("fbgemm", "tritonlm"):
        raise ValueError(f"{INT8_KERNEL_ENV}={value!r}: tritonlm (the default: 8-bit activations on every x86 CPU), "
                         "fbgemm (PyTorch's dynamic int8 linear) or unset")
    return value


def i8_path(isa: str = "auto") -> str:
    """Which i8_linear path a projection of Act8Panels.isa runs, for logs and `tritonlm doctor`:
    the one named, or for "auto" the best this build has here; with AMX, "auto" runs it for
    calls of several rows (prefill chunks, batched decode steps) and the best vector path for
    a few (one stream's decode step), so both are named. A CPU with AMX whose tiles go
    unused (a lower build, Linux refusing the tile state) is told why."""
    if isa != "auto":
        return isa
    paths = torch.ops.tritonlm.i8_isas()
    if paths[0] == "amx":
        return f"amx (batches, prefill) and {paths[1]} (a few rows)"
    from tritonlm.engine.kernels.isa import cpu_flags

    if {"amx_tile", "amx_int8"} <= cpu_flags():
        return f"{paths[0]} (this CPU's AMX unused: {torch.ops.tritonlm.i8_amx_refusal()})"
    return paths[0]


BLOCKED_DTYPES = (torch.float32, torch.bfloat16)  # what oneDNN's prepacked linear runs on any x86 CPU


def blocked_rows(rows: int) -> int:
    """The row count a blocked matmul runs with: `rows` rounded up to a bucket.

    oneDNN compiles kernels per matmul shape, the row count included, and keeps them beyond
    its primitive cache's reach, while a server sees every row count from 1 to its token
    budget (batch sizes, prefill chunks): buckets bound the shapes a process ever compiles,
    and cost little, as small-M steps are bound by streaming the weights, not by the rows
    (docs/performance-notes.md, "The decode step").
        1-8 exact, then multiples of 8 to 64, of 16 to 256, of 64 to 1024, of 256 beyond."""
    for limit, step in ((8, 1), (64, 8), (256, 16), (1024, 64)):
        if rows <= limit:
            return -(-rows // step) * step
    return -(-rows // 256) * 256


def owned_copy(t: torch.Tensor | None) -> torch.Tensor | None:
    """A contiguous copy (never a view: the full model's storage must be freeable)."""
    return None if t is None else t.clone(memory_format=torch.contiguous_format)


class PinnedRows:
    """Int8Linear's input buffers: [>= 1 + rows, in], row 0 pinned to (1, -1, 0, ...). One
    per input width, shared by all of a model's int8 projections (they run one at a time),
    so a wide prefill chunk costs one buffer per width, not one per projection."""

    def __init__(self) -> None:
        self._bufs: dict[int, torch.Tensor] = {}

    def take(self, rows: int, width: int) -> torch.Tensor:
        buf = self._bufs.get(width)
        if buf is None or buf.shape[0] < rows + 1:
            buf = torch.zeros(max(rows + 1, 0 if buf is None else buf.shape[0] * 3 // 2), width)
            buf[0, 0], buf[0, 1] = 1.0, -1.0
            self._bufs[width] = buf
        return buf


class Linear:
    """y = x @ W + b in one weight format. `apply(x, bias)` is the format's matmul, adding
    `bias` when given (inside the kernel where it can); calling the projection adds its own
    bias, `matmul` none (a row-parallel projection adds it once, after the all-reduce)."""

    b: torch.Tensor | None  # [out]

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:  # [..., in] -> [..., out]
        raise NotImplementedError

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        return self.apply(x, self.b)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out], no bias
        return self.apply(x, None)

    def plain(self) -> "FloatLinear":
        """The plain float weights that slicing and quantization read; ValueError, saying why,
        for formats that no longer hold them."""
        raise NotImplementedError

    def opaque_weight(self) -> tuple[object, int] | None:
        """(the weight object, its bytes) when it is not a tensor with storage of its own
        (prepacked formats), for memory accounting; None when its tensors can be measured."""
        return None


@dataclass(eq=False)
class FloatLinear(Linear):
    """w stored [in, out], contiguous (GPT-2's Conv1D layout; nn.Linear weights are
    transposed once at load, as `x @ w.t()` through a view is slower on the CPU)."""

    w: torch.Tensor  # [in, out]
    b: torch.Tensor | None  # [out]

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = x @ self.w
        return y if bias is None else y + bias

    def plain(self) -> "FloatLinear":
        return self


@dataclass(eq=False)
class BlockedLinear(Linear):
    """The float weight reordered once into oneDNN's blocked layout (what inductor's CPU
    weight prepacking does): a decode step streams every weight from memory, and the blocked
    kernel streams it faster than `x @ w` does (docs/performance-notes.md, "The decode step").
    Rows are padded to a bucket (blocked_rows)."""

    blocked: torch.Tensor  # opaque oneDNN tensor holding [out, in]
    b: torch.Tensor | None  # [out]
    nbytes: int  # of `blocked` (an opaque tensor: no storage to measure)

    @staticmethod
    def from_float(p: Linear) -> "BlockedLinear":
        """p's weights blocked, the same values up to summation order; no [in, out] copy is kept."""
        p = p.plain()
        w = p.w.t().contiguous()  # [out, in]
        blocked = torch.ops.mkldnn._reorder_linear_weight(w, None)  # None: any batch size
        return BlockedLinear(blocked, owned_copy(p.b), w.numel() * w.element_size())

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])  # [M, in]
        rows = flat.shape[0]
        padded = blocked_rows(rows)
        if padded != rows:  # zero rows up to the bucket; their outputs are dropped
            flat = F.pad(flat, (0, 0, 0, padded - rows))
        y = torch.ops.mkldnn._linear_pointwise(flat, self.blocked, bias, "none", [], "")  # [M', out]
        return y[:rows].view(*x.shape[:-1], y.shape[-1])

    def plain(self) -> FloatLinear:
        raise ValueError("blocked weights cannot be sliced or quantized: slice or quantize the plain model, then block")

    def opaque_weight(self) -> tuple[object, int]:
        return self.blocked, self.nbytes


PANEL_LANES = 16  # output channels per panel (kLanes of float_panel.cpp and weight_only_int8.cpp)
QUAD = 4  # consecutive inputs of a channel side by side in an int8 panel (kQuad of weight_only_int8.cpp)


def panels_available() -> bool:
    """tritonlm's C++ kernels are built and have the panel kernel (AVX-512 or AVX2 levels)."""
    from tritonlm.engine.kernels import kernels_available

    return kernels_available()[0] and bool(torch.ops.tritonlm.panel_supported())


@dataclass(eq=False)
class PanelLinear(Linear):
    """The float32 weight in 16-wide output panels, [P, in, 16] with panel[p, k, j] =
    W[k, 16 p + j] (zero past `out`), run by tritonlm's panel kernel (float_panel.cpp): each
    panel is one contiguous stream, which small-M steps read at close to the memory's rate,
    and a row's result does not depend on the other rows of its batch."""

    panel: torch.Tensor  # [P, in, 16]
    b: torch.Tensor | None  # [out]
    out: int

    @staticmethod
    def from_float(p: Linear) -> "PanelLinear":
        """p's weights in panels (a new tensor: no [in, out] copy is kept)."""
        p = p.plain()
        w = p.w  # [in, out]
        n_in, out = w.shape
        padded = -(-out // PANEL_LANES) * PANEL_LANES
        w = F.pad(w.to(torch.float32), (0, padded - out))  # [in, P * 16]
        panel = w.view(n_in, padded // PANEL_LANES, PANEL_LANES).transpose(0, 1).contiguous()  # [P, in, 16]
        return PanelLinear(panel, owned_copy(p.b), out)

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return torch.ops.tritonlm.panel_linear(x, self.panel, bias, self.out)

    def plain(self) -> FloatLinear:
        raise ValueError("panel weights cannot be sliced or quantized: slice or quantize the plain model, then pack")


@dataclass(eq=False)
class Act8Panels:
    """Int8Linear's weights for torch.ops.tritonlm.i8_linear (kernels/int8_act8.cpp): the same
    int8 codes, 16 output channels per panel, 4 consecutive inputs together:
    panel[p, k // 4, j, k % 4] = w[16 p + j, k], zero past `out` and past the input width."""

    panel: torch.Tensor  # [P, in4, 16, 4] int8, codes in [-127, 127]
    wscale: torch.Tensor  # [P * 16] float32, zero past `out`
    out: int
    isa: str = "auto"  # the kernel's path: auto (the best this build has) or one of i8_isas(); a decoder stack reads it when built


@dataclass(eq=False)
class Int8Linear(Linear):
    """Per-output-channel int8 weights prepacked for PyTorch's dynamic quantized linear
    (fbgemm), float32 activations quantized per token; b stays float, outside the pack.
    use_act8() moves the weights to tritonlm's own kernel instead (`act8`)."""

    packed: object  # torch.ops.quantized LinearPackedParams (int8 [out, in] + scales)
    b: torch.Tensor | None  # [out]
    nbytes: int  # of `packed` (opaque: no storage to measure)
    in_features: int  # the pinned row's width
    smooth: torch.Tensor | None = None  # [in] 1/s of SmoothQuant's migration, when not folded upstream
    pinned: PinnedRows = field(default_factory=PinnedRows, repr=False)  # shared by the model's int8 projections
    cpp_op: bool = False  # through torch.ops.tritonlm.int8_linear (scaling, kernel, rescale, bias: one op)
    # 7-bit activations (int8_reduce_range), decided once when the projection is made: not
    # an environment read in every call of the hot path
    reduce_range: bool = field(default_factory=lambda: int8_reduce_range())
    act8: Act8Panels | None = None  # set by use_act8: then `packed` is None

    @staticmethod
    def from_float(w: torch.Tensor, b: torch.Tensor | None, smooth: torch.Tensor | None = None) -> "Int8Linear":
        """w [in, out] float32 quantized symmetrically, one scale per output channel
        (max |w| of the channel / 127). smooth [in]: what x is multiplied by first, at run time."""
        w = w.t().contiguous()  # [out, in]
        scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12).double()  # [out]
        zero = torch.zeros(w.shape[0], dtype=torch.long)
        with warnings.catch_warnings():  # quantized tensor creation warns of deprecation; the kernel needs it
            warnings.simplefilter("ignore")
            q = torch.quantize_per_channel(w, scale, zero, 0, torch.qint8)
            packed = torch.ops.quantized.linear_prepack(q, None)
        return Int8Linear(packed, owned_copy(b), w.numel() + 8 * w.shape[0], w.shape[1], smooth=smooth)

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:  # [..., in] -> [..., out]
        # The kernel quantizes its whole input with one range (min..max of the tensor), so
        # one row's outliers would coarsen every other row's, and a request's output would
        # depend on what shares its batch. Each row is scaled to max |x| = 1 and a pinned
        # row (1, -1, 0, ...) fixes the range to [-1, 1]: every token is quantized alone,
        # the same in any batch. The pinned row is row 0 of a reused buffer, the scaled rows
        # are written after it (no concatenation). [M, in] -> [1 + M, in] -> [M, out]
        # SmoothQuant's division where it could not be folded upstream is applied here too.
        # With the C++ ops (`cpp_op`) all of it, the rescale and the bias are one op.
        flat = x.reshape(-1, x.shape[-1])
        if self.act8 is not None:  # each row quantized alone inside the op: no pinned row
            a = self.act8
            flat = flat if self.smooth is None else flat * self.smooth
            y = torch.ops.tritonlm.i8_linear(flat.contiguous(), a.panel, a.wscale, bias, a.out, a.isa)
            return y.view(*x.shape[:-1], a.out)
        rows = flat.shape[0]
        buf = self.pinned.take(rows, self.in_features)
        if self.cpp_op:
            y = torch.ops.tritonlm.int8_linear(flat.contiguous(), self.smooth, bias, self.packed, buf, self.reduce_range)
            return y.view(*x.shape[:-1], y.shape[-1])
        if self.smooth is not None:
            flat = flat * self.smooth
        scale = flat.abs().amax(dim=-1, keepdim=True).clamp_(min=1e-30)  # [M, 1] (faster than vector_norm(inf))
        torch.div(flat, scale, out=buf[1 : rows + 1])
        y = torch.ops.quantized.linear_dynamic(buf[: rows + 1], self.packed, self.reduce_range)
        y = (y[1:] * scale).view(*x.shape[:-1], y.shape[-1])
        return y if bias is None else y + bias

    def use_act8(self, isa: str = "auto") -> None:
        """Run through tritonlm's int8 kernel (torch.ops.tritonlm.i8_linear, which must be
        loaded) instead of fbgemm's: activations quantized per token, symmetrically, to 8 bits
        (s = max |x| / 127) on every x86 level. The weights are fbgemm's codes and scales,
        repacked; fbgemm's pack is dropped."""
        if self.act8 is not None:
            return
        w, _ = self.packed.unpack()  # qint8 [out, in], one scale per output channel
        # from_float's scales are max |w| / 127, so the codes already lie in [-127, 127]; the
        # kernel's no-saturation bound needs that, so a -128 from elsewhere is clamped
        codes = w.int_repr().clamp_(-127, 127)
        out, n = codes.shape
        panels, in4 = -(-out // PANEL_LANES), -(-n // 4)
        buf = torch.zeros(panels * PANEL_LANES, in4 * 4, dtype=torch.int8)
        buf[:out, :n] = codes
        wscale = torch.zeros(panels * PANEL_LANES)
        wscale[:out] = w.q_per_channel_scales().float()
        panel = buf.view(panels, PANEL_LANES, in4, 4).permute(0, 2, 1, 3).contiguous()  # [P, in4, 16, 4]
        self.act8 = Act8Panels(panel, wscale, out, isa)
        self.packed, self.nbytes = None, panel.numel() + 4 * wscale.numel()

    def plain(self) -> FloatLinear:
        raise ValueError("int8 weights cannot be sliced: slice the float model, then quantize each share")

    def opaque_weight(self) -> tuple[object, int]:
        return (self.packed if self.act8 is None else self.act8.panel), self.nbytes


ACT_CODE_MAX = 32767.0  # int8_weight_only's activation codes: 16-bit, symmetric
ACT_CHUNK = 256  # inputs of a group under one activation scale, at most (kernels/weight_only_int8.cpp)


def rounded_activations(x: torch.Tensor, groups: int) -> torch.Tensor:  # [..., in] -> [..., in]
    """x with every input rounded to int8_weight_only's 16-bit codes, as its kernel rounds them:
    per row, per chunk of at most ACT_CHUNK inputs from each group's first, code = round(x /
    max|x| * 32767) times max|x| / 32767; a chunk holding an inf or a NaN becomes NaN."""
    group = x.shape[-1] // groups
    xg = x.reshape(*x.shape[:-1], groups, group)
    out = torch.empty_like(xg)
    for k0 in range(0, group, ACT_CHUNK):
        part = xg[..., k0:k0 + ACT_CHUNK]
        top = part.abs().amax(dim=-1, keepdim=True)
        finite = top.isfinite()
        safe = torch.where(finite & (top > 0), top, torch.ones_like(top))
        codes = torch.round((part / safe * ACT_CODE_MAX).clamp(-ACT_CODE_MAX, ACT_CODE_MAX))
        codes = torch.where(finite & (top > 0), codes, torch.zeros_like(codes))
        scale = torch.where(finite, top / ACT_CODE_MAX, torch.full_like(top, float("nan")))
        out[..., k0:k0 + ACT_CHUNK] = codes * scale
    return out.reshape(x.shape)


@dataclass(eq=False)
class WeightOnlyInt8Linear(Linear):
    """8-bit weight codes with float16 scales and offsets (`dtype: int8_weight_only`):
    y = x @ (q * s + o)^T + b, q in [0, 255], one scale s and one offset o per group of
    consecutive inputs of each output channel (G groups of in / G inputs; G = 1: per channel).
    Stored in 16-wide output panels of quads, four consecutive inputs of a channel side by side
    (the layout int8's i8_linear reads): panel[p, g * Q + t, j, r] = q[16 p + j, g * group +
    4 t + r], Q = ceil(group / 4) quads per group, zero past the group's end and past `out`;
    scale[p, g, j] = s[16 p + j, g] and offset likewise. With the C++ kernels (`cpp_op`) the
    activations are rounded to 16-bit codes (a scale per row and block of at most 256 inputs
    of a group); a decode-sized batch multiplies them with the codes in integer arithmetic, a
    prefill-sized one with the weights widened to float a few panels at a time for the float32
    panel kernel (kernels/weight_only_int8.cpp).
    Without the kernels, the same rounding in torch ops, times a float copy of the weights."""

    panel: torch.Tensor  # [P, G * Q, 16, 4] uint8
    scale: torch.Tensor  # [P, G, 16] float16
    offset: torch.Tensor  # [P, G, 16] float16
    b: torch.Tensor | None  # [out]
    out: int
    inputs: int  # in: the panel's quads may hold padding past it
    cpp_op: bool = False  # through torch.ops.tritonlm.w8_linear

    @staticmethod
    def from_rows(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor,
                  b: torch.Tensor | None) -> "WeightOnlyInt8Linear":
        """q [out, in] uint8, scale and offset [out, G] (stored as float16) into panels."""
        out, inputs = q.shape
        groups = scale.shape[1]
        group = inputs // groups
        quads = -(-group // QUAD)
        pad = -(-out // PANEL_LANES) * PANEL_LANES - out

        def to_panels(rows: torch.Tensor) -> torch.Tensor:  # [out, n] -> [P, n, 16]
            return F.pad(rows, (0, 0, 0, pad)).view(-1, PANEL_LANES, rows.shape[1]).transpose(1, 2).contiguous()

        codes = F.pad(q.reshape(out, groups, group), (0, quads * QUAD - group, 0, 0, 0, pad))  # [out_p, G, Q * 4]
        codes = codes.view(-1, PANEL_LANES, groups * quads, QUAD).transpose(1, 2).contiguous()  # [P, G * Q, 16, 4]
        return WeightOnlyInt8Linear(codes, to_panels(scale.half()), to_panels(offset.half()), b, out, inputs)

    def code_rows(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q [out, in] uint8, scale [out, G] float16, offset [out, G] float16): the weights as
        from_rows took them."""

        def rows(t: torch.Tensor) -> torch.Tensor:
            return t.transpose(1, 2).reshape(-1, t.shape[1])[: self.out]

        groups = self.scale.shape[1]
        group = self.inputs // groups
        codes = self.panel.transpose(1, 2).reshape(-1, groups, self.panel.shape[1] // groups * QUAD)  # [out_p, G, Q * 4]
        return codes[: self.out, :, :group].reshape(self.out, self.inputs), rows(self.scale), rows(self.offset)

    def dequantized(self) -> torch.Tensor:  # [out, in] float32
        q, scale, offset = self.code_rows()
        group = q.shape[1] // scale.shape[1]
        return q.float() * scale.float().repeat_interleave(group, dim=1) + offset.float().repeat_interleave(group, dim=1)

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:  # [..., in] -> [..., out]
        if self.cpp_op:
            return torch.ops.tritonlm.w8_linear(x, self.panel, self.scale, self.offset, bias, self.inputs, self.out,
                                                "auto")
        return F.linear(rounded_activations(x, self.scale.shape[1]), self.dequantized(), bias)

    def plain(self) -> FloatLinear:
        raise ValueError("int8 weights cannot be sliced: slice the float model, then quantize each share")


# ---------------------------------------------------------------------------- norms, activations, a layer


@dataclass
class Norm:
    w: torch.Tensor  # [C]
    b: torch.Tensor | None  # [C] (LayerNorm) / None (RMSNorm)
    eps: float
    rms: bool
    # Gemma's RMSNorm: w holds 1 + the checkpoint's weight, in float32, and multiplies before
    # the cast back to the input dtype (Llama's casts first, then multiplies)
    weight_first: bool = False

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [..., C] -> [..., C]
        if not self.rms:
            return F.layer_norm(x, (x.shape[-1],), self.w, self.b, self.eps)
        if x.dtype == torch.float32 and self.w.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.w, self.eps)  # one kernel, the same math in float32
        # RMSNorm as HF computes it: in float32, back to the input dtype, then the weight
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight_first:
            return (x32 * self.w.float()).to(x.dtype)
        return self.w * x32.to(x.dtype)


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


@dataclass
class Layer:
    ln_attn: Norm
    ln_mlp: Norm
    qkv: Linear  # fused [q | k | v]: [C, (H + 2 Hkv) D], column-parallel under TP
    o: Linear  # [H*D, C] row-parallel under TP
    down: Linear | None  # [F, C] row-parallel under TP; None in a mixture-of-experts layer
    # GPT-2: fc [C, F] -> act; Llama: act(gate(x)) * up(x) with gate | up fused: [C, 2F]
    fc: Linear | None = None
    gate_up: Linear | None = None
    attn_scale: float = 1.0
    # what the config asks of this layer's attention beyond Llama's (runners.families.BlockSpec),
    # and the q/k norms when block.qk_norm is "per_head": weights [D], shared by every head
    block: BlockSpec = BlockSpec()
    q_norm: Norm | None = None
    k_norm: Norm | None = None
    # block.moe: the MLP is a runners.moe.MoE (router + experts) instead of gate_up / down
    moe: object | None = None
    # block.norm "sandwich" (Gemma 2 / 3): the attention's and the MLP's outputs normed before
    # the residual add, besides ln_attn / ln_mlp on their inputs
    post_attn: Norm | None = None
    post_mlp: Norm | None = None
    # attention sinks (gpt-oss): [H] float32, a learned logit per query head that joins each
    # softmax's denominator and weighs no value; the attention kernels take it per call
    sinks: torch.Tensor | None = None


PROJECTION_NAMES = ("qkv", "o", "down", "fc", "gate_up")  # a Layer's projection fields


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
    # {BlockSpec.rope_table: cos, sin [B, T, 1, D]} for models with a RoPE table per layer type (Gemma 3)
    ropes: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # gather path, sliding-window layers: {window: [B, 1, T, L] mask}, `mask` with only the
    # keys at positions p - window < j <= p of each query's p (transformers' sliding_window_overlay)
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)
    kernel: bool = False  # torch.ops.tritonlm.paged_attention_qkv reads the pool directly
    slot_table: torch.Tensor | None = None  # [B, L] int64 contiguous, for the kernel
    # gather path, padded batch: [N] plan.packed, the valid tokens' rows of [B*T]; the
    # layers' row-wise work runs on those N rows, attention on the padded [B, T] layout
    packed: torch.Tensor | None = None
    # decode step on CUDA: the Triton kernel (kernels.paged_decode) reads the pool in place
    # through plan.block_table; no gather, no mask
    triton: bool = False


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
    mask: torch.Tensor | None = None,  # [B, 1, T, L] instead of ctx.mask (a sliding window's)
    softcap: float | None = None,  # attention logits c * tanh(s / c) (Gemma 2): SDPA has no such step
    sinks: torch.Tensor | None = None,  # [H] attention sinks (gpt-oss): nor this one
) -> torch.Tensor:  # [B, T, H*D]
    bsz = q.shape[0]
    mask = ctx.mask if mask is None else mask
    explicit = softcap is not None or sinks is not None
    attend = F.scaled_dot_product_attention if not explicit else partial(softcapped_attention, softcap=softcap)
    write_kv(k_cache, ctx.plan.write_slots, k)
    write_kv(v_cache, ctx.plan.write_slots, v)
    keys = gather_kv(k_cache, ctx.rows, bsz, out=ctx.k_buf).to(q.dtype)  # [B, Hkv, L, D]
    values = gather_kv(v_cache, ctx.rows, bsz, out=ctx.v_buf).to(q.dtype)  # [B, Hkv, L, D]
    _, width, heads, dim = q.shape
    kv_heads = k.shape[2]
    group = heads // kv_heads
    sink = {} if sinks is None else {"sinks": sink_rows(sinks, kv_heads, width)}
    if group == 1:
        out = attend(q.transpose(1, 2), keys, values, attn_mask=mask, scale=scale, **sink)
        return out.transpose(1, 2).reshape(bsz, width, heads * dim)  # [B, H, T, D] -> [B, T, H*D]
    # GQA: the `group` query heads that share a kv head become query rows of that head
    # (query head h reads kv head h // group), so each key block is loaded once per kv
    # head, not once per query head. [B, T, Hkv, G, D] -> [B, Hkv, G*T, D]; the mask
    # [B, 1, T, L] repeats over the group: [B, 1, G*T, L].
    q_rows = q.view(bsz, width, kv_heads, group, dim).permute(0, 2, 3, 1, 4).reshape(bsz, kv_heads, group * width, dim)
    mask = mask if width == 1 else mask.unsqueeze(2).expand(-1, -1, group, -1, -1).reshape(bsz, 1, group * width, -1)
    out = attend(q_rows, keys, values, attn_mask=mask, scale=scale, **sink)  # [B, Hkv, G*T, D]
    return out.view(bsz, kv_heads, group, width, dim).permute(0, 3, 1, 2, 4).reshape(bsz, width, heads * dim)


def softcapped_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, attn_mask: torch.Tensor,
                         scale: float, softcap: float | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """SDPA with the logits soft-capped and / or attention sinks, as transformers' eager
    attention computes them: scaled q.k, then c * tanh(s / c), the mask, a float32 softmax
    (with each row's sink logit appended, its probability dropped after) back to q's dtype,
    times v. q [B, h, M, D], keys / values [B, h, L, D], attn_mask [B, 1, M, L] bool,
    sinks [1, h, M, 1] (sink_rows) -> [B, h, M, D]."""
    scores = torch.matmul(q, keys.transpose(-1, -2)) * scale  # [B, h, M, L]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~attn_mask, float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    else:  # [B, h, M, L + 1] -> the keys' share of each softmax
        sink = sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1, dtype=torch.float32)[..., :-1]
    return torch.matmul(probs.to(q.dtype), values)


def sink_rows(sinks: torch.Tensor, kv_heads: int, width: int) -> torch.Tensor:
    """sinks [H] laid out as paged_attention's query rows: [1, Hkv, G*T, 1], row g*T + t of kv
    head k holding query head k*G + g's sink (G = H / Hkv; G = 1: [1, H, T, 1])."""
    group = sinks.shape[0] // kv_heads
    return sinks.view(kv_heads, group, 1).expand(kv_heads, group, width).reshape(1, kv_heads, group * width, 1)


def decode_attention(
    q: torch.Tensor,  # [B, 1, H, D]
    k: torch.Tensor,  # [B, 1, Hkv, D]
    v: torch.Tensor,  # [B, 1, Hkv, D]
    k_cache: torch.Tensor,  # [S, Hkv, D]
    v_cache: torch.Tensor,  # [S, Hkv, D]
    ctx: StepContext,
    scale: float,
    window: int | None = None,  # the layer's sliding window (BlockSpec.sliding_window)
    softcap: float | None = None,  # attention logits c * tanh(s / c) (BlockSpec.softcap)
    sinks: torch.Tensor | None = None,  # [H] attention sinks (Layer.sinks)
) -> torch.Tensor:  # [B, 1, H*D]
    """A decode step's attention without copying K/V out of the pool: the new token's K/V
    written in place, then the paged kernel over each row's blocks (only a window's keys
    with a window). No host read, so the step can be captured in a CUDA graph; both are
    custom ops (kernels.torch_ops), so torch.compile can take the rest of the step around them."""
    from tritonlm.engine.kernels import torch_ops  # noqa: F401 - registers torch.ops.tritonlm_gpu

    plan = ctx.plan
    torch.ops.tritonlm_gpu.write_kv(k_cache, plan.write_slots, k)
    torch.ops.tritonlm_gpu.write_kv(v_cache, plan.write_slots, v)
    bsz, _, heads, dim = q.shape
    out = torch.ops.tritonlm_gpu.paged_decode(
        q.reshape(bsz, heads, dim).contiguous(), k_cache, v_cache, plan.block_table, plan.seq_lens, plan.block_size, scale,
        window or 0, softcap or 0.0, sinks,
    )  # [B, H, D]
    return out.view(bsz, 1, heads * dim)
