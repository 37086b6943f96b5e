"""The run-time LoRA endpoints' parts that need no server (tritonlm/openai/lora_admin.py; the
endpoints themselves run against a real tritonserver in tests/integration/test_lora_server.py):
off unless asked, the model repository required, which model a new adapter goes on, and
multi_lora.json rewritten whole."""

from __future__ import annotations

import json

import pytest

from tests.unit.openai.fake_backend import FakeBackend
from tritonlm.openai.chat import ChatTemplates
from tritonlm.openai.errors import OpenAIError
from tritonlm.openai.lora_admin import ALLOW_ENV, _base_model, allow_runtime_lora_from, read_entries, write_entries
from tritonlm.openai.triton import ServedModel, with_adapters


def model(name: str, **params: str) -> ServedModel:
    return ServedModel(name, "1", {"parameters": {k: {"string_value": v} for k, v in params.items()}})


def test_off_unless_the_flag_or_the_environment_says_so(monkeypatch):
    monkeypatch.delenv(ALLOW_ENV, raising=False)
    assert not allow_runtime_lora_from(False) and allow_runtime_lora_from(True)
    for word, on in (("1", True), ("TRUE", True), ("yes", True), ("0", False), ("", False), ("no", False)):
        monkeypatch.setenv(ALLOW_ENV, word)
        assert allow_runtime_lora_from(False) is on, word


def test_the_endpoints_need_the_model_repository():
    from tritonlm.openai.app import create_app

    with pytest.raises(ValueError, match="needs the model repository"):
        create_app(backend=FakeBackend(), templates=ChatTemplates(), allow_runtime_lora=True)


def test_which_model_a_new_adapter_goes_on(tmp_path):
    for name in ("a", "b", "c"):
        (tmp_path / name).mkdir()
    (tmp_path / "c" / "multi_lora.json").write_text(json.dumps({"x": "adapters/x"}))
    served = with_adapters({"a": model("a", enable_lora="true"), "b": model("b"), "c": model("c")}, tmp_path)
    with pytest.raises(OpenAIError, match=r"several models take LoRA adapters \(a, c\); name the one"):
        _base_model(served, tmp_path, None)
    assert _base_model(served, tmp_path, "c").name == "c"
    with pytest.raises(OpenAIError, match="model 'b' was not loaded to take LoRA adapters; set the parameter enable_lora"):
        _base_model(served, tmp_path, "b")
    with pytest.raises(OpenAIError, match="'x' is not a served generation model; served: a, b, c"):
        _base_model(served, tmp_path, "x")  # an adapter is no base
    alone = {"a": model("a", lora_adapters="s=adapters/s"), "b": model("b")}
    assert _base_model(alone, tmp_path, None).name == "a"
    with pytest.raises(OpenAIError, match=r"no served model takes LoRA adapters.*\(served: b\)"):
        _base_model({"b": model("b")}, tmp_path, None)


def test_multi_lora_json_is_rewritten_whole(tmp_path):
    assert read_entries(tmp_path) == {}
    write_entries(tmp_path, {"b": "adapters/b", "a": "adapters/a"})
    assert read_entries(tmp_path) == {"a": "adapters/a", "b": "adapters/b"}
    assert [p.name for p in tmp_path.iterdir()] == ["multi_lora.json"]  # no temporary file left
    (tmp_path / "multi_lora.json").write_text("[1]")
    with pytest.raises(OpenAIError, match="is not a JSON object"):
        read_entries(tmp_path)


def test_runtime_lora_on_a_reachable_address_needs_an_api_key():
    """Anyone who reaches the port could rewrite the adapters otherwise: refused before binding."""
    from tritonlm.errors import CliError
    from tritonlm.openai.server import OpenAIServer
    from tritonlm.server import free_ports

    (port,) = free_ports(1)
    server = OpenAIServer("127.0.0.1:1", host="0.0.0.0", port=port, allow_runtime_lora=True)
    with pytest.raises(CliError, match=r"^--allow-runtime-lora on 0.0.0.0 without an API key .* set --api-key"):
        server.start()


def test_the_rewritten_file_is_readable_by_the_models_instances(tmp_path):
    """Rewritten whole through a temporary file: the new file keeps the old one's mode (a
    plain 0644 at first), never mkstemp's 0600, so instances running as another user read it."""
    write_entries(tmp_path, {"a": "adapters/a"})
    path = tmp_path / "multi_lora.json"
    assert path.stat().st_mode & 0o777 == 0o644 and read_entries(tmp_path) == {"a": "adapters/a"}
    path.chmod(0o664)
    write_entries(tmp_path, {})
    assert path.stat().st_mode & 0o777 == 0o664 and read_entries(tmp_path) == {}
    assert [p.name for p in tmp_path.iterdir()] == ["multi_lora.json"]  # no temporary file left
