"""`tritonlm perf goodput` end to end: a short open-loop run against a real tritonserver, through
the OpenAI frontend and through gRPC, answers every request with the token counts asked
(prompts of exact length with the model's tokenizer, answers forced to max_tokens), and the
server's own counters agree, and the model unloads after a run (the generator and the OpenAI
frontend let each stream end rather than cancel it after its final response); against a model whose slo_ttft_ms no
prediction meets, the requests behind a running one are recorded as shed and the server
counted the same refusals (an idle engine admits: the run's first request is held in its
step, the test-only stall file, until the others have been refused).

Nothing depends on the host's speed: rates are low and only counts and statuses are checked
(the latencies themselves are whatever the host gives)."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import tritonclient.http as httpclient

from tests.helpers.servers import HANG_GUARD_S, add_generation_model, metric, release_when, wait_until
from tritonlm.cli import main as cli_main
from tritonlm.client.generate import generate_grpc
from tritonlm.engine.slo.controller import COLD_STEPS
from tritonlm.engine.slo.step_time import StepTimeModel
from tritonlm.openai.server import OpenAIServer
from tritonlm.perf.trace import build_schedule, parse_arrivals
from tritonlm.server import free_ports

COUNT = 5
# after one request this long the SLO controller predicts (its cold steps are not fitted)
WARM_TOKENS = COLD_STEPS + StepTimeModel().min_steps + 2


@pytest.fixture(scope="module")
def triton_repo(tmp_path_factory, stall_file):
    repo = tmp_path_factory.mktemp("goodputrepo")
    add_generation_model(repo, "tiny")
    add_generation_model(repo, "tiny_slo", slo_ttft_ms="0.001")
    add_generation_model(repo, "tiny_unload_grpc")
    add_generation_model(repo, "tiny_unload_openai")
    return repo


@pytest.fixture(scope="module")
def triton_server_options() -> dict:
    return {"model_control": "explicit", "load_models": ["tiny", "tiny_slo"]}  # the unload tests load their own


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


def test_a_model_whose_slo_no_request_meets_sheds_and_the_run_records_it(capsys, tmp_path, triton_server, frontend,
                                                                        stall_file):
    shed = lambda: metric(triton_server, "tritonlm_slo_requests_total", "tiny_slo", default=0, outcome="shed")  # noqa: E731
    # admitted (the controller has seen no step yet) and long enough for the step-time model to
    # predict; after it no prediction meets one microsecond
    warm = generate_grpc(triton_server.grpc_url, "tiny_slo", "Hello there", max_tokens=WARM_TOKENS, end_id=-1,
                         timeout_s=HANG_GUARD_S)
    assert warm.num_output_tokens == WARM_TOKENS
    for n, where in enumerate((["--openai", frontend.url], ["--grpc", triton_server.grpc_url])):
        before = shed()
        stall_file.touch()  # the first request in is admitted (idle) and held; the rest are refused behind it
        release = release_when(lambda: shed() - before >= COUNT - 1, stall_file)
        summary, requests, _ = goodput(
            capsys, tmp_path / str(n), *where, "--model", "tiny_slo", "--arrivals", "poisson:4", "--count", str(COUNT),
            "--prompt-tokens", "8", "--output-tokens", "4", "--warmup", "0", "--slo-ttft-ms", "0.001")
        release.join(HANG_GUARD_S)
        (row,) = summary
        assert int(row["shed"]) == COUNT - 1 and int(row["ok"]) == 1 and int(row["met_slo"]) == 0
        assert float(row["goodput_rps"]) == 0.0 and float(row["attainment_pct"]) == 0.0
        assert sorted(r["status"] for r in requests) == ["ok"] + ["shed"] * (COUNT - 1)
        refused = [r for r in requests if r["status"] == "shed"]
        assert all(("503" in r["error"]) if n == 0 else ("overloaded" in r["error"]) for r in refused)
        assert shed() - before == COUNT - 1


@pytest.mark.parametrize("via", ["grpc", "openai"])
def test_a_model_unloads_after_a_run(capsys, tmp_path, triton_server, triton_repo, via):
    # tritonserver 2.51 can miss a cancellation that comes just after a stream's final
    # response, and then holds the model in UNLOADING for good (docs/serving.md#unloading-a-model):
    # the generator and the OpenAI frontend read each stream to its end instead
    model = f"tiny_unload_{via}"
    client = httpclient.InferenceServerClient(triton_server.http_url)
    try:
        client.load_model(model)
        if via == "openai":
            (port,) = free_ports(1)
            with OpenAIServer(triton_server.grpc_url, port=port, repo=triton_repo) as frontend:
                where = ["--openai", frontend.url]
                summary, _, _ = goodput(capsys, tmp_path, *where, "--model", model, "--arrivals", "poisson:200", "--count",
                                        "40", "--prompt-tokens", "8", "--output-tokens", "8", "--warmup", "0",
                                        "--slo-ttft-ms", "60000")
        else:
            summary, _, _ = goodput(capsys, tmp_path, "--grpc", triton_server.grpc_url, "--model", model, "--arrivals",
                                    "poisson:200", "--count", "40", "--prompt-tokens", "8", "--output-tokens", "8",
                                    "--warmup", "0", "--slo-ttft-ms", "60000")
        (row,) = summary
        assert int(row["ok"]) == 40  # every stream reached its final response
        client.unload_model(model)
        state = lambda: {m["name"]: m.get("state") for m in client.get_model_repository_index()}.get(model)  # noqa: E731
        assert wait_until(lambda: state() == "UNAVAILABLE", HANG_GUARD_S), state()
    finally:
        client.close()
