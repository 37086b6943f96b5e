"""tritonlm/engine/lora as a served model gets it: the `lora_adapters` / `max_lora_rank` /
`max_cpu_loras` parameters and multi_lora.json (engine.settings), and the registry the loader
attaches (engine.loader.load_lora_registry). The served path itself is
tests/integration/test_lora_server.py."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.helpers.lora import make_adapter, write_config
from tests.helpers.models import tiny_llama
from tritonlm.engine.loader import load_lora_registry
from tritonlm.engine.runners.torch_runner import TorchRunner
from tritonlm.engine.settings import EngineSettings, SettingsError, adapter_pairs


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    folder = tmp_path_factory.mktemp("made") / "ad"
    make_adapter(tiny_llama(), folder, seed=3, r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
    return folder


@pytest.fixture
def model_dir(tmp_path, adapter):
    """repo/m with 1/hf and two adapter folders, a and b."""
    folder = tmp_path / "repo" / "m"
    (folder / "1" / "hf").mkdir(parents=True)
    for name in ("a", "b"):
        shutil.copytree(adapter, folder / "adapters" / name)
    return folder


def test_off_by_default(model_dir):
    s = EngineSettings.from_params({}, model_dir)
    assert s.lora_adapters == () and s.max_lora_rank == 64 and s.max_cpu_loras == 8


@pytest.mark.parametrize("text", ["a=adapters/a, b=adapters/b", '{"a": "adapters/a", "b": "adapters/b"}'])
def test_pairs_or_json_name_folders_in_the_model_folder(model_dir, text):
    s = EngineSettings.from_params({"lora_adapters": text, "max_lora_rank": "16", "max_cpu_loras": "1"}, model_dir)
    assert [(n, p.relative_to(model_dir).as_posix()) for n, p in s.lora_adapters] == [("a", "adapters/a"), ("b", "adapters/b")]
    assert (s.max_lora_rank, s.max_cpu_loras) == (16, 1)


def test_multi_lora_json_beside_the_model_adds_adapters(model_dir):
    (model_dir / "multi_lora.json").write_text(json.dumps({"b": "adapters/b"}))
    s = EngineSettings.from_params({"lora_adapters": "a=adapters/a"}, model_dir)
    assert [n for n, _ in s.lora_adapters] == ["a", "b"]
    assert [n for n, _ in EngineSettings.from_params({}, model_dir).lora_adapters] == ["b"]
    with pytest.raises(SettingsError, match=r"^multi_lora.json: adapter 'b' is also named in lora_adapters"):
        EngineSettings.from_params({"lora_adapters": "b=adapters/a"}, model_dir)
    (model_dir / "multi_lora.json").write_text('["adapters/b"]')
    with pytest.raises(SettingsError, match=r"^multi_lora.json: expected a JSON object"):
        EngineSettings.from_params({}, model_dir)


@pytest.mark.parametrize("params, error", [
    ({"lora_adapters": "a"}, r"lora_adapters: 'a' is not name=folder"),
    ({"lora_adapters": "a=adapters/a,a=adapters/b"}, r"lora_adapters: adapter 'a' is named twice"),
    ({"lora_adapters": " =adapters/a"}, r"lora_adapters: adapter name '': use letters"),
    ({"lora_adapters": '{"a": 1}'}, r"lora_adapters: every adapter's folder must be a string"),
    ({"lora_adapters": "{nope"}, r"lora_adapters: not valid JSON"),
    ({"lora_adapters": "a=adapters/none"}, r"lora_adapters: adapter 'a': 'adapters/none' holds no adapter_config.json"),
    ({"lora_adapters": "a=/etc"}, r"lora_adapters: adapter 'a': '/etc' is an absolute path"),
    ({"lora_adapters": "a=../../x"}, r"lora_adapters: adapter 'a': '../../x' leaves the model repository"),
    ({"lora_adapters": "a=adapters/a", "runtime": "onnx", "onnx_model": "1/hf"},
     r"lora_adapters: LoRA adapters run on the torch runtime"),
    ({"lora_adapters": "a=adapters/a", "dtype": "int8"}, r"lora_adapters: LoRA adapters do not run on dtype 'int8'"),
    ({"enable_lora": "true", "dtype": "int8"}, r"enable_lora: LoRA adapters do not run on dtype 'int8'"),
    ({"max_lora_rank": "0"}, r"max_lora_rank: must be >= 1"),
    ({"max_cpu_loras": "0"}, r"max_cpu_loras: must be >= 1"),
])
def test_bad_parameters_name_the_field_and_what_is_allowed(model_dir, params, error):
    with pytest.raises(SettingsError, match=error):
        EngineSettings.from_params(params, model_dir)


def test_the_frontend_reads_the_names_without_the_folders():
    assert adapter_pairs("sql=x/1,chat=x/2") == [("sql", "x/1"), ("chat", "x/2")]
    assert adapter_pairs("") == []


def test_the_loader_attaches_a_registry_and_loads_every_adapter_once(model_dir):
    runner = TorchRunner(tiny_llama())
    settings = EngineSettings.from_params({"lora_adapters": "a=adapters/a,b=adapters/b", "max_cpu_loras": "1"}, model_dir)
    registry = load_lora_registry(settings, runner)
    assert registry.names == ["a", "b"] and registry.loads == 2 and registry.resident == ["b"]
    assert runner.transformer.lora is not None and registry.get("a").name == "a"
    assert load_lora_registry(EngineSettings.from_params({}, model_dir), TorchRunner(tiny_llama())) is None


def test_enable_lora_takes_adapters_with_none_named(model_dir):
    """A model meant for adapters loaded at run time: attached, an empty registry; refused where
    adapters cannot run."""
    runner = TorchRunner(tiny_llama())
    registry = load_lora_registry(EngineSettings.from_params({"enable_lora": "true"}, model_dir), runner)
    assert registry is not None and registry.names == [] and runner.transformer.lora is not None
    with pytest.raises(SettingsError, match="^enable_lora: LoRA adapters run on the torch runtime"):
        EngineSettings.from_params({"enable_lora": "true", "tensor_parallel_size": "2"}, model_dir)


def test_a_broken_adapter_refuses_the_model_at_load_naming_it(model_dir):
    write_config(model_dir / "adapters" / "b", use_dora=True)
    settings = EngineSettings.from_params({"lora_adapters": "a=adapters/a,b=adapters/b"}, model_dir)
    with pytest.raises(SettingsError, match=r"^lora_adapters: LoRA adapter 'b': .*use_dora"):
        load_lora_registry(settings, TorchRunner(tiny_llama()))
    settings = EngineSettings.from_params({"lora_adapters": "a=adapters/a", "max_lora_rank": "4"}, model_dir)
    with pytest.raises(SettingsError, match=r"^lora_adapters: LoRA adapter 'a': .*rank"):
        load_lora_registry(settings, TorchRunner(tiny_llama()))
