"""tritonlm/engine/runners/torch_runner.py: reduced precision and the attention backend's choice."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.models import assert_close, forward_rows, hf_logits, paged_cache, random_tokens
from tritonlm.engine.runners import load_runner


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_torch_runner_half_precision(hf_models, dtype):
    """Weights and KV pool in half precision; logits still float32 and close to fp32 HF."""
    model = hf_models["gpt2"]
    runner = load_runner("torch", model, dtype=dtype)
    mgr = paged_cache(runner)
    assert runner.spec.dtype == dtype and mgr.pool.k[0].dtype == dtype
    seq = random_tokens(12, seed=15)
    ref = hf_logits(model, seq)
    mgr.allocate(1, 12)
    forward_rows(runner, mgr, [(1, 0, seq[:10])])
    out = forward_rows(runner, mgr, [(1, 10, seq[10:])], all_logits=True)
    assert out.dtype == torch.float32
    assert_close(out[0], ref[10:12], atol=0.1)
    assert next(model.parameters()).dtype == torch.float32  # the HF model itself is left alone


def test_attention_backend_falls_back_where_the_kernel_cannot_run(hf_models):
    half = load_runner("torch", hf_models["llama"], dtype=torch.bfloat16)
    assert half.attention == "gather" and "float32 on the CPU" in half.attention_why
    with pytest.raises(ValueError, match="attention: 'flash'"):
        load_runner("torch", hf_models["llama"], attention="flash")


def test_prompt_chunks_join_the_decode_pass_only_where_rows_read_the_pool_in_place():
    """chunk_rows (ModelExecutor._run_beside_decodes): on a CPU with the C++ paged kernel in
    float32, up to FUSED_CHUNK_TOKENS; none on the gathered path (each row would copy its
    whole history), with int8 weights only, or in bfloat16."""
    from tests.helpers.models import tiny
    from tritonlm.engine.kernels import kernels_available
    from tritonlm.engine.runners.torch_runner import FUSED_CHUNK_TOKENS, TorchRunner

    model, _ = tiny()
    if kernels_available()[0]:
        assert TorchRunner(model).chunk_rows == FUSED_CHUNK_TOKENS
    assert TorchRunner(model, attention="gather").chunk_rows == 0
    assert TorchRunner(model, int8_weight_only=True).chunk_rows == 0
    assert TorchRunner(model, dtype=torch.bfloat16).chunk_rows == 0
