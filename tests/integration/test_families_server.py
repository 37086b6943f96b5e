"""A family beyond GPT-2 and Llama through the whole path: a tiny seeded Qwen3 folder
(per-head q/k norm, explicit head_dim) exported by `tritonlm export` with its default
`--formats none` (the generation model alone: all a team serving a chat model needs; the
forward formats per family are tests/unit/export/test_wrapper.py's), loaded in a real
tritonserver, and its greedy text equal to transformers' generate()."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.models import MIXED_PROMPTS, tiny_family
from tritonlm.client.generate import generate_grpc
from tritonlm.models.builtin import tiny_tokenizer

NAME = "tiny-qwen3"
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def qwen3():
    return tiny_family("qwen3"), tiny_tokenizer()


@pytest.fixture(scope="module")
def exported(tmp_path_factory, qwen3):
    from tritonlm.export.pipeline import ExportOptions, export

    model, tok = qwen3
    folder = tmp_path_factory.mktemp("hf") / "Tiny-Qwen3"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    repo = tmp_path_factory.mktemp("qwen3repo")
    lines: list[str] = []
    result = export(ExportOptions(model=str(folder), repo=repo, max_context=128, formats=[]), out=lines.append)
    return repo, result, lines


@pytest.fixture(scope="module")
def triton_repo(exported):
    return exported[0]


def test_formats_none_writes_the_generation_model_alone(exported):
    repo, result, lines = exported
    assert result.artifacts == [] and sorted(p.name for p in repo.iterdir()) == [NAME]
    assert not any("onnx" in line.lower() for line in lines), lines


def test_greedy_text_equals_transformers(triton_server, qwen3):
    model, tok = qwen3
    for prompt in MIXED_PROMPTS[:3]:
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                                 do_sample=False, pad_token_id=0)
        ref = out[0, ids.shape[1]:].tolist()
        if tok.eos_token_id in ref:  # the server stops at the tokenizer's EOS
            ref = ref[: ref.index(tok.eos_token_id)]
        result = generate_grpc(triton_server.grpc_url, NAME, prompt, stream=True, max_tokens=MAX_TOKENS,
                               exclude_input_in_output=True)
        assert result.text == tok.decode(ref, skip_special_tokens=True), prompt
        assert result.num_output_tokens == len(ref)
