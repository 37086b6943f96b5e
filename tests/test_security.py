"""Safe network defaults and what a config may point at.

Unit tests (no server): the address and model-control checks, the flags tritonserver gets,
the path rule of hf_dir / onnx_model / draft_model. Server tests: this module's server runs
on loopback with explicit model control restricted to a header (the load API refuses a
request without it, over HTTP and gRPC); a temporary log goes after a clean stop and stays
after a failed start; Ctrl-C while `tritonlm serve` starts leaves no tritonserver behind.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.waiting import HANG_GUARD_S, wait_until
from tritonlm.cli import main as cli_main
from tritonlm.engine.settings import EngineSettings, SettingsError
from tritonlm.paths import REPO_ROOT
from tritonlm.server import ServerStartError, TritonServer, check_exposure, free_ports

KEY, VALUE = "tritonlm-admin", "s3cret-for-tests"


def flags(server: TritonServer) -> list[str]:
    return [a for a in server.command() if a.startswith(("--http-", "--grpc-", "--metrics-"))]


# ---- where it listens, and who may load models (no server) -----------------------------------

def test_every_endpoint_binds_loopback_by_default():
    server = TritonServer(Path("model_repository"), 8000, 8001, 8002)
    assert server.host == "127.0.0.1"
    got = flags(server)
    for name in ("http", "grpc", "metrics"):
        assert f"--{name}-address=127.0.0.1" in got
    assert not any("restricted" in f for f in got)
    assert server.http_url == "127.0.0.1:8000" and server.grpc_url == "127.0.0.1:8001"


def test_all_interfaces_is_a_choice_and_clients_here_use_loopback():
    server = TritonServer(Path("model_repository"), 8000, 8001, 8002, host="0.0.0.0")
    got = flags(server)
    assert {"--http-address=0.0.0.0", "--grpc-address=0.0.0.0", "--metrics-address=0.0.0.0"} <= set(got)
    assert server.http_url == "127.0.0.1:8000"
    assert server.listen_addresses()["gRPC"] == "0.0.0.0:8001"


def test_restriction_covers_the_model_repository_api_on_http_and_grpc():
    server = TritonServer(Path("model_repository"), model_control="explicit", restrict_model_control=f"{KEY}={VALUE}")
    got = flags(server)
    assert f"--http-restricted-api=model-repository:{KEY}={VALUE}" in got
    assert f"--grpc-restricted-protocol=model-repository:{KEY}={VALUE}" in got


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3"])
def test_explicit_model_control_off_loopback_needs_a_restriction(host):
    with pytest.raises(ServerStartError, match=r"--model-control explicit on .* --restrict-model-control KEY=VALUE"):
        check_exposure(host, "explicit", None)
    check_exposure(host, "explicit", f"{KEY}={VALUE}")
    check_exposure(host, "none", None)  # no load API at all
    check_exposure("127.0.0.1", "explicit", None)
    check_exposure("localhost", "explicit", None)


@pytest.mark.parametrize("host", ["example.org", "::1", "0.0.0", ""])
def test_host_must_be_an_ipv4_address(host):
    with pytest.raises(ServerStartError, match="is not an IPv4 address"):
        check_exposure(host, "none", None)


@pytest.mark.parametrize("bad", ["novalue", "=zz1", "Upper=zz2", "key=", "key=zz 3", "key=zz,4"])
def test_restriction_must_be_key_equals_value_and_is_not_echoed(bad):
    with pytest.raises(ServerStartError, match="KEY=VALUE") as err:
        check_exposure("127.0.0.1", "explicit", bad)
    assert "zz" not in str(err.value)  # the value is a secret


def test_serve_cli_refuses_explicit_on_all_interfaces_before_starting(tmp_path, capsys):
    shutil.copytree(REPO_ROOT / "model_repository" / "echo", tmp_path / "echo")
    code = cli_main(["serve", "--repo", str(tmp_path), "--host", "0.0.0.0", "--model-control", "explicit",
                     *sum((["--" + n, str(p)] for n, p in zip(("http-port", "grpc-port", "metrics-port"), free_ports(3))), [])])
    out, err = capsys.readouterr()
    assert code == 1 and err.startswith("error: --model-control explicit on 0.0.0.0") and "--restrict-model-control" in err
    assert "starting tritonserver" not in out


# ---- config paths stay inside the model repository (no server) -------------------------------

@pytest.fixture()
def repo(tmp_path) -> Path:
    """A repository like an export writes: NAME (1/hf), NAME_onnx, NAME_draft; and a file outside."""
    repo = tmp_path / "repo"
    for sub in ("gen/1/hf", "gen_onnx/1", "gen_draft/1/hf", "gen/1/draft_hf"):
        (repo / sub).mkdir(parents=True)
    (repo / "gen_onnx/1/model.onnx").write_bytes(b"")
    (tmp_path / "secret").mkdir()
    (tmp_path / "secret/model.onnx").write_bytes(b"")
    return repo


def test_paths_an_export_writes_load(repo):
    s = EngineSettings.from_params(
        {"hf_dir": "1/hf", "runtime": "onnx", "onnx_model": "../gen_onnx/1/model.onnx", "draft_model": "../gen_draft/1/hf"},
        repo / "gen",
    )
    assert s.hf_dir == repo / "gen/1/hf" and s.onnx_model == repo / "gen_onnx/1/model.onnx"
    assert s.draft_model == repo / "gen_draft/1/hf"
    assert EngineSettings.from_params({}, repo / "gen").hf_dir == repo / "gen/1/hf"  # the default


@pytest.mark.parametrize("field", ["hf_dir", "onnx_model", "draft_model"])
def test_absolute_path_refuses_to_load_naming_the_field(repo, field):
    target = repo / ("gen_onnx/1/model.onnx" if field == "onnx_model" else "gen/1/hf")  # exists, and inside
    with pytest.raises(SettingsError, match=rf"^{field}: .* is an absolute path; paths are relative to the model folder"):
        EngineSettings.from_params({field: str(target)}, repo / "gen")


@pytest.mark.parametrize("field", ["hf_dir", "onnx_model", "draft_model"])
@pytest.mark.parametrize("raw", ["../../secret/model.onnx", "1/hf/../../../../secret", "..", "../..", "./../../secret"])
def test_dotdot_out_of_the_repository_refuses_to_load(repo, field, raw):
    with pytest.raises(SettingsError, match=rf"^{field}: '{re.escape(raw)}' leaves the model repository"):
        EngineSettings.from_params({field: raw}, repo / "gen")


def test_model_folder_given_relative_or_through_a_symlinked_repository(repo, tmp_path, monkeypatch):
    monkeypatch.chdir(repo.parent)
    assert EngineSettings.from_params({"draft_model": "../gen_draft/1/hf"}, Path("repo/gen")).draft_model.is_dir()
    # tritonlm perf serves a private repository of symlinks to model folders
    private = tmp_path / "private"
    private.mkdir()
    for name in ("gen", "gen_onnx"):
        (private / name).symlink_to(repo / name, target_is_directory=True)
    s = EngineSettings.from_params({"runtime": "onnx", "onnx_model": "../gen_onnx/1/model.onnx"}, private / "gen")
    assert s.onnx_model == private / "gen_onnx/1/model.onnx" and s.onnx_model.is_file()
    with pytest.raises(SettingsError, match="leaves the model repository"):
        EngineSettings.from_params({"hf_dir": "../../repo/gen/1/hf"}, private / "gen")


def test_symlink_in_the_repository_is_followed_but_dotdot_is_applied_to_the_text(repo, tmp_path):
    (repo / "gen/1/linked").symlink_to(tmp_path / "secret", target_is_directory=True)  # placed by the owner
    assert EngineSettings.from_params({"hf_dir": "1/linked"}, repo / "gen").hf_dir.resolve() == (tmp_path / "secret").resolve()
    # through the link, '1/linked/../repo' would be tmp_path/repo (it exists); as written it is gen/1/repo
    with pytest.raises(SettingsError, match=r"hf_dir: '1/linked/\.\./repo' does not exist \(looked at \S+/gen/1/repo\)"):
        EngineSettings.from_params({"hf_dir": "1/linked/../repo"}, repo / "gen")


# ---- the real server: loopback, model control restricted to a header ------------------------

@pytest.fixture(scope="module")
def triton_server_options():
    return {"model_control": "explicit", "restrict_model_control": f"{KEY}={VALUE}"}


def test_load_without_the_header_is_refused_with_it_works_http(triton_server):
    client = httpclient.InferenceServerClient(triton_server.http_url)
    try:
        assert not client.is_model_ready("echo")  # explicit: nothing loaded at start
        for headers in (None, {KEY: "wrong"}):
            with pytest.raises(InferenceServerException, match="restricted"):
                client.load_model("echo", headers=headers)
        with pytest.raises(InferenceServerException, match="restricted"):
            client.get_model_repository_index()
        assert not client.is_model_ready("echo")
        client.load_model("echo", headers={KEY: VALUE})
        assert client.is_model_ready("echo")
        client.unload_model("echo", headers={KEY: VALUE})
    finally:
        client.close()


def test_load_without_the_header_is_refused_with_it_works_grpc(triton_server):
    client = grpcclient.InferenceServerClient(triton_server.grpc_url)
    try:
        with pytest.raises(InferenceServerException, match="restricted"):
            client.load_model("echo")
        with pytest.raises(InferenceServerException, match="restricted"):
            client.load_model("echo", headers={KEY: VALUE})  # gRPC: Triton prefixes the key
        client.load_model("echo", headers={f"triton-grpc-protocol-{KEY}": VALUE})
        assert client.is_model_ready("echo")
        assert client.is_server_ready()  # other APIs need no header
    finally:
        client.close()


def _outside_address() -> str | None:
    """An address of this machine that is not loopback (none on an isolated machine)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))  # no packet is sent: only picks the outgoing interface
            addr = s.getsockname()[0]
    except OSError:
        return None
    return None if addr.startswith("127.") or addr == "0.0.0.0" else addr


