"""Greedy answers against transformers' generate(): the reference, the near-tie rule, and an
Engine run over prompts that are chunked, batched and (with the prefix cache) reused.

    hf_generate(model, prompt, new)          transformers' greedy tokens (no EOS: `new` of them)
    assert_greedy_equal(model, prompt, ...)  equal, up to transformers' own near-tie
    submit_all(engine, prompts, new)         every prompt submitted: the events, the request ids
    engine_answers(engine, prompts, new)     an Engine's answers, submitted together, in rounds
    assert_engine_greedy_equal(...)          engine_answers against a reference, each round
"""

from __future__ import annotations

from typing import Callable

import torch

from tests.helpers.models import Collector, drain, hf_logits

NEAR_TIE = 1e-5  # transformers' own top-1 / top-2 margin below which either token is greedy's answer


def hf_generate(model, prompt: list[int], new: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             do_sample=False, max_new_tokens=new, min_new_tokens=new, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def assert_greedy_equal(model, prompt: list[int], got: list[int], want: list[int]) -> None:
    """Equal token for token, up to the first position where transformers' own top-1 / top-2
    margin is below NEAR_TIE: there either token is greedy's, and the answers may part."""
    for i, (g, w) in enumerate(zip(got, want)):
        if g != w:
            top2 = hf_logits(model, prompt + want[:i])[-1].topk(2).values
            assert float(top2[0] - top2[1]) < NEAR_TIE, f"token {i}: {g} != {w} (margin {float(top2[0] - top2[1]):.3g})"
            return
    assert len(got) == len(want)


def submit_all(engine, prompts: list[list[int]], new: int) -> tuple[Collector, list[int]]:
    """Every prompt submitted (`new` tokens each, no EOS): (the events, each prompt's request id)."""
    from tritonlm.engine.request import GenerationRequest, SamplingParams

    col, ids = Collector(), []
    for prompt in prompts:
        req = GenerationRequest(list(prompt), SamplingParams(max_tokens=new, end_id=-1), col._on_event)
        col.events[req.request_id] = []
        engine.submit(req)
        ids.append(req.request_id)
    return col, ids


def engine_answers(engine, prompts: list[list[int]], new: int, rounds: int = 1) -> list[tuple[Collector, list[int]]]:
    """Per round, every prompt submitted at once and drained: (the events, each prompt's request id)."""
    out = []
    for _ in range(rounds):
        col, ids = submit_all(engine, prompts, new)
        drain(engine)
        out.append((col, ids))
    return out


def assert_engine_greedy_equal(model, runner, prompts: list[list[int]], new: int, prefix_caching: bool,
                               reference: Callable[[list[int], int], list[int]] | None = None,
                               kv_tokens: int = 256) -> None:
    """An Engine over `runner` (prefill in 5-token chunks, the rows batched, a KV cache of
    kv_tokens in blocks of 4), two rounds: every answer equals reference(prompt, new)
    (hf_generate by default); with the prefix cache on, the second round's first prompt
    comes from the cache."""
    from tritonlm.engine.engine import Engine
    from tritonlm.engine.kv_cache import KVCacheManager
    from tritonlm.engine.scheduler import SchedulerConfig
    from tritonlm.models.builtin import tiny_tokenizer

    reference = reference or (lambda prompt, n: hf_generate(model, prompt, n))
    cache = KVCacheManager(runner.spec, kv_tokens * runner.spec.bytes_per_token, 4, allocate_kv=runner.allocate_kv,
                           prefix_caching=prefix_caching)
    engine = Engine(runner, tiny_tokenizer(), cache, SchedulerConfig(max_num_batched_tokens=5), max_context=128)
    for round_, (col, ids) in enumerate(engine_answers(engine, prompts, new, rounds=2)):
        for prompt, rid in zip(prompts, ids):
            assert_greedy_equal(model, prompt, col.ids(rid), reference(prompt, new))
        if round_ == 1 and prefix_caching:
            assert col.final(ids[0]).num_cached_tokens > 0
