"""tritonlm/engine/kernels/isa.py and the loader's dispatch (kernels/__init__.py): which prebuilt
ISA level a CPU gets for its flags, a forced level refused by name where the CPU lacks it, and
every level this host runs, forced in its own process (one build per process), passing the
kernels' own correctness checks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tritonlm.engine.kernels import isa

ROOT = Path(__file__).resolve().parents[4]

# /proc/cpuinfo flags of real CPUs, trimmed to what the levels look at (and some they do not)
BASE = {"fpu", "sse", "sse2", "cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3"}
HASWELL = BASE | {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave", "rdrand"}
MILAN = HASWELL | {"sha_ni", "vaes", "clzero"}  # AMD Zen 3: AVX2 only
SKYLAKE_SP = HASWELL | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
GENOA = SKYLAKE_SP | {"avx512_vnni", "avx512_bf16", "avx512ifma", "gfni"}
SAPPHIRE_RAPIDS = GENOA | {"amx_tile", "amx_int8", "amx_bf16"}
ALL = set(isa.NAMES)


@pytest.mark.parametrize("flags, best", [
    (BASE, "portable"), (set(), "portable"), (HASWELL, "avx2"), (MILAN, "avx2"), (SKYLAKE_SP, "avx512"),
    (GENOA, "avx512_vnni"), (SAPPHIRE_RAPIDS, "avx512_vnni"),
    (HASWELL - {"bmi2"}, "portable"),  # -march=x86-64-v3 may emit BMI2 anywhere: all of a level or none
    (SKYLAKE_SP - {"avx512vl"}, "avx2"), (GENOA - {"avx512_bf16"}, "avx512"),
], ids=["sse4", "no-cpuinfo", "haswell", "milan", "skylake-sp", "genoa", "sapphire-rapids", "no-bmi2",
        "no-avx512vl", "vnni-no-bf16"])
def test_the_best_prebuilt_level_the_flags_run_is_chosen(flags, best):
    chosen, why = isa.choose(flags, ALL)
    assert chosen.name == best and why == "the best level this CPU runs"
    assert isa.supported(flags)[0].name == best and isa.supported(flags)[-1].name == "portable"


def test_a_missing_prebuilt_level_falls_to_the_next_one_and_none_to_a_compile():
    chosen, why = isa.choose(GENOA, {"avx2", "portable"})
    assert chosen.name == "avx2" and "avx512_vnni is not prebuilt" in why
    chosen, why = isa.choose(MILAN, {"avx512", "avx512_vnni"})  # only levels this CPU cannot run
    assert chosen is None and "it runs avx2, portable" in why
    assert isa.choose(GENOA, set()) == (None, "no prebuilt level this CPU runs (it runs avx512_vnni, avx512, avx2, portable)")


def test_a_forced_level_is_taken_where_the_cpu_runs_it_and_refused_by_name_where_not(monkeypatch):
    assert isa.choose(GENOA, set(), "avx2") == (isa.level("avx2"), "forced by TRITONLM_KERNEL_ISA")
    assert isa.choose(MILAN, ALL, "portable")[0].name == "portable"
    with pytest.raises(isa.IsaError, match=r"TRITONLM_KERNEL_ISA=avx512: this CPU lacks avx512bw avx512cd avx512dq "
                                           r"avx512f avx512vl; it runs avx2, portable"):
        isa.choose(MILAN, ALL, "avx512")
    with pytest.raises(isa.IsaError, match="TRITONLM_KERNEL_ISA=avx512_vnni: this CPU lacks avx512_bf16 avx512_vnni"):
        isa.choose(SKYLAKE_SP, ALL, "avx512_vnni")
    monkeypatch.setenv("TRITONLM_KERNEL_ISA", "neon")
    with pytest.raises(isa.IsaError, match="TRITONLM_KERNEL_ISA='neon' is not a kernel ISA level; use one of "
                                           "avx512_vnni, avx512, avx2, portable"):
        isa.forced_level()
    monkeypatch.setenv("TRITONLM_KERNEL_ISA", "")
    assert isa.forced_level() is None


def test_the_loader_refuses_a_forced_level_this_cpu_lacks_before_loading_anything(monkeypatch):
    """The loader itself (not only choose): a CPU without AVX-512 forced to avx512 gets the
    error, never a build that would stop on an illegal instruction."""
    import tritonlm.engine.kernels as kernels

    monkeypatch.setattr(isa, "cpu_flags", lambda: set(MILAN))
    monkeypatch.setenv("TRITONLM_KERNEL_ISA", "avx512")
    with pytest.raises(isa.IsaError, match="this CPU lacks avx512bw"):
        kernels._load()


def test_an_unknown_forced_level_stops_the_load_naming_the_levels():
    env = {**os.environ, "TRITONLM_KERNEL_ISA": "neon"}
    out = subprocess.run([sys.executable, "-m", "tritonlm.engine.kernels"], capture_output=True, text=True, env=env)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "refused: TRITONLM_KERNEL_ISA='neon' is not a kernel ISA level; use one of avx512_vnni, avx512, avx2, " \
           "portable" in out.stdout, out.stdout + out.stderr


def test_cpu_flags_reads_the_flags_line(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: fpu sse2 avx2 fma\n\nprocessor\t: 1\n")
    assert isa.cpu_flags(str(info)) == {"fpu", "sse2", "avx2", "fma"}
    assert isa.cpu_flags(str(tmp_path / "absent")) == set()


def expected_paths(level: str) -> tuple[str, bool]:
    """What a build of `level` has compiled in: w8_linear's best path and the float panels."""
    if level == "native":
        level = isa.supported(isa.cpu_flags())[0].name
    if level.startswith("avx512"):
        return "avx512", True
    return ("avx2", True) if level == "avx2" else ("scalar", False)


