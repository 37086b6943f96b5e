"""KV cache capacity planner: exact figures, no server."""

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
    # 6.74B parameters x 2 bytes; an "80 GB" A100 leaves ~66 GB after them
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


# ---- replicas (tritonlm/perf/replicas.py) -------------------------------------------------

from tritonlm.perf import replicas  # noqa: E402


def test_replicas_exact_figures():
    r = replicas.plan_replicas(rate=100, p99_ms=500, capacity=30)
    # ceil(100 / (30 x 0.8)) = ceil(4.17) = 5; waiting target floor(30 x 0.5 x 0.2) = 3
    assert (r.replicas, r.hpa_waiting_target) == (5, 3)
    assert r.per_replica_rate == 20.0
    # exactly at the planned utilization: 96 / 24 = 4, not 5 (float rounding)
    assert replicas.plan_replicas(rate=96, p99_ms=500, capacity=30).replicas == 4
    assert replicas.plan_replicas(rate=96.1, p99_ms=500, capacity=30).replicas == 5
    # a low rate still needs one replica; a tight budget still allows one queued request
    low = replicas.plan_replicas(rate=0.5, p99_ms=50, capacity=30)
    assert (low.replicas, low.hpa_waiting_target) == (1, 1)
    # no headroom asked for: replicas at full capacity
    full = replicas.plan_replicas(rate=90, p99_ms=2000, capacity=30, utilization=1.0)
    assert (full.replicas, full.hpa_waiting_target) == (3, 1)
    half = replicas.plan_replicas(rate=90, p99_ms=2000, capacity=30, utilization=0.5)
    assert (half.replicas, half.hpa_waiting_target) == (6, 30)  # floor(30 x 2 x 0.5)


@pytest.mark.parametrize("kwargs, flag", [
    ({"rate": 0, "p99_ms": 500, "capacity": 30}, "--rate"),
    ({"rate": -5, "p99_ms": 500, "capacity": 30}, "--rate"),
    ({"rate": 10, "p99_ms": 500, "capacity": 0}, "--capacity"),
    ({"rate": 10, "p99_ms": 500, "capacity": -1}, "--capacity"),
    ({"rate": 10, "p99_ms": 0, "capacity": 30}, "--p99-ms"),
    ({"rate": 10, "p99_ms": 500, "capacity": 30, "utilization": 1.5}, "--utilization"),
    ({"rate": float("nan"), "p99_ms": 500, "capacity": 30}, "--rate"),
])
def test_replicas_refuse_bad_input_naming_the_flag(kwargs, flag):
    with pytest.raises(replicas.ReplicaPlanError, match=f"^{flag} "):
        replicas.plan_replicas(**kwargs)


def write_sla_csv(path):
    # the columns `tritonlm perf sla` writes (Point.row() + within_budget), trimmed
    path.write_text(
        "model,concurrency,throughput_per_s,p50_ms,p99_ms,within_budget\n"
        "m,1,12.5,70.0,80.0,True\n"
        "m,2,22.0,85.0,95.0,True\n"
        "m,4,31.0,120.0,140.0,True\n"
        "m,8,33.0,230.0,260.0,False\n"
    )
    return path


def test_capacity_from_a_number_or_the_sla_csv(tmp_path):
    assert replicas.capacity_from("42.5", 100) == 42.5
    csv_path = write_sla_csv(tmp_path / "sla.csv")
    assert replicas.capacity_from(str(csv_path), 150) == 31.0  # the best point within 150 ms
    assert replicas.capacity_from(str(csv_path), 100) == 22.0  # a tighter budget than the sweep's
    assert replicas.capacity_from(str(csv_path), 1000) == 33.0
    json_path = tmp_path / "sla.json"
    json_path.write_text(json.dumps([{"throughput_per_s": 12.5, "p99_ms": 80}, {"throughput_per_s": 31, "p99_ms": 140}]))
    assert replicas.capacity_from(str(json_path), 150) == 31.0
    with pytest.raises(replicas.ReplicaPlanError, match="no point .* within 50 ms"):
        replicas.capacity_from(str(csv_path), 50)
    with pytest.raises(replicas.ReplicaPlanError, match="^--capacity: .* neither a number"):
        replicas.capacity_from(str(tmp_path / "missing.csv"), 100)
    (tmp_path / "other.csv").write_text("a,b\n1,2\n")
    with pytest.raises(replicas.ReplicaPlanError, match="not a `tritonlm perf sla` result"):
        replicas.capacity_from(str(tmp_path / "other.csv"), 100)


def test_plan_cli_replicas(tmp_path, capsys):
    csv_path = write_sla_csv(tmp_path / "sla.csv")
    assert cli_main(["plan", "--rate", "100", "--p99-ms", "150", "--capacity", str(csv_path)]) == 0
    out = capsys.readouterr().out
    # capacity 31 req/s: ceil(100 / 24.8) = 5 replicas; floor(31 x 0.15 x 0.2) = 0 -> 1
    assert "replicas: 5 = ceil(100 / (31 x 0.8 utilization target))" in out
    assert 'metric tritonlm_requests_waiting, target averageValue "1"' in out
    assert cli_main(["plan", "--rate", "100", "--p99-ms", "500", "--capacity", "30", "--utilization", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "replicas: 7 = " in out and 'averageValue "7"' in out  # ceil(100/15); floor(30 x 0.5 x 0.5)


@pytest.mark.parametrize("argv, message", [
    (["plan", "--rate", "0", "--p99-ms", "500", "--capacity", "30"], "--rate must be a positive"),
    (["plan", "--rate", "10", "--p99-ms", "500", "--capacity", "0"], "--capacity must be"),
    (["plan", "--rate", "10", "--p99-ms", "-1", "--capacity", "30"], "--p99-ms must be a positive"),
    (["plan", "--rate", "10"], "--rate needs --p99-ms and --capacity"),
    (["plan", "--capacity", "30"], "--capacity only count with --rate"),
    (["plan"], "give a model"),
])
def test_plan_cli_replicas_refuses_bad_input(argv, message, capsys):
    assert cli_main(argv) != 0
    assert f"error: {message}" in capsys.readouterr().err
