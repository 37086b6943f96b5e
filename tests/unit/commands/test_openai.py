"""`tritonlm openai` (tritonlm/commands/openai.py) without a server: its arguments are read or
refused before anything starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from tritonlm.cli import main as cli_main
from tritonlm.commands.openai import parse_tokenizers


def test_tokenizers_for_every_model_or_one(tmp_path):
    odd = tmp_path / "tok=v2"  # a folder whose name holds '=': a path, not MODEL=PATH
    odd.mkdir()
    assert parse_tokenizers([]) == {}
    assert parse_tokenizers(["/tokenizers/llama"]) == {"*": Path("/tokenizers/llama")}
    assert parse_tokenizers(["qwen=/t/qwen", "/t/any"]) == {"qwen": Path("/t/qwen"), "*": Path("/t/any")}
    assert parse_tokenizers([str(odd)]) == {"*": odd}


def test_a_header_without_key_and_value_is_refused_by_name(capsys):
    assert cli_main(["openai", "--port", "0", "--header", "no-equals-sign"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == "error: --header 'no-equals-sign': use KEY=VALUE"


def test_an_address_that_is_not_ipv4_is_refused_naming_what_works(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli_main(["openai", "--host", "::1"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "host '::1' is not an IPv4 address" in err and "0.0.0.0" in err
