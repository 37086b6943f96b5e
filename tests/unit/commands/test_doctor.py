"""tritonlm/commands/doctor.py: the int8 kernel row says which kernel `dtype: int8` runs and
with how many activation bits, and names a wrong TRITONLM_INT8_KERNEL."""

from __future__ import annotations

from tritonlm.commands.doctor import int8_kernel_row
from tritonlm.engine.kernels import kernels_available


def test_the_int8_row_names_the_kernel_int8_runs(monkeypatch):
    ok, why = kernels_available()
    assert ok, why
    monkeypatch.delenv("TRITONLM_INT8_KERNEL", raising=False)
    monkeypatch.delenv("TRITONLM_INT8_REDUCE_RANGE", raising=False)
    name, good, text = int8_kernel_row(True)
    assert good and "tritonlm's i8_linear" in text and "8-bit activations" in text
    assert "fbgemm (no C++ kernels)" in int8_kernel_row(False)[2]  # without them int8 runs fbgemm whatever is set

    monkeypatch.setenv("TRITONLM_INT8_KERNEL", "fbgemm")
    monkeypatch.setenv("TRITONLM_INT8_REDUCE_RANGE", "1")
    name, good, text = int8_kernel_row(True)
    assert good and text.startswith("fbgemm: 7-bit activations")

    monkeypatch.setenv("TRITONLM_INT8_KERNEL", "onednn")
    name, good, text = int8_kernel_row(True)
    assert not good and "TRITONLM_INT8_KERNEL='onednn'" in text
