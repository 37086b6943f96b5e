"""Device block tables: slots mapped from them equal the host slot table, and a step run
from block tables gives the same logits and tokens as one run from host slot tables."""

from __future__ import annotations

import random

import pytest
import torch

from tests.helpers.models import Collector, drain, tiny, tiny_llama
from tritonlm.engine.batch import StepBatch
from tritonlm.engine.block_table import DeviceBlockTable, position_slots, slot_mapping
from tritonlm.engine.engine import Engine
from tritonlm.engine.kv_cache import SCRATCH_SLOT, KVCacheManager
from tritonlm.engine.model_shape import ModelShape
from tritonlm.engine.runners.torch_runner import TorchRunner
from tritonlm.engine.scheduler import SchedulerConfig

SPEC = ModelShape(architecture="gpt2", num_layers=1, num_heads=2, num_kv_heads=2, head_dim=4, vocab_size=10,
                  max_positions=4096, dtype=torch.float32)


def churned_cache(seed: int, block_size: int, blocks: int = 200) -> tuple[KVCacheManager, dict[int, int]]:
    """A cache with device tables after random allocations and frees (non-contiguous, reused
    blocks and rows, prefix sharing); returns it and the live sequences' reserved tokens."""
    rng = random.Random(seed)
    cache = KVCacheManager(SPEC, SPEC.bytes_per_token * block_size * blocks, block_size, device_tables=True)
    live: dict[int, int] = {}
    for sid in range(60):
        if live and rng.random() < 0.4:
            gone = rng.choice(sorted(live))
            cache.free(gone)
            del live[gone]
        n = rng.randint(1, 12 * block_size)
        if cache.can_allocate(n):
            cache.allocate(sid, n)
            live[sid] = n
    return cache, live


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_device_slot_mapping_equals_host_slot_table(seed: int, block_size: int):
    cache, live = churned_cache(seed, block_size)
    rng = random.Random(seed + 100)
    ids = rng.sample(sorted(live), k=min(len(live), 9))
    lengths = [rng.randint(1, live[s]) for s in ids]
    want = cache.slot_table(ids, lengths)  # [B, L]
    table = cache.device_table.gather(ids)  # [B, M]
    got = slot_mapping(table, torch.tensor(lengths), max(lengths), block_size)
    assert torch.equal(got, want)
    # the slot of each row's last position, as a decode step writes it
    last = torch.tensor(lengths).unsqueeze(1) - 1  # [B, 1]
    assert torch.equal(position_slots(table, last, block_size), want.gather(1, last))


def test_rows_are_reused_and_cleared():
    table = DeviceBlockTable("cpu", rows=2, width=2)
    table.add(1, [5, 6])
    table.add(2, [7])
    table.add(3, [8, 9, 10, 11, 12])  # grows rows and width
    assert table.width >= 5 and table.table.shape[0] >= 3
    assert table.gather([3, 1]).tolist()[0][:5] == [8, 9, 10, 11, 12]
    row = table.row(1)
    table.remove(1)
    assert table.table[row].tolist() == [0] * table.width  # scratch: never points at live blocks
    table.add(4, [3])
    assert table.row(4) == row
    with pytest.raises(KeyError):
        table.add(4, [1])


def test_padding_positions_map_to_scratch():
    table = torch.tensor([[3, 4], [5, 0]], dtype=torch.int32)
    got = slot_mapping(table, torch.tensor([5, 2]), 8, 4)
    assert got[0].tolist() == [12, 13, 14, 15, 16, SCRATCH_SLOT, SCRATCH_SLOT, SCRATCH_SLOT]
    assert got[1].tolist() == [20, 21] + [SCRATCH_SLOT] * 6


@pytest.mark.parametrize("model", ["gpt2", "llama"])
def test_forward_from_block_tables_equals_slot_tables(model: str):
    hf = tiny()[0] if model == "gpt2" else tiny_llama()
    runner = TorchRunner(hf)
    host = KVCacheManager(runner.spec, runner.spec.bytes_per_token * 4 * 64, 4, allocate_kv=runner.allocate_kv)
    dev = KVCacheManager(runner.spec, runner.spec.bytes_per_token * 4 * 64, 4, allocate_kv=runner.allocate_kv,
                         device_tables=True)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17, 18]]
    for cache in (host, dev):
        for sid, p in enumerate(prompts):
            cache.allocate(sid, 24)
    ids = list(range(len(prompts)))
    for past, feeds in ((0, prompts), (None, [[3], [4], [5]])):  # a padded prefill pass, then a decode step
        pasts = [0] * 3 if past == 0 else [len(p) for p in prompts]
        lengths = [a + len(f) for a, f in zip(pasts, feeds)]
        a = runner.forward(StepBatch.from_slot_table(feeds, pasts, host.slot_table(ids, lengths)), host.pool)
        b = runner.forward(StepBatch.from_block_table(feeds, pasts, dev.device_table.gather(ids), 4), dev.pool)
        assert torch.equal(a, b)


def test_engine_with_device_tables_gives_the_same_tokens():
    model, tok = tiny()
    out = []
    for device_tables in (False, True):
        runner = TorchRunner(model)
        cache = KVCacheManager(runner.spec, 8 * 272 * runner.spec.bytes_per_token, 16, allocate_kv=runner.allocate_kv,
                               device_tables=device_tables)
        engine = Engine(runner, tok, cache, SchedulerConfig(max_num_batched_tokens=24), max_context=256)
        col = Collector()
        rids = [col.request(engine, p, max_tokens=20) for p in ("hello there", "a b c d e f g h i j k l m n o", "x")]
        drain(engine)
        out.append([col.ids(r) for r in rids])
        assert len(cache.device_table or []) == 0  # every row given back
    assert out[0] == out[1]
