"""tritonlm/perf/replicas.py, `tritonlm plan --rate`: how many replicas a request rate needs
and the autoscaler's waiting target, exact figures, no server."""

from __future__ import annotations

import json

import pytest

from tritonlm.cli import main as cli_main
from tritonlm.perf import replicas


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
