"""Hooks for every test, unit and integration alike: the paged-attention kernel is built
once before any test runs, and a failing test marks its module so that a server fixture
of that module (tests/integration/conftest.py) prints the server's log at teardown."""

from __future__ import annotations

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

    kernels_available()
