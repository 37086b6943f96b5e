"""The forward-pass wrapper (wrapper.py: its sliding-window masks and dense experts) and the
forward formats (ONNX, its int8 and fp16 variants, TorchScript) of the families beyond GPT-2
and Llama: a tiny seeded model of each (tests.helpers.models.tiny_family, and the MoE
families' tiny_moe), saved as a Hugging Face folder and exported through the pipeline, whose
verification compares every artifact with transformers' own forward (verify.py: prefill,
decode on the returned cache, left- and mid-padded batches). The sliding-window models have a
window of WINDOW positions, which the verification's sequences pass.

int8 is checked on models with transformers' default initializer_range (0.02), as the Llama
int8 test does: at the tiny models' 0.2 (set for varied greedy text) Llama itself misses the
int8 check's top-1 threshold on some seeds, a matter of the weights' scale, not the family.

Default run: TorchScript for every family; ONNX and fp16 ONNX for a subset that covers what the
wrapper adds to transformers' forward: Mistral (one window on every layer), Gemma 2 (sliding
and full layers mixed, soft-capping) and Qwen2-MoE (experts, a shared expert, dense layers
between); int8 for Qwen2-MoE. TRITONLM_EXPORT_ALL_FAMILIES=1 runs the ONNX formats for every
family (minutes on a small host: two ONNX exports each).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.helpers.models import WINDOW, tiny_family
from tests.helpers.models import MOE_NAMES, tiny_moe
from tritonlm.export.pipeline import FORWARD_FORMATS, ExportError, ExportOptions, export
from tritonlm.export.verify import eager_decoder_fn, verify_decoder
from tritonlm.export.wrapper import attention_bias
from tritonlm.models.builtin import tiny_tokenizer

DENSE = ("qwen2", "qwen3", "mistral", "ministral", "phi3", "granite", "smollm3", "olmo2", "glm", "glm4", "gemma", "gemma2",
         "gemma3_text")
FAMILIES = DENSE + MOE_NAMES
SUBSET = ("mistral", "gemma2", "qwen2_moe")
ALL = os.environ.get("TRITONLM_EXPORT_ALL_FAMILIES") == "1"
FORMATS = ["onnx", "onnx-int8", "onnx-fp16", "torchscript"]


def _model(family: str, **overrides):
    return tiny_moe(family, **overrides) if family in MOE_NAMES else tiny_family(family, **overrides)


def _folder(tmp_path, family: str, **overrides):
    folder = tmp_path / f"Tiny-{family}"
    _model(family, **overrides).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def _export_and_check(tmp_path, family: str, formats: list[str], **overrides) -> None:
    repo = tmp_path / "repo"
    result = export(ExportOptions(model=str(_folder(tmp_path, family, **overrides)), repo=repo, formats=formats,
                                  runtime="python", max_context=64), out=lambda s: None)
    assert sorted(a.fmt for a in result.artifacts) == sorted(formats)
    for a in result.artifacts:
        ver = json.loads((repo / a.path).with_name(f"{(repo / a.path).stem}.verify.json").read_text())
        assert ver["passed"], ver["failure"]
        assert {c["name"] for c in ver["cases"]} == {"decode", "left_padded", "mid_padded"}
        if a.fmt in ("onnx", "torchscript"):
            assert a.max_abs_logit_diff < 1e-4 and a.top1_agreement == 1.0, (family, a)


def test_every_served_family_claims_every_format():
    from tritonlm.engine.runners.families import FAMILIES as SERVED

    # a family served but not listed here: export a tiny model of it (this file's tests), then
    # list its verified formats in pipeline.FORWARD_FORMATS and the others in FORWARD_REFUSED
    assert set(FORWARD_FORMATS) == set(SERVED), set(SERVED) ^ set(FORWARD_FORMATS)
    assert set(FAMILIES) | {"gpt2", "llama"} == set(SERVED), set(SERVED) ^ (set(FAMILIES) | {"gpt2", "llama"})
    assert all(tuple(FORWARD_FORMATS[f]) == tuple(FORMATS) for f in FAMILIES)


@pytest.mark.parametrize("family", FAMILIES)
def test_torchscript_exports_and_verifies(tmp_path, family):
    _export_and_check(tmp_path, family, ["torchscript"])


every_family = pytest.mark.skipif(not ALL, reason="TRITONLM_EXPORT_ALL_FAMILIES=1 runs every family's ONNX export")


@pytest.mark.parametrize("family", [*SUBSET, *(pytest.param(f, marks=[pytest.mark.slow, every_family])
                                               for f in FAMILIES if f not in SUBSET)])
def test_onnx_and_fp16_export_and_verify(tmp_path, family):
    _export_and_check(tmp_path, family, ["onnx", "onnx-fp16"])


@pytest.mark.parametrize("family", ["qwen2_moe", *(pytest.param(f, marks=[pytest.mark.slow, every_family])
                                                   for f in FAMILIES if f != "qwen2_moe")])
def test_int8_exports_and_verifies(tmp_path, family):
    _export_and_check(tmp_path, family, ["onnx-int8"], initializer_range=0.02)


# ---------------------------------------------------------------------------- the window


def test_verification_sequences_pass_the_window():
    """The checks above only test the window if verify's sequences are longer than it: the
    decode case runs 7 + 4 + 3 tokens, the padded batches 8 + 4 and 6 + 5 columns."""
    assert WINDOW < 11


@pytest.mark.parametrize("family", ["mistral", "gemma3_text"])
def test_transformers_masks_fail_where_the_wrapper_masks_pass(family, monkeypatch):
    """The reason for the wrapper's own masks: with transformers' (window over cache columns),
    a mid-padded pool is wrong past the window; with the wrapper's, every case passes."""
    from tritonlm.export import wrapper

    model = _model(family)
    assert verify_decoder(eager_decoder_fn(model), model, "onnx").failure() is None
    monkeypatch.setattr(wrapper, "layer_windows", lambda config: [None] * config.num_hidden_layers)
    report = verify_decoder(eager_decoder_fn(model), model, "onnx")
    bad = {c.name for c in report.cases if c.max_abs_diff > 1e-3}
    assert bad == {"mid_padded"}, [(c.name, c.max_abs_diff) for c in report.cases]


