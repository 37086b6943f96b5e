"""The perf harnesses end to end: real perf_analyzer against a real tritonserver.
`tritonlm perf llm --serve` measures the tritonlm generation model on a server of its own.

Models: the `echo` wiring model (batched, Python-based backend), a streaming test
model with known timing (tests.helpers.timed_models: first piece after PREFILL_MS,
then one every TOKEN_MS) and a token-id model that rejects ids outside its
vocabulary. Windows are short and request counts small: the machine has 2 cores.
Every check compares perf_analyzer's figures with the server's own statistics.
"""

from __future__ import annotations

import csv
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf import text_format

from tests.helpers.servers import add_generation_model
from tritonlm.cli import main as cli_main
from tritonlm.paths import REPO_ROOT
from tritonlm.perf import diagnose, llm
from tritonlm.perf.analyzer import Measure
from tritonlm.perf.inputs import input_args
from tritonlm.perf.stats import percentile
from tritonlm.perf.target import Target
from tests.helpers.timed_models import write_streaming_model, write_token_model
from tritonlm.perf.variants import ModelConfig

PREFILL_MS = 40.0
TOKEN_MS = 15.0
MODELS = ["echo", "stream_test", "token_test"]


@pytest.fixture(scope="module")
def triton_repo(tmp_path_factory) -> Path:
    repo = tmp_path_factory.mktemp("perfrepo")
    shutil.copytree(REPO_ROOT / "model_repository" / "echo", repo / "echo")
    write_streaming_model(repo, "stream_test", prefill_ms=PREFILL_MS, token_ms=TOKEN_MS)
    write_token_model(repo, "token_test", vocab=100)
    return repo


@pytest.fixture(scope="module")
def triton_server_options() -> dict:
    return {"model_control": "explicit", "load_models": MODELS, "extra_args": ["--metrics-interval-ms=250"]}


@pytest.fixture(scope="module")
def target(triton_server) -> Target:
    t = Target("127.0.0.1", triton_server.http_port, triton_server.grpc_port, triton_server.metrics_port, repo=Path(triton_server.repo))
    yield t
    t.close()


def server_args(server) -> list[str]:
    return [
        "--host", "127.0.0.1",
        "--http-port", str(server.http_port),
        "--grpc-port", str(server.grpc_port),
        "--metrics-port", str(server.metrics_port),
        "--repo", str(server.repo),
    ]


def run(capsys, argv: list[str]) -> tuple[int, str, str]:
    rc = cli_main(argv)
    captured = capsys.readouterr()
    print(captured.out)  # visible with -s / on failure
    return rc, captured.out, captured.err


