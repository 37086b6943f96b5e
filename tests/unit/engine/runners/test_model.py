"""The Transformer forward pass gives the recorded logits (data/golden_logits.npz).

Every variant of make_golden_logits.VARIANTS (float32 plain, packed for the CPU with and
without tritonlm's C++ ops, oneDNN-blocked, int8 with and without the C++ ops, two
tensor-parallel ranks, two pipeline stages), for tiny-gpt2 and a tiny grouped-query Llama, over a packed prefill,
two decode steps and a verify step; int8 in both activation ranges (8 bits: CPUs with VNNI;
7 bits: the others, and any CPU when forced), one test case each. On a host whose HostFacts
match the recording's (CPU features, the levels its code paths run at, torch version, thread
count, kernels built) the logits must be the same bits: a refactoring may not change one. Elsewhere other kernels run, so
they are compared within float32 rounding (int8: within a few activation quantization
steps of the range's own recording), and a warning says why it could not compare bits.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from tritonlm.engine.runners.layers import INT8_VNNI

FLOAT_ATOL = 2e-5  # float32 logits of magnitude ~5 after other kernels' summation orders
# int8 in one activation range: every host computes the same integer sums (exact in int32),
# but float32 rounding before a quantization (norms, attention) differs between hosts and
# can move an activation across a rounding boundary, by one step: 2 / (2^bits - 1) of its
# row's range. These small random models amplify such a step into several at the logits; a
# wrong layout or scale is off by the logits' own size, far beyond.
INT8_STEPS = 8


def int8_atol(part: str, largest_logit: float) -> float:
    """How far an int8 part's logits may be from its recording on another host."""
    bits = maker.INT8_PARTS[part]
    return INT8_STEPS * 2 / (2**bits - 1) * largest_logit


def _load_maker():
    """make_golden_logits.py beside this file, whatever pytest's import mode."""
    path = Path(__file__).resolve().parent / "make_golden_logits.py"
    spec = importlib.util.spec_from_file_location("make_golden_logits", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)
    spec.loader.exec_module(module)
    return module


maker = _load_maker()


@pytest.fixture(scope="module")
def recorded():
    return maker.load_golden()


@pytest.mark.parametrize("part", maker.PARTS)
def test_golden_logits_are_reproduced(recorded, part):
    if part == "int8_act8" and not INT8_VNNI:  # tritonlm's int8_i8 runs 8 bits everywhere
        pytest.skip("fbgemm's int8 with 8-bit activations needs VNNI (fbgemm's kernel without it sums u8*s8 pairs in "
                    "int16, which saturates): fbgemm runs 7 bits here, checked by int8_act7")
    facts, recording = recorded
    golden = {k: v for k, v in recording.items() if maker.part_of(k) == part}
    computed = maker.compute_logits(parts=(part,))
    here = maker.HostFacts.here()
    assert set(computed) == set(golden), "the variants or steps changed: rerun make_golden_logits.py if intended"
    bitwise = here == facts
    if not bitwise:
        warnings.warn(f"golden logits compared within tolerance, not bit for bit: recorded on {facts}, "
                      f"this host is {here}", stacklevel=1)
    failures = []
    for key in sorted(golden):
        want, got = torch.from_numpy(golden[key]), torch.from_numpy(computed[key])
        assert got.shape == want.shape, f"{key}: shape {tuple(got.shape)}, recorded {tuple(want.shape)}"
        diff = (got - want).abs().max().item()
        if bitwise:
            ok = torch.equal(got, want)
        elif part in maker.INT8_PARTS:
            ok = diff <= int8_atol(part, want.abs().max().item())
        else:
            ok = diff <= FLOAT_ATOL
        if not ok:
            failures.append(f"{key}: max abs diff {diff:.3g}")
    how = "bit for bit" if bitwise else "within tolerance (another host: see the printed facts)"
    assert not failures, f"logits differ from the recording ({how}):\n" + "\n".join(failures)


def test_golden_file_is_small_and_raw_float32(recorded):
    _, golden = recorded
    assert maker.DATA.stat().st_size < 1_000_000
    assert all(a.dtype == np.float32 for a in golden.values())


def test_host_facts_tell_a_capped_code_path_from_the_recording(recorded, monkeypatch):
    """A level capped below the CPU's (how an older host is checked on this one) is a fact of
    its own, so its logits are compared within tolerance, not bit for bit; and a recording
    made before the levels were recorded matches no host."""
    facts, _ = recorded
    for name in maker.CAP_ENV:
        monkeypatch.delenv(name, raising=False)
    plain = maker.HostFacts.here()
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    capped = maker.HostFacts.here()
    assert capped.isa_caps == ("ONEDNN_MAX_CPU_ISA=AVX2",) and capped != plain
    assert dataclasses.replace(capped, isa_caps=()) == plain
    old = maker.HostFacts.from_json(
        '{"cpu_flags": ["avx2"], "torch_version": "2.13.0+cpu", "num_threads": 2, "kernels": true}')
    assert old.kernels == "unrecorded" and old.aten_capability == "unrecorded"
    assert maker.HostFacts.from_json(facts.to_json()) == facts


def test_int8_path_names_the_kernel_the_projections_run(monkeypatch):
    """Transformer.int8_path (the startup log's line): tritonlm's i8_linear by default, fbgemm
    where forced, None for a float model."""
    from tests.helpers.models import tiny_llama
    from tritonlm.engine.runners.torch_runner import TorchRunner

    model = tiny_llama()
    assert TorchRunner(model).transformer.int8_path() is None
    monkeypatch.delenv("TRITONLM_INT8_KERNEL", raising=False)
    path = TorchRunner(model, int8=True).transformer.int8_path()
    assert path.startswith("tritonlm's i8_linear, ") and path.endswith(" path, 8-bit activations")
    best = torch.ops.tritonlm.i8_isas()
    assert path.split(", ", 1)[1].startswith(f"{best[0]} ")
    if best[0] == "amx":  # AMX runs calls of several rows: one stream's vector path is named too
        assert f"and {best[1]} (a few rows) path" in path
    monkeypatch.setenv("TRITONLM_INT8_KERNEL", "fbgemm")
    monkeypatch.setenv("TRITONLM_INT8_REDUCE_RANGE", "1")
    assert TorchRunner(model, int8=True).transformer.int8_path() == "fbgemm, 7-bit activations"
