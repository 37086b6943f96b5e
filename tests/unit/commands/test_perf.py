"""`tritonlm perf` (tritonlm/commands/perf.py) without a server: a harness that cannot reach
tritonserver says so in one line and exits 1."""

from __future__ import annotations

from tritonlm.cli import main as cli_main
from tritonlm.server import free_ports


def run(capsys, argv: list[str]) -> tuple[int, str, str]:
    rc = cli_main(argv)
    captured = capsys.readouterr()
    print(captured.out)  # visible with -s / on failure
    return rc, captured.out, captured.err


def test_unreachable_server_is_one_clear_line(tmp_path, capsys):
    http, grpc, metrics = free_ports(3)
    for harness in (["sla", "--p99-ms", "10"], ["batching"], ["llm"], ["diagnose", "--p99-ms", "10"], ["tune", "--p99-ms", "10"]):
        rc, _, err = run(
            capsys,
            ["perf", *harness, "--model", "echo", "--http-port", str(http), "--grpc-port", str(grpc),
             "--metrics-port", str(metrics), "--results", str(tmp_path)],
        )
        assert rc == 1
        assert len(err.strip().splitlines()) == 1
        assert f"cannot reach tritonserver at http://127.0.0.1:{http}" in err
