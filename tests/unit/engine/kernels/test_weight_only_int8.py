"""tritonlm/engine/kernels/weight_only_int8.cpp: w8_linear (8-bit weight codes in 16-wide output
panels with float16 scales and offsets, float32 activations) against torch's float64 matmul over the dequantized weights, on
every instruction-set path this CPU runs, and its refusals."""

from __future__ import annotations

import pytest
import torch

from tritonlm.engine.runners.layers import WeightOnlyInt8Linear


@pytest.fixture(scope="module")
def ops():
    from tritonlm.engine.kernels import kernels_available

    assert kernels_available()[0]
    return torch.ops.tritonlm


def reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, in], q [out, in] uint8, scale and offset [out, G] float16 (each covering in / G
    inputs) -> [M, out] in float64."""
    group = q.shape[1] // scale.shape[1]
    weights = q.double() * scale.double().repeat_interleave(group, dim=1) + offset.double().repeat_interleave(group, dim=1)
    y = x.double() @ weights.t()  # [M, out]
    return (y if bias is None else y + bias.double()).float()


def packed(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor):
    """q [out, in] uint8, scale and offset [out, G] float16 -> (panel [P, in, 16], scale,
    offset [P, G, 16], out)."""
    p = WeightOnlyInt8Linear.from_rows(q, scale, offset, None)
    assert [t.equal(u) for t, u in zip(p.code_rows(), (q, scale, offset))] == [True] * 3  # the layout round-trips
    return p.panel, p.scale, p.offset, p.out


@pytest.mark.parametrize("out_features, in_features, groups",
                         [(96, 64, 1), (13, 37, 1), (40, 576, 1), (7, 15, 1), (260, 100, 1), (96, 64, 4), (21, 576, 9),
                          (13, 96, 3), (200, 96, 12)],
                         ids=["aligned", "odd", "wide", "tiny", "ragged-panels", "groups-of-16", "groups-of-64",
                              "groups-of-32-odd-outputs", "groups-of-8"])
def test_w8_linear_equals_the_dequantized_matmul_on_every_path(ops, out_features, in_features, groups):
    """Every path the CPU has (w8_isas: AVX-512, AVX2, scalar), row counts on both sides of
    the direct kernel's limit (64; above it the weights are widened once for a GEMM) and of
    its tiles, outputs that do not fill the last panel or a tile of panels; one scale and
    offset per output channel (groups 1) or per group of inputs. Within float32 summation
    error of the float64 reference; a row's result is the same bits alone and inside a
    batch (every tile sums in one order)."""
    g = torch.Generator().manual_seed(out_features * 1000 + in_features)
    w = torch.randint(0, 256, (out_features, in_features), dtype=torch.uint8, generator=g)
    scale = (torch.rand(out_features, groups, generator=g) * 0.02 + 1e-3).half()
    offset = (torch.randn(out_features, groups, generator=g) * 0.5).half()
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
    panel, scale, offset, out = packed(torch.zeros(8, 16, dtype=torch.uint8), torch.ones(8, 1).half(),
                                       torch.zeros(8, 1).half())
    x = torch.ones(2, 16)
    with pytest.raises(RuntimeError, match="isa 'neon' is not one of auto, avx512, avx2, scalar"):
        ops.w8_linear(x, panel, scale, offset, None, out, "neon")
    missing = [isa for isa in ("avx512", "avx2") if isa not in ops.w8_isas()]
    for isa in missing:  # a path the CPU lacks is refused, never run
        with pytest.raises(RuntimeError, match=f"isa '{isa}' is not supported by this CPU"):
            ops.w8_linear(x, panel, scale, offset, None, out, isa)
    with pytest.raises(RuntimeError, match="x's rows have 15 values; the panel takes 16"):
        ops.w8_linear(torch.ones(2, 15), panel, scale, offset, None, out, "auto")
    with pytest.raises(RuntimeError, match=r"panel must be a contiguous uint8 CPU tensor \[P, in, 16\]"):
        ops.w8_linear(x, panel.float(), scale, offset, None, out, "auto")
    with pytest.raises(RuntimeError, match="1 panels cannot hold out=17"):
        ops.w8_linear(x, panel, scale, offset, None, 17, "auto")
    with pytest.raises(RuntimeError, match=r"scale must be a contiguous float16 CPU tensor \[1, groups, 16\]"):
        ops.w8_linear(x, panel, torch.ones(2, 1, 16).half(), offset, None, out, "auto")
    with pytest.raises(RuntimeError, match="the 16 inputs do not split into that many equal groups"):
        ops.w8_linear(x, panel, torch.ones(1, 3, 16).half(), torch.ones(1, 3, 16).half(), None, out, "auto")
    with pytest.raises(RuntimeError, match="bias must be a contiguous float32 CPU tensor of 8 values"):
        ops.w8_linear(x, panel, scale, offset, torch.ones(9), out, "auto")
    with pytest.raises(RuntimeError, match=r"offset must be a contiguous float16 CPU tensor shaped as scale \[1, 1, 16\]"):
        ops.w8_linear(x, panel, scale, torch.ones(1, 2, 16).half(), None, out, "auto")
    with pytest.raises(RuntimeError, match=r"scale must be a contiguous float16 CPU tensor \[1, groups, 16\], not Float"):
        ops.w8_linear(x, panel, scale.float(), offset, None, out, "auto")
