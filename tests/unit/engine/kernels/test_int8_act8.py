"""tritonlm/engine/kernels/int8_act8.cpp: i8_linear (int8 weights x int8 activations with all 8
bits, no saturation without VNNI) against a float64 matmul over the same integer codes, on every
instruction-set path this build has; the same bits on every path and for a row alone or in a
batch; and its refusals."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def ops():
    from tritonlm.engine.kernels import kernels_available

    ok, why = kernels_available()
    assert ok, why
    return torch.ops.tritonlm


def pack(w: torch.Tensor) -> tuple[torch.Tensor, int]:
    """w [out, in] int8 codes in [-127, 127] -> (panel [P, in4, 16, 4], out): 16 outputs per panel,
    4 consecutive inputs of each output together, zero-padded."""
    out, n = w.shape
    panels, in4 = -(-out // 16), -(-n // 4)
    buf = torch.zeros(panels * 16, in4 * 4, dtype=torch.int8)
    buf[:out, :n] = w
    return buf.view(panels, 16, in4, 4).permute(0, 2, 1, 3).contiguous(), out


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The op's activation codes, computed by torch in float32: s = max|row| / 127, q = round(x / s)."""
    m = x.abs().amax(-1, keepdim=True)
    s = torch.where(m > 0, m / 127, torch.ones_like(m))
    return (x * (1 / s)).round().clamp(-127, 127), s


def reference(x, w, wscale, bias) -> torch.Tensor:
    q, s = quantize_rows(x)
    y = (q.double() @ w.double().t()) * (s * wscale).double()
    return y if bias is None else y + bias.double()


@pytest.mark.parametrize("out_features, in_features", [(96, 64), (13, 37), (40, 576), (7, 15), (260, 100)],
                         ids=["aligned", "odd", "wide", "tiny", "ragged-panels"])
def test_i8_linear_equals_the_integer_matmul_on_every_path(ops, out_features, in_features):
    g = torch.Generator().manual_seed(out_features * 1000 + in_features)
    w = torch.randint(-127, 128, (out_features, in_features), dtype=torch.int8, generator=g)
    wscale = torch.rand(out_features, generator=g) * 0.01 + 1e-4
    panel, out = pack(w)
    padded_scale = torch.zeros(panel.shape[0] * 16)
    padded_scale[:out] = wscale
    bias = torch.randn(out, generator=g)
    isas = ops.i8_isas()
    assert isas[-1] == "scalar" and set(isas) <= {"amx", "avx512_vnni", "avx512", "avx2", "scalar"}
    # every remainder of the AVX2 path's 4-row tiles; around "auto"'s first AMX call (4 rows);
    # AMX's blocks of two 16-row tiles: one tile, two, the second one part padding, a block plus one
    for rows in (1, 2, 3, 4, 5, 7, 13, 16, 20, 33, 50, 65):
        # heavy-tailed activations (a few large values per row), one exact zero
        x = torch.randn(rows, in_features, generator=g) * torch.exp(torch.randn(rows, in_features, generator=g))
        x[0, 0] = 0.0
        for b in (bias, None):
            want = reference(x, w, wscale, b)
            got = {isa: ops.i8_linear(x, panel, padded_scale, b, out, isa) for isa in [*isas, "auto"]}
            for isa, y in got.items():
                assert y.shape == (rows, out_features) and y.dtype == torch.float32
                # exact integer sums: the same bits (a -0.0 against a 0.0 would differ here)
                assert torch.equal(y.view(torch.int32), got["scalar"].view(torch.int32)), f"{isa} differs from scalar"
                err = (y.double() - want).abs().max().item()
                assert err <= 1e-6 * want.abs().max().item() + 1e-6, f"{isa}, {rows} rows: max error {err:.3g}"
            for r in (0, rows - 1):
                alone = ops.i8_linear(x[r:r + 1].clone(), panel, padded_scale, b, out, "auto")
                assert torch.equal(alone.view(torch.int32), got["auto"][r:r + 1].view(torch.int32)), r


def test_i8_linear_does_not_saturate_at_full_scale(ops):
    """Every code at +-127 with the weights' signs alike: each pair of products sums to 32258,
    which u8 x s8 pairs in int16 (vpmaddubsw on 8-bit codes) would have saturated."""
    n = 1024
    w = torch.full((16, n), 127, dtype=torch.int8)
    w[8:] = -127
    x = torch.ones(3, n)
    x[1] = -1
    x[2, ::2] = -1
    panel, out = pack(w)
    for isa in ops.i8_isas():
        got = ops.i8_linear(x, panel, torch.ones(16), None, out, isa)
        want = reference(x, w, torch.ones(16), None)
        assert want[0, 0] > 130000 and want[2].abs().max() == 0
        assert ((got.double() - want).abs() <= 1e-6 * want.abs()).all(), isa


