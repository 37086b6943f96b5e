"""tritonlm/engine/runners/layers.py: RoPE variants against transformers' Llama, and the
oneDNN-blocked projections against a plain matmul."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.models import (
    LLAMA_VOCAB,
    assert_close,
    forward_rows,
    hf_logits,
    paged_cache,
    random_tokens,
    tiny_llama,
)
from tritonlm.engine.batch import StepBatch
from tritonlm.engine.kv_cache import KVCacheManager
from tritonlm.engine.runners.torch_runner import TorchRunner


# ---------------------------------------------------------------------------- RoPE (Llama variants)


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default", "rope_theta": 500000.0},
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
        {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ],
    ids=lambda r: r["rope_type"],
)
def test_llama_rope_variants_and_untied_head(rope):
    model = tiny_llama(rope_parameters=rope, tie_word_embeddings=False, num_key_value_heads=1)
    runner = TorchRunner(model)
    seq = random_tokens(12, seed=13)
    mgr = paged_cache(runner)
    mgr.allocate(1, 12)
    first = forward_rows(runner, mgr, [(1, 0, seq[:9])], all_logits=True)[0]
    rest = forward_rows(runner, mgr, [(1, 9, seq[9:])], all_logits=True)[0]
    out = torch.cat([first, rest])
    assert_close(out, hf_logits(model, seq))


def test_llama_length_dependent_rope_is_refused():
    model = tiny_llama(rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    with pytest.raises(ValueError, match="rope_type 'dynamic'"):
        TorchRunner(model)


# ---------------------------------------------------------------------------- blocked weights


def test_blocked_row_buckets_are_few_cover_every_count_and_waste_little():
    from tritonlm.engine.runners.layers import blocked_rows

    padded = [blocked_rows(m) for m in range(1, 8193)]
    assert all(p >= m for m, p in zip(range(1, 8193), padded))
    assert padded[:8] == list(range(1, 9))  # single rows and small batches exactly
    assert len(set(padded)) <= 70  # a bounded set of matmul shapes (oneDNN keeps kernels per shape)
    assert max(p / m for m, p in zip(range(9, 8193), padded[8:])) <= 1.9
    assert all(p / m <= 1.25 for m, p in zip(range(65, 8193), padded[64:]))


@pytest.mark.parametrize("layout", ["auto", "blocked"])
@pytest.mark.parametrize("widths", [[1] * 9, [7, 3], [70, 5, 33]])
def test_packed_weights_give_the_plain_matmul_logits(widths, layout):
    """The CPU float paths (tritonlm's panels where its AVX-512 kernel builds, the default;
    oneDNN-blocked weights with rows padded to a bucket) against the same weights
    multiplied plainly, x @ w [in, out], for row counts inside and across buckets; a packed
    projection refuses to be sliced, naming why."""
    from tritonlm.engine.parallel.shard import tensor_slice
    from tritonlm.engine.runners.layers import BlockedLinear, PanelLinear, panels_available
    from tritonlm.engine.runners.model import Transformer

    model = tiny_llama(tie_word_embeddings=False)
    runner = TorchRunner(model)
    runner.transformer = Transformer.from_hf(model)
    runner.transformer.block_weights(layout)
    runner.transformer.use_paged_kernel()
    kind = PanelLinear if layout == "auto" and panels_available() else BlockedLinear
    assert isinstance(runner.transformer.layers[0].qkv, kind) and isinstance(runner.transformer.lm_head, kind)
    plain = TorchRunner(model)
    plain.transformer = Transformer.from_hf(model)  # not packed
    plain.transformer.use_paged_kernel()  # the same C++ ops as the packed runner: only the matmuls differ
    gen = torch.Generator().manual_seed(sum(widths))
    rows = [torch.randint(0, LLAMA_VOCAB, (w,), generator=gen).tolist() for w in widths]
    outs = []
    for r in (runner, plain):
        cache = KVCacheManager(r.spec, (sum(w // 16 + 2 for w in widths) + 1) * 16 * r.spec.bytes_per_token, 16,
                               allocate_kv=r.allocate_kv)
        for b, w in enumerate(widths):
            cache.allocate(b, w)
        outs.append(r.forward(StepBatch.build(rows, [0] * len(rows), [cache.slots(b, w) for b, w in enumerate(widths)],
                                              all_logits=True), cache.pool))
    for b, w in enumerate(widths):
        assert_close(outs[0][b, :w], outs[1][b, :w], atol=1e-5)
    with pytest.raises(ValueError, match="weights cannot be sliced"):
        tensor_slice(runner.transformer, 0, 2)
