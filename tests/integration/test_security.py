"""Safe network defaults, against the real tritonserver: this module's server runs on
loopback with explicit model control restricted to a header (the load API refuses a request
without it, over HTTP and gRPC); a temporary log goes after a clean stop and stays after a
failed start; Ctrl-C while `tritonlm serve` starts leaves no tritonserver behind; a parallel
worker outlives stop signals until its engine lets go. The checks that need no server
(addresses, flags, config paths) are in tests/unit/test_server.py,
tests/unit/commands/test_serve.py and tests/unit/engine/test_settings.py.
"""

from __future__ import annotations

import os
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

from tests.helpers.servers import HANG_GUARD_S, wait_until
from tritonlm.server import ServerStartError, TritonServer, free_ports

KEY, VALUE = "tritonlm-admin", "s3cret-for-tests"


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
class SlowLoadingModel:
    def initialize(self, args):
        pathlib.Path({marker!r}).write_text("loading")
        for _ in range(6000):  # 10 minutes at most: a hang guard
            if pathlib.Path({release!r}).exists():
                break
            time.sleep(0.1)
    def execute(self, requests):
        return []
TritonPythonModel = SlowLoadingModel  # the name the Python backend looks up
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
         "--openai-port", "0", "--health-port", "0",  # not the default ports: another run may hold them
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