def test_the_loaded_build_is_the_chosen_level_and_has_its_instructions():
    """The build in this process (TRITONLM_KERNEL_ISA's when set) is the level dispatch chose, and
    its own code reports that level's paths: AVX-512 builds run w8_linear's AVX-512 path, avx2
    its AVX2 path, portable the scalar one; every level but portable has the float panels."""
    from tritonlm.engine.kernels import kernels_available, loaded_build

    ok, why = kernels_available()
    assert ok, why
    built = loaded_build()
    forced = isa.forced_level()
    if forced is not None:
        assert built.level == forced and "forced by TRITONLM_KERNEL_ISA" in built.why, built
    elif built.origin == "prebuilt":
        assert built.level == isa.supported(isa.cpu_flags())[0].name or "is not prebuilt" in built.why
    best, panels = expected_paths(built.level)
    assert torch.ops.tritonlm.w8_isas()[0] == best
    assert torch.ops.tritonlm.panel_supported() == panels


# the kernels' own checks, against their torch / float64 references, run under each forced level
CHECKS = [
    "tests/unit/engine/kernels/test_isa.py::test_the_loaded_build_is_the_chosen_level_and_has_its_instructions",
    "tests/unit/engine/kernels/test_kernels.py::test_paged_attention_kernel_equals_the_gather_path",
    "tests/unit/engine/kernels/test_kernels.py::"
    "test_paged_attention_kernel_gives_a_row_the_same_bits_alone_in_a_batch_and_among_new_tokens",
    "tests/unit/engine/kernels/test_kernels.py::test_fused_norm_and_activation_ops_equal_the_torch_math",
    "tests/unit/engine/kernels/test_paged_attention.py::test_options_match_float64_reference",
    "tests/unit/engine/kernels/test_kernels.py::test_greedy_argmax_equals_torch_max",
    "tests/unit/engine/kernels/test_kernels.py::test_greedy_argmax_marks_rows_whose_winner_is_not_finite",
    "tests/unit/engine/kernels/test_weight_only_int8.py::test_w8_linear_equals_the_dequantized_matmul_on_every_path",
    "tests/unit/engine/kernels/test_int8_act8.py",
    "tests/unit/engine/kernels/test_float_panel.py",
    "tests/unit/engine/kernels/test_decoder_stack.py::test_decode_step_gives_the_python_paths_bits",
    "tests/unit/engine/kernels/test_lora_ops.py",
]


