"""What tritonserver says it serves, as the watch reads it: the repository index's states and
the stubs a loaded configuration asks for."""

from __future__ import annotations

import pytest

from tritonlm.server import free_ports
from tritonlm.supervise.served import LOADING, READY, UNAVAILABLE, UNLOADING, TritonModels, index_states, stubs_asked


def test_index_states_take_the_most_serving_version():
    entries = [
        {"name": "a", "version": "1", "state": "READY"},
        {"name": "b", "version": "1", "state": "UNAVAILABLE", "reason": "unloaded"},
        {"name": "c", "version": "1", "state": "UNLOADING"}, {"name": "c", "version": "2", "state": "LOADING"},
        {"name": "d", "version": "1", "state": "UNAVAILABLE"}, {"name": "d", "version": "2", "state": "READY"},
        {"name": "e"},  # never loaded: no version, no state
    ]
    assert index_states(entries) == {"a": READY, "b": UNAVAILABLE, "c": UNLOADING, "d": READY, "e": UNAVAILABLE}
    assert index_states([{"name": "x", "state": "LOADING"}]) == {"x": LOADING}
    with pytest.raises(ValueError, match="without a model name"):
        index_states([{"state": "READY"}])


def test_stubs_asked_count_instances_of_stub_backends_only():
    def config(backend: str, *groups: dict) -> dict:
        return {"backend": backend, "instance_group": list(groups)}

    assert stubs_asked(config("tritonlm", {"kind": "KIND_CPU", "count": 2})) == 2
    assert stubs_asked(config("python", {"kind": "KIND_CPU", "count": 1}, {"kind": "KIND_MODEL", "count": 3})) == 4
    assert stubs_asked(config("tritonlm", {"kind": "KIND_GPU", "count": 2, "gpus": [0, 1]})) == 4
    assert stubs_asked(config("tritonlm", {"kind": "KIND_GPU", "count": 1, "gpus": []})) == 1
    assert stubs_asked({"backend": "tritonlm"}) == 1  # no group: Triton's one instance
    assert stubs_asked(config("onnxruntime", {"kind": "KIND_CPU", "count": 4})) == 0  # no stub processes


def test_an_unreachable_server_is_unknown_not_empty():
    (port,) = free_ports(1)
    triton = TritonModels(f"127.0.0.1:{port}", {"key": "value"}, timeout_s=1)
    assert triton.index() is None and triton.stubs_asked("m") is None
