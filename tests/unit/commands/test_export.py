"""`tritonlm export` (tritonlm/commands/export.py): bad input is refused with one clear line,
exit 1 and nothing half-written."""

from __future__ import annotations

import json
import os
from pathlib import Path

from tests.helpers.exports import assert_untouched
from tritonlm.cli import main as cli_main
from tritonlm.models.builtin import build_tiny


def _run_cli(capsys, *argv) -> tuple[int, str]:
    code = cli_main(["export", *argv])
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
