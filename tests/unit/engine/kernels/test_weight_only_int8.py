"""tritonlm/engine/kernels/weight_only_int8.cpp: w8_linear (8-bit weight codes in 16-wide output
panels with float16 scales and offsets; 16-bit activation codes up to 64 rows) against torch's
float64 matmul over the dequantized weights, on every instruction-set path this CPU runs, and
its refusals."""

from __future__ import annotations

import pytest
import torch

from tritonlm.engine.runners.layers import WeightOnlyInt8Linear


@pytest.fixture(scope="module")
def ops():
    from tritonlm.engine.kernels import kernels_available

    assert kernels_available()[0]
    return torch.ops.tritonlm


def dequantized(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """q [out, in] uint8, scale and offset [out, G] float16 (each covering in / G inputs) ->
    the weights q * s + o, [out, in] float64."""
    group = q.shape[1] // scale.shape[1]
    return q.double() * scale.double().repeat_interleave(group, dim=1) + offset.double().repeat_interleave(group, dim=1)


def reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, in] -> x @ the dequantized weights^T (+ bias) in float64, as float32 [M, out]."""
    y = x.double() @ dequantized(q, scale, offset).t()  # [M, out]
    return (y if bias is None else y + bias.double()).float()


def packed(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor):
    """q [out, in] uint8, scale and offset [out, G] float16 -> (panel [P, G * Q, 16, 4], scale,
    offset [P, G, 16], in, out)."""
    p = WeightOnlyInt8Linear.from_rows(q, scale, offset, None)
    assert [t.equal(u) for t, u in zip(p.code_rows(), (q, scale, offset))] == [True] * 3  # the layout round-trips
    return p.panel, p.scale, p.offset, p.inputs, p.out


def activation_codes(x: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, in] -> (x rounded to the kernel's 16-bit codes, each input's half step), both
    [M, in] float64: per row, per group of in / groups inputs, per chunk of at most 256 inputs
    from the group's first, scale = max|x| / 32767 and code = round(x / max|x| * 32767), in
    float32 as the kernel computes them."""
    rounded, half_step = torch.empty_like(x, dtype=torch.float64), torch.empty_like(x, dtype=torch.float64)
    group = x.shape[1] // groups
    for g in range(groups):
        for k0 in range(g * group, (g + 1) * group, 256):
            chunk = x[:, k0:min(k0 + 256, (g + 1) * group)]
            top = chunk.abs().amax(dim=1, keepdim=True)  # [M, 1] float32
            codes = torch.round((chunk / top.clamp(min=torch.finfo(torch.float32).tiny) * 32767.0).clamp(-32767, 32767))
            scale = top / torch.tensor(32767.0)
            rounded[:, k0:k0 + chunk.shape[1]] = codes.double() * scale.double()
            half_step[:, k0:k0 + chunk.shape[1]] = scale.double().expand_as(chunk) / 2
    return rounded, half_step


@pytest.mark.parametrize("out_features, in_features, groups",
                         [(96, 64, 1), (13, 37, 1), (40, 576, 1), (7, 15, 1), (260, 100, 1), (96, 64, 4), (21, 576, 9),
                          (13, 96, 3), (200, 96, 12), (24, 1536, 1), (9, 30, 5), (16, 6, 3)],
                         ids=["aligned", "odd", "wide", "tiny", "ragged-panels", "groups-of-16", "groups-of-64",
                              "groups-of-32-odd-outputs", "groups-of-8", "chunks-of-256", "groups-of-6",
                              "groups-of-2"])
