"""PEFT adapter folders read and checked (lora.adapter): what is not supported is refused by
name when the adapter is loaded (a ValueError naming the adapter, the field and what is
allowed), never ignored; the content digest the prefix cache keys blocks by. check_adapter
makes the same checks from a config.json and the weights' header alone (the OpenAI frontend's
check before a run-time load)."""

from __future__ import annotations

import shutil

import pytest

from tests.helpers.lora import make_adapter, write_config
from tests.helpers.models import tiny, tiny_family, tiny_llama
from tritonlm.engine.lora import load_adapter
from tritonlm.engine.lora.adapter import BaseShape, check_adapter
from tritonlm.engine.runners.model import Transformer

pytest.importorskip("peft")


@pytest.fixture(scope="module")
def base():
    return Transformer.from_hf(tiny_llama())


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A rank-8 all-linear adapter of tiny_llama, saved once; tests change copies of it."""
    folder = tmp_path_factory.mktemp("saved") / "ad"
    make_adapter(tiny_llama(), folder, seed=1, r=8, lora_alpha=16, target_modules="all-linear")
    return folder


@pytest.fixture
def copy_of(saved, tmp_path):
    folder = tmp_path / "mine"
    shutil.copytree(saved, folder)
    return folder


def test_loads_every_projection_and_names_its_targets(base, saved):
    adapter = load_adapter(saved, base, "ad")
    assert adapter.rank == 8 and len(adapter.targets) == 14  # 7 modules x 2 layers
    assert set(adapter.deltas) == {(li, p) for li in range(2) for p in ("qkv", "o", "gate_up", "down")}
    qkv = adapter.deltas[0, "qkv"]
    assert tuple(qkv.a.shape) == (64, 24) and tuple(qkv.b.shape) == (24, 128)  # q, k, v: rank 8 each
    assert bool((qkv.b[:8, 64:] == 0).all()) and bool((qkv.b[8:16, :64] == 0).all())  # q's rows write q only


@pytest.mark.parametrize("fields, message", [
    (dict(use_dora=True), "use_dora=True: DoRA"),
    (dict(bias="all"), "bias='all': only bias='none'"),
    (dict(lora_bias=True), "lora_bias"),
    (dict(peft_type="IA3"), "peft_type 'IA3'"),
    (dict(target_modules=["q_proj", "lm_head"]), r"target_modules \['lm_head'\] not supported"),
    (dict(modules_to_save=["norm"]), r"modules_to_save \['norm'\] not supported"),
    (dict(r=4), "its weights have rank 8, its config .* says 4"),
    (dict(target_modules=["q_proj"]), "do not target it"),
    (dict(layers_to_transform=[0]), "model.layers.1.* do not target it"),
    (dict(layer_replication=[[0, 2]]), "layer_replication"),
    (dict(some_new_feature=True), "some_new_feature, which tritonlm does not know"),
    (dict(modules_to_save=["lm_head"]), "has no base_model.model.lm_head.weight"),
])
def test_refused_by_name(base, copy_of, fields, message):
    write_config(copy_of, **fields)
    with pytest.raises(ValueError, match=f"LoRA adapter 'mine': .*{message}"):
        load_adapter(copy_of, base)


def test_rank_over_the_limit(base, saved):
    with pytest.raises(ValueError, match="rank 8 is over max_lora_rank=4"):
        load_adapter(saved, base, "ad", max_rank=4)


def test_another_base_model(base, tmp_path):
    """An adapter of a model with another MLP width (shapes), or more layers, is refused."""
    make_adapter(tiny_llama(intermediate_size=96), tmp_path / "wide", seed=2, r=4, lora_alpha=4,
                 target_modules=["up_proj"])
    with pytest.raises(ValueError, match="do not fit the base model's up_proj, which maps 64 inputs to 128 outputs"):
        load_adapter(tmp_path / "wide", base)
    make_adapter(tiny_llama(num_hidden_layers=3), tmp_path / "deep", seed=2, r=4, lora_alpha=4,
                 target_modules=["q_proj"], layers_to_transform=[2])
    with pytest.raises(ValueError, match="layer 2 is not there, the base model has 2 layers"):
        load_adapter(tmp_path / "deep", base)
    make_adapter(tiny_llama(vocab_size=300), tmp_path / "vocab", seed=2, r=4, lora_alpha=4,
                 target_modules=["q_proj"], modules_to_save=["embed_tokens"])
    with pytest.raises(ValueError, match=r"modules_to_save 'embed_tokens' is \(300, 64\); the base model's is"):
        load_adapter(tmp_path / "vocab", base)


def test_lora_on_the_lm_head_is_refused(base, tmp_path):
    """Named in a list, the config is refused; through a regex, its weights are."""
    make_adapter(tiny_llama(), tmp_path / "head", seed=3, r=4, lora_alpha=4, target_modules=["lm_head"])
    with pytest.raises(ValueError, match=r"target_modules \['lm_head'\] not supported.*only through modules_to_save"):
        load_adapter(tmp_path / "head", base)
    make_adapter(tiny_llama(), tmp_path / "regex", seed=3, r=4, lora_alpha=4, target_modules=r".*(lm_head|q_proj)")
    with pytest.raises(ValueError, match="'base_model.model.lm_head[.a-z_]*weight' is not a LoRA A / B of a layer's projection"):
        load_adapter(tmp_path / "regex", base)


def test_missing_files(base, tmp_path, copy_of):
    with pytest.raises(ValueError, match="no adapter_config.json in"):
        load_adapter(tmp_path / "nowhere", base)
    (copy_of / "adapter_model.safetensors").unlink()
    with pytest.raises(ValueError, match="no adapter_model.safetensors"):
        load_adapter(copy_of, base)


def test_families_without_adapters_are_refused(saved):
    with pytest.raises(ValueError, match="family 'gpt2' takes no LoRA adapters yet"):
        load_adapter(saved, Transformer.from_hf(tiny()[0]), "ad")
    with pytest.raises(ValueError, match="family 'granite' takes no LoRA adapters yet"):
        load_adapter(saved, Transformer.from_hf(tiny_family("granite")), "ad")


def test_digest_is_the_content(base, saved, copy_of):
    """Equal content under two names: one digest; one weight or one config field changed: another."""
    first = load_adapter(saved, base, "one").digest
    assert load_adapter(copy_of, base, "two").digest == first
    write_config(copy_of, lora_alpha=17)
    assert load_adapter(copy_of, base).digest != first
    from safetensors.torch import load_file, save_file

    shutil.copy(saved / "adapter_config.json", copy_of / "adapter_config.json")
    tensors = load_file(str(copy_of / "adapter_model.safetensors"))
    key = next(iter(tensors))
    tensors[key] = tensors[key].clone()
    tensors[key].view(-1)[0] += 1e-3
    save_file(tensors, str(copy_of / "adapter_model.safetensors"))
    assert load_adapter(copy_of, base).digest != first
    assert len(first) == 16


def test_a_config_alone_checks_as_the_loaded_model_does(base, saved, tmp_path):
    """BaseShape from transformers' config equals the loaded model's; check_adapter plans what
    load_adapter loads, and refuses what it refuses, with the same words."""
    config = tiny_llama().config
    shape = BaseShape.of_hf_config(config)
    assert shape == BaseShape.of_model(base)
    plans = check_adapter(saved, shape, "ad")
    assert tuple(p.module for p in plans) == load_adapter(saved, base, "ad").targets
    make_adapter(tiny_llama(intermediate_size=96), tmp_path / "wide", seed=2, r=4, lora_alpha=4,
                 target_modules=["up_proj"])
    with pytest.raises(ValueError, match="do not fit the base model's up_proj, which maps 64 inputs to 128 outputs"):
        check_adapter(tmp_path / "wide", shape)
    with pytest.raises(ValueError, match="rank 8 is over max_lora_rank=4"):
        check_adapter(saved, shape, "ad", max_rank=4)
    (tmp_path / "broken").mkdir()
    shutil.copy(saved / "adapter_config.json", tmp_path / "broken")
    (tmp_path / "broken" / "adapter_model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(ValueError, match="adapter_model.safetensors cannot be read as safetensors"):
        check_adapter(tmp_path / "broken", shape)
