"""`tritonlm export` and `tritonlm serve-default` (tritonlm/export/cli.py): bad input is refused
with one clear line, exit 1 and nothing half-written; serve-default exports once, then serves."""

from __future__ import annotations

import json
import os
from pathlib import Path

from tests.helpers.exports import assert_untouched
from tritonlm.export.cli import main as export_main
from tritonlm.models.builtin import build_tiny


def _run_cli(capsys, *argv) -> tuple[int, str]:
    code = export_main(["export", *argv])
    err = capsys.readouterr().err.strip()
    return code, err


def test_error_unknown_model_id(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # as on a machine without the hub: answer at once
    code, err = _run_cli(capsys, "no-such-org/no-such-model", "--repo", str(tmp_path / "r"))
    assert code == 1 and len(err.splitlines()) == 1
    assert "no-such-org/no-such-model" in err and "built-in" in err
    assert not (tmp_path / "r").exists()
    assert_untouched(tmp_path)


def test_error_missing_path(tmp_path, capsys):
    code, err = _run_cli(capsys, str(tmp_path / "nope.gguf"), "--repo", str(tmp_path / "r"))
    assert code == 1 and "no such file or folder" in err
    assert not (tmp_path / "r").exists()


def test_error_file_that_is_not_a_model(tmp_path, capsys):
    f = tmp_path / "notes.txt"
    f.write_text("hello")
    code, err = _run_cli(capsys, str(f), "--repo", str(tmp_path / "r"))
    assert code == 1 and "is a file but not a model" in err
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"\x00" * 64)
    code, err = _run_cli(capsys, str(fake), "--repo", str(tmp_path / "r"))
    assert code == 1 and "not a GGUF file" in err
    assert not (tmp_path / "r").exists()


def test_error_unsupported_architecture(tmp_path, capsys):
    folder = tmp_path / "bert"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "bert"}))
    code, err = _run_cli(capsys, str(folder), "--repo", str(tmp_path / "r"))
    assert code == 1 and "'bert' is not supported" in err and "gpt2" in err and "llama" in err


def test_error_repo_holds_other_things(tmp_path, capsys):
    repo = tmp_path / "r"
    repo.mkdir()
    (repo / "holiday.jpg").write_bytes(b"x")
    (repo / "README.md").write_text("fine")
    code, err = _run_cli(capsys, "tiny-gpt2", "--repo", str(repo))
    assert code == 1 and "holiday.jpg" in err and "not a Triton model" in err
    assert sorted(p.name for p in repo.iterdir()) == ["README.md", "holiday.jpg"]


def test_error_unwritable_folder(tmp_path, capsys, monkeypatch):
    locked = tmp_path / "locked"
    locked.mkdir()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if Path(p) == locked else real_access(p, mode))
    code, err = _run_cli(capsys, "tiny-gpt2", "--repo", str(locked / "repo"))
    assert code == 1 and "not writable" in err
    code, err = _run_cli(capsys, "tiny-gpt2", "--repo", str(locked))
    assert code == 1 and "not writable" in err
    file_repo = tmp_path / "plain"
    file_repo.write_text("x")
    code, err = _run_cli(capsys, "tiny-gpt2", "--repo", str(file_repo))
    assert code == 1 and "is a file, not a folder" in err


def test_error_max_context_beyond_positions(tmp_path, capsys):
    code, err = _run_cli(capsys, "tiny-gpt2", "--repo", str(tmp_path / "r"), "--max-context", "100000")
    assert code == 1 and "beyond" in err and "256" in err
    assert not (tmp_path / "r").exists()
    assert_untouched(tmp_path)


def test_error_draft_with_another_tokenizer(tmp_path, capsys):
    model, tok = build_tiny("tiny-gpt2-draft")
    tok.add_tokens(["<only-in-the-draft>"])
    folder = tmp_path / "other-draft"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    code, err = _run_cli(capsys, "tiny-gpt2", "--repo", str(tmp_path / "r"), "--draft", str(folder), "--formats", "onnx")
    assert code == 1 and "does not share the tokenizer" in err
    assert not (tmp_path / "r").exists()
    assert_untouched(tmp_path)


def test_serve_default_exports_once_then_serves(tmp_path, monkeypatch, capsys):
    import tritonlm.commands.serve as serve_mod

    served = []
    monkeypatch.setattr(serve_mod, "serve", lambda repo, args: served.append((Path(repo), args.http_port)) or 0)
    repo = tmp_path / "repo"
    argv = ["serve-default", "--model", "tiny-gpt2", "--repo", str(repo), "--http-port", "18000",
            "--grpc-port", "18001", "--metrics-port", "18002"]
    assert export_main(argv) == 0
    out = capsys.readouterr().out
    assert "exporting tiny-gpt2" in out
    assert sorted(p.name for p in repo.iterdir()) == ["tiny-gpt2", "tiny-gpt2_onnx"]
    assert export_main(argv) == 0
    assert "already in" in capsys.readouterr().out
    assert served == [(repo, 18000), (repo, 18000)]


def test_export_stamps_from_before_model_ref_still_name_their_model():
    """export.json written before the key was "model_ref" carries it as "spec": such a
    repository must still count as exported from that model, not be exported again."""
    from tritonlm.export.cli import stamped_model_ref

    assert stamped_model_ref({"source": {"model_ref": "tiny-gpt2"}}) == "tiny-gpt2"
    assert stamped_model_ref({"source": {"spec": "tiny-gpt2"}}) == "tiny-gpt2"
    assert stamped_model_ref({"source": {}}) is None