@pytest.mark.parametrize("in_features", [7, 32, 70, 577])
def test_i8_linear_quantizes_each_row_as_torch_rounds_it(ops, in_features):
    """Identity weights (code 1, scale 1) make y = q * s: the op's codes and scale, exactly as
    torch computes them in float32 (round half to even, ties included), whether the op's
    vector loop or its scalar tail quantized them."""
    g = torch.Generator().manual_seed(in_features)
    panel, out = pack(torch.eye(in_features, dtype=torch.int8))
    x = torch.randn(5, in_features, generator=g) * 3
    x[1] = (torch.arange(in_features) % 9 - 4) + 0.5  # every code a tie: max |x| is 4.5, so s = 4.5 / 127
    x[1, 0] = 127.0  # s = 1: the ties stay ties, x.5 rounds to the even neighbour
    x[2] = 0.0  # s = 1, every code 0
    q, s = quantize_rows(x)
    for isa in ops.i8_isas():
        assert torch.equal(ops.i8_linear(x, panel, torch.ones(panel.shape[0] * 16), None, out, isa), q * s), isa


def test_i8_linear_refuses_bad_inputs_naming_them(ops):
    panel, out = pack(torch.zeros(8, 16, dtype=torch.int8))
    x, scale = torch.ones(2, 16), torch.ones(16)
    with pytest.raises(RuntimeError, match="isa 'neon' is not one of auto, amx, avx512_vnni, avx512, avx2, scalar"):
        ops.i8_linear(x, panel, scale, None, out, "neon")
    for isa in {"amx", "avx512_vnni", "avx512", "avx2"} - set(ops.i8_isas()):
        with pytest.raises(RuntimeError, match=f"isa '{isa}' is not in this build or not allowed on this CPU"):
            ops.i8_linear(x, panel, scale, None, out, isa)
    with pytest.raises(RuntimeError, match="x's rows have 12 values; the panel takes 16"):
        ops.i8_linear(torch.ones(2, 12), panel, scale, None, out, "auto")
    with pytest.raises(RuntimeError, match="panel must be a contiguous Char CPU tensor"):
        ops.i8_linear(x, panel.float(), scale, None, out, "auto")
    with pytest.raises(RuntimeError, match="1 panels cannot hold out=17"):
        ops.i8_linear(x, panel, scale, None, 17, "auto")
    with pytest.raises(RuntimeError, match="wscale has 8 values; 1 panels need 16"):
        ops.i8_linear(x, panel, torch.ones(8), None, out, "auto")
    with pytest.raises(RuntimeError, match="bias has 5 values; out is 8"):
        ops.i8_linear(x, panel, scale, torch.ones(5), out, "auto")


REFUSED_BY_LINUX = "Linux refused this process the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM: errno "
NO_AMX_BUILD = "this build has no AMX path"  # a lower level, or an AVX-512 VNNI build by an older compiler


def linux_granted_amx_tiles() -> bool:
    """Whether Linux has granted this process AMX's tile state (arch_prctl ARCH_GET_XCOMP_PERM:
    bit 18, XFEATURE_XTILEDATA, of the permitted features); False off x86-64 Linux."""
    import ctypes
    import platform

    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    sys_arch_prctl, get_xcomp_perm, xfeature_xtiledata = 158, 0x1022, 18
    permitted = ctypes.c_ulong(0)
    if libc.syscall(sys_arch_prctl, get_xcomp_perm, ctypes.byref(permitted)) != 0:
        return False
    return bool(permitted.value >> xfeature_xtiledata & 1)


def test_i8_linear_offers_amx_exactly_where_the_cpu_the_build_and_linux_allow_it(ops):
    """The AMX path ships inside the AVX-512 VNNI build (and a -march=native one on such a CPU)
    and asks Linux for the tile state when first listed: on such a build, a CPU with AMX gets
    it exactly when Linux granted it; any other CPU or build never does."""
    from tritonlm.engine.kernels import isa, loaded_build

    paths = ops.i8_isas()  # asks Linux for the tiles where the build and the CPU have AMX
    level = loaded_build().level
    flags = isa.cpu_flags()
    cpu = "amx_int8" in flags and "amx_tile" in flags
    refusal = ops.i8_amx_refusal()
    assert ("amx" in paths) == (refusal == ""), (paths, refusal)  # it runs exactly where nothing refuses it
    if cpu and level in ("avx512_vnni", "native"):
        assert ("amx" in paths) == linux_granted_amx_tiles(), (paths, refusal)
        assert "amx" not in paths or paths[0] == "amx", paths
        assert "amx" in paths or refusal.startswith(REFUSED_BY_LINUX) or refusal.startswith(NO_AMX_BUILD), refusal
    else:
        assert "amx" not in paths, (level, paths)
        # a Linux before 5.16 lists no amx flags though CPUID has them, and refuses the tile state
        assert refusal == "this CPU has no AMX-INT8" or refusal.startswith((NO_AMX_BUILD, REFUSED_BY_LINUX)), refusal


def test_the_int8_path_line_says_why_this_cpus_amx_goes_unused(ops):
    """i8_path() (the startup log's and `tritonlm doctor`'s words): both paths where AMX runs;
    where the CPU has AMX but this build or Linux leaves it unused (every lower level forced on
    an AMX CPU), the reason; elsewhere the one path."""
    from tritonlm.engine.kernels import isa
    from tritonlm.engine.runners.layers import i8_path

    paths, text = ops.i8_isas(), i8_path()
    if paths[0] == "amx":
        assert text == f"amx (batches, prefill) and {paths[1]} (a few rows)"
    elif {"amx_tile", "amx_int8"} <= isa.cpu_flags():
        assert ops.i8_amx_refusal() and text == f"{paths[0]} (this CPU's AMX unused: {ops.i8_amx_refusal()})"
    else:
        assert text == paths[0]
