"""tritonlm/export/pipeline.py without a server: every format written with its verification,
artifacts that match transformers on fresh inputs, configs that parse as Triton's ModelConfig,
re-runs that reuse verified artifacts, a failed verification that writes nothing, a local
Llama folder exported; `--formats none`, refused families and features named. The other
families' forward formats: test_wrapper.py. The shared export: tests/unit/export/conftest.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.helpers.exports import FORWARD, NAME, artifact, assert_untouched
from tests.helpers.models import tiny_family
from tritonlm.export.pipeline import ExportError, ExportOptions, export, parse_formats
from tritonlm.export.repository import parse_config
from tritonlm.export.verify import onnx_decoder_fn, torchscript_decoder_fn, verify_decoder
from tritonlm.models.builtin import tiny_tokenizer


def _fn(path: Path):
    return torchscript_decoder_fn(path) if path.suffix == ".pt" else onnx_decoder_fn(path)


def test_all_formats_written_with_verification_json(exported):
    repo, result, lines = exported
    assert sorted(a.fmt for a in result.artifacts) == sorted(FORWARD)
    assert not any(a.reused for a in result.artifacts)
    for fmt in FORWARD:
        path = artifact(repo, fmt)
        assert path.is_file() and path.stat().st_size > 0
        ver = json.loads(path.with_name(path.stem + ".verify.json").read_text())
        assert ver["passed"] and ver["format"] == fmt
        assert {"max_abs_logit_diff", "top1_agreement"} <= set(ver)
        assert {c["name"] for c in ver["cases"]} == {"decode", "left_padded", "mid_padded"}
    # progress lines and the summary table were printed
    assert any("verifying against PyTorch" in s for s in lines)
    assert any(s.startswith("format") for s in lines)


@pytest.mark.parametrize("fmt", list(FORWARD))
def test_artifact_matches_transformers_on_fresh_inputs(exported, model, fmt):
    repo, _, _ = exported
    report = verify_decoder(_fn(artifact(repo, fmt)), model, fmt, seed=98765, decode_steps=5)
    assert report.failure() is None, report.summary()
    if fmt in ("onnx", "torchscript"):
        assert report.max_abs_diff < 1e-4
        assert report.top1_agreement == 1.0
    elif fmt == "onnx-fp16":
        assert report.max_rel_diff < 5e-2
    else:
        # tighter than the export-time int8 tolerance (which must also hold SmolLM2):
        # blockwise int8 weights on tiny-gpt2 measured MEASURED_TINY
        assert report.max_rel_diff < 0.05, report.summary()
        assert report.top1_agreement_tie_aware >= 0.95, report.summary()
        assert report.nonfinite == 0


def test_every_config_parses_and_names_its_folder(exported):
    repo, result, _ = exported
    folders = sorted(p.name for p in repo.iterdir())
    assert folders == sorted([NAME, f"{NAME}_draft", *FORWARD.values()])
    for folder in folders:
        cfg = parse_config((repo / folder / "config.pbtxt").read_text())
        assert cfg.name == folder
    assert not [p for p in repo.parent.iterdir() if p.name.startswith(".repo.export-")], "staging left behind"


def test_rerun_reuses_verified_artifacts_and_writes_native_configs(exported, tmp_path):
    repo, _, _ = exported
    copy = tmp_path / "repo"
    shutil.copytree(repo, copy)
    lines: list[str] = []
    result = export(ExportOptions(model="tiny-gpt2", name=NAME, repo=copy, runtime="native", max_context=128),
                    out=lines.append)
    assert all(a.reused for a in result.artifacts)
    assert any("reusing" in s for s in lines)
    onnx_cfg = parse_config((copy / FORWARD["onnx"] / "config.pbtxt").read_text())
    assert onnx_cfg.platform == "onnxruntime_onnx" and onnx_cfg.backend == "onnxruntime"
    for fmt in ("onnx-int8", "onnx-fp16"):
        cfg = parse_config((copy / FORWARD[fmt] / "config.pbtxt").read_text())
        assert (cfg.platform, cfg.backend) == ("onnxruntime_onnx", "onnxruntime")
    ts = parse_config((copy / FORWARD["torchscript"] / "config.pbtxt").read_text())
    assert ts.platform == "pytorch_libtorch" and ts.backend == "pytorch"
    assert [i.name for i in ts.input][:3] == ["input_ids__0", "attention_mask__1", "position_ids__2"]
    assert ts.output[0].name == "logits__0"
    assert ts.max_batch_size > 0 and ts.dynamic_batching.max_queue_delay_microseconds == 5000
    # no draft this time: the generation entry no longer names one
    params = {k: v.string_value for k, v in parse_config((copy / NAME / "config.pbtxt").read_text()).parameters.items()}
    assert "draft_model" not in params


def test_cuda_device_writes_gpu_instances(exported, tmp_path):
    copy = tmp_path / "repo"
    shutil.copytree(exported[0], copy)
    export(ExportOptions(model="tiny-gpt2", name=NAME, repo=copy, runtime="native", formats=["onnx"], device="cuda",
                         max_context=128), out=lambda s: None)
    cfg = parse_config((copy / FORWARD["onnx"] / "config.pbtxt").read_text())
    assert cfg.instance_group[0].kind == cfg.instance_group[0].KIND_GPU
    gen = parse_config((copy / NAME / "config.pbtxt").read_text())
    assert gen.parameters["device"].string_value == "cuda"


def test_error_bad_formats():
    with pytest.raises(ExportError, match="unknown format 'tensorrt'"):
        parse_formats("onnx,tensorrt")
    assert parse_formats("all") == ["onnx", "onnx-int8", "onnx-fp16", "torchscript"]
    assert parse_formats("int8,onnx") == ["onnx-int8", "onnx"]


def test_failed_verification_writes_nothing(tmp_path, monkeypatch):
    """An artifact out of tolerance: exit with the reason, the repository untouched."""
    from tritonlm.export import verify

    monkeypatch.setitem(verify.TOLERANCES, "onnx", verify.Tolerance(max_rel_diff=1e-12, min_top1=1.0))
    repo = tmp_path / "r"
    repo.mkdir()
    with pytest.raises(ExportError, match="failed verification"):
        export(ExportOptions(model="tiny-gpt2", repo=repo, formats=["onnx"], runtime="python"), out=lambda s: None)
    assert list(repo.iterdir()) == []
    assert_untouched(tmp_path)


def test_tiny_llama_folder_exports_and_verifies(tmp_path):
    """A Llama-architecture model (grouped-query attention, rotary positions, tied head)
    from a local Hugging Face folder: ONNX and TorchScript pass verification."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tritonlm.models.builtin import tiny_tokenizer

    tok = tiny_tokenizer()
    torch.manual_seed(7)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    llama = LlamaForCausalLM(cfg).eval()
    folder = tmp_path / "Tiny-Llama"
    llama.save_pretrained(folder)
    tok.save_pretrained(folder)
    repo = tmp_path / "repo"
    result = export(ExportOptions(model=str(folder), repo=repo, formats=["onnx", "torchscript"], runtime="python"),
                    out=lambda s: None)
    assert result.name == "tiny-llama"
    for a in result.artifacts:
        assert a.top1_agreement == 1.0 and a.max_abs_logit_diff < 1e-4
    onnx_cfg = parse_config((repo / "tiny-llama_onnx" / "config.pbtxt").read_text())
    assert list(onnx_cfg.input[3].dims) == [2, -1, 16]  # kv heads, past, head_dim
    report = verify_decoder(onnx_decoder_fn(repo / "tiny-llama_onnx" / "1" / "model.onnx"), llama, "onnx", seed=31)
    assert report.failure() is None and report.max_abs_diff < 1e-4
    gen = parse_config((repo / "tiny-llama" / "config.pbtxt").read_text())
    assert gen.parameters["max_context"].string_value == "128"


