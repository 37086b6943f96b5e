"""The harnesses' pure parts, without a server: config variants, input synthesis, the
profile-export parser, the operating-point classifier, perf_analyzer error text."""

from __future__ import annotations

import os

import pytest
from google.protobuf import text_format

from tritonlm.paths import REPO_ROOT
from tritonlm.perf import diagnose, llm
from tritonlm.perf.analyzer import error_text, parse_loads
from tritonlm.perf.inputs import parse_shape, synth_input_data, vocab_size_of
from tritonlm.perf.report import table
from tritonlm.perf.serverstats import parse_prometheus
from tritonlm.perf.stats import percentile
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


# --- variants ----------------------------------------------------------------------------------
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


# --- input synthesis ---------------------------------------------------------------------------
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


def test_parse_loads():
    assert parse_loads("1,2,4") == [1, 2, 4]
    assert parse_loads("1:64") == [1, 2, 4, 8, 16, 32, 64]
    assert parse_loads("10:30:10") == [10, 20, 30]
    for bad in ("", "0,1", "8:1", "a,b"):
        with pytest.raises(ValueError):
            parse_loads(bad)


def test_error_text_keeps_perf_analyzers_words_and_drops_usage():
    stdout = "Error: Failed to parse --input-data. Unsupported type provided\nUsage: perf_analyzer [options]\n -m <model>\n"
    assert error_text(stdout, "") == "Error: Failed to parse --input-data. Unsupported type provided"
    stderr = "error: failed to get model metadata: Request for unknown model: 'nope' is not found\n"
    assert "unknown model: 'nope'" in error_text("*** Measurement Settings ***\n", stderr)
    assert error_text("", "") == "no output"


def test_table_aligns_columns():
    text = table([{"a": 1, "b": "x"}, {"a": 22.5, "b": "yy"}], title="T")
    lines = text.splitlines()
    assert lines[0] == "T" and lines[1].split() == ["a", "b"]
    assert lines[3].startswith("    1") and lines[4].startswith("22.50")


# --- the profile export parser ----------------------------------------------------------------
MS = 1_000_000  # ns


def _request(sent_ms, token_ms, final_ms=None, pieces=None):
    pieces = pieces or [f" t{i}" for i in range(len(token_ms))]
    stamps = [int((sent_ms + t) * MS) for t in token_ms]
    outputs = [{"text_output": p} for p in pieces]
    if final_ms is not None:  # the empty response that carries the final flag
        stamps.append(int((sent_ms + final_ms) * MS))
        outputs.append({})
    return {"timestamp": int(sent_ms * MS), "request_inputs": {}, "response_timestamps": stamps, "response_outputs": outputs}


def test_parse_profile_export_exact():
    export = {
        "experiments": [
            {
                "experiment": {"mode": "concurrency", "value": 2},
                "requests": [
                    _request(0, [40, 55, 70, 85], final_ms=86),  # TTFT 40, ITL 15, 4 tokens
                    _request(10, [30, 50], final_ms=60),  # TTFT 30, ITL 20, 2 tokens
                    _request(20, [25]),  # one token: no ITL
                    {"timestamp": 30 * MS, "response_timestamps": [int(35 * MS)], "response_outputs": [{"text_output": ""}]},
                ],
            }
        ]
    }
    (m,) = llm.parse_profile_export(export)
    assert (m.mode, m.load, m.requests, m.empty_requests) == ("concurrency", 2.0, 4, 1)
    assert [t.ttft_ms for t in m.timings] == pytest.approx([40, 30, 25])
    assert m.timings[0].itl_ms == pytest.approx(15) and m.timings[1].itl_ms == pytest.approx(20) and m.timings[2].itl_ms is None
    assert [t.latency_ms for t in m.timings] == pytest.approx([86, 60, 25])
    assert [t.output_tokens for t in m.timings] == [4, 2, 1]
    assert m.output_tokens == 7
    assert m.duration_s == pytest.approx(0.086)  # first request sent at 0, last response at 86 ms
    assert m.output_tokens_per_s == pytest.approx(7 / 0.086)
    assert m.itl_ms["avg"] == pytest.approx(17.5)
    assert m.ttft_ms["p50"] == pytest.approx(30) and m.ttft_ms["max"] == pytest.approx(40)
    # re-tokenizing the text instead of counting pieces
    (m2,) = llm.parse_profile_export(export, count_tokens=lambda s: 2 * len(s.split()))
    assert m2.timings[0].output_tokens == 8 and m2.timings[0].itl_ms == pytest.approx(45 / 7)