def test_server_listens_on_loopback_only(triton_server):
    log = triton_server.log_text()
    for what, port in (("GRPCInferenceService", triton_server.grpc_port), ("HTTPService", triton_server.http_port),
                       ("Metrics Service", triton_server.metrics_port)):
        assert f"Started {what} at 127.0.0.1:{port}" in log
    addr = _outside_address()
    if addr is None:
        pytest.skip("this machine has no non-loopback address to try")
    for port in (triton_server.http_port, triton_server.grpc_port, triton_server.metrics_port):
        with pytest.raises(OSError):
            socket.create_connection((addr, port), timeout=2).close()


# ---- the log file, and Ctrl-C while starting ---------------------------------------------

def test_temporary_log_goes_after_a_clean_stop_and_stays_after_a_failed_start(tmp_path):
    bad = TritonServer(tmp_path, *free_ports(3), model_control="explicit", extra_args=["--no-such-flag=1"])
    with pytest.raises(ServerStartError) as err:
        bad.start(timeout_s=60)
    assert bad.log_path.is_file() and str(bad.log_path) in str(err.value)
    bad.log_path.unlink()

    good = TritonServer(tmp_path, *free_ports(3), model_control="explicit")  # empty repository: fast
    good.start(timeout_s=HANG_GUARD_S)
    log = good.log_path
    assert log.is_file() and good.started
    assert good.stop() == 0
    assert not log.exists()