@pytest.mark.parametrize("level", isa.NAMES)
def test_each_level_this_cpu_runs_passes_the_kernel_checks_when_forced(level):
    """TRITONLM_KERNEL_ISA=level in a fresh process (one build per process): that level's build
    loads (prebuilt by `make setup`; compiled once into torch's extension cache where it is not)
    and the kernels' checks (CHECKS) pass on it."""
    runs = [lv.name for lv in isa.supported(isa.cpu_flags())]
    if level not in runs:
        pytest.skip(f"this CPU does not run {level} (it runs {', '.join(runs)})")
    env = {**os.environ, "TRITONLM_KERNEL_ISA": level}
    out = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *CHECKS],
                         cwd=ROOT, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert " passed" in out.stdout and " failed" not in out.stdout, out.stdout[-2000:]


# what each level's vector kernels compute for seeded inputs: the panel projections (AVX2's
# two ymm per panel against AVX-512's one zmm), weight-only int8's prefill-sized calls (its
# panels widened to float for the panel kernel) and the int8 projections (i8_linear's best
# path there), every tile shape, with and without a bias
SAME_BITS = """
import hashlib, torch
from tritonlm.engine.kernels import kernels_available
from tritonlm.engine.runners.layers import FloatLinear, Int8Linear, PanelLinear, WeightOnlyInt8Linear, panels_available
assert kernels_available()[0]
g = torch.Generator().manual_seed(0)
float_digest, int8_digest = hashlib.sha256(), hashlib.sha256()
for n_in, out in ((576, 960), (100, 49), (7, 33)):
    w, b = torch.randn(n_in, out, generator=g), torch.randn(out, generator=g)
    float_proj = PanelLinear.from_float(FloatLinear(w, b)) if panels_available() else None
    int8_proj = Int8Linear.from_float(w, b)
    int8_proj.use_act8()
    groups = 4 if n_in % 4 == 0 else 1
    q = torch.randint(0, 256, (out, n_in), dtype=torch.uint8, generator=g)
    weight_only = WeightOnlyInt8Linear.from_rows(q, torch.rand(out, groups, generator=g) * 0.02,
                                                 torch.randn(out, groups, generator=g) * 0.5, None)
    weight_only.cpp_op = True
    for rows in (1, 2, 3, 7, 13, 40, 65, 100):
        x = torch.randn(rows, n_in, generator=g)
        if float_proj is not None:
            float_digest.update(float_proj(x).numpy().tobytes())
            if rows > 64:
                float_digest.update(weight_only.apply(x, b).numpy().tobytes())
        int8_digest.update(int8_proj(x).numpy().tobytes())
print("digests", int8_digest.hexdigest(), float_digest.hexdigest() if panels_available() else "-")
"""


def test_every_level_computes_the_same_projection_bits():
    """The float32 panel kernel and weight-only int8's prefill-sized calls (AVX-512 and AVX2
    levels) and i8_linear (every level) give the same bits on every level this CPU runs: a
    model's projections answer alike on any x86 CPU."""
    runs = [lv.name for lv in isa.supported(isa.cpu_flags())]
    digests = {}
    for level in runs:
        out = subprocess.run([sys.executable, "-c", SAME_BITS], cwd=ROOT, capture_output=True, text=True,
                             env={**os.environ, "TRITONLM_KERNEL_ISA": level})
        assert out.returncode == 0, f"{level}: {out.stderr[-2000:]}"
        digests[level] = out.stdout.split("digests ")[-1].split()
    int8 = {lv: d[0] for lv, d in digests.items()}
    assert len(set(int8.values())) == 1, int8
    panels = {lv: d[1] for lv, d in digests.items() if d[1] != "-"}
    assert len(set(panels.values())) == 1, panels
    assert set(panels) == set(runs) - {"portable"}  # every vector level has the panel kernel
