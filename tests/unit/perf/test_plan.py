"""tritonlm/perf/plan.py, the KV cache capacity planner: exact figures, no server."""

from __future__ import annotations

import json

import pytest

from tritonlm.cli import main as cli_main
from tritonlm.perf import plan
from tritonlm.perf.plan import GB, GiB, KiB, MiB


def llama7b():
    return plan.load_model_config("llama-7b")[1]


def test_llama_7b_fp16_reference_figures():
    cfg = llama7b()
    per_token = plan.bytes_per_token(cfg, "fp16")
    assert per_token == 512 * KiB
    assert plan.human(per_token) == "512 KiB"
    chat = plan.bytes_per_sequence(per_token, 512)
    assert chat == 256 * MiB
    # 6.74B parameters x 2 bytes; an "80 GB" A100 leaves 66 GB after them
    assert plan.param_count(cfg) == 6_738_415_616
    weights = plan.weight_bytes(cfg, "fp16")
    free = plan.free_memory(plan.DEVICES["a100-80gb"], weights)
    assert free == 80 * GB - 13_476_831_232
    assert round(free / GB) == 67 and 66 * GB < free < 67 * GB
    chats = plan.max_concurrent(free, per_token, 512)
    assert chats == 247  # the "about 260" is 66.5 GB / 256 MB (decimal); 256 MiB is 268 MB
    assert abs(chats - 260) / 260 < 0.06
    long_ctx = plan.bytes_per_sequence(per_token, 16 * 1024)
    assert long_ctx == 8 * GiB
    assert plan.max_concurrent(free, per_token, 16 * 1024) == 7


def test_bytes_per_token_is_modelspec_arithmetic():
    # 2 (K,V) x layers x kv_heads x head_dim x bytes
    assert plan.bytes_per_token(plan.load_model_config("gpt2")[1], "fp32") == 2 * 12 * 12 * 64 * 4 == 72 * KiB
    assert plan.bytes_per_token(plan.load_model_config("gpt2-medium")[1], "fp16") == 2 * 24 * 16 * 64 * 2
    assert plan.bytes_per_token(plan.load_model_config("distilgpt2")[1], "fp16") == 2 * 6 * 12 * 64 * 2
    assert plan.bytes_per_token(plan.load_model_config("llama-13b")[1], "fp16") == 2 * 40 * 40 * 128 * 2 == 800 * KiB
    # grouped-query attention: only the 3 KV heads count
    assert plan.bytes_per_token(plan.load_model_config("smollm2-135m")[1], "fp16") == 2 * 30 * 3 * 64 * 2
    assert plan.bytes_per_token(llama7b(), "int8") == 256 * KiB


def test_param_counts_match_published_sizes():
    assert plan.param_count(plan.load_model_config("gpt2")[1]) == 124_439_808
    assert plan.param_count(plan.load_model_config("smollm2-135m")[1]) == 134_515_008
    assert plan.param_count(plan.load_model_config("llama-13b")[1]) == 13_015_864_320
    assert plan.param_count(plan.load_model_config("llama-70b")[1]) == 68_976_648_192


def test_hf_config_json_path(tmp_path):
    # what `save_pretrained` writes for a GQA llama; head_dim given explicitly
    cfg = {
        "model_type": "llama", "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
        "hidden_size": 256, "head_dim": 32, "intermediate_size": 512, "max_position_embeddings": 1024, "vocab_size": 1000,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    name, loaded = plan.load_model_config(str(tmp_path))
    assert loaded == cfg
    assert plan.bytes_per_token(loaded, "fp16") == 2 * 4 * 2 * 32 * 2
    with pytest.raises(plan.PlanError, match="unknown model"):
        plan.load_model_config(str(tmp_path / "nope.json"))


def test_sizes_and_rounding():
    assert plan.parse_size("80GB") == 80 * 10**9
    assert plan.parse_size("66GiB") == 66 * 2**30
    assert plan.parse_size("512MiB") == 512 * MiB
    assert plan.parse_size("1.5GB") == 1_500_000_000
    assert plan.parse_size("4096") == 4096
    with pytest.raises(plan.PlanError):
        plan.parse_size("lots")
    assert plan.human(8 * GiB) == "8 GiB"
    assert plan.human(1.5 * GiB) == "1.5 GiB"
    assert plan.max_concurrent(10 * GiB, 512 * KiB, 16 * 1024) == 1
    assert plan.max_concurrent(16 * GiB - 1, 512 * KiB, 16 * 1024) == 1
    assert plan.max_concurrent(16 * GiB, 512 * KiB, 16 * 1024) == 2


def test_max_sequence_length_from_traffic_log(tmp_path):
    log = tmp_path / "traffic.jsonl"
    # 100 requests: lengths 10, 20, ..., 1000 (prompt + output); P99 nearest rank = the 99th = 990
    lines = [json.dumps({"prompt_tokens": 5 * i, "output_tokens": 5 * i}) for i in range(1, 101)]
    log.write_text("\n".join(lines) + "\n")
    lengths = plan.sequence_lengths(log)
    assert lengths == [10 * i for i in range(1, 101)]
    assert plan.nearest_rank(lengths, 99) == 990
    assert plan.nearest_rank(lengths, 50) == 500
    assert plan.recommend_max_sequence_length(lengths) == 1024  # 990 rounded up to a multiple of 64
    assert plan.recommend_max_sequence_length(lengths, round_to=1) == 990
    assert plan.recommend_max_sequence_length(lengths, cap=512) == 512
    # text instead of counts: ~4 characters a token
    text_log = tmp_path / "text.jsonl"
    text_log.write_text(json.dumps({"prompt": "x" * 40, "output": "y" * 9}) + "\n")
    assert plan.sequence_lengths(text_log) == [10 + 3]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt_tokens": 3}\n')
    with pytest.raises(plan.PlanError, match="bad.jsonl:1"):
        plan.sequence_lengths(bad)


def test_plan_cli(tmp_path, capsys):
    log = tmp_path / "traffic.jsonl"
    log.write_text("\n".join(json.dumps({"prompt_tokens": 400, "output_tokens": 100 + i}) for i in range(100)) + "\n")
    rc = cli_main(["plan", "llama-7b", "--context", "512,16384", "--traffic-log", str(log), "--results", str(tmp_path / "out")])
    out = capsys.readouterr().out
    assert rc == 0
    assert "512 KiB per token" in out
    assert "66.52 GB" in out
    assert "P99 of prompt+output = 598 tokens -> max_sequence_length 640" in out
    rows = (tmp_path / "out" / "plan.csv").read_text().splitlines()
    assert rows[0].startswith("context_tokens,kv_bytes_per_sequence")
    assert rows[1].split(",")[:4] == ["512", str(256 * MiB), "256 MiB", "247"]
    assert rows[2].split(",")[:4] == ["16384", str(8 * GiB), "8 GiB", "7"]
    assert (tmp_path / "out" / "plan.png").stat().st_size > 1000
    # free memory given directly, binary units
    rc = cli_main(["plan", "llama-7b", "--free-memory", "66GiB", "--context", "512", "--results", str(tmp_path / "o2")])
    assert rc == 0
    assert (tmp_path / "o2" / "plan.csv").read_text().splitlines()[1].split(",")[3] == "264"
    # a bad model name is one clear line, exit 1
    assert cli_main(["plan", "no-such-model", "--results", str(tmp_path / "o3")]) == 1
    assert "unknown model 'no-such-model'" in capsys.readouterr().err
