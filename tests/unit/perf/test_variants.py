"""tritonlm/perf/variants.py: a model config changed only where asked, refused where the model
cannot do it, and variant folders that link the original's artifacts and clean up after
themselves without touching a real model folder."""

from __future__ import annotations

import os

import pytest
from google.protobuf import text_format

from tritonlm.paths import REPO_ROOT
from tritonlm.perf.variants import (
    MARKER,
    ModelConfig,
    VariantError,
    VariantSpec,
    apply_variant,
    config_to_json,
    make_variant,
    read_config,
    remove_variant,
)


ECHO = REPO_ROOT / "model_repository" / "echo"


def test_apply_variant_changes_only_the_asked_fields():
    original = read_config(ECHO)
    assert original.HasField("dynamic_batching")
    off = apply_variant(original, VariantSpec(dynamic_batching=False), name="echo__unbatched")
    assert not off.HasField("dynamic_batching")
    assert off.name == "echo__unbatched" and off.max_batch_size == original.max_batch_size
    assert original.HasField("dynamic_batching") and original.name == "echo"  # untouched
    tuned = apply_variant(original, VariantSpec(max_batch_size=16, max_queue_delay_us=500, instance_count=3))
    assert tuned.max_batch_size == 16
    assert tuned.dynamic_batching.max_queue_delay_microseconds == 500
    assert [g.count for g in tuned.instance_group] == [3]
    assert tuned.parameters["task"].string_value == "echo" and tuned.backend == "tritonlm"
    # the JSON override Triton's load API takes round-trips through the same schema
    assert '"max_queue_delay_microseconds": "500"' in config_to_json(tuned)


def test_apply_variant_refuses_what_the_model_cannot_do():
    no_batch = text_format.Parse('name: "m" max_batch_size: 0 backend: "python"', ModelConfig())
    with pytest.raises(VariantError, match="no batch dimension"):
        apply_variant(no_batch, VariantSpec(dynamic_batching=True))
    with pytest.raises(VariantError, match="cannot add or remove the batch dimension"):
        apply_variant(no_batch, VariantSpec(max_batch_size=8))
    with pytest.raises(VariantError, match="instance count"):
        apply_variant(read_config(ECHO), VariantSpec(instance_count=0))
    # preferred sizes above a smaller max would make an invalid config: they are dropped
    cfg = text_format.Parse(
        'name: "m" max_batch_size: 16 dynamic_batching { preferred_batch_size: [4, 16] }', ModelConfig()
    )
    assert list(apply_variant(cfg, VariantSpec(max_batch_size=8)).dynamic_batching.preferred_batch_size) == [4]


def test_make_variant_links_artifacts_and_cleans_up(tmp_path):
    repo = tmp_path / "repo"
    src = repo / "m"
    (src / "1").mkdir(parents=True)
    (src / "1" / "model.onnx").write_bytes(b"weights")
    (src / "tokenizer.json").write_text("{}")
    (src / "config.pbtxt").write_text(
        'name: "m" backend: "python" max_batch_size: 4 dynamic_batching { max_queue_delay_microseconds: 100 }'
    )
    dst = make_variant(src, repo, "m__x", VariantSpec(dynamic_batching=False, instance_count=2))
    cfg = read_config(dst)
    assert cfg.name == "m__x" and not cfg.HasField("dynamic_batching") and cfg.instance_group[0].count == 2
    weights = dst / "1" / "model.onnx"
    assert weights.is_symlink() and not os.path.isabs(os.readlink(weights))  # relative: the repo can move
    assert weights.read_bytes() == b"weights"
    assert (dst / "tokenizer.json").is_symlink()
    assert (dst / MARKER).is_file()
    # a real model folder is never deleted or overwritten
    assert remove_variant(src) is False
    with pytest.raises(VariantError, match="original model's name"):
        make_variant(src, repo, "m", VariantSpec())
    (repo / "other" / "1").mkdir(parents=True)
    with pytest.raises(VariantError, match="not a variant"):
        make_variant(src, repo, "other", VariantSpec())
    assert remove_variant(dst) is True and not dst.exists()
    assert (src / "1" / "model.onnx").read_bytes() == b"weights"
