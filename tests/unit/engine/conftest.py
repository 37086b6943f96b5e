"""Models the runner and kernel tests share, built once per session."""

from __future__ import annotations

import pytest

from tests.helpers.models import tiny_llama
from tritonlm.models.builtin import build_tiny


@pytest.fixture(scope="session")
def hf_models() -> dict:
    """{"gpt2": tiny-gpt2, "llama": tiny_llama()}: the HF models the runners are checked against."""
    return {"gpt2": build_tiny("tiny-gpt2")[0], "llama": tiny_llama()}


@pytest.fixture(scope="session")
def onnx_paths(hf_models, tmp_path_factory) -> dict:
    """Each of hf_models exported by the project's exporter (tritonlm.export.onnx_export)."""
    from tritonlm.export.onnx_export import export_decoder_onnx

    out = tmp_path_factory.mktemp("onnx")
    return {arch: export_decoder_onnx(model, out / f"{arch}.onnx") for arch, model in hf_models.items()}
