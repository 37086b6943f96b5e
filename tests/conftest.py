"""Hooks for every test, unit and integration alike: the paged-attention kernel is built
once before any test runs, and a failing test marks its module so that a server fixture
of that module (tests/integration/conftest.py) prints the server's log at teardown."""

from __future__ import annotations

import getpass
import os
import tempfile

import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        # mark the module so its server fixture prints the log at teardown
        item.module_node = item.getparent(pytest.Module)
        if item.module_node is not None:
            item.module_node._tritonlm_failed = True


def pytest_sessionstart(session):
    """Build the paged-attention kernel (tritonlm/engine/kernels) here, once, before any
    test's tritonserver loads models: each of those would otherwise wait for the first."""
    from tritonlm.engine.kernels import kernels_available

    _inductor_cache_per_capability()
    kernels_available()


def _inductor_cache_per_capability() -> None:
    """A run with ATEN_CPU_CAPABILITY set (an older CPU's code on this one) gets a compile
    cache of its own: torch's cache hands back CPU kernels built for the other capability,
    which compute wrong values (docs/configuration.md)."""
    capability = os.environ.get("ATEN_CPU_CAPABILITY")
    if capability and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        name = f"torchinductor_{getpass.getuser()}_{capability.lower()}"
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(tempfile.gettempdir(), name)
