"""The real-server fixtures: one tritonserver per test module.

A module picks what the server loads by defining a module-scoped fixture
`triton_repo` that returns a model repository folder (default: a copy of the
hand-written `echo` wiring model). The server runs on free ports, its log is
captured and printed when a test of the module fails (tests/conftest.py marks the
module), and it is always stopped.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.helpers.servers import stall_env
from tritonlm.paths import REPO_ROOT
from tritonlm.server import TritonServer, free_ports


@pytest.fixture(scope="module")
def triton_repo(tmp_path_factory) -> Path:
    repo = tmp_path_factory.mktemp("repo")
    shutil.copytree(REPO_ROOT / "model_repository" / "echo", repo / "echo")
    return repo


@pytest.fixture(scope="module")
def stall_file(tmp_path_factory) -> Path:
    """While this file exists the module's engines hold in their step (helpers.servers.stall_env):
    a module's `triton_repo` that asks for it makes tritonserver inherit the setting."""
    with stall_env(tmp_path_factory.mktemp("stall") / "stall") as path:
        yield path


@pytest.fixture(scope="module")
def triton_server_options() -> dict:
    """Override in a module for e.g. model_control='explicit'."""
    return {}


@pytest.fixture(scope="module")
def triton_server(request, triton_repo, triton_server_options, tmp_path_factory):
    http, grpc, metrics = free_ports(3)
    log = tmp_path_factory.mktemp("serverlog") / "tritonserver.log"
    server = TritonServer(triton_repo, http, grpc, metrics, log_path=log, **triton_server_options)
    try:
        server.start(timeout_s=300)
        yield server
    finally:
        server.stop()
        if getattr(request.node, "_tritonlm_failed", False):
            print(f"\n----- tritonserver log ({log}) -----\n" + server.log_text()[-20000:])
