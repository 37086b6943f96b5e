"""The adapters a model serves by name (lora.registry): more adapters than max_cpu_loras are
all served, the least recently used dropped and loaded again; unknown names are refused
naming the known ones; a reload in place brings new content under a new digest."""

from __future__ import annotations

import shutil

import pytest
import torch

from tests.helpers.lora import lora_rows, make_adapter
from tests.helpers.models import assert_close, hf_logits, paged_cache, random_tokens, tiny_llama
from tritonlm.engine.lora import attach_lora
from tritonlm.engine.lora.registry import LoraRegistry
from tritonlm.engine.runners.torch_runner import TorchRunner

pytest.importorskip("peft")


def scaled_copy(src, dst, factor: float) -> None:
    """src's adapter with every B times factor (B is linear in the update: another adapter)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(str(src / "adapter_model.safetensors"))
    save_file({k: v * factor if "lora_B" in k else v for k, v in tensors.items()}, str(dst / "adapter_model.safetensors"))


@pytest.fixture(scope="module")
def twenty(tmp_path_factory):
    """(model, runner, registry over 20 adapter folders with max_cpu_loras 4, one merged model
    of adapter 0 and of adapter 19)."""
    root = tmp_path_factory.mktemp("many")
    model = tiny_llama()
    merged = make_adapter(model, root / "a0", seed=7, r=8, lora_alpha=16, target_modules="all-linear")
    for i in range(1, 20):
        scaled_copy(root / "a0", root / f"a{i}", 1.0 + i / 10)
    runner = TorchRunner(model)
    attach_lora(runner.transformer)
    registry = LoraRegistry(runner.transformer, {f"a{i}": root / f"a{i}" for i in range(20)}, max_cpu_loras=4)
    return model, runner, registry, merged, root


def test_twenty_adapters_through_four_places(twenty):
    """20 adapters, 4 loaded at a time: all served in one step, each row different, adapter 0's
    row equal to PEFT's merged model; loads and evictions counted, most recent ones kept."""
    model, runner, registry, merged, _ = twenty
    adapters = [registry.get(f"a{i}") for i in range(20)]
    assert registry.loads == 20 and registry.evictions == 16
    assert registry.resident == ["a16", "a17", "a18", "a19"]
    seq = random_tokens(6, seed=3)
    mgr = paged_cache(runner, blocks=80)
    for sid in range(21):
        mgr.allocate(sid, len(seq))
    out = lora_rows(runner, mgr, [(sid, 0, seq) for sid in range(21)], adapters + [None])
    assert_close(out[0], hf_logits(merged, seq)[-1])
    assert_close(out[20], hf_logits(model, seq)[-1])
    assert len({round(float(row.max()), 5) for row in out}) == 21  # every adapter did something of its own
    assert len(registry.drain_load_seconds()) == 20 and registry.drain_load_seconds() == []  # each cold load, once
    registry.get("a17")  # a hit: no load, now the most recent
    assert registry.loads == 20 and registry.resident[-1] == "a17"
    assert registry.get("a0") is not adapters[0] and registry.loads == 21  # evicted earlier: loaded again
    assert registry.requests["a17"] == 2 and registry.requests["a0"] == 2 and registry.requests["a5"] == 1
    assert len(registry.drain_load_seconds()) == 1


def test_unknown_names_and_settings_are_refused(twenty):
    _, runner, registry, _, _ = twenty
    with pytest.raises(ValueError, match=r"unknown LoRA adapter 'nope'; this model serves: 'a0', 'a1', "):
        registry.get("nope")
    with pytest.raises(ValueError, match="max_cpu_loras=0"):
        LoraRegistry(runner.transformer, max_cpu_loras=0)
    with pytest.raises(ValueError, match="unknown LoRA adapter 'x'; this model serves: none"):
        LoraRegistry(runner.transformer).get("x")


def test_reload_in_place_changes_the_digest(twenty, tmp_path):
    _, runner, _, _, root = twenty
    registry = LoraRegistry(runner.transformer, {"r": root / "a0"})
    first = registry.get("r")
    registry.add("r", root / "a5")  # the same name, new weights
    second = registry.get("r")
    assert second.digest != first.digest
    assert not torch.equal(second.deltas[0, "qkv"].b, first.deltas[0, "qkv"].b)
    registry.remove("r")
    assert registry.names == [] and registry.resident == []


def test_acquire_loads_on_the_loader_thread_and_a_reload_meanwhile_wins(twenty):
    """acquire(): a loaded adapter at once; a cold one as a PendingAdapter loaded on the loader
    thread (never the caller's), shared by every request that waits for it. A name added again
    while its old folder loads keeps the new folder: the old load serves the requests that
    asked before, and is not kept."""
    import threading

    from tests.helpers.servers import HANG_GUARD_S
    from tritonlm.engine.lora.registry import LOADER_THREAD, PendingAdapter

    _, runner, _, _, root = twenty
    registry = LoraRegistry(runner.transformer, {"x": root / "a1"})
    release, threads = threading.Event(), []

    def held(name: str) -> None:
        threads.append(threading.current_thread().name)
        assert release.wait(HANG_GUARD_S)

    registry.before_load = held
    try:
        pending = registry.acquire("x")
        assert isinstance(pending, PendingAdapter) and registry.acquire("x") is pending
        registry.add("x", root / "a2")  # reloaded in place while the old folder loads
        newer = registry.acquire("x")
        assert newer is not pending
        release.set()
        old, new = pending.future.result(HANG_GUARD_S), newer.future.result(HANG_GUARD_S)
        assert old.digest != new.digest and registry.acquire("x") is new
        assert registry.resident == ["x"] and registry.requests["x"] == 4
        assert all(t.startswith(LOADER_THREAD) for t in threads) and len(threads) == 2
    finally:
        release.set()
        registry.close()
