"""The foundation: a real tritonserver with the tritonlm backend, reached by real clients."""

from __future__ import annotations

import shutil
import subprocess
import sys

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tritonlm.paths import REPO_ROOT
from tritonlm.perf.analyzer import read_perf_csv, run_perf_analyzer
from tritonlm.server import ServerStartError, TritonServer, free_ports


def _echo_http(url: str, texts: list[bytes]):
    client = httpclient.InferenceServerClient(url)
    inp = httpclient.InferInput("text_input", [len(texts), 1], "BYTES")
    inp.set_data_from_numpy(np.array(texts, dtype=object).reshape(-1, 1))
    return client.infer("echo", [inp])


def test_server_reports_ready(triton_server):
    client = httpclient.InferenceServerClient(triton_server.http_url)
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("echo")
    assert client.get_server_metadata()["version"] == "2.51.0"


def test_echo_over_http(triton_server):
    result = _echo_http(triton_server.http_url, ["héllo wörld 你好".encode(), b"second"])
    assert result.as_numpy("text_output").reshape(-1).tolist() == ["héllo wörld 你好".encode(), b"second"]
    assert result.as_numpy("num_chars").reshape(-1).tolist() == [14, 6]


def test_echo_over_grpc(triton_server):
    client = grpcclient.InferenceServerClient(triton_server.grpc_url)
    inp = grpcclient.InferInput("text_input", [1, 1], "BYTES")
    inp.set_data_from_numpy(np.array([["grpc ok ✓".encode()]], dtype=object))
    result = client.infer("echo", [inp])
    assert result.as_numpy("text_output")[0, 0].decode() == "grpc ok ✓"
    assert result.as_numpy("num_chars")[0, 0] == 9


def test_bad_request_gets_clear_error_and_server_keeps_serving(triton_server):
    with pytest.raises(InferenceServerException) as err:
        _echo_http(triton_server.http_url, [b"\xff\xfe not utf-8"])
    assert "text_input" in str(err.value) and "UTF-8" in str(err.value)
    # a wrong datatype is refused by Triton itself, naming the input
    client = httpclient.InferenceServerClient(triton_server.http_url)
    bad = httpclient.InferInput("text_input", [1, 1], "INT32")
    bad.set_data_from_numpy(np.array([[1]], dtype=np.int32))
    with pytest.raises(InferenceServerException, match="text_input"):
        client.infer("echo", [bad])
    assert _echo_http(triton_server.http_url, [b"still here"]).as_numpy("text_output")[0, 0] == b"still here"


def test_perf_analyzer_measures_the_server(triton_server, tmp_path):
    csv = tmp_path / "pa.csv"
    res = run_perf_analyzer(
        [
            "-m", "echo", "-u", triton_server.http_url, "-i", "http",
            "--concurrency-range", "1:2", "--measurement-interval", "800",
            "--max-trials", "4", "--stability-percentage", "100",
            "--string-data", "hello", "-f", str(csv),
        ],
        timeout_s=180,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    rows = read_perf_csv(csv)
    assert [r["Concurrency"] for r in rows] == [1.0, 2.0]
    for row in rows:
        assert row["Inferences/Second"] > 0
        assert 0 < row["p50 latency"] <= row["p99 latency"]
    stats = httpclient.InferenceServerClient(triton_server.http_url).get_inference_statistics("echo")
    assert int(stats["model_stats"][0]["inference_count"]) > 0


def test_cli_doctor_reports_the_stack():
    out = subprocess.run([sys.executable, "-m", "tritonlm.cli", "doctor"], capture_output=True, text=True, timeout=120)
    assert "tritonserver binary" in out.stdout and "perf_analyzer" in out.stdout
    assert "Perf Analyzer Version 2.51.0" in out.stdout, out.stdout
    assert out.returncode == 0, out.stdout


# ---- start-up errors: each must say what is wrong --------------------------------


def test_port_already_taken(triton_server, tmp_path):
    shutil.copytree(REPO_ROOT / "model_repository" / "echo", tmp_path / "echo")
    http, _, metrics = free_ports(3)
    with pytest.raises(ServerStartError, match=rf"port {triton_server.grpc_port} \(--grpc-port\) is already in use"):
        TritonServer(tmp_path, http, triton_server.grpc_port, metrics).start()


def test_model_that_fails_to_load_shows_server_message(tmp_path):
    bad = tmp_path / "broken"
    (bad / "1").mkdir(parents=True)
    config = (REPO_ROOT / "model_repository" / "echo" / "config.pbtxt").read_text()
    (bad / "config.pbtxt").write_text(config.replace('name: "echo"', 'name: "broken"').replace('"echo" }', '"no-such-task" }'))
    with pytest.raises(ServerStartError) as err:
        TritonServer(tmp_path, *free_ports(3)).start(timeout_s=300)
    msg = str(err.value)
    assert "model 'broken' failed to load" in msg and "parameters.task" in msg and "no-such-task" in msg


def test_serve_cli_answers_and_ctrl_c_stops_it_cleanly(tmp_path):
    import signal
    import time

    shutil.copytree(REPO_ROOT / "model_repository" / "echo", tmp_path / "echo")
    http, grpc, metrics, openai = free_ports(4)  # not the default OpenAI port: another run may hold it
    proc = subprocess.Popen(
        [sys.executable, "-m", "tritonlm.cli", "serve", "--repo", str(tmp_path),
         "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics), "--openai-port", str(openai),
         "--health-port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        lines = []
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            lines.append(line)
            if "Ctrl-C stops it" in line or not line:
                break
        assert any(f"127.0.0.1:{grpc}" in l for l in lines), "".join(lines)
        assert _echo_http(f"127.0.0.1:{http}", [b"served"]).as_numpy("text_output")[0, 0] == b"served"
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=300)  # a hang guard
        assert proc.returncode == 0 and "tritonserver stopped" in out, out
    finally:
        if proc.poll() is None:
            proc.kill()
    import urllib.request

    with pytest.raises(OSError):  # nothing listens any more
        urllib.request.urlopen(f"http://127.0.0.1:{http}/v2/health/live", timeout=2)
