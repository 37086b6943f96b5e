"""tritonlm/engine/kv_cache.py: prefix caching, shared KV blocks of common prompt prefixes.

The block accounting is checked with exact block ids and counts (no model); the engine
is checked token for token against the same engine with the cache off and against
transformers' own generate(), for prefixes of every length around the block boundary."""

from __future__ import annotations

import random

import pytest
import torch

from tests.helpers.models import Collector, drain, make_prefix_caching_engine, tiny
from tritonlm.engine.engine import Engine
from tritonlm.engine.kv_cache import KVCacheManager
from tritonlm.engine.model_shape import ModelShape
from tritonlm.engine.request import GenerationRequest, SamplingParams


BS = 16
SPEC = ModelShape("gpt2", num_layers=1, num_heads=1, num_kv_heads=1, head_dim=4, vocab_size=100, max_positions=512)


def manager(blocks: int) -> KVCacheManager:
    return KVCacheManager(SPEC, (blocks + 1) * BS * SPEC.bytes_per_token, BS, prefix_caching=True)


def fill(mgr: KVCacheManager, sid: int, tokens: list[int]) -> None:
    """What the scheduler does for a sequence whose cache holds `tokens`: register full blocks."""
    parent = mgr.root_digest
    from tritonlm.engine.kv_cache import block_digest

    for i in range(len(tokens) // BS):
        parent = block_digest(parent, tokens[i * BS : (i + 1) * BS])
        mgr.register(sid, i, parent, tokens[i * BS : (i + 1) * BS])


# ---------------------------------------------------------------------------- accounting


def test_a_freed_prefix_stays_cached_and_is_shared_by_the_next_prompt():
    mgr = manager(10)
    a = list(range(40))  # 2 full blocks + 8 tokens
    mgr.allocate(1, 48)  # 3 blocks
    blocks_a = list(mgr._tables[1])
    fill(mgr, 1, a)
    mgr.free(1)
    assert mgr.used_bytes == 0 and mgr.cached_blocks == 2 and mgr.free_blocks == 10
    b = a[:33] + [99] * 7  # same first 2 blocks, then differs
    hits = mgr.find_prefix(mgr.prompt_digests(b), b)
    assert hits == blocks_a[:2]
    mgr.allocate(2, 48, hits)
    assert mgr._tables[2][:2] == blocks_a[:2] and mgr.free_blocks == 7  # 2 cached ones now referenced, 1 new
    # a third sequence sharing them too: references, not copies
    mgr.allocate(3, 40, mgr.find_prefix(mgr.prompt_digests(b), b))
    assert mgr._refs[blocks_a[0]] == 2 and mgr.free_blocks == 6  # only its 3rd block is new
    mgr.free(2)
    mgr.free(3)
    assert mgr.used_bytes == 0 and all(r == 0 for r in mgr._refs)


def test_the_block_of_the_last_prompt_token_is_never_shared():
    mgr = manager(10)
    a = list(range(32))  # exactly 2 full blocks
    mgr.allocate(1, 40)
    fill(mgr, 1, a)
    mgr.free(1)
    # the same 32 tokens again: only block 0 may be shared, block 1 holds the last token
    assert len(mgr.find_prefix(mgr.prompt_digests(a), a)) == 1
    assert len(mgr.find_prefix(mgr.prompt_digests(a + [5]), a + [5])) == 2


def test_lru_eviction_takes_unreferenced_cached_blocks_tail_first():
    mgr = manager(4)
    a = list(range(48))
    mgr.allocate(1, 48)
    fill(mgr, 1, a)
    mgr.free(1)
    assert mgr.cached_blocks == 3 and mgr.free_blocks == 4
    mgr.allocate(2, 32)  # 1 never-used block + 1 evicted: the tail of a's chain (block 2) goes first
    assert mgr.cached_blocks == 2
    assert len(mgr.find_prefix(mgr.prompt_digests(a + [1]), a + [1])) == 2
    mgr.free(2)


def test_a_digest_hit_with_other_tokens_is_not_a_hit():
    mgr = manager(6)
    a = list(range(40))
    mgr.allocate(1, 40)
    fill(mgr, 1, a)
    mgr.free(1)
    # forge the table: the digest of a's block 0 now claims other token ids
    block = mgr._cached[mgr.prompt_digests(a)[0]]
    mgr._content[block] = (mgr._content[block][0], tuple([7] * BS))
    assert mgr.find_prefix(mgr.prompt_digests(a), a) == []


def test_without_prefix_caching_nothing_is_kept():
    mgr = KVCacheManager(SPEC, 11 * BS * SPEC.bytes_per_token, BS, prefix_caching=False)
    mgr.allocate(1, 48)
    fill(mgr, 1, list(range(48)))
    mgr.free(1)
    assert mgr.cached_blocks == 0 and mgr.find_prefix(mgr.prompt_digests(list(range(48))), list(range(48))) == []


def test_lora_adapters_key_their_own_chains():
    """The same prompt under adapter A, adapter B and the base never shares blocks; A's blocks
    are shared under A; an adapter digest equal to a base chain digest (a name or key made to look
    like another) still starts a chain of its own; new adapter content (a reload) misses."""
    import hashlib

    mgr = manager(20)
    a_digest, b_digest = (hashlib.blake2b(n, digest_size=16).digest() for n in (b"A", b"B"))
    prompt = list(range(40))  # 2 shareable blocks
    mgr.allocate(1, 48)
    for i, digest in enumerate(mgr.prompt_digests(prompt, mgr.chain_root(a_digest))):
        mgr.register(1, i, digest, prompt[i * BS : (i + 1) * BS])
    mgr.free(1)
    assert mgr.cached_blocks == 2
    assert len(mgr.find_prefix(mgr.prompt_digests(prompt, mgr.chain_root(a_digest)), prompt)) == 2
    assert mgr.find_prefix(mgr.prompt_digests(prompt, mgr.chain_root(b_digest)), prompt) == []
    assert mgr.find_prefix(mgr.prompt_digests(prompt), prompt) == []  # the base
    assert mgr.find_prefix(mgr.prompt_digests(prompt, mgr.chain_root(None)), prompt) == []
    reloaded = hashlib.blake2b(b"A, retrained", digest_size=16).digest()
    assert mgr.find_prefix(mgr.prompt_digests(prompt, mgr.chain_root(reloaded)), prompt) == []
    base_chain = mgr.prompt_digests(prompt)
    lookalike = mgr.prompt_digests(prompt, mgr.chain_root(base_chain[0]))
    assert not set(lookalike) & set(base_chain + [mgr.root_digest]) and mgr.chain_root(a_digest) != mgr.root_digest


# ---------------------------------------------------------------------------- through the engine


def submit(engine: Engine, col: Collector, prompt: list[int], max_tokens: int) -> int:
    req = GenerationRequest(list(prompt), SamplingParams(max_tokens=max_tokens, end_id=-1), col._on_event)
    col.events[req.request_id] = []
    engine.submit(req)
    return req.request_id


def hf_ids(prompt: list[int], n: int) -> list[int]:
    model, tok = tiny()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=tok.eos_token_id)
    return out[0, len(prompt):].tolist()


