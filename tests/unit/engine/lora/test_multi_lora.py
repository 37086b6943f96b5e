"""A served model's adapters follow its multi_lora.json (lora.multi_lora), as the OpenAI
frontend rewrites it: names added and removed, the config's own names kept, a file that
cannot be used changes nothing, and an adapter reloaded in place under its name gets a new
digest, so the prefix cache never hands its requests blocks of the old weights (answers equal
PEFT's merged model of the new weights)."""

from __future__ import annotations

import json
import logging
import os

import pytest

from tests.helpers.lora import make_adapter
from tests.helpers.models import hf_greedy_ids, random_tokens, tiny_llama
from tritonlm.engine.lora import attach_lora
from tritonlm.engine.lora.multi_lora import MultiLoraFile
from tritonlm.engine.lora.registry import LoraRegistry
from tritonlm.engine.runners.torch_runner import TorchRunner
from tritonlm.engine.settings import MULTI_LORA_FILE, lora_folders

pytest.importorskip("peft")


def rewrite(model_dir, entries: dict) -> None:
    """As the frontend writes it: whole, to a temporary file renamed over the old one."""
    tmp = model_dir / (MULTI_LORA_FILE + ".tmp")
    tmp.write_text(json.dumps(entries))
    os.replace(tmp, model_dir / MULTI_LORA_FILE)


@pytest.fixture(scope="module")
def model_and_adapters(tmp_path_factory):
    model = tiny_llama()
    root = tmp_path_factory.mktemp("repo") / "tiny"
    merged = {name: make_adapter(model, root / "adapters" / name, seed=i + 1, r=4, lora_alpha=8,
                                 target_modules="all-linear") for i, name in enumerate(("a", "b", "c"))}
    return model, root, merged


def served(model, root, params: str = "", json_entries: dict | None = None):
    if json_entries is not None:
        rewrite(root, json_entries)
    elif (root / MULTI_LORA_FILE).exists():
        (root / MULTI_LORA_FILE).unlink()
    runner = TorchRunner(model)
    attach_lora(runner.transformer)
    folders = dict(lora_folders(params, root))
    registry = LoraRegistry(runner.transformer, folders)
    fixed = {name for name, _ in (p.split("=") for p in params.split(",") if p)}
    return runner, registry, MultiLoraFile(registry, root, fixed)


def test_names_come_and_go_with_the_file(model_and_adapters):
    model, root, _ = model_and_adapters
    _, registry, file = served(model, root, "a=adapters/a", {"b": "adapters/b"})
    assert not file.check() and registry.names == ["a", "b"]  # as loaded: nothing to do
    b = registry.get("b")
    rewrite(root, {"b": "adapters/b", "c": "adapters/c"})
    assert file.check() and registry.names == ["a", "b", "c"]
    assert registry.get("b") is b  # untouched: not reloaded
    assert not file.check()  # one stat, nothing new
    rewrite(root, {"c": "adapters/c"})
    assert file.check() and registry.names == ["a", "c"]
    with pytest.raises(ValueError, match="unknown LoRA adapter 'b'; this model serves: 'a', 'c'"):
        registry.acquire("b")
    (root / MULTI_LORA_FILE).unlink()
    assert file.check() and registry.names == ["a"]  # the config's adapter stays


def test_the_config_names_stay_a_bad_entry_is_left_out_and_a_bad_file_changes_nothing(model_and_adapters, caplog):
    model, root, _ = model_and_adapters
    _, registry, file = served(model, root, "a=adapters/a", {"b": "adapters/b"})
    caplog.set_level(logging.ERROR)
    rewrite(root, {"b": "adapters/b", "a": "adapters/c"})
    file.check()
    assert registry.folders["a"] == root / "adapters" / "a"
    assert "adapter 'a' is also named in lora_adapters" in caplog.text
    rewrite(root, {"b": "adapters/b", "x": "adapters/missing"})
    assert not file.check() and registry.names == ["a", "b"]
    assert "adapter 'x'" in caplog.text and "holds no adapter_config.json" in caplog.text
    # the other entries still apply beside a bad one: later loads and unloads are not frozen
    rewrite(root, {"c": "adapters/c", "x": "adapters/missing"})
    assert file.check() and registry.names == ["a", "c"]
    (root / MULTI_LORA_FILE).write_text("not json")
    assert not file.check() and registry.names == ["a", "c"]


def test_a_reload_in_place_gets_a_new_digest_and_no_old_cached_blocks(model_and_adapters, tmp_path):
    """The frontend's unload then load of one name with new weights in the same folder: the
    registry reloads it (its files changed), the digest is new, and the same prompt under it
    again is computed afresh (no cached tokens) and equals the new weights' merged model."""
    from tests.helpers.models import Collector, drain
    from tritonlm.engine.engine import Engine
    from tritonlm.engine.kv_cache import KVCacheManager
    from tritonlm.engine.request import GenerationRequest, SamplingParams
    from tritonlm.engine.scheduler import SchedulerConfig
    from tritonlm.models.builtin import tiny_tokenizer

    model = model_and_adapters[0]
    root = tmp_path / "repo" / "tiny"
    first = make_adapter(model, root / "adapters" / "r", seed=21, r=4, lora_alpha=8, target_modules="all-linear")
    runner, registry, file = served(model, root, "", {"r": "adapters/r"})
    cache = KVCacheManager(runner.spec, 96 * 4 * runner.spec.bytes_per_token, 4, allocate_kv=runner.allocate_kv,
                           prefix_caching=True)
    engine = Engine(runner, tiny_tokenizer(), cache, SchedulerConfig(), max_context=128)
    engine.lora_registry = registry
    prompt, col = random_tokens(13, seed=8), Collector()

    def run() -> int:
        file.check()
        req = GenerationRequest(list(prompt), SamplingParams(max_tokens=6, end_id=-1), col._on_event,
                                lora=registry.get("r"))
        col.events[req.request_id] = []
        engine.submit(req)
        drain(engine)
        return req.request_id

    one, two = run(), run()
    assert col.ids(one) == col.ids(two) == hf_greedy_ids(first, prompt, 6)
    assert col.final(two).num_cached_tokens > 0  # the same adapter's blocks are shared
    old = registry.get("r").digest
    rewrite(root, {})  # unload ...
    assert file.check() and registry.names == []
    second = make_adapter(model, root / "adapters" / "r", seed=22, r=4, lora_alpha=8, target_modules="all-linear")
    rewrite(root, {"r": "adapters/r"})  # ... and load again, new weights in the same folder
    three = run()
    assert registry.get("r").digest != old
    assert col.final(three).num_cached_tokens == 0
    assert col.ids(three) == hf_greedy_ids(second, prompt, 6) != col.ids(one)
    # both changes seen in one check (no request between them) reload it too: its files changed
    rewrite(root, {})
    third = make_adapter(model, root / "adapters" / "r", seed=23, r=4, lora_alpha=8, target_modules="all-linear")
    rewrite(root, {"r": "adapters/r"})
    four = run()
    assert col.final(four).num_cached_tokens == 0 and col.ids(four) == hf_greedy_ids(third, prompt, 6)
