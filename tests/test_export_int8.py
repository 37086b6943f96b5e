"""onnx-int8 for the Llama family: a tiny seeded Llama exported and quantized passes the
export's own check, and a MatMul fed by outlier activations stays float32.
(Real weights: tests/test_smollm2.py exports SmolLM2-135M to onnx-int8 as well.)"""

from __future__ import annotations

import onnx
import pytest
import torch

from tritonlm.export.onnx_export import (
    OUTLIER_RATIO,
    activation_outlier_ratios,
    export_decoder_onnx,
    quantize_int8,
)
from tritonlm.export.verify import TOLERANCES, onnx_decoder_fn, verify_decoder


def _tiny_llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=True, bos_token_id=0, eos_token_id=0)
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def llama_fp32(tmp_path_factory):
    model = _tiny_llama()
    path = export_decoder_onnx(model, tmp_path_factory.mktemp("llama") / "fp32.onnx")
    return model, path


def test_llama_threshold_is_not_lowered():
    assert TOLERANCES["onnx-int8"].min_top1 >= 0.95


def test_tiny_llama_int8_passes_its_check(llama_fp32, tmp_path):
    model, src = llama_fp32
    dst = quantize_int8(src, tmp_path / "int8.onnx")
    graph = onnx.load(str(dst)).graph
    ops = [n.op_type for n in graph.node]
    n = model.config.num_hidden_layers
    assert ops.count("MatMulNBits") == 7 * n + 1  # q, k, v, o, gate, up, down per layer + LM head
    # the embedding table stays float32 (most of this tiny model); the linear weights are bytes
    assert dst.stat().st_size < 0.8 * src.stat().st_size
    for seed in (0, 11):
        report = verify_decoder(onnx_decoder_fn(dst), model, "onnx-int8", seed=seed)
        assert report.failure() is None, report.summary()
        assert report.top1_agreement_tie_aware >= 0.95, report.summary()


def test_outlier_activation_keeps_its_matmul_float(llama_fp32, tmp_path, monkeypatch):
    """A MatMul whose input ratio max|x|/RMS reaches OUTLIER_RATIO stays float32 (SmolLM2's
    massive-activation down-projections); a tiny random model has none, so the threshold
    is put just under its largest measured ratio: exactly that MatMul must stay float."""
    import tritonlm.export.onnx_export as onnx_export

    model, src = llama_fp32
    proto = onnx.load(str(src))
    onnx_export.fold_constant_transposes(proto)  # as quantize_int8 does: the tied LM head counts
    ratios = activation_outlier_ratios(proto)
    assert len(ratios) == 7 * model.config.num_hidden_layers + 1
    assert max(ratios.values()) < OUTLIER_RATIO  # random weights: no outliers
    top = max(ratios, key=ratios.get)
    monkeypatch.setattr(onnx_export, "OUTLIER_RATIO", ratios[top] * 0.999)
    assert sum(r >= ratios[top] * 0.999 for r in ratios.values()) == 1
    dst = quantize_int8(src, tmp_path / "int8.onnx")
    graph = onnx.load(str(dst)).graph
    inits = {t.name for t in graph.initializer}
    assert [x.name for x in graph.node if x.op_type == "MatMul" and x.input[1] in inits] == [top]
    assert [x.op_type for x in graph.node].count("MatMulNBits") == len(ratios) - 1