def test_attention_bias_counts_positions_over_unmasked_columns():
    """A mid-padded row [a b c _ _ | d]: d is at position 3; with a window of 2 it sees c and
    itself only, not the holes; a padding query sees itself (no empty softmax row)."""
    mask = torch.tensor([[1, 1, 1, 0, 0, 1], [0, 0, 1, 1, 1, 1]])
    bias = attention_bias(mask, seq=1, window=2)  # [2, 1, 1, 6]
    seen = (bias[:, 0, 0] == 0).int().tolist()
    assert seen == [[0, 0, 1, 0, 0, 1], [0, 0, 0, 0, 1, 1]]
    full = attention_bias(mask, seq=1, window=None)
    assert (full[:, 0, 0] == 0).int().tolist() == [[1, 1, 1, 0, 0, 1], [0, 0, 1, 1, 1, 1]]
    padded = attention_bias(torch.tensor([[0, 0, 1]]), seq=3, window=None)[0, 0]  # [3, 3]
    assert (padded == 0).int().tolist() == [[1, 0, 0], [0, 1, 0], [0, 0, 1]]


# ---------------------------------------------------------------------------- refusals


def test_unverified_format_is_skipped_by_default_and_refused_by_name(tmp_path, monkeypatch):
    """A family whose format is not verified: the default export skips that format with its
    reason and writes the others; naming it in --formats is refused, naming family, format and why."""
    from tritonlm.export import pipeline

    monkeypatch.setitem(pipeline.FORWARD_FORMATS, "granite", ("torchscript",))
    monkeypatch.setitem(pipeline.FORWARD_REFUSED, "granite", {f: "a test's reason" for f in FORMATS[:3]})
    folder = _folder(tmp_path, "granite")
    lines: list[str] = []
    result = export(ExportOptions(model=str(folder), repo=tmp_path / "repo", default_formats=["onnx", "torchscript"],
                                  runtime="python", max_context=64), out=lines.append)
    assert [a.fmt for a in result.artifacts] == ["torchscript"]
    assert any(s.startswith("skipping onnx forward-model export is not supported for Granite 3 dense (granite) "
                            "(onnx: a test's reason): exporting torchscript and the generation model") for s in lines)
    with pytest.raises(ExportError, match=r"--formats: onnx-fp16 forward-model export is not supported for Granite 3 "
                                          r"dense \(granite\) \(onnx-fp16: a test's reason\); its verified formats: "
                                          r"torchscript.*--formats none"):
        export(ExportOptions(model=str(folder), repo=tmp_path / "repo2", formats=["onnx-fp16"]), out=lambda s: None)
    assert not (tmp_path / "repo2").exists()


def test_a_length_dependent_rope_exports_the_generation_model_alone(tmp_path):
    """Phi-4-mini's longrope (tables that change with the sequence's length): the default export
    writes the generation model and skips every forward format, saying why; naming one is refused."""
    from tests.unit.engine.runners.test_rope import tiny_variant

    folder = tmp_path / "Tiny-phi4"
    tiny_variant("phi4_mini").save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    lines: list[str] = []
    result = export(ExportOptions(model=str(folder), repo=tmp_path / "repo", runtime="python", max_context=64),
                    out=lines.append)
    assert result.artifacts == [] and any((tmp_path / "repo").iterdir())
    assert any("its longrope RoPE changes its tables with the sequence's length" in s
               and "exporting the generation model alone" in s for s in lines), lines
    with pytest.raises(ExportError, match=r"--formats: onnx forward-model export is not supported for Phi-3 / Phi-4-mini "
                                          r"\(phi3\) \(onnx: its longrope RoPE"):
        export(ExportOptions(model=str(folder), repo=tmp_path / "repo2", formats=["onnx"]), out=lambda s: None)
