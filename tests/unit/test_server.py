"""tritonlm/server.py without starting a server: where tritonserver listens and who may load
models (the flags it gets, the address and model-control checks), and a repository that
cannot be served refused before anything starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from tritonlm.server import ServerStartError, TritonServer, check_exposure, free_ports

KEY, VALUE = "tritonlm-admin", "s3cret-for-tests"


def flags(server: TritonServer) -> list[str]:
    return [a for a in server.command() if a.startswith(("--http-", "--grpc-", "--metrics-"))]


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


def test_missing_and_empty_repository(tmp_path):
    with pytest.raises(ServerStartError, match="does not exist"):
        TritonServer(tmp_path / "nope", *free_ports(3)).start()
    with pytest.raises(ServerStartError, match="holds no model"):
        TritonServer(tmp_path, *free_ports(3)).start()
