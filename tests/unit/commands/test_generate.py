"""`tritonlm generate` (tritonlm/commands/generate.py) with nothing listening: one clear line
naming the address, exit 1, over either protocol."""

from __future__ import annotations

import pytest

from tritonlm.cli import main as cli_main
from tritonlm.server import free_ports


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_http_to_nothing_names_the_address(capsys, stream):
    (port,) = free_ports(1)
    argv = ["generate", "hi", "--protocol", "http", "--url", f"127.0.0.1:{port}"] + (["--stream"] if stream else [])
    assert cli_main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"error: cannot reach the server at 127.0.0.1:{port}: ")


def test_grpc_to_nothing_says_why_in_one_line(capsys):
    (port,) = free_ports(1)
    assert cli_main(["generate", "hi", "--model", "tiny", "--url", f"127.0.0.1:{port}"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: tiny: ") and "UNAVAILABLE" in err
    assert f"127.0.0.1:{port}" in err
