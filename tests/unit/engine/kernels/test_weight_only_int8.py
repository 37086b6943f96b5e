"""tritonlm/engine/kernels/weight_only_int8.cpp: w8_linear (int8 weights in 16-wide output
panels with scales and optional offsets, float32 activations) against torch's float64 matmul over the dequantized weights, on
every instruction-set path this CPU runs, and its refusals."""

from __future__ import annotations

import pytest
import torch

from tritonlm.engine.runners.layers import WeightOnlyInt8Linear


@pytest.fixture(scope="module")
def ops():
    from tritonlm.engine.kernels import kernels_available

    assert kernels_available() == (True, "built for this CPU")
    return torch.ops.tritonlm


def reference(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None,
              bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, in], w [out, in] int8, scale and offset [out, G] (each covering in / G inputs) ->
    [M, out] in float64."""
    group = w.shape[1] // scale.shape[1]
    weights = w.double() * scale.double().repeat_interleave(group, dim=1)  # [out, in]
    if offset is not None:
        weights = weights + offset.double().repeat_interleave(group, dim=1)
    y = x.double() @ weights.t()  # [M, out]
    return (y if bias is None else y + bias.double()).float()


def packed(w: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None = None):
    """w [out, in] int8, scale and offset [out, G] -> (panel [P, in, 16], scale and offset
    [P, G, 16] (offset None without), out)."""
    p = WeightOnlyInt8Linear.from_rows(w, scale, None, offset)
    rows = p.int8_rows()  # the layout round-trips
    assert rows[0].equal(w) and rows[1].equal(scale) and (offset is None) == (rows[2] is None)
    assert offset is None or rows[2].equal(offset)
    return p.panel, p.scale, p.offset, p.out


@pytest.mark.parametrize("out_features, in_features, groups",
                         [(96, 64, 1), (13, 37, 1), (40, 576, 1), (7, 15, 1), (260, 100, 1), (96, 64, 4), (21, 576, 9),
                          (13, 96, 3), (200, 96, 12)],
                         ids=["aligned", "odd", "wide", "tiny", "ragged-panels", "groups-of-16", "groups-of-64",
                              "groups-of-32-odd-outputs", "groups-of-8"])
@pytest.mark.parametrize("with_offset", [True, False], ids=["offsets", "symmetric"])
def test_w8_linear_equals_the_dequantized_matmul_on_every_path(ops, out_features, in_features, groups, with_offset):
    """Every path the CPU has (w8_isas: AVX-512, AVX2, scalar), row counts on both sides of
    the direct kernel's limit (64; above it the weights are widened once for a GEMM) and of
    its tiles, outputs that do not fill the last panel or a tile of panels; one scale (and
    offset) per output channel (groups 1) or per group of inputs. Within float32 summation
    error of the float64 reference; a row's result is the same bits alone and inside a
    batch (every tile sums in one order)."""
    g = torch.Generator().manual_seed(out_features * 1000 + in_features)
    w = torch.randint(-128, 128, (out_features, in_features), dtype=torch.int8, generator=g)
    scale = torch.rand(out_features, groups, generator=g) * 0.02 + 1e-3
    offset = torch.randn(out_features, groups, generator=g) * 0.5 if with_offset else None
    bias = torch.randn(out_features, generator=g)
    panel, panel_scale, panel_offset, out = packed(w, scale, offset)
    isas = ops.w8_isas()
    assert isas[-1] == "scalar" and set(isas) <= {"avx512", "avx2", "scalar"}
    for rows in (1, 2, 3, 5, 7, 13, 37, 64, 65):
        x = torch.randn(rows, in_features, generator=g)
        for b in (bias, None):
            want = reference(x, w, scale, offset, b)
            tol = 2e-5 * in_features ** 0.5 * want.abs().max().item() + 1e-5
            for isa in [*isas, "auto"]:
                got = ops.w8_linear(x, panel, panel_scale, panel_offset, b, out, isa)
                assert got.shape == (rows, out_features) and got.dtype == torch.float32
                err = (got - want).abs().max().item()
                assert err <= tol, f"{isa}, {rows} rows: max error {err:.3g} > {tol:.3g}"
    x = torch.randn(13, in_features, generator=g)
    for isa in isas:
        batch = ops.w8_linear(x, panel, panel_scale, panel_offset, bias, out, isa)
        for r in (0, 3, 12):
            alone = ops.w8_linear(x[r:r + 1].clone(), panel, panel_scale, panel_offset, bias, out, isa)
            assert torch.equal(batch[r:r + 1], alone), (isa, r)
        pair = ops.w8_linear(x[3:5].clone(), panel, panel_scale, panel_offset, bias, out, isa)
        assert torch.equal(batch[3:5], pair), isa
    x3 = torch.randn(2, 3, in_features, generator=g)  # [..., in] keeps its leading shape
    assert ops.w8_linear(x3, panel, panel_scale, panel_offset, bias, out, "auto").shape == (2, 3, out_features)


def test_w8_linear_refuses_bad_inputs_naming_them(ops):
    panel, scale, _, out = packed(torch.zeros(8, 16, dtype=torch.int8), torch.ones(8, 1))
    x = torch.ones(2, 16)
    with pytest.raises(RuntimeError, match="isa 'neon' is not one of auto, avx512, avx2, scalar"):
        ops.w8_linear(x, panel, scale, None, None, out, "neon")
    missing = [isa for isa in ("avx512", "avx2") if isa not in ops.w8_isas()]
    for isa in missing:  # a path the CPU lacks is refused, never run
        with pytest.raises(RuntimeError, match=f"isa '{isa}' is not supported by this CPU"):
            ops.w8_linear(x, panel, scale, None, None, out, isa)
    with pytest.raises(RuntimeError, match="x's rows have 15 values; the panel takes 16"):
        ops.w8_linear(torch.ones(2, 15), panel, scale, None, None, out, "auto")
    with pytest.raises(RuntimeError, match=r"panel must be a contiguous int8 CPU tensor \[P, in, 16\]"):
        ops.w8_linear(x, panel.float(), scale, None, None, out, "auto")
    with pytest.raises(RuntimeError, match="1 panels cannot hold out=17"):
        ops.w8_linear(x, panel, scale, None, None, 17, "auto")
    with pytest.raises(RuntimeError, match=r"scale must be a contiguous float32 CPU tensor \[1, groups, 16\]"):
        ops.w8_linear(x, panel, torch.ones(2, 1, 16), None, None, out, "auto")
    with pytest.raises(RuntimeError, match="the 16 inputs do not split into that many equal groups"):
        ops.w8_linear(x, panel, torch.ones(1, 3, 16), None, None, out, "auto")
    with pytest.raises(RuntimeError, match="bias must be a contiguous float32 CPU tensor of 8 values"):
        ops.w8_linear(x, panel, scale, None, torch.ones(9), out, "auto")
    with pytest.raises(RuntimeError, match=r"offset must be a contiguous float32 CPU tensor shaped as scale \[1, 1, 16\]"):
        ops.w8_linear(x, panel, scale, torch.ones(1, 2, 16), None, out, "auto")