def read_csv(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def ready_models(target: Target) -> set[str]:
    return set(target.loaded_models())


# --- batching ----------------------------------------------------------------------------------
def test_batching_on_vs_off_matches_server_statistics(triton_server, target, tmp_path, capsys):
    out = tmp_path / "batching"
    rc, stdout, _ = run(
        capsys,
        ["perf", "batching", "--model", "echo", "--concurrency", "2,8", "--requests", "400", "--results", str(out), *server_args(triton_server)],
    )
    assert rc == 0
    points = read_csv(out / "batching_points.csv")
    assert [(p["variant"], p["concurrency"]) for p in points] == [("batched", "2"), ("batched", "8"), ("unbatched", "2"), ("unbatched", "8")]
    for p in points:
        # exactly the requests perf_analyzer sent reached the model, and it reported them all
        assert int(p["pa_requests"]) == int(p["server_inferences"]) == 400
        if p["variant"] == "batched":
            assert int(p["server_executions"]) < int(p["server_inferences"])
        else:
            assert int(p["server_executions"]) == int(p["server_inferences"])
            assert float(p["server_avg_batch"]) == 1.0
    batched_c8 = next(p for p in points if p["variant"] == "batched" and p["concurrency"] == "8")
    assert float(batched_c8["server_avg_batch"]) > 2.0  # 8 in flight, 2 ms queue delay: batches form
    assert float(batched_c8["server_avg_batch"]) <= 8.0  # never above max_batch_size
    summary = read_csv(out / "batching.csv")
    for row in summary:
        gain = float(row["batched_per_s"]) / float(row["unbatched_per_s"])
        assert float(row["gain"]) == pytest.approx(gain, abs=0.01)
    assert "best gain" in stdout and (out / "batching.png").stat().st_size > 1000
    # the variants are unloaded and their folders removed
    assert not (Path(triton_server.repo) / "echo__batched").exists()
    assert not (Path(triton_server.repo) / "echo__unbatched").exists()
    assert ready_models(target) == set(MODELS)


# --- sla ---------------------------------------------------------------------------------------
def test_sla_time_windows(triton_server, tmp_path, capsys):
    out = tmp_path / "sla"
    rc, stdout, _ = run(
        capsys,
        [
            "perf", "sla", "--model", "echo", "--p99-ms", "1000", "--concurrency", "1,4",
            "--measurement-interval", "500", "--max-trials", "4", "--stability", "30",
            "--results", str(out), *server_args(triton_server),
        ],
    )
    assert rc == 0
    rows = read_csv(out / "sla.csv")
    assert [r["concurrency"] for r in rows] == ["1", "4"]
    for r in rows:
        assert r["within_budget"] == "True"
        assert float(r["p50_ms"]) <= float(r["p95_ms"]) <= float(r["p99_ms"])
        # windows cover most of the run; the server also saw the requests between windows
        assert 0 < int(r["pa_requests"]) <= int(r["server_inferences"])
        assert int(r["pa_requests"]) >= 0.4 * int(r["server_inferences"])
    best = max(rows, key=lambda r: float(r["throughput_per_s"]))
    assert "SLA met: best" in stdout and f"(concurrency {best['concurrency']}, p99" in stdout
    assert (out / "sla.png").stat().st_size > 1000


def test_sla_not_met_exits_3(triton_server, tmp_path, capsys):
    rc, stdout, _ = run(
        capsys,
        ["perf", "sla", "--model", "echo", "--p99-ms", "0.001", "--concurrency", "1,2,4", "--requests", "50",
         "--results", str(tmp_path), *server_args(triton_server)],
    )
    assert rc == 3
    assert "SLA not met" in stdout
    assert len(read_csv(tmp_path / "sla.csv")) == 2  # stopped after two points over budget


def test_any_model_gets_valid_token_ids(triton_server, tmp_path, capsys):
    """token_test has dynamic INT64 inputs and rejects ids >= 100: inputs come from its config."""
    rc, _, _ = run(
        capsys,
        ["perf", "sla", "--model", "token_test", "--p99-ms", "1000", "--concurrency", "2", "--requests", "100",
         "--shape", "input_ids:7", "--shape", "attention_mask:7", "--results", str(tmp_path), *server_args(triton_server)],
    )
    assert rc == 0
    (row,) = read_csv(tmp_path / "sla.csv")
    assert int(row["server_inferences"]) == int(row["pa_requests"]) == 100
    # ids drawn from a wrong vocabulary: perf_analyzer fails and its own words (the model's error) are shown
    rc, _, err = run(
        capsys,
        ["perf", "sla", "--model", "token_test", "--p99-ms", "1000", "--concurrency", "1", "--requests", "20",
         "--vocab-size", "100000", "--results", str(tmp_path), *server_args(triton_server)],
    )
    assert rc == 1
    assert len(err.strip().splitlines()) == 1
    assert "perf_analyzer failed" in err and "input_ids outside [0, 100)" in err


# --- tune --------------------------------------------------------------------------------------
def test_tune_loads_candidates_with_config_overrides(triton_server, target, tmp_path, capsys):
    out = tmp_path / "tune"
    best = tmp_path / "best" / "config.pbtxt"
    log_before = len(triton_server.log_text())
    rc, stdout, _ = run(
        capsys,
        [
            "perf", "tune", "--model", "echo", "--p99-ms", "1000", "--concurrency", "8", "--requests", "200",
            "--queue-delays", "2000", "--batch-sizes", "4", "--instances", "1,2",
            "--results", str(out), "--write", str(best), *server_args(triton_server),
        ],
    )
    assert rc == 0
    rows = read_csv(out / "tune.csv")
    assert [r["candidate"].split(" ")[0] for r in rows] == ["current", "dyn_mbs4_q2000_i1", "dyn_mbs4_q2000_i2"]
    points = {r["candidate"].split(" ")[0]: r for r in read_csv(out / "tune_points.csv")}
    for p in points.values():
        assert int(p["server_inferences"]) == int(p["pa_requests"]) == 200
    # the override really reached the server: max_batch_size 4 caps the batches it formed
    assert 1.0 < float(points["dyn_mbs4_q2000_i1"]["server_avg_batch"]) <= 4.0
    assert float(points["current"]["server_avg_batch"]) > 4.0
    # ... and instance_group count 2 started a second instance of the tuning variant
    assert "echo__tune_0_1" in triton_server.log_text()[log_before:]
    winner = max(rows, key=lambda r: float(r["best_per_s"]))
    assert "recommended:" in stdout
    written = text_format.Parse(best.read_text(), ModelConfig())
    assert written.name == "echo" and written.backend == "tritonlm"
    if winner["candidate"].startswith("dyn_"):
        assert written.max_batch_size == 4
        assert written.dynamic_batching.max_queue_delay_microseconds == 2000
        assert written.instance_group[0].count == int(winner["instances"])
    assert not (Path(triton_server.repo) / "echo__tune").exists()
    assert ready_models(target) == set(MODELS)


# --- llm ---------------------------------------------------------------------------------------
def test_llm_streaming_metrics_match_known_timing(triton_server, target, tmp_path, capsys):
    before = target.stats("stream_test")
    out = tmp_path / "llm"
    rc, stdout, _ = run(
        capsys,
        [
            "perf", "llm", "--model", "stream_test", "--concurrency", "1,4", "--num-prompts", "8",
            "--prompt-tokens", "6", "--output-tokens", "5", "--results", str(out), *server_args(triton_server),
        ],
    )
    assert rc == 0
    rows = read_csv(out / "llm.csv")
    assert [r["concurrency"] for r in rows] == ["1", "4"]
    assert [int(r["requests"]) for r in rows] == [10, 16]  # max(10, 4 x concurrency)
    for r in rows:
        assert float(r["tokens_per_request"]) == 5.0
        assert PREFILL_MS <= float(r["ttft_p50_ms"]) <= PREFILL_MS + 25
        assert TOKEN_MS - 3 <= float(r["itl_avg_ms"]) <= TOKEN_MS + 10  # an average: one late piece moves it
        expected_latency = PREFILL_MS + 4 * TOKEN_MS
        assert expected_latency <= float(r["latency_p50_ms"]) <= expected_latency + 30
    # concurrent streams overlap: ~4x the tokens per second of one stream
    assert float(rows[1]["output_tokens_per_s"]) > 2.5 * float(rows[0]["output_tokens_per_s"])
    # the server saw every request perf_analyzer sent (2 warm-up requests included)
    assert (target.stats("stream_test") - before).success_count == 2 + 10 + 16
    assert (out / "llm.png").stat().st_size > 1000


def test_llm_dataset_lengths_and_export_parser(triton_server, target, tmp_path, capsys):
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text("".join(json.dumps({"prompt": f"question {n}", "max_tokens": n}) + "\n" for n in (2, 3, 4, 6)))
    out = tmp_path / "llm"
    rc, _, _ = run(
        capsys,
        ["perf", "llm", "--model", "stream_test", "--concurrency", "2", "--dataset", str(dataset),
         "--results", str(out), *server_args(triton_server)],
    )
    assert rc == 0
    export = json.loads((out / "raw" / "stream_test_concurrency_2.export.json").read_text())
    (metrics,) = llm.parse_profile_export(export)
    requests = export["experiments"][0]["requests"]
    assert metrics.requests == len(requests) == 10
    for req, timing in zip(requests, metrics.timings):
        asked = req["request_inputs"]["max_tokens"]
        assert timing.output_tokens == asked  # one streamed piece per token
        assert timing.text == "".join(f" t{i}" for i in range(asked))
        # The model keeps absolute deadlines: nothing arrives early, but on a busy 2-core machine any
        # single piece can arrive late (and the next ones catch up), so single ITLs are only bounded below
        # through the whole request's latency.
        assert timing.ttft_ms >= PREFILL_MS
        assert timing.latency_ms >= PREFILL_MS + (asked - 1) * TOKEN_MS
    assert metrics.output_tokens == sum(r["request_inputs"]["max_tokens"] for r in requests)
    assert metrics.ttft_ms["p50"] <= PREFILL_MS + 25
    itl_median = percentile([t.itl_ms for t in metrics.timings if t.itl_ms is not None], 50)
    assert TOKEN_MS - 3 <= itl_median <= TOKEN_MS + 6


# --- diagnose ----------------------------------------------------------------------------------
def test_diagnose_metrics_agree_with_statistics(triton_server, target, tmp_path):
    work = tmp_path / "raw"
    work.mkdir()
    args = input_args(target.config("echo"), work)
    measure = Measure(requests=600, protocol="http")
    diagnosis, op, point, summary, samples = diagnose.run_diagnose(target, "echo", 8, measure, args, work, 1000.0, interval_s=0.1)
    # the metrics endpoint and the statistics API count the same run
    assert summary["inferences"] == point.server.inference_count == 600
    assert summary["executions"] == point.server.execution_count
    assert op.avg_batch == pytest.approx(point.server.avg_batch)
    assert op.source == "cpu" and 0.0 <= op.utilization <= 1.0
    assert op.queue_us > 0 and op.compute_us > 0
    assert diagnosis.state in {
        diagnose.UNDER_BATCHED, diagnose.ON_TARGET, diagnose.LIGHT_LOAD, diagnose.NEAR_SATURATION,
    }  # within a 1 s budget nothing is over budget
    assert len(samples) >= 2


def test_diagnose_cli(triton_server, tmp_path, capsys):
    rc, stdout, _ = run(
        capsys,
        ["perf", "diagnose", "--model", "echo", "--p99-ms", "1000", "--concurrency", "4", "--requests", "300",
         "--results", str(tmp_path), *server_args(triton_server)],
    )
    assert rc == 0
    (row,) = read_csv(tmp_path / "diagnose.csv")
    assert row["state"] in stdout.lower() or row["state"].upper() in stdout
    assert float(row["avg_batch"]) >= 1.0 and int(row["max_batch_size"]) == 8
    assert (tmp_path / "diagnose.png").stat().st_size > 1000


# --- errors ------------------------------------------------------------------------------------
def test_missing_model_and_wrong_kind(triton_server, tmp_path, capsys):
    rc, _, err = run(capsys, ["perf", "sla", "--model", "nope", "--p99-ms", "10", "--results", str(tmp_path), *server_args(triton_server)])
    assert rc == 1
    assert "model 'nope' is not loaded" in err and "echo" in err and len(err.strip().splitlines()) == 1
    rc, _, err = run(capsys, ["perf", "batching", "--model", "stream_test", "--results", str(tmp_path), *server_args(triton_server)])
    assert rc == 1 and "decoupled" in err and "perf llm" in err
    rc, _, err = run(capsys, ["perf", "llm", "--model", "echo", "--results", str(tmp_path), *server_args(triton_server)])
    assert rc == 1 and "not decoupled" in err
    # --serve checks the repository before starting anything
    rc, _, err = run(capsys, ["perf", "sla", "--serve", "--repo", str(tmp_path), "--model", "echo", "--p99-ms", "10", "--results", str(tmp_path)])
    assert rc == 1 and "not in the model repository" in err


def test_serve_starts_a_private_server(triton_server, tmp_path, capsys):
    rc, stdout, _ = run(
        capsys,
        ["perf", "sla", "--serve", "--repo", str(triton_server.repo), "--model", "token_test", "--p99-ms", "1000",
         "--concurrency", "2", "--requests", "50", "--results", str(tmp_path)],
    )
    assert rc == 0
    assert "starting tritonserver" in stdout and "SLA met" in stdout
    assert int(read_csv(tmp_path / "sla.csv")[0]["server_inferences"]) == 50
    assert {p.name for p in Path(triton_server.repo).iterdir()} == set(MODELS)  # nothing written into the repo


# --- the generation model ----------------------------------------------------------------------
def test_perf_llm_measures_the_generation_model(tmp_path):
    repo = tmp_path / "repo"
    add_generation_model(repo, "tiny")
    results = tmp_path / "results"
    out = subprocess.run(
        [
            sys.executable, "-m", "tritonlm.cli", "perf", "llm", "--serve", "--repo", str(repo), "--model", "tiny",
            "--concurrency", "1,2", "--output-tokens", "12", "--fixed-output-length", "--prompt-tokens", "8",
            "--requests-per-concurrency", "5", "--results", str(results),
        ],
        capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = list(csv.DictReader(open(results / "llm.csv")))
    assert [int(r["concurrency"]) for r in rows] == [1, 2]
    for row in rows:
        assert int(row["requests"]) >= 10
        assert float(row["tokens_per_request"]) == 12.0  # the server's own count, every request full length
        assert 0 < float(row["ttft_p50_ms"]) <= float(row["latency_p50_ms"])
        assert float(row["itl_avg_ms"]) > 0 and float(row["output_tokens_per_s"]) > 0