def test_w8_linear_equals_the_dequantized_matmul_on_every_path(ops, out_features, in_features, groups):
    """Every path the CPU has (w8_isas: AVX-512, AVX2, scalar), row counts on both sides of
    the direct kernel's limit (64; above it the weights are widened to float, for the float32
    panel kernel on the vector paths, in blocks of rows where there are few panels, or for a
    GEMM on scalar) and of its tiles, outputs that do not fill the last panel or a tile of
    panels, groups whose inputs do not fill their last quad or any quad (2 inputs); one
    scale and offset per output channel (groups 1) or
    per group of inputs. The activations are 16-bit codes: the result is the float64 matmul of
    the rounded activations (activation_codes) to float32 summation error on both sides of the
    limit, and within the rounding's own bound (half a step per input times |w|) of the
    float64 matmul of x itself; up to 64 rows the same bits on every path. A row's result is
    the same bits alone and inside a batch, and above 64 rows inside either of two batches
    (the vector paths)."""
    g = torch.Generator().manual_seed(out_features * 1000 + in_features)
    w = torch.randint(0, 256, (out_features, in_features), dtype=torch.uint8, generator=g)
    scale = (torch.rand(out_features, groups, generator=g) * 0.02 + 1e-3).half()
    offset = (torch.randn(out_features, groups, generator=g) * 0.5).half()
    bias = torch.randn(out_features, generator=g)
    panel, panel_scale, panel_offset, inputs, out = packed(w, scale, offset)
    assert inputs == in_features
    weights = dequantized(w, scale, offset)  # [out, in]
    isas = ops.w8_isas()
    assert isas[-1] == "scalar" and set(isas) <= {"avx512", "avx2", "scalar"}
    for rows in (1, 2, 3, 5, 7, 13, 37, 64, 65, 200):
        x = torch.randn(rows, in_features, generator=g) * torch.rand(1, in_features, generator=g) * 4
        rounded, half_step = activation_codes(x, groups)
        for b in (bias, None):
            want = reference(x, w, scale, offset, b)
            tol = 2e-5 * in_features ** 0.5 * want.abs().max().item() + 1e-5
            want_rounded = (rounded @ weights.t() + (0 if b is None else b.double())).float()
            bound = half_step @ weights.abs().t()  # [rows, out]: the rounding's largest effect
            same_bits = None
            for isa in [*isas, "auto"]:
                got = ops.w8_linear(x, panel, panel_scale, panel_offset, b, in_features, out, isa)
                assert got.shape == (rows, out_features) and got.dtype == torch.float32
                err = (got - want_rounded).abs().max().item()
                assert err <= tol, f"{isa}, {rows} rows: max error {err:.3g} from the rounded activations > {tol:.3g}"
                over = (got.double() - want.double()).abs() - bound - tol
                assert over.max().item() <= 0, f"{isa}, {rows} rows: past the 16-bit rounding's bound by {over.max():.3g}"
                if rows > 64:  # widened to float: its own summation order
                    continue
                same_bits = got if same_bits is None else same_bits
                assert torch.equal(got, same_bits), f"{isa}, {rows} rows: other bits than {isas[0]}'s"
    x = torch.randn(13, in_features, generator=g)
    for isa in isas:
        batch = ops.w8_linear(x, panel, panel_scale, panel_offset, bias, in_features, out, isa)
        for r in (0, 3, 12):
            alone = ops.w8_linear(x[r:r + 1].clone(), panel, panel_scale, panel_offset, bias, in_features, out, isa)
            assert torch.equal(batch[r:r + 1], alone), (isa, r)
        pair = ops.w8_linear(x[3:5].clone(), panel, panel_scale, panel_offset, bias, in_features, out, isa)
        assert torch.equal(batch[3:5], pair), isa
        bad = x[:3].clone()
        bad[1, 0] = float("inf")  # not finite in: that row's outputs are NaN, the others untouched
        got = ops.w8_linear(bad, panel, panel_scale, panel_offset, bias, in_features, out, isa)
        assert got[1].isnan().all() and torch.equal(got[[0, 2]], batch[[0, 2]]), isa
    # above 64 rows a row's bits depend on its batch neither (the vector paths run the build's
    # panel kernel, whichever is asked for; blocks of rows differ between these two batches)
    x = torch.randn(200, in_features, generator=g)
    for isa in isas[:-1]:
        batch = ops.w8_linear(x, panel, panel_scale, panel_offset, bias, in_features, out, isa)
        for lo, hi in ((3, 68), (3, 190)):
            part = ops.w8_linear(x[lo:hi].clone(), panel, panel_scale, panel_offset, bias, in_features, out, isa)
            assert torch.equal(batch[lo:hi], part), (isa, lo, hi)
    x3 = torch.randn(2, 3, in_features, generator=g)  # [..., in] keeps its leading shape
    got3 = ops.w8_linear(x3, panel, panel_scale, panel_offset, bias, in_features, out, "auto")
    assert got3.shape == (2, 3, out_features)


