"""tritonlm/engine/kernels/triton_device.py: where the Triton kernels (paged_decode,
lora_triton) can run, and their builds kept per interpreter setting."""

from __future__ import annotations

import sys

import pytest

from tritonlm.engine.kernels.triton_device import available, built


def test_available(monkeypatch: pytest.MonkeyPatch):
    """CUDA or the interpreter; otherwise False with the reason, also without triton."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    ok, why = available("cpu")
    assert not ok and "not CUDA" in why
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    ok, why = available("cpu")
    assert ok and "interpreter" in why
    monkeypatch.setitem(sys.modules, "triton", None)  # import triton raises ImportError
    ok, why = available("cpu")
    assert not ok and "not installed" in why


def test_kernels_are_built_once_per_interpreter_setting(monkeypatch: pytest.MonkeyPatch):
    cache: dict = {}
    builds = []

    def build():
        builds.append(1)
        return len(builds)

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert built(cache, build) == built(cache, build) == 1
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert built(cache, build) == built(cache, build) == 2
    assert len(builds) == 2