def test_percentile_matches_numpy():
    import numpy as np

    values = [3.0, 1.0, 4.0, 1.5, 9.0, 2.6, 5.0]
    for q in (0, 10, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_llm_input_data_and_datasets(tmp_path):
    ds = llm.synthetic_dataset(20, prompt_mean=10, prompt_stddev=3, output_mean=8, output_stddev=2, seed=1)
    assert len(ds) == 20 and all(p.max_tokens >= 1 for p in ds)
    assert 6 <= sum(len(p.text.split()) for p in ds) / 20 <= 14
    assert ds == llm.synthetic_dataset(20, prompt_mean=10, prompt_stddev=3, output_mean=8, output_stddev=2, seed=1)
    data = llm.input_data(ds[:2], {"text_input", "max_tokens", "stream", "min_tokens"}, fixed_length=True)
    assert data["data"][0] == {
        "text_input": [ds[0].text], "max_tokens": [ds[0].max_tokens], "stream": [True], "min_tokens": [ds[0].max_tokens]
    }
    with pytest.raises(llm.PerfError, match="no input max_tokens"):
        llm.input_data(ds, {"text_input"})
    f = tmp_path / "d.jsonl"
    f.write_text('{"prompt": "hello there", "max_tokens": 3}\n\n{"text_input": "x", "output_tokens": 5}\n')
    assert llm.load_dataset(f) == [llm.Prompt("hello there", 3), llm.Prompt("x", 5)]
    f.write_text('{"prompt": "hello"}\n')
    with pytest.raises(llm.PerfError, match="d.jsonl:1"):
        llm.load_dataset(f)


# --- the operating-point classifier ------------------------------------------------------------
def _metrics(util, success, inferences, executions, queue_us, compute_us, gpu=False):
    lines = [
        f'nv_inference_request_success{{model="m",version="1"}} {success}',
        'nv_inference_request_success{model="other",version="1"} 999',
        f'nv_inference_count{{model="m",version="1"}} {inferences}',
        f'nv_inference_exec_count{{model="m",version="1"}} {executions}',
        f'nv_inference_queue_duration_us{{model="m",version="1"}} {queue_us}',
        f'nv_inference_compute_infer_duration_us{{model="m",version="1"}} {compute_us}',
        "# HELP nv_cpu_utilization CPU utilization rate [0.0 - 1.0]",
        f"nv_cpu_utilization {0.5 if gpu else util}",
    ]
    if gpu:
        lines += [f'nv_gpu_utilization{{gpu_uuid="GPU-a"}} {util}', f'nv_gpu_utilization{{gpu_uuid="GPU-b"}} {util}']
    return "\n".join(lines) + "\n"


def test_prometheus_samples_to_operating_point():
    parsed = parse_prometheus('a{x="1",y="q\\"z"} 2.5\nb 3\n# c 4\nbad line\n')
    assert parsed == {("a", (("x", "1"), ("y", 'q\\"z'))): 2.5, ("b", ()): 3.0}
    samples = [
        diagnose.Sample(0.0, parse_prometheus(_metrics(0.1, 100, 100, 50, 1000, 2000, gpu=True))),
        diagnose.Sample(0.5, parse_prometheus(_metrics(0.8, 300, 500, 100, 21000, 42000, gpu=True))),
        diagnose.Sample(1.0, parse_prometheus(_metrics(0.9, 500, 900, 150, 41000, 82000, gpu=True))),
    ]
    s = diagnose.summarize_samples(samples, "m")
    assert s["source"] == "gpu"
    assert s["utilization"] == pytest.approx(0.85)  # samples after the first, GPUs averaged
    assert (s["requests"], s["inferences"], s["executions"]) == (400, 800, 100)
    assert s["avg_batch"] == pytest.approx(8.0)
    assert s["queue_us"] == pytest.approx(100.0) and s["compute_us"] == pytest.approx(200.0)
    cpu = [diagnose.Sample(0, parse_prometheus(_metrics(0.3, 0, 0, 0, 0, 0))),
           diagnose.Sample(1, parse_prometheus(_metrics(0.4, 10, 10, 10, 0, 0)))]
    assert diagnose.summarize_samples(cpu, "m")["source"] == "cpu"
    assert diagnose.summarize_samples(cpu, "m")["utilization"] == pytest.approx(0.4)


@pytest.mark.parametrize(
    "util,p99,queue,compute,state",
    [
        (0.30, 20, 100, 900, diagnose.UNDER_BATCHED),
        (0.59, 200, 900, 100, diagnose.UNDER_BATCHED),
        (0.98, 150, 800, 200, diagnose.OVER_BATCHED),
        (0.98, 150, 100, 900, diagnose.MODEL_TOO_BIG),
        (0.78, 95, 300, 700, diagnose.ON_TARGET),
        (0.70, 40, 300, 700, diagnose.ON_TARGET),
        (0.85, 100, 300, 700, diagnose.ON_TARGET),
        (0.65, 50, 300, 700, diagnose.LIGHT_LOAD),
        (0.90, 80, 300, 700, diagnose.NEAR_SATURATION),
        (0.98, 80, 300, 700, diagnose.NEAR_SATURATION),
        (0.80, 130, 700, 300, diagnose.OVER_BUDGET),
    ],
)
def test_classify(util, p99, queue, compute, state):
    op = diagnose.OperatingPoint(util, "gpu", p99, 100.0, queue_us=queue, compute_us=compute, avg_batch=4, max_batch_size=8)
    d = diagnose.classify(op)
    assert d.state == state
    assert d.advice and d.summary


def test_classify_advice_names_the_knobs():
    under = diagnose.classify(diagnose.OperatingPoint(0.2, "cpu", 10, 100, avg_batch=1.2, max_batch_size=8))
    assert "max_batch_size" in under.advice[0] and "max_queue_delay" in under.advice[0]
    assert "average batch 1.2 of max 8" in under.summary
    big = diagnose.classify(diagnose.OperatingPoint(0.99, "gpu", 300, 100, queue_us=10, compute_us=990))
    assert "quantize" in big.advice[0] and "smaller model" in big.advice[0]
    assert any("instances" in a for a in big.advice)
