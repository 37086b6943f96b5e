"""`tritonlm perf goodput` end to end: a short open-loop run against a real tritonserver, through
the OpenAI frontend and through gRPC, answers every request with the token counts asked
(prompts of exact length with the model's tokenizer, answers forced to max_tokens), and the
server's own counters agree; against a model whose slo_ttft_ms no prediction meets, the
scheduled requests are recorded as shed and the server counted the same refusals.

Nothing depends on the host's speed: rates are low and only counts and statuses are checked
(the latencies themselves are whatever the host gives)."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from tests.helpers.servers import add_generation_model, metric
from tritonlm.cli import main as cli_main
from tritonlm.engine.slo.step_time import StepTimeModel
from tritonlm.openai.server import OpenAIServer
from tritonlm.perf.trace import build_schedule, parse_arrivals
from tritonlm.server import free_ports

COUNT = 5
WARM_TOKENS = StepTimeModel().min_steps + 2  # after one request this long the SLO controller predicts


@pytest.fixture(scope="module")
def triton_repo(tmp_path_factory):
    repo = tmp_path_factory.mktemp("goodputrepo")
    add_generation_model(repo, "tiny")
    add_generation_model(repo, "tiny_slo", slo_ttft_ms="0.001")
    return repo


@pytest.fixture(scope="module")
def frontend(triton_server, triton_repo):
    (port,) = free_ports(1)
    with OpenAIServer(triton_server.grpc_url, port=port, repo=triton_repo, metrics_url=triton_server.metrics_url) as server:
        yield server


def read_csv(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def goodput(capsys, out: Path, *args: str) -> tuple[list[dict], list[dict], str]:
    rc = cli_main(["perf", "goodput", *args, "--out", str(out)])
    printed = capsys.readouterr().out
    print(printed)
    assert rc == 0
    return read_csv(out / "summary.csv"), read_csv(out / "requests.csv"), printed


@pytest.mark.parametrize("via, arrivals", [("openai", "azure-conv:2"), ("grpc", "gamma:2:3")])
def test_a_short_run_answers_every_request_with_the_token_counts_asked(capsys, tmp_path, triton_server, triton_repo, frontend,
                                                                        via, arrivals):
    ttft_count = lambda: metric(triton_server, "tritonlm_time_to_first_token_seconds_count", "tiny", default=0)  # noqa: E731
    before = ttft_count()
    where = ["--openai", frontend.url] if via == "openai" else ["--grpc", triton_server.grpc_url]
    summary, requests, printed = goodput(
        capsys, tmp_path, *where, "--model", "tiny", "--arrivals", arrivals, "--count", str(COUNT), "--prompt-tokens", "40",
        "--output-tokens", "12", "--tokenizer", str(triton_repo / "tiny" / "1" / "hf"), "--seed", "3", "--warmup", "1",
        "--slo-ttft-ms", "60000")
    assert "CPU: " in printed and "goodput" in printed
    assert (tmp_path / "goodput.png").stat().st_size > 0
    (row,) = summary
    assert int(row["requests"]) == int(row["ok"]) == int(row["met_slo"]) == COUNT  # a minute's TTFT target: all met
    assert int(row["shed"]) == int(row["errors"]) == 0 and float(row["attainment_pct"]) == 100.0
    # the server saw each scheduled request once, plus the warm-up's one
    assert ttft_count() - before == COUNT + 1
    # what was asked is the schedule's own, and what was served matches it
    schedule = build_schedule(parse_arrivals(arrivals), seed=3, prompt_tokens=40, output_tokens=12, count=COUNT)
    assert [int(r["prompt_tokens"]) for r in requests] == [s.prompt_tokens for s in schedule]
    assert [int(r["output_tokens"]) for r in requests] == [s.output_tokens for s in schedule]
    for r, s in zip(requests, schedule):
        assert r["status"] == "ok", r["error"]
        assert int(r["served_output_tokens"]) == s.output_tokens  # forced past any end token
        assert int(r["served_prompt_tokens"]) == s.prompt_tokens  # exact with the model's tokenizer
        assert float(r["sent_s"]) >= float(r["scheduled_s"])  # never early
        assert 0 < float(r["ttft_ms"]) <= float(r["latency_ms"])
        assert len(r["itls_ms"].split()) <= s.output_tokens - 1


def test_a_model_whose_slo_no_request_meets_sheds_and_the_run_records_it(capsys, tmp_path, triton_server, frontend):
    shed = lambda: metric(triton_server, "tritonlm_slo_requests_total", "tiny_slo", default=0, outcome="shed")  # noqa: E731
    for n, where in enumerate((["--openai", frontend.url], ["--grpc", triton_server.grpc_url])):
        before = shed()
        # the first run's warm-up request is admitted (the controller has seen no step yet) and runs
        # long enough for the step-time model to predict; after it no prediction meets one microsecond
        summary, requests, _ = goodput(
            capsys, tmp_path / str(n), *where, "--model", "tiny_slo", "--arrivals", "poisson:4", "--count", str(COUNT),
            "--prompt-tokens", "8", "--output-tokens", str(WARM_TOKENS), "--warmup", "1" if n == 0 else "0")
        (row,) = summary
        assert int(row["shed"]) == COUNT and int(row["ok"]) == int(row["met_slo"]) == 0
        assert float(row["goodput_rps"]) == 0.0 and float(row["attainment_pct"]) == 0.0
        assert all(r["status"] == "shed" for r in requests)
        assert all(("503" in r["error"]) if n == 0 else ("overloaded" in r["error"]) for r in requests)
        assert shed() - before == COUNT