def test_w8_linear_rounds_activations_per_chunk_as_designed(ops):
    """A case where the rounding is far larger than float error: in each row one input 10^4
    times the others, its weight 0. The kernel's result equals the matmul of the activations
    as activation_codes rounds them (a scale per chunk of 256 inputs, not per row or group)
    and is far from x's own; on both paths (1 and 65 rows), every ISA, and the torch fallback."""
    out_features, in_features = 40, 512  # one group, two chunks of 256
    g = torch.Generator().manual_seed(3)
    w = torch.randint(0, 256, (out_features, in_features), dtype=torch.uint8, generator=g)
    w[:, 7] = 128  # the large input's weight: 128 * s + o = 0 below
    scale = torch.full((out_features, 1), 0.01).half()
    offset = (-128 * scale.float()).half()
    panel, panel_scale, panel_offset, inputs, out = packed(w, scale, offset)
    weights = dequantized(w, scale, offset)  # [out, in]
    assert weights[:, 7].abs().max() == 0
    for rows in (1, 65):
        x = torch.rand(rows, in_features, generator=g) * 2 - 1
        x[:, 7] = 1e4  # chunk 0's steps become 1e4 / 32767; chunk 1 keeps its own
        rounded, _ = activation_codes(x, 1)
        want_rounded = rounded @ weights.t()
        want = x.double() @ weights.t()
        for isa in ops.w8_isas():
            got = ops.w8_linear(x, panel, panel_scale, panel_offset, None, in_features, out, isa).double()
            tol = 2e-5 * in_features ** 0.5 * want.abs().max().item()
            assert (got - want_rounded).abs().max().item() <= tol, (isa, rows)
            assert (got - want).abs().max().item() > 20 * tol, (isa, rows)  # the rounding shows
            per_row = x.clone()  # one scale for the whole row instead: also far off
            step = 1e4 / 32767
            per_row = torch.round(per_row / step) * step
            assert (got - per_row.double() @ weights.t()).abs().max().item() > 20 * tol, (isa, rows)
        # without the C++ kernels the layer rounds alike in torch ops (layers.rounded_activations)
        fallback = WeightOnlyInt8Linear.from_rows(w, scale, offset, None)
        assert not fallback.cpp_op
        assert (fallback.apply(x, None).double() - want_rounded).abs().max().item() <= tol, rows


def test_w8_linear_refuses_bad_inputs_naming_them(ops):
    panel, scale, offset, inputs, out = packed(torch.zeros(8, 16, dtype=torch.uint8), torch.ones(8, 1).half(),
                                               torch.zeros(8, 1).half())
    x = torch.ones(2, 16)
    with pytest.raises(RuntimeError, match="isa 'neon' is not one of auto, avx512, avx2, scalar"):
        ops.w8_linear(x, panel, scale, offset, None, inputs, out, "neon")
    missing = [isa for isa in ("avx512", "avx2") if isa not in ops.w8_isas()]
    for isa in missing:  # a path the CPU lacks is refused, never run
        with pytest.raises(RuntimeError, match=f"isa '{isa}' is not supported by this CPU"):
            ops.w8_linear(x, panel, scale, offset, None, inputs, out, isa)
    with pytest.raises(RuntimeError, match="x's rows have 15 values; the weights take 16"):
        ops.w8_linear(torch.ones(2, 15), panel, scale, offset, None, inputs, out, "auto")
    with pytest.raises(RuntimeError, match="the panel holds 4 quads of inputs; 1 groups of 12 inputs take 3"):
        ops.w8_linear(torch.ones(2, 12), panel, scale, offset, None, 12, out, "auto")
    with pytest.raises(RuntimeError, match=r"panel must be a contiguous uint8 CPU tensor \[P, groups \* quads per group, 16, 4\]"):
        ops.w8_linear(x, panel.float(), scale, offset, None, inputs, out, "auto")
    with pytest.raises(RuntimeError, match="1 panels cannot hold out=17"):
        ops.w8_linear(x, panel, scale, offset, None, inputs, 17, "auto")
    with pytest.raises(RuntimeError, match=r"scale must be a contiguous float16 CPU tensor \[1, groups, 16\]"):
        ops.w8_linear(x, panel, torch.ones(2, 1, 16).half(), offset, None, inputs, out, "auto")
    with pytest.raises(RuntimeError, match="the 16 inputs do not split into that many equal groups"):
        ops.w8_linear(x, panel, torch.ones(1, 3, 16).half(), torch.ones(1, 3, 16).half(), None, inputs, out, "auto")
    with pytest.raises(RuntimeError, match="bias must be a contiguous float32 CPU tensor of 8 values"):
        ops.w8_linear(x, panel, scale, offset, torch.ones(9), inputs, out, "auto")
    with pytest.raises(RuntimeError, match=r"offset must be a contiguous float16 CPU tensor shaped as scale \[1, 1, 16\]"):
        ops.w8_linear(x, panel, scale, torch.ones(1, 2, 16).half(), None, inputs, out, "auto")
    with pytest.raises(RuntimeError, match=r"scale must be a contiguous float16 CPU tensor \[1, groups, 16\], not Float"):
        ops.w8_linear(x, panel, scale.float(), offset, None, inputs, out, "auto")