# loads until the test lets it go (the release file): the Ctrl-C surely comes while it loads
SLOW_MODEL = '''
import pathlib, time
class TritonPythonModel:
    def initialize(self, args):
        pathlib.Path({marker!r}).write_text("loading")
        for _ in range(6000):  # 10 minutes at most: a hang guard
            if pathlib.Path({release!r}).exists():
                break
            time.sleep(0.1)
    def execute(self, requests):
        return []
'''
SLOW_CONFIG = '''name: "slow"
backend: "python"
max_batch_size: 0
input [ { name: "x" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [ 1 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
'''


def _pids_with(arg: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if arg.encode() in (entry / "cmdline").read_bytes().split(b"\0"):
                    pids.append(int(entry.name))
            except OSError:
                pass
    return pids


def _live_members_of_group(pgid: int) -> list[int]:
    """Processes of process group pgid that still run (zombies wait for init to reap them)."""
    live = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rpartition(")")[2].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                live.append(int(entry.name))
    return live


def test_ctrl_c_while_serve_starts_leaves_no_server_behind(tmp_path):
    marker, release = tmp_path / "loading", tmp_path / "release"
    (tmp_path / "repo/slow/1").mkdir(parents=True)
    (tmp_path / "repo/slow/1/model.py").write_text(SLOW_MODEL.format(marker=str(marker), release=str(release)))
    (tmp_path / "repo/slow/config.pbtxt").write_text(SLOW_CONFIG)
    http, grpc, metrics = free_ports(3)
    proc = subprocess.Popen(
        [sys.executable, "-m", "tritonlm.cli", "serve", "--repo", str(tmp_path / "repo"),
         "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics),
         "--openai-port", "0",  # not the default port: another run may hold it (and it never starts here)
         "--log-file", str(tmp_path / "server.log")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        wait_until(lambda: marker.exists() or proc.poll() is not None, HANG_GUARD_S)
        assert marker.exists(), "the slow model never started loading"
        (server_pid,) = _pids_with(f"--http-port={http}")
        os.kill(proc.pid, signal.SIGINT)  # the model is still loading: the server is not ready
        release.write_text("")  # now the load may end, and the server stop
        out, _ = proc.communicate(timeout=HANG_GUARD_S)
        assert proc.returncode == 130, out
        assert "interrupted while starting; tritonserver stopped" in out and "tritonserver ready" not in out
        assert f"(log: {tmp_path / 'server.log'})" in out and "loading: slow" in (tmp_path / "server.log").read_text()
        assert _live_members_of_group(server_pid) == []  # the server and its whole group (the stub)
        for port in (http, grpc, metrics):
            with pytest.raises(OSError):
                socket.create_connection(("127.0.0.1", port), timeout=2).close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in _pids_with(f"--http-port={http}"):
            os.kill(pid, signal.SIGKILL)


def _ignored_signals(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigIgn:"):
            return int(line.split()[1], 16)
    return 0


def test_parallel_worker_outlives_group_stop_signals_until_its_engine_lets_go():
    """Triton's graceful shutdown and `kill -TERM -PGID` reach the workers too: they wait for
    their engine (here: the control socket closing) instead of dying mid-step."""
    ours, theirs = socket.socketpair()
    with ours, theirs:
        worker = subprocess.Popen(
            [sys.executable, "-m", "tritonlm.engine.parallel.worker", "--fd", str(theirs.fileno()),
             "--parent", str(os.getpid()), "--rank", "0", "--world", "1", "--name", "sigtest"],
            pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
        )
        theirs.close()
        try:
            wanted = (1 << (signal.SIGINT - 1)) | (1 << (signal.SIGTERM - 1))
            wait_until(lambda: _ignored_signals(worker.pid) & wanted == wanted or worker.poll() is not None, HANG_GUARD_S)
            assert worker.poll() is None
            assert _ignored_signals(worker.pid) & wanted == wanted
            for sig in (signal.SIGTERM, signal.SIGINT):
                worker.send_signal(sig)
            time.sleep(0.5)  # a chance to die wrongly (a slow host only makes it smaller)
            assert worker.poll() is None, "a stop signal killed the worker before its engine let go"
            ours.close()  # the engine goes away: the worker follows
            assert worker.wait(timeout=HANG_GUARD_S) == 0
        finally:
            if worker.poll() is None:
                worker.kill()
                worker.wait()
