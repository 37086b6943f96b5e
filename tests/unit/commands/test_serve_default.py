"""`tritonlm serve-default` (tritonlm/commands/serve_default.py): exports once, then serves;
an earlier export of the same model counts, whatever its stamp's age."""

from __future__ import annotations

from pathlib import Path

from tritonlm.cli import main as cli_main
from tritonlm.commands.serve_default import stamped_model_ref


def test_serve_default_exports_once_then_serves(tmp_path, monkeypatch, capsys):
    import tritonlm.commands.serve as serve_mod

    served = []
    monkeypatch.setattr(serve_mod, "serve", lambda repo, args: served.append((Path(repo), args.http_port)) or 0)
    repo = tmp_path / "repo"
    argv = ["serve-default", "--model", "tiny-gpt2", "--repo", str(repo), "--http-port", "18000",
            "--grpc-port", "18001", "--metrics-port", "18002"]
    assert cli_main(argv) == 0
    out = capsys.readouterr().out
    assert "exporting tiny-gpt2" in out
    assert sorted(p.name for p in repo.iterdir()) == ["tiny-gpt2", "tiny-gpt2_onnx"]
    assert cli_main(argv) == 0
    assert "already in" in capsys.readouterr().out
    assert served == [(repo, 18000), (repo, 18000)]


def test_export_stamps_from_before_model_ref_still_name_their_model():
    """export.json written before the key was "model_ref" carries it as "spec": such a
    repository must still count as exported from that model, not be exported again."""
    assert stamped_model_ref({"source": {"model_ref": "tiny-gpt2"}}) == "tiny-gpt2"
    assert stamped_model_ref({"source": {"spec": "tiny-gpt2"}}) == "tiny-gpt2"
    assert stamped_model_ref({"source": {}}) is None