# ---------------------------------------------------------------------------- families


def _folder(tmp_path, family: str, **overrides):
    folder = tmp_path / f"Tiny-{family}"
    tiny_family(family, **overrides).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def test_formats_none_is_the_generation_model_alone(tmp_path):
    assert parse_formats("none") == [] and parse_formats(["None"]) == []
    with pytest.raises(ExportError, match="'none'.*cannot be combined"):
        parse_formats("none,onnx")
    result = export(ExportOptions(model="tiny-gpt2", repo=tmp_path / "repo", formats=parse_formats("none")),
                    out=lambda s: None)
    assert result.artifacts == [] and sorted(p.name for p in (tmp_path / "repo").iterdir()) == ["tiny-gpt2"]


@pytest.mark.parametrize("model_type, name", [("gemma3", "Gemma 3 multimodal"), ("llama4", "Llama 4"), ("gemma3n", "Gemma 3n"),
                                              ("phimoe", "Phi-MoE"), ("granitemoe", "Granite MoE")])
def test_refused_families_are_named(tmp_path, model_type, name):
    folder = tmp_path / model_type
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": model_type}))
    with pytest.raises(ExportError) as e:
        export(ExportOptions(model=str(folder), repo=tmp_path / "repo"), out=lambda s: None)
    message = str(e.value)
    assert f"architecture {model_type!r} ({name}" in message and "supported: gpt2" in message and "qwen3:" in message


def test_partial_rotary_where_the_family_has_none_is_refused_naming_it(tmp_path):
    """A partial rotary factor in a Qwen3 config (whose transformers forward rotates every head
    dim) is refused when the model loads, naming the family and the families that have one."""
    folder = _folder(tmp_path, "qwen3")
    cfg = json.loads((folder / "config.json").read_text())
    cfg.setdefault("rope_parameters", {"rope_type": "default", "rope_theta": 10000.0})["partial_rotary_factor"] = 0.75
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ExportError, match=r"Qwen3 dense: rope partial_rotary_factor=0.75 is not supported for qwen3 "
                                          r"\(only 1.0; partial rotary: phi3, glm, glm4\)"):
        export(ExportOptions(model=str(folder), repo=tmp_path / "repo"), out=lambda s: None)
