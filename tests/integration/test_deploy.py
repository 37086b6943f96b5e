"""deploy/entrypoint.sh serving for real: the container's entry point (`tritonlm serve` on the
image's tritonserver) run on this machine's tritonserver, stopped with SIGTERM as Kubernetes
stops a pod. The checks of deploy/ that
need neither a server nor Docker are in tests/unit/test_deploy.py."""

from __future__ import annotations

import os
import subprocess
import threading
import urllib.request

from tests.helpers.servers import HANG_GUARD_S, add_generation_model, wait_for_requests, wait_until
from tritonlm.backend_setup import prepare_backend_dir
from tritonlm.client.generate import generate_grpc
from tritonlm.paths import REPO_ROOT, server_env, triton_install
from tritonlm.server import free_ports

DEPLOY = REPO_ROOT / "deploy"


def test_entrypoint_serves_and_drains_on_sigterm(tmp_path):
    """The entry point's serve path on this machine's tritonserver (PyPI 2.51; a shim adds
    the backend directory the container has at /opt/tritonserver/backends): ready, a stream
    in flight at SIGTERM finishes whole, readiness goes off, exit 0."""
    repo = tmp_path / "models"
    add_generation_model(repo, "tiny", max_num_seqs=1)
    shim = tmp_path / "bin" / "tritonserver"
    shim.parent.mkdir()
    shim.write_text(f'#!/bin/sh\nexec {triton_install().server_binary} --backend-directory={prepare_backend_dir()} "$@"\n')
    shim.chmod(0o755)
    http, grpc, metrics, openai, health = free_ports(5)
    env = {**server_env(), "TRITONLM_REPO": str(repo), "TRITONLM_HOST": "127.0.0.1", "TRITONLM_HTTP_PORT": str(http),
           "TRITONLM_GRPC_PORT": str(grpc), "TRITONLM_METRICS_PORT": str(metrics), "TRITONLM_OPENAI_PORT": str(openai),
           "TRITONLM_HEALTH_PORT": str(health),
           "TRITONLM_DRAIN_TIMEOUT": "3600"}  # a hang guard: the streams finish on their own, however slow the host
    env["PATH"] = f"{shim.parent}:{REPO_ROOT / '.venv' / 'bin'}:{env['PATH']}"
    proc = subprocess.Popen(["bash", str(DEPLOY / "entrypoint.sh"), "serve"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    out: list[str] = []
    threading.Thread(target=lambda: out.extend(proc.stdout), daemon=True).start()

    def ready(port, path):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=1) as r:
                return r.status == 200
        except OSError:
            return False

    try:
        assert wait_until(lambda: ready(http, "/v2/health/ready") or proc.poll() is not None, HANG_GUARD_S), "".join(out)
        assert wait_until(lambda: ready(openai, "/v1/models") or proc.poll() is not None, HANG_GUARD_S), "".join(out)
        assert ready(health, "/health/ready") and ready(health, "/health/live")  # what the pod's probes ask
        results = {}
        prompts = [f"Entry {i}" for i in range(4)]  # one at a time (max_num_seqs=1): the last ones wait
        threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, generate_grpc(
            f"127.0.0.1:{grpc}", "tiny", prompts[i], max_tokens=200, min_tokens=200, exclude_input_in_output=True)))
            for i in range(len(prompts))]
        for t in threads:
            t.start()
        # every request inside the engine before the signal (one sent after it is refused, rightly)
        assert wait_for_requests(metrics, "tiny", len(prompts)), "".join(out)
        proc.send_signal(15)
        assert wait_until(lambda: not ready(http, "/v2/health/ready"), HANG_GUARD_S)
        assert not ready(health, "/health/ready")  # the drain takes the pod out of the Service
        for t in threads:
            t.join(HANG_GUARD_S)
        assert proc.wait(HANG_GUARD_S) == 0, "".join(out)
        assert [(r.finish_reason, r.num_output_tokens) for r in results.values()] == [("length", 200)] * len(prompts)
        assert "draining" in "".join(out)

        def group_gone() -> bool:
            try:
                os.killpg(proc.pid, 0)
                return False
            except ProcessLookupError:
                return True

        assert wait_until(group_gone, HANG_GUARD_S), "the entry point left processes behind (the drain timer?)"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait(10)
