"""sliding_window_kv 'window' (engine/window_kv.py): the windowed layers keep a ring of blocks.

Greedy answers of an Engine (5-token prefill chunks, rows batched) over tiny Gemma 3 (local
and global layers), Gemma 2 and Mistral (every layer windowed) equal transformers' generate()
on the C++ kernel path and the gather path, for sequences several windows long; the bytes a
long sequence reserves are the design's (full layers: every block; windowed layers: a ring);
the settings refused; requests wait when the rings are all taken, then finish right.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.greedy import assert_greedy_equal, engine_answers, hf_generate, submit_all
from tests.helpers.models import WINDOW, drain, random_tokens, tiny_family, triton_decode_runner
from tritonlm.engine.engine import Engine
from tritonlm.engine.kernels import kernels_available
from tritonlm.engine.kv_cache import KVCacheManager
from tritonlm.engine.model_shape import ModelShape
from tritonlm.engine.runners.torch_runner import TorchRunner
from tritonlm.engine.scheduler import SchedulerConfig
from tritonlm.engine.settings import EngineSettings, SettingsError
from tritonlm.engine.window_kv import HybridKVCache, ring_blocks
from tritonlm.models.builtin import tiny_tokenizer

CHUNK = 5  # prefill chunk: max_num_batched_tokens, the most new tokens a row runs in one step
BLOCK = 4


def window_engine(runner: TorchRunner, budget_tokens: int = 256, max_num_seqs: int = 8, ring_seqs: int | None = None) -> Engine:
    """An Engine whose cache keeps the windowed layers in rings, set up as the loader does."""
    windows = [layer.block.sliding_window for layer in runner.transformer.layers]
    cache = HybridKVCache(runner.spec, budget_tokens * runner.spec.bytes_per_token, BLOCK, windows, CHUNK,
                          ring_seqs or max_num_seqs, 128, device=runner.device)
    if cache.window_group is not None:
        runner.transformer.use_window_groups()
    return Engine(runner, tiny_tokenizer(), cache, SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=CHUNK),
                  max_context=128)


@pytest.fixture(scope="module", params=["gemma3_text", "gemma2", "mistral"])
def family(request):
    return request.param, tiny_family(request.param)


@pytest.mark.parametrize("attention", ["auto", "gather"])
def test_engine_greedy_equals_generate_with_rings(family, attention):
    name, model = family
    runner = TorchRunner(model, attention=attention)
    if attention == "auto" and kernels_available()[0]:
        assert runner.attention == "paged"  # the C++ kernel reads the rings in place
    engine = window_engine(runner)
    cache = engine.cache
    assert cache.ring_blocks * BLOCK < 13 + 20  # the sequences below wrap around their rings
    assert (cache.full is None) == (name == "mistral")
    prompts = [random_tokens(13, seed=11), random_tokens(6, seed=12), random_tokens(17, seed=13)]
    new = 20
    ((col, ids),) = engine_answers(engine, prompts, new)
    for prompt, rid in zip(prompts, ids):
        assert_greedy_equal(model, prompt, col.ids(rid), hf_generate(model, prompt, new))
    assert cache.used_bytes == 0  # every ring given back once


def gemma3_shape(layers: int = 6) -> tuple[ModelShape, list[int | None]]:
    """Gemma-3-1b-shaped KV: 5 local layers (window 512) to 1 global, 1 kv head of 256 dims, bf16."""
    spec = ModelShape("llama", layers, 4, 1, 256, 262144, 32768, torch.bfloat16, "gemma3_text")
    return spec, [None if (i + 1) % 6 == 0 else 512 for i in range(layers)]


def test_a_long_sequence_reserves_a_ring_in_the_windowed_layers():
    spec, windows = gemma3_shape()
    block, chunk, tokens = 16, 512, 4096
    cache = HybridKVCache(spec, 64 * tokens * spec.bytes_per_token, block, windows, chunk, 4, tokens)
    cache.allocate(1, tokens)
    per_layer_token = 2 * 1 * 256 * 2  # K and V, 1 kv head, 256 dims, 2 bytes
    ring = -(-(512 + chunk - 1) // block) + 1  # window + one step's tokens, and a block for the edges
    assert cache.ring_blocks == ring == ring_blocks(512, chunk, block)
    want = 1 * tokens * per_layer_token + 5 * ring * block * per_layer_token
    assert cache.reserved_bytes(1) == want
    assert cache.used_bytes == want
    cache.free(1)
    assert cache.used_bytes == 0
    assert cache.window.free_blocks == cache.window.usable_blocks  # no block given back twice


def test_a_ring_table_repeats_its_blocks_and_frees_each_once():
    spec, _ = gemma3_shape(1)
    mgr = KVCacheManager(spec, 20 * 4 * spec.bytes_per_token, 4, ring_blocks=3)
    mgr.allocate(7, 30)  # 8 blocks of positions, 3 blocks held
    table = mgr._tables[7]
    assert len(table) == 8 and len(set(table)) == 3
    assert all(table[m] == table[m % 3] for m in range(8))
    assert mgr.reserved_bytes(7) == 3 * mgr.block_bytes
    mgr.allocate(8, 5)  # shorter than a ring: a block per 4 positions
    assert mgr.reserved_bytes(8) == 2 * mgr.block_bytes
    mgr.free(7)
    mgr.free(8)
    assert mgr.free_blocks == mgr.usable_blocks


def test_an_all_windowed_model_has_no_full_group():
    model = tiny_family("mistral")
    runner = TorchRunner(model)
    cache = window_engine(runner).cache
    assert cache.full is None and cache.window_group is None
    assert all(k.shape[0] == cache.window.num_slots for k in cache.pool.k)


def test_settings_refuse_window_mode_with_prefix_caching(tmp_path):
    (tmp_path / "1" / "hf").mkdir(parents=True)
    with pytest.raises(SettingsError, match="sliding_window_kv.*enable_prefix_caching"):
        EngineSettings.from_params({"sliding_window_kv": "window"}, tmp_path)
    with pytest.raises(SettingsError, match="sliding_window_kv: 'ring'; use one of full, window"):
        EngineSettings.from_params({"sliding_window_kv": "ring"}, tmp_path)
    s = EngineSettings.from_params({"sliding_window_kv": "window", "enable_prefix_caching": "false"}, tmp_path)
    assert s.sliding_window_kv == "window"


def test_requests_wait_for_a_ring_then_finish_right():
    model = tiny_family("gemma3_text")
    runner = TorchRunner(model)
    engine = window_engine(runner, budget_tokens=512, max_num_seqs=8, ring_seqs=2)  # rings for 2 sequences
    prompts = [random_tokens(9, seed=20 + i) for i in range(4)]
    new = 14
    col, ids = submit_all(engine, prompts, new)
    engine.step()
    assert engine.scheduler.num_running == 2 and engine.scheduler.num_waiting == 2
    drain(engine)
    for prompt, rid in zip(prompts, ids):
        assert_greedy_equal(model, prompt, col.ids(rid), hf_generate(model, prompt, new))


@pytest.mark.parametrize("family_name", ["gemma3_text", "llama"])
def test_the_loader_builds_rings_where_a_layer_has_a_window(tmp_path, family_name):
    """build_engine with sliding_window_kv 'window': two groups and no decoder stack for
    Gemma 3 (answers equal generate()'s), the ordinary cache for a model with no window."""
    from tritonlm.engine.loader import build_engine
    from tritonlm.export.repository import write_generation_model

    model = tiny_family(family_name)
    folder = write_generation_model(tmp_path, "m", model, tiny_tokenizer(), max_context=128)
    engine = build_engine(EngineSettings.from_params(
        {"sliding_window_kv": "window", "enable_prefix_caching": "false", "kv_block_size": str(BLOCK),
         "max_num_seqs": "4", "max_num_batched_tokens": str(CHUNK), "kv_cache_bytes": str(2**20)}, folder))
    try:
        if family_name == "llama":
            assert type(engine.cache) is KVCacheManager
            return
        cache = engine.cache
        assert isinstance(cache, HybridKVCache) and cache.window_group is not None
        assert cache.ring_blocks == ring_blocks(WINDOW, CHUNK, BLOCK)
        assert engine.runner.transformer.decoder_stack is None
        assert "sliding_window_kv" in engine.runner.transformer.fast_paths().why
        prompts = [random_tokens(11, seed=31), random_tokens(4, seed=32)]
        ((col, rids),) = engine_answers(engine, prompts, 18)
        for prompt, rid in zip(prompts, rids):
            assert_greedy_equal(model, prompt, col.ids(rid), hf_generate(model, prompt, 18))
    finally:
        engine.shutdown()


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the Triton interpreter's numpy calls
@pytest.mark.parametrize("family_name", ["gemma3_text", "mistral"])
def test_the_triton_decode_path_reads_the_rings(monkeypatch, family_name):
    """The GPU's decode path (the Triton decode kernel, run by its interpreter; block tables on
    the device) over the rings: answers equal generate()'s."""
    model = tiny_family(family_name)
    runner = triton_decode_runner(model, monkeypatch)
    engine = window_engine(runner)
    prompts = [random_tokens(13, seed=11), random_tokens(6, seed=12), random_tokens(17, seed=13)]
    new = 20
    ((col, rids),) = engine_answers(engine, prompts, new)
    for prompt, rid in zip(prompts, rids):
        assert_greedy_equal(model, prompt, col.ids(rid), hf_generate(model, prompt, new))
