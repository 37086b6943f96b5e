"""tritonlm/perf/inputs.py: perf_analyzer's input data synthesized from a model's config,
a KV-cache forward pass's past included."""

from __future__ import annotations

import pytest

from tritonlm.perf.inputs import parse_shape, synth_input_data, vocab_size_of


def test_synth_input_data_from_config():
    config = {
        "name": "lm",
        "max_batch_size": 8,
        "input": [
            {"name": "input_ids", "data_type": "TYPE_INT64", "dims": ["-1"]},
            {"name": "attention_mask", "data_type": "TYPE_INT64", "dims": ["-1"]},
            {"name": "prompt", "data_type": "TYPE_STRING", "dims": ["1"]},
            {"name": "temperature", "data_type": "TYPE_FP32", "dims": ["1"], "optional": True},
        ],
        "output": [{"name": "logits", "data_type": "TYPE_FP32", "dims": ["-1", "50"]}],
    }
    assert vocab_size_of(config) == 50
    data, args = synth_input_data(config, seq_len=12, string_length=20, entries=5)
    assert args == ["--shape", "attention_mask:12", "--shape", "input_ids:12"]
    assert len(data["data"]) == 5
    for entry in data["data"]:
        assert set(entry) == {"input_ids", "attention_mask", "prompt"}  # optional input left out
        ids = entry["input_ids"]
        assert ids["shape"] == [12] and len(ids["content"]) == 12
        assert all(0 <= i < 50 for i in ids["content"])
        assert entry["attention_mask"]["content"] == [1] * 12
        assert len(entry["prompt"]) == 1 and 0 < len(entry["prompt"][0]) <= 20
    data, args = synth_input_data(config, vocab_size=7, shape_overrides={"input_ids": [3]})
    assert data["data"][0]["input_ids"]["shape"] == [3] and max(data["data"][0]["input_ids"]["content"]) < 7
    assert "input_ids:3" in args
    assert vocab_size_of({"parameters": {"vocab_size": {"string_value": "321"}}}) == 321
    assert vocab_size_of({}) == 256
    assert parse_shape("input_ids:1,16") == ("input_ids", [1, 16])
    with pytest.raises(ValueError, match="NAME:D1"):
        parse_shape("input_ids")


def test_synth_input_data_for_a_kv_cache_forward_pass():
    """The exported forward models (input_ids, attention_mask, position_ids, past_key_values.N.*)."""
    config = {
        "name": "lm_onnx",
        "max_batch_size": 16,
        "input": [
            {"name": "input_ids", "data_type": "TYPE_INT64", "dims": ["-1"]},
            {"name": "attention_mask", "data_type": "TYPE_INT64", "dims": ["-1"]},
            {"name": "position_ids", "data_type": "TYPE_INT64", "dims": ["-1"]},
            {"name": "past_key_values.0.key", "data_type": "TYPE_FP32", "dims": ["4", "-1", "16"]},
        ],
        "output": [{"name": "logits", "data_type": "TYPE_FP32", "dims": ["-1", "512"]}],
    }
    data, args = synth_input_data(config, seq_len=5, past_len=3, entries=1)
    (entry,) = data["data"]
    assert entry["input_ids"]["shape"] == [5] and max(entry["input_ids"]["content"]) < 512
    assert entry["attention_mask"] == {"content": [1] * 8, "shape": [8]}  # past + new
    assert entry["position_ids"] == {"content": [3, 4, 5, 6, 7], "shape": [5]}  # continue after the past
    assert entry["past_key_values.0.key"]["shape"] == [4, 3, 16] and len(entry["past_key_values.0.key"]["content"]) == 192
    assert "past_key_values.0.key:4,3,16" in args
    # the default is a prefill: an empty cache, whose shape perf_analyzer's --shape cannot express
    data, args = synth_input_data(config, seq_len=5, entries=1)
    (entry,) = data["data"]
    assert entry["past_key_values.0.key"] == {"content": [], "shape": [4, 0, 16]}
    assert entry["attention_mask"]["shape"] == [5] and entry["position_ids"]["content"] == [0, 1, 2, 3, 4]
    assert not any(a.startswith("past_key_values") for a in args)
