"""tritonlm/engine/executor.py: prefill chunks packed into shared passes, and one row's
failure kept out of its batch."""

from __future__ import annotations

import types

from tests.helpers.models import MIXED_PROMPTS, Collector, drain, hf_greedy_text, make_engine


def test_simultaneous_prompts_prefill_together_and_equal_hf_generate():
    """Prompts arriving together share prefill passes (padding costs only attention): fewer
    passes than prompts, every text still transformers' own."""
    from tritonlm.engine.executor import group_prefill

    engine = make_engine(max_num_batched_tokens=512)
    passes = []
    real_forward = engine.runner.forward
    engine.runner.forward = lambda batch, pool: passes.append(len(batch.num_new)) or real_forward(batch, pool)
    prompts = [f"Story number {i}: once upon a time" for i in range(12)] + MIXED_PROMPTS
    col = Collector()
    rids = [col.request(engine, p, max_tokens=6) for p in prompts]
    engine.step()  # admission and the prefill passes
    assert len(passes) < len(prompts) and max(passes) > 1, passes
    drain(engine)
    for p, rid in zip(prompts, rids):
        assert col.ids(rid) == hf_greedy_text(p, 6), p
    def widths(*ns: int, past: int = 0) -> list[list[int]]:
        chunks = [(types.SimpleNamespace(num_computed=past), [0] * n) for n in ns]
        return [[len(t) for _, t in g] for g in group_prefill(chunks)]

    assert widths(23, 23, 23) == [[23, 23, 23]]
    assert widths(6, 8, 10, 12, 40, 41, 55) == [[6, 8, 10, 12, 40, 41, 55]]  # padding costs attention only
    assert widths(1, 100) == [[1, 100]]
    assert widths(1, 2000) == [[1], [2000]]  # 2000 x 2000 padded keys for one token: not worth a pass saved
    assert widths(16, 16, 512, past=3000) == [[16, 16], [512]]  # long cached contexts count too
    assert widths() == []


def sampled_alone(prompt: str, **params) -> list[int]:
    engine = make_engine()
    col = Collector()
    rid = col.request(engine, prompt, **params)
    drain(engine)
    return col.ids(rid)


def test_a_row_whose_sampling_fails_does_not_fail_its_batch(monkeypatch):
    # a fault injected into one row's sampling (seed 666), batched or alone; the seven greedy
    # rows and the two sampled rows sharing its batch (the sampled ones in its sample_rows
    # call) must come out exactly as alone, and nothing may stay in the cache
    import tritonlm.engine.executor as executor

    real_row, real_rows = executor.sample_row, executor.sample_rows
    batches = []

    def faulty_row(logits, row):
        if row.params.seed == 666:
            raise FloatingPointError("injected")
        return real_row(logits, row)

    def faulty_rows(logits, rows):
        batches.append(len(rows))
        if any(row.params.seed == 666 for row in rows):
            raise FloatingPointError("injected")
        return real_rows(logits, rows)

    monkeypatch.setattr(executor, "sample_row", faulty_row)
    monkeypatch.setattr(executor, "sample_rows", faulty_rows)
    sampled = dict(max_tokens=8, temperature=0.9, top_k=20)
    engine = make_engine()
    col = Collector()
    bad = col.request(engine, MIXED_PROMPTS[0], max_tokens=8, temperature=0.7, seed=666)
    good = [col.request(engine, p, max_tokens=8) for p in MIXED_PROMPTS[:7]]
    neighbours = [col.request(engine, p, seed=s, **sampled) for s, p in zip((5, 6), MIXED_PROMPTS[1:3])]
    drain(engine)
    assert col.final(bad).finish_reason == "error" and "sampling" in col.final(bad).error
    for p, rid in zip(MIXED_PROMPTS[:7], good):
        assert col.final(rid).finish_reason == "length" and col.ids(rid) == hf_greedy_text(p, 8), p
    assert engine.cache.used_bytes == 0 and engine.cache.live_sequences() == 0
    assert max(batches) == 3  # the faulty row shared a sample_rows call with both neighbours
    monkeypatch.setattr(executor, "sample_row", real_row)
    monkeypatch.setattr(executor, "sample_rows", real_rows)
    for s, p, rid in zip((5, 6), MIXED_PROMPTS[1:3], neighbours):
        assert col.final(rid).finish_reason == "length" and col.ids(rid) == sampled_alone(p, seed=s, **sampled), p


def test_chunks_beside_decoding_rows_share_their_pass_and_equal_hf_generate():
    """A prompt that arrives while others decode runs its chunk as one-token rows in the
    decoding rows' pass, so a step with both is one pass (on a CPU each pass reads every
    weight); a step whose chunks are wider than the executor's chunk_rows, or read more
    (token, key) pairs than its chunk_keys (a chunk far into a long prompt), runs them
    apart. Either way every answer is transformers' own."""
    from tritonlm.engine.executor import JOINED_KEYS_PER_TOKEN
    from tritonlm.engine.runners.torch_runner import FUSED_CHUNK_TOKENS

    jobs = [("The quick brown fox", 9), ("Once upon a time there was", 7), ("Hello", 8),
            ("A much longer prompt that takes several chunks of the step's budget to run", 6), ("Why", 5)]
    for chunk_rows, chunk_keys in ((None, None), (0, None), (4, None), (None, 12 * 20)):
        engine = make_engine(max_num_batched_tokens=12)
        executor = engine.executor
        if chunk_rows is None:
            assert executor.chunk_rows == FUSED_CHUNK_TOKENS
            assert executor.chunk_keys == FUSED_CHUNK_TOKENS * JOINED_KEYS_PER_TOKEN
        else:
            executor.chunk_rows = chunk_rows
        if chunk_keys is not None:
            executor.chunk_keys = chunk_keys
        passes, chunks = [], []  # per step: forward calls; (prompt tokens, their (token, key) pairs) beside decoding rows
        real_forward, real_step = engine.runner.forward, executor.forward
        engine.runner.forward = lambda batch, pool: passes.__setitem__(-1, passes[-1] + 1) or real_forward(batch, pool)

        def step(plan, ahead=None):
            passes.append(0)
            prompt = [(s, n) for s, n in plan if s.in_prefill]
            mixed = prompt and len(prompt) < len(plan)
            chunks.append((sum(n for _, n in prompt), sum(n * (s.num_computed + n) for s, n in prompt)) if mixed else None)
            return real_step(plan, ahead)

        executor.forward = step
        col = Collector()
        rids = []
        for i, (prompt, n) in enumerate(jobs):  # each arrives while those before it decode
            rids.append(col.request(engine, prompt, max_tokens=n, end_id=-1))
            for _ in range(2 + i):
                engine.step()
        drain(engine)
        for (prompt, n), rid in zip(jobs, rids):
            assert col.ids(rid) == hf_greedy_text(prompt, n, eos_token_id=None)[:n], (chunk_rows, prompt)
        both = [(p, c) for p, c in zip(passes, chunks) if c is not None]
        assert len(both) >= 3, (chunk_rows, passes, chunks)
        assert all((p == 1) == (t <= executor.chunk_rows and k <= executor.chunk_keys) for p, (t, k) in both), both
        if chunk_rows is None and chunk_keys is None:
            assert all(p == 1 for p, _ in both)
        if chunk_rows == 4 or chunk_keys is not None:  # some steps together, some apart
            assert {p == 1 for p, _ in both} == {True, False}, both
