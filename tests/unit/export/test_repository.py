"""tritonlm/export/repository.py: the config.pbtxt files an export writes, for the forward
models (python runtime) and the generation entry, and a generation config written alone."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.exports import FORWARD, NAME
from tritonlm.export.repository import parse_config, write_generate_config


def test_forward_configs_python_runtime(exported):
    repo, _, _ = exported
    for fmt, folder in FORWARD.items():
        cfg = parse_config((repo / folder / "config.pbtxt").read_text())
        assert cfg.backend == "tritonlm"
        assert cfg.max_batch_size > 0
        assert cfg.dynamic_batching.max_queue_delay_microseconds == 5000
        assert list(cfg.dynamic_batching.preferred_batch_size)
        assert cfg.instance_group[0].kind == cfg.instance_group[0].KIND_CPU
        params = {k: v.string_value for k, v in cfg.parameters.items()}
        assert params["task"] == "forward"
        assert params["format"] == ("torchscript" if fmt == "torchscript" else "onnx")
        assert [i.name for i in cfg.input][:3] == ["input_ids", "attention_mask", "position_ids"]
        assert all(i.allow_ragged_batch for i in cfg.input)  # the handler pads different lengths itself


def test_generation_entry_contract(exported, model):
    repo, _, _ = exported
    cfg = parse_config((repo / NAME / "config.pbtxt").read_text())
    assert cfg.backend == "tritonlm" and cfg.max_batch_size == 0
    assert cfg.model_transaction_policy.decoupled
    params = {k: v.string_value for k, v in cfg.parameters.items()}
    assert params["task"] == "generate"
    assert params["hf_dir"] == "1/hf"
    assert params["runtime"] == "torch"
    assert params["onnx_model"] == f"../{NAME}_onnx/1/model.onnx"
    assert (repo / NAME / params["onnx_model"]).is_file()
    assert params["max_context"] == "128"
    assert int(params["kv_cache_bytes"]) >= 8 * 128 * 2 * 2 * 64 * 4
    assert params["draft_model"] == f"../{NAME}_draft/1/hf"
    assert (repo / NAME / params["draft_model"] / "config.json").is_file()
    inputs = {i.name: i for i in cfg.input}
    assert not inputs["text_input"].optional
    assert all(i.optional for n, i in inputs.items() if n != "text_input")
    from tritonclient.grpc import model_config_pb2 as pb

    assert inputs["seed"].data_type == pb.TYPE_UINT64
    assert inputs["temperature"].data_type == pb.TYPE_FP32
    assert inputs["stream"].data_type == pb.TYPE_BOOL
    assert inputs["max_tokens"].data_type == pb.TYPE_INT32
    assert list(inputs["stop_words"].dims) == [-1]
    outputs = {o.name for o in cfg.output}
    assert {"text_output", "finish_reason", "num_input_tokens", "num_output_tokens", "output_log_probs",
            "acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens", "num_cached_tokens",
            "output_top_token_ids", "output_top_log_probs", "logprobs", "prompt_token_ids", "prompt_log_probs",
            "prompt_top_token_ids", "prompt_top_log_probs"} == outputs
    # the saved HF folder is the same model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = repo / NAME / "1" / "hf"
    assert list(hf.glob("*.safetensors"))
    loaded = AutoModelForCausalLM.from_pretrained(str(hf)).eval()
    ids = torch.tensor([[5, 77, 300, 12]])
    with torch.no_grad():
        assert torch.allclose(loaded(input_ids=ids).logits, model(input_ids=ids).logits, atol=1e-5)
    assert loaded.dtype == torch.float32
    assert AutoTokenizer.from_pretrained(str(hf)).get_vocab() == AutoTokenizer.from_pretrained(
        str(repo / f"{NAME}_draft" / "1" / "hf")).get_vocab()


def test_write_generate_config_reusable(tmp_path):
    path = write_generate_config(tmp_path / "m", max_context=64, runtime="onnx", onnx_model="../m_onnx/1/model.onnx",
                                 kv_cache_fraction=0.25)
    cfg = parse_config(path.read_text())
    params = {k: v.string_value for k, v in cfg.parameters.items()}
    assert params["runtime"] == "onnx" and params["kv_cache_fraction"] == "0.25" and "kv_cache_bytes" not in params
    with pytest.raises(ValueError, match="onnx_model"):
        write_generate_config(tmp_path / "n", max_context=64, runtime="onnx")
