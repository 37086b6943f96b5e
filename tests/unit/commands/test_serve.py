"""`tritonlm serve` (tritonlm/commands/serve.py) refusing what it cannot serve before it
starts tritonserver: one line on stderr, exit 1."""

from __future__ import annotations

import shutil
import subprocess
import sys

from tritonlm.cli import main as cli_main
from tritonlm.paths import REPO_ROOT
from tritonlm.server import free_ports


def test_serve_cli_refuses_explicit_on_all_interfaces_before_starting(tmp_path, capsys):
    shutil.copytree(REPO_ROOT / "model_repository" / "echo", tmp_path / "echo")
    code = cli_main(["serve", "--repo", str(tmp_path), "--host", "0.0.0.0", "--model-control", "explicit",
                     *sum((["--" + n, str(p)] for n, p in zip(("http-port", "grpc-port", "metrics-port"), free_ports(3))), [])])
    out, err = capsys.readouterr()
    assert code == 1 and err.startswith("error: --model-control explicit on 0.0.0.0") and "--restrict-model-control" in err
    assert "starting tritonserver" not in out


def test_serve_cli_errors_are_one_line(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "tritonlm.cli", "serve", "--repo", str(tmp_path / "missing")],
        capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 1
    assert out.stderr.startswith("error: model repository") and "does not exist" in out.stderr


def test_serve_refuses_bad_health_and_restart_options_by_name(tmp_path):
    for flag, value, says in [("--health-port", "70000", "port number from 0 (off) to 65535"),
                              ("--health-deadline", "0", "seconds between 1 and 600"),
                              ("--max-restarts", "-1", "whole number >= 0"),
                              ("--restart-window", "soon", "seconds between 1 and 86400")]:
        out = subprocess.run([sys.executable, "-m", "tritonlm.cli", "serve", "--repo", str(tmp_path), flag, value],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and flag in out.stderr and says in out.stderr, out.stderr
    missing = subprocess.run([sys.executable, "-m", "tritonlm.cli", "serve", "--repo", str(tmp_path),
                              "--tritonserver", str(tmp_path / "nope")], capture_output=True, text=True, timeout=60)
    assert missing.returncode == 1 and "--tritonserver" in missing.stderr and "not an executable file" in missing.stderr