rng = random.Random(7)
BASE = [rng.randrange(3, 500) for _ in range(80)]


def family(prefix_len: int) -> list[list[int]]:
    """Prompts sharing their first prefix_len tokens, then different."""
    return [BASE[:prefix_len] + [rng.randrange(3, 500) for _ in range(5 + i)] for i in range(3)]


@pytest.mark.parametrize("prefix_len", [15, 16, 17, 31, 32, 33, 64])
def test_greedy_text_is_the_same_with_the_cache_on_and_off(prefix_len):
    prompts = family(prefix_len)
    outs = {}
    for on in (False, True):
        engine, col = make_prefix_caching_engine(on), Collector()
        ids = []
        for p in prompts:  # one after the other: each finds the earlier ones' blocks cached
            ids.append(submit(engine, col, p, 12))
            drain(engine)
        outs[on] = [col.ids(r) for r in ids]
        assert engine.cache.used_bytes == 0 and engine.cache.live_sequences() == 0
        hits = [col.final(r).num_cached_tokens for r in ids]
        # the 2nd and 3rd prompts share the first one's full blocks within the common prefix
        assert hits == ([0, (prefix_len // BS) * BS, (prefix_len // BS) * BS] if on else [0, 0, 0])
    assert outs[True] == outs[False]
    assert outs[True][-1] == hf_ids(prompts[-1], 12)


def test_a_prompt_that_is_a_strict_prefix_of_another_and_of_an_earlier_answer():
    engine, col = make_prefix_caching_engine(True), Collector()
    long = BASE[:60]
    first = submit(engine, col, long, 20)
    drain(engine)
    # a next turn: the earlier prompt + its answer + more; its generated blocks are reused too
    turn = long + col.ids(first) + [7, 8, 9]
    second = submit(engine, col, turn, 8)
    short = submit(engine, col, long[:40], 8)  # a strict prefix of the first prompt
    drain(engine)
    assert col.ids(second) == hf_ids(turn, 8)
    assert col.ids(short) == hf_ids(long[:40], 8)
    assert engine.cache.hit_tokens >= 64 + 32  # 4 blocks of the turn (prompt + answer), 2 of the short one
    assert engine.cache.used_bytes == 0


def test_concurrent_requests_and_cancellation_keep_outputs_exact_and_references_counted():
    engine, col = make_prefix_caching_engine(True, max_num_batched_tokens=32), Collector()
    warm = submit(engine, col, BASE[:48] + [1], 4)
    drain(engine)
    prompts = [BASE[:48] + [rng.randrange(3, 500) for _ in range(3 + i)] for i in range(8)]
    rids = [submit(engine, col, p, 10) for p in prompts]
    victims = [submit(engine, col, BASE[:40] + [9, 9], 50) for _ in range(2)]
    for _ in range(3):
        engine.step()
    for v in victims:
        engine.cancel(v)
    drain(engine)
    assert all(col.final(v).finish_reason == "cancelled" for v in victims)
    for p, r in zip(prompts, rids):
        assert col.ids(r) == hf_ids(p, 10)
    assert col.final(warm).finish_reason == "length"
    assert engine.cache.used_bytes == 0 and all(r == 0 for r in engine.cache._refs)


def test_the_setting_turns_it_on_and_off_and_a_bad_value_is_refused(tmp_path):
    from tests.helpers.servers import add_generation_model
    from tritonlm.engine.loader import build_engine
    from tritonlm.engine.settings import EngineSettings, SettingsError

    folder = add_generation_model(tmp_path, "m")
    for raw, on in (("", True), ("false", False), ("true", True)):
        engine = build_engine(EngineSettings.from_params({"enable_prefix_caching": raw}, folder))
        assert engine.cache.prefix_caching is on
        engine.shutdown()
    engine = build_engine(EngineSettings.from_params({"use_kv_cache": "false"}, folder))
    assert engine.cache.prefix_caching is False  # recomputing every step shares nothing
    engine.shutdown()
    with pytest.raises(SettingsError, match="enable_prefix_caching: 'maybe' is not a boolean"):
        EngineSettings.from_params({"enable_prefix_caching": "maybe"}, folder)
