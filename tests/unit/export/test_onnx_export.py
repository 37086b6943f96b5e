"""tritonlm/export/onnx_export.py: the ONNX decoder's inputs and outputs, a mid-padded batch
with explicit positions equal to each sequence alone, and onnx-int8: a tied LM head is
quantized, a tiny seeded Llama exported and quantized passes the export's own check, and a
MatMul fed by outlier activations stays float32.
(Real weights: tests/integration/test_smollm2.py exports SmolLM2-135M to onnx-int8 as well.)"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

from tests.helpers.exports import artifact
from tritonlm.export.onnx_export import (
    OUTLIER_RATIO,
    activation_outlier_ratios,
    export_decoder_onnx,
    quantize_int8,
)
from tritonlm.export.verify import DecoderInputs, onnx_decoder_fn, verify_decoder
from tritonlm.export.wrapper import input_names, output_names


def test_onnx_io_contract(exported, model):
    import onnxruntime as ort

    sess = ort.InferenceSession(str(artifact(exported[0], "onnx")), providers=["CPUExecutionProvider"])
    n = model.config.n_layer
    assert [i.name for i in sess.get_inputs()] == input_names(n)
    assert [o.name for o in sess.get_outputs()] == output_names(n)
    types = {i.name: i.type for i in sess.get_inputs()}
    assert types["input_ids"] == types["attention_mask"] == types["position_ids"] == "tensor(int64)"


def test_onnx_mid_padded_mask_with_explicit_positions(exported, model):
    """Two sequences prefilled alone; their caches right-padded into one pool (padding
    filled with garbage); one decode step with mask [1..1 0..0 | 1] must equal each
    sequence run alone."""
    run = onnx_decoder_fn(artifact(exported[0], "onnx"))
    rng = np.random.default_rng(2024)
    seqs = [rng.integers(0, 512, size=n).tolist() for n in (2, 7)]
    n_layers, heads, hd = model.config.n_layer, model.config.n_head, model.config.n_embd // model.config.n_head
    caches = []
    for s in seqs:
        m = torch.ones(1, len(s), dtype=torch.long)
        empty = tuple(torch.zeros(1, heads, 0, hd) for _ in range(2 * n_layers))
        caches.append(run(DecoderInputs(torch.tensor([s]), m, torch.arange(len(s)).unsqueeze(0), empty))[1:])
    pool = max(len(s) for s in seqs)
    past = []
    for j in range(2 * n_layers):
        t = torch.full((2, heads, pool, hd), -3.0)
        for b, s in enumerate(seqs):
            t[b, :, : len(s)] = torch.from_numpy(caches[b][j][0])
        past.append(t)
    mask = torch.zeros(2, pool + 1, dtype=torch.long)
    mask[0, :2] = 1
    mask[1, :7] = 1
    mask[:, -1] = 1
    new = rng.integers(0, 512, size=(2, 1))
    out = run(DecoderInputs(torch.tensor(new), mask, torch.tensor([[2], [7]]), tuple(past)))
    for b, s in enumerate(seqs):
        with torch.no_grad():
            ref = model(input_ids=torch.tensor([s + [int(new[b, 0])]])).logits[0, -1].numpy()
        assert np.abs(out[0][b, 0] - ref).max() < 1e-4
    assert out[1].shape == (2, heads, pool + 1, hd)


def test_int8_quantizes_a_tied_lm_head(tmp_path):
    """With tied embeddings the dynamo graph computes the LM head as MatMul(h, Transpose(wte));
    unless that Transpose is folded into a stored weight, the quantizer leaves the largest
    matrix float32 and int8 gives no size or speed gain."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=512, n_positions=64, tie_word_embeddings=True,
                     bos_token_id=0, eos_token_id=0)
    tied = GPT2LMHeadModel(cfg).eval()
    src = export_decoder_onnx(tied, tmp_path / "fp32.onnx")
    dst = quantize_int8(src, tmp_path / "int8.onnx")
    graph = onnx.load(str(dst)).graph
    inits = {t.name: t for t in graph.initializer}
    ops = [n.op_type for n in graph.node]
    assert ops.count("MatMulNBits") == 4 * cfg.n_layer + 1  # qkv, attn out, mlp in/out, LM head
    assert not [n.name for n in graph.node if n.op_type in ("MatMul", "Gemm") and any(i in inits for i in n.input)]
    assert not [n.name for n in graph.node if n.op_type == "Transpose" and n.input[0] in inits]
    for node in graph.node:
        if node.op_type == "MatMulNBits":
            attrs = {a.name: a.i for a in node.attribute}
            assert attrs["bits"] == 8 and attrs["block_size"] == 32
            assert inits[node.input[1]].data_type == onnx.TensorProto.UINT8  # stored as bytes, not floats
    report = verify_decoder(onnx_decoder_fn(dst), tied, "onnx-int8", seed=4)
    assert report.nonfinite == 0
    assert report.max_rel_diff < 0.05, report.summary()  # a wrong scale on the quantized LM head shows here
    assert report.failure() is None, report.summary()


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
