"""tritonlm/engine/kernels/weight_only_int8.cpp: w8_linear (int8 weights, float32 activations)
against torch's float64 matmul over the dequantized weights, on every instruction-set path
this CPU runs, and its refusals."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def ops():
    from tritonlm.engine.kernels import kernels_available

    assert kernels_available() == (True, "built for this CPU")
    return torch.ops.tritonlm


def reference(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, in], w [out, in] int8, scale [out, G] (each covering in / G inputs) -> [M, out] in float64."""
    per_input = scale.double().repeat_interleave(w.shape[1] // scale.shape[1], dim=1)  # [out, in]
    y = x.double() @ (w.double() * per_input).t()  # [M, out]
    return (y if bias is None else y + bias.double()).float()


@pytest.mark.parametrize("out_features, in_features, groups",
                         [(96, 64, 1), (13, 37, 1), (40, 576, 1), (7, 15, 1), (260, 100, 1), (96, 64, 4), (21, 576, 9),
                          (13, 96, 3)],
                         ids=["aligned", "odd", "wide", "tiny", "ragged-blocks", "groups-of-16", "groups-of-64",
                              "groups-of-32-odd-outputs"])
def test_w8_linear_equals_the_dequantized_matmul_on_every_path(ops, out_features, in_features, groups):
    """Every path the CPU has (w8_isas: AVX-512, AVX2, scalar), row counts on both sides of
    the direct kernel's limit (64; above it the weights are widened once for a GEMM), odd
    widths that leave tails after the vector body and output channels that do not fill a
    block of 4; one scale per output channel (groups 1) or per group of inputs. Within float32 summation error of the float64 reference; a row's result is
    the same bits alone and inside a batch (the direct kernel sums in one order)."""
    g = torch.Generator().manual_seed(out_features * 1000 + in_features)
    w = torch.randint(-127, 128, (out_features, in_features), dtype=torch.int8, generator=g)
    scale = torch.rand(out_features, groups, generator=g) * 0.02 + 1e-3
    bias = torch.randn(out_features, generator=g)
    isas = ops.w8_isas()
    assert isas[-1] == "scalar" and set(isas) <= {"avx512", "avx2", "scalar"}
    for rows in (1, 2, 3, 5, 37, 64, 65):
        x = torch.randn(rows, in_features, generator=g)
        for b in (bias, None):
            want = reference(x, w, scale, b)
            tol = 2e-5 * in_features ** 0.5 * want.abs().max().item() + 1e-5
            for isa in [*isas, "auto"]:
                got = ops.w8_linear(x, w, scale, b, isa)
                assert got.shape == (rows, out_features) and got.dtype == torch.float32
                err = (got - want).abs().max().item()
                assert err <= tol, f"{isa}, {rows} rows: max error {err:.3g} > {tol:.3g}"
    x = torch.randn(5, in_features, generator=g)
    for isa in isas:
        batch = ops.w8_linear(x, w, scale, bias, isa)
        alone = ops.w8_linear(x[3:4].clone(), w, scale, bias, isa)
        assert torch.equal(batch[3:4], alone), isa
    x3 = torch.randn(2, 3, in_features, generator=g)  # [..., in] keeps its leading shape
    assert ops.w8_linear(x3, w, scale, bias, "auto").shape == (2, 3, out_features)


def test_w8_linear_refuses_bad_inputs_naming_them(ops):
    w = torch.zeros(8, 16, dtype=torch.int8)
    scale, x = torch.ones(8, 1), torch.ones(2, 16)
    with pytest.raises(RuntimeError, match="isa 'neon' is not one of auto, avx512, avx2, scalar"):
        ops.w8_linear(x, w, scale, None, "neon")
    missing = [isa for isa in ("avx512", "avx2") if isa not in ops.w8_isas()]
    for isa in missing:  # a path the CPU lacks is refused, never run
        with pytest.raises(RuntimeError, match=f"isa '{isa}' is not supported by this CPU"):
            ops.w8_linear(x, w, scale, None, isa)
    with pytest.raises(RuntimeError, match="x's rows have 15 values; w takes 16"):
        ops.w8_linear(torch.ones(2, 15), w, scale, None, "auto")
    with pytest.raises(RuntimeError, match="w must be a contiguous int8 CPU tensor"):
        ops.w8_linear(x, w.float(), scale, None, "auto")
    with pytest.raises(RuntimeError, match=r"scale must be a contiguous float32 CPU tensor \[8, groups\]"):
        ops.w8_linear(x, w, torch.ones(7, 1), None, "auto")
    with pytest.raises(RuntimeError, match="the 16 inputs must split into groups of a multiple of 16"):
        ops.w8_linear(x, w, torch.ones(8, 2), None, "auto")
    with pytest.raises(RuntimeError, match="bias must be a contiguous float32 CPU tensor of 8 values"):
        ops.w8_linear(x, w, scale, torch.ones(9), "auto")
