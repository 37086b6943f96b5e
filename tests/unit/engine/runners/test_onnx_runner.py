"""tritonlm/engine/runners/onnx_runner.py: an fp16 artifact (the contract every runner keeps,
float32 artifacts included, is in test_base.py)."""

from __future__ import annotations

import torch

from tests.helpers.models import assert_close, forward_rows, hf_logits, paged_cache, random_tokens


def test_onnx_fp16_artifact(hf_models, onnx_paths, tmp_path):
    """An fp16 artifact: inputs/outputs cast per declared types, KV pool in fp16, logits float32."""
    import onnx
    from onnxruntime.transformers.float16 import convert_float_to_float16

    from tritonlm.engine.runners.onnx_runner import OnnxRunner

    fp16 = convert_float_to_float16(onnx.load(str(onnx_paths["gpt2"])), keep_io_types=False)
    path = tmp_path / "gpt2-fp16.onnx"
    onnx.save(fp16, str(path))
    model = hf_models["gpt2"]
    runner = OnnxRunner(model, path)
    assert runner.spec.dtype == torch.float16
    mgr = paged_cache(runner)
    assert mgr.pool.k[0].dtype == torch.float16
    seq = random_tokens(10, seed=14)
    ref = hf_logits(model, seq)
    mgr.allocate(1, 10)
    out = forward_rows(runner, mgr, [(1, 0, seq[:8])])
    assert out.dtype == torch.float32
    assert_close(out[0], ref[7], atol=0.1)
    out = forward_rows(runner, mgr, [(1, 8, seq[8:10])], all_logits=True)
    assert_close(out[0], ref[8:10], atol=0.1)
    assert out[0].argmax(-1).tolist() == ref[8:10].argmax(-1).tolist()
