"""The engine alone (no server): continuous batching, KV budget, sampling, stop rules,
checked token for token against transformers' own generate()."""

from __future__ import annotations

import types

import pytest
import torch

from tests.genrepo import hf_greedy, tiny
from tritonlm.engine.engine import Engine
from tritonlm.engine.kv_cache import KVCacheManager
from tritonlm.engine.request import GenerationRequest, InvalidRequestError, SamplingParams, ServerBusyError
from tritonlm.engine.runners.torch_runner import TorchRunner
from tritonlm.engine.scheduler import SchedulerConfig

PROMPTS = [
    "The capital of France is",
    "Once upon a time there was a small robot who wanted",
    "Hi",
    "Numbers: 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25",
    "Café naïve — 你好，世界 🙂",
    "def main(): return",
]


def make_engine(kv_sequences: float = 8, max_context: int = 256, use_kv_cache: bool = True, **sched) -> Engine:
    model, tok = tiny()
    runner = TorchRunner(model)
    budget = int(kv_sequences * (max_context + 16) * runner.spec.bytes_per_token) + 16 * runner.spec.bytes_per_token
    cache = KVCacheManager(runner.spec, budget, block_size=16, allocate_kv=runner.allocate_kv)
    return Engine(runner, tok, cache, SchedulerConfig(**sched), max_context=max_context, use_kv_cache=use_kv_cache)


class Collector:
    def __init__(self):
        self.events = {}

    def request(self, engine: Engine, prompt: str, stream: bool = True, **params) -> int:
        req = GenerationRequest(engine.encode(prompt), SamplingParams(**params), self._on_event, stream=stream)
        self.events[req.request_id] = []  # before submit: a started engine may answer at once
        try:
            engine.submit(req)
        except BaseException:  # refused (e.g. server busy): no request to follow
            del self.events[req.request_id]
            raise
        return req.request_id

    def _on_event(self, ev):
        self.events[ev.request_id].append(ev)

    def ids(self, rid):
        return [t for e in self.events[rid] for t in e.token_ids]

    def text(self, rid):
        return "".join(e.text for e in self.events[rid])

    def final(self, rid):
        assert self.events[rid] and self.events[rid][-1].finished
        return self.events[rid][-1]


def drain(engine: Engine, max_steps: int = 10_000) -> None:
    for _ in range(max_steps):
        if not (engine.has_work() or engine._inbox):
            return
        engine.step()
    raise AssertionError("engine did not finish")


def test_batch_of_mixed_prompts_equals_hf_generate_token_for_token():
    engine = make_engine(max_num_batched_tokens=8)  # small budget: prompts prefill in chunks
    col = Collector()
    rids = [col.request(engine, p, max_tokens=24) for p in PROMPTS]
    drain(engine)
    _, tok = tiny()
    for p, rid in zip(PROMPTS, rids):
        ref = hf_greedy(p, 24)
        assert col.ids(rid) == ref, p
        assert col.text(rid) == tok.decode(ref)
        fin = col.final(rid)
        assert fin.finish_reason == "length" and fin.num_output_tokens == 24
        assert fin.num_input_tokens == len(tok(p).input_ids)
    assert engine.cache.used_bytes == 0 and engine.cache.live_sequences() == 0


def test_simultaneous_prompts_prefill_together_and_equal_hf_generate():
    """Prompts arriving together share prefill passes (padding costs only attention): fewer
    passes than prompts, every text still transformers' own."""
    from tritonlm.engine.executor import group_prefill

    engine = make_engine(max_num_batched_tokens=512)
    passes = []
    real_forward = engine.runner.forward
    engine.runner.forward = lambda batch, pool: passes.append(len(batch.num_new)) or real_forward(batch, pool)
    prompts = [f"Story number {i}: once upon a time" for i in range(12)] + PROMPTS
    col = Collector()
    rids = [col.request(engine, p, max_tokens=6) for p in prompts]
    engine.step()  # admission and the prefill passes
    assert len(passes) < len(prompts) and max(passes) > 1, passes
    drain(engine)
    for p, rid in zip(prompts, rids):
        assert col.ids(rid) == hf_greedy(p, 6), p
    def widths(*ns: int, past: int = 0) -> list[list[int]]:
        chunks = [(types.SimpleNamespace(num_computed=past), [0] * n) for n in ns]
        return [[len(t) for _, t in g] for g in group_prefill(chunks)]

    assert widths(23, 23, 23) == [[23, 23, 23]]
    assert widths(6, 8, 10, 12, 40, 41, 55) == [[6, 8, 10, 12, 40, 41, 55]]  # padding costs attention only
    assert widths(1, 100) == [[1, 100]]
    assert widths(1, 2000) == [[1], [2000]]  # 2000 x 2000 padded keys for one token: not worth a pass saved
    assert widths(16, 16, 512, past=3000) == [[16, 16], [512]]  # long cached contexts count too
    assert widths() == []


def test_same_text_alone_in_a_batch_of_16_and_when_joining_a_running_batch():
    prompt = "Once upon a time"
    alone = Collector()
    e1 = make_engine()
    rid = alone.request(e1, prompt, max_tokens=30)
    drain(e1)
    expected = alone.text(rid)

    e2 = make_engine()
    batch = Collector()
    mixed = [PROMPTS[i % len(PROMPTS)] + " " * (i % 3) for i in range(15)]
    rids = [batch.request(e2, p, max_tokens=10 + i) for i, p in enumerate(mixed)]
    target = batch.request(e2, prompt, max_tokens=30)
    drain(e2)
    assert batch.text(target) == expected
    assert e2.stats.max_batch_size == 16

    e3 = make_engine()
    late = Collector()
    for p in PROMPTS:
        late.request(e3, p, max_tokens=40)
    for _ in range(7):  # others are mid-decode when it joins
        e3.step()
    target = late.request(e3, prompt, max_tokens=30)
    drain(e3)
    assert late.text(target) == expected


def test_kv_budget_of_two_sequences_serves_twelve_requests():
    engine = make_engine(kv_sequences=2)
    budget = engine.cache.total_bytes
    col = Collector()
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(12)]
    rids = [col.request(engine, p, max_tokens=200) for p in prompts]  # each reserves most of a full context
    peak_running = 0
    while engine.has_work() or engine._inbox:
        engine.step()
        peak_running = max(peak_running, engine.scheduler.num_running)
        assert engine.cache.used_bytes <= budget
    assert peak_running == 2
    assert engine.stats.max_kv_used_bytes <= budget
    for p, rid in zip(prompts, rids):
        assert col.final(rid).finish_reason == "length"
        assert col.ids(rid) == hf_greedy(p, 200)


def test_streaming_pieces_concatenate_to_the_non_streaming_text():
    engine = make_engine()
    col = Collector()
    prompt = "Café naïve — 你好"
    s = col.request(engine, prompt, stream=True, max_tokens=60)
    n = col.request(engine, prompt, stream=False, max_tokens=60)
    drain(engine)
    assert len(col.events[n]) == 1  # non-streaming: one answer
    assert col.text(s) == col.text(n)
    pieces = [e.text for e in col.events[s]]
    assert len(pieces) > 10
    # each piece is whole characters: a piece that split a multi-byte character would carry
    # U+FFFD where the whole text has the real character, so every running prefix must be a
    # prefix of the text of all the tokens decoded at once
    _, tok = tiny()
    full = tok.decode(col.ids(s))
    assert col.text(s) == full
    assert any(ord(c) > 127 for c in full)  # the check has multi-byte characters to catch
    so_far = ""
    for piece in pieces:
        so_far += piece
        assert full.startswith(so_far), (piece, so_far[-20:])
    assert full.count("\ufffd") == sum(p.count("\ufffd") for p in pieces)


def test_a_streamed_token_without_text_is_still_sent_at_once():
    """A token whose text is empty (here an end token the request ignores, end_id=-1) is
    streamed at once, with its id, not held for the next token's text: a streaming client's
    first response is the first token, as llama-server's stream has it."""
    from tritonlm.engine.executor import RowOutput, StepOutput

    engine = make_engine()
    _, tok = tiny()
    col = Collector()
    rid = col.request(engine, "Once upon a time", max_tokens=8, end_id=-1)
    engine.step()  # prefill and a first token
    sent = len(col.events[rid])
    assert sent == 1 and col.events[rid][0].token_ids, col.events[rid]
    seq = engine.scheduler.get(rid)
    engine.output.process(StepOutput([RowOutput(seq, [(tok.eos_token_id, 0.0)])], 1, 1, 0.0))  # [eos]: text ""
    assert tok.decode([tok.eos_token_id], skip_special_tokens=True) == ""
    ev = col.events[rid][sent]
    assert ev.token_ids == [tok.eos_token_id] and ev.text == "" and not ev.finished


def test_stream_interval_sends_the_first_token_at_once_then_every_n_tokens(tmp_path):
    from tests.genrepo import add_generation_model
    from tritonlm.engine.loader import build_engine
    from tritonlm.engine.settings import EngineSettings

    folder = add_generation_model(tmp_path, "tiny", stream_interval=4)  # as config.pbtxt sets it
    engine = build_engine(EngineSettings.from_params({"task": "generate", "max_context": "256", "stream_interval": "4"}, folder))
    col = Collector()
    streams = [col.request(engine, p, max_tokens=30, end_id=-1) for p in PROMPTS]
    wholes = [col.request(engine, p, stream=False, max_tokens=30, end_id=-1) for p in PROMPTS]
    drain(engine)
    for p, s, w in zip(PROMPTS, streams, wholes):
        assert col.text(s) == col.text(w) and col.ids(s) == col.ids(w), p
        sizes = [len(e.token_ids) for e in col.events[s]]
        assert sum(sizes) == 30 and col.events[s][-1].finished, (p, sizes)
        # the first event as soon as the first token's text is whole, then every 4 tokens
        # (more when a character spans the 4th), the rest with the final event
        assert sizes[0] <= 2 and all(n >= 4 for n in sizes[1:-1]) and len(sizes) >= 6, (p, sizes)
    assert sum(len(col.events[s]) for s in streams) < 0.4 * 30 * len(PROMPTS)


def test_kv_cache_off_gives_the_same_tokens():
    on, off = make_engine(), make_engine(use_kv_cache=False)
    c_on, c_off = Collector(), Collector()
    r_on = [c_on.request(on, p, max_tokens=12) for p in PROMPTS[:3]]
    r_off = [c_off.request(off, p, max_tokens=12) for p in PROMPTS[:3]]
    drain(on)
    drain(off)
    for a, b in zip(r_on, r_off):
        assert c_on.ids(a) == c_off.ids(b)


def test_repetition_penalty_matches_hf():
    engine = make_engine()
    col = Collector()
    rid = col.request(engine, PROMPTS[1], max_tokens=20, repetition_penalty=1.5)
    drain(engine)
    assert col.ids(rid) == hf_greedy(PROMPTS[1], 20, repetition_penalty=1.5)


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch():
    def run(with_neighbours: bool):
        engine = make_engine()
        col = Collector()
        if with_neighbours:
            for p in PROMPTS:
                col.request(engine, p, max_tokens=15, temperature=0.9, seed=7)
        rid = col.request(engine, "Once upon a time", max_tokens=25, temperature=1.0, top_k=40, top_p=0.9, seed=1234)
        drain(engine)
        return col.ids(rid)

    first = run(False)
    assert first == run(False) == run(True)
    other_engine = make_engine()
    col = Collector()
    rid = col.request(other_engine, "Once upon a time", max_tokens=25, temperature=1.0, top_k=40, top_p=0.9, seed=99)
    drain(other_engine)
    assert col.ids(rid) != first  # another seed, another text
    greedy = hf_greedy("Once upon a time", 25)
    assert first != greedy


def test_top_k_one_is_greedy():
    engine = make_engine()
    col = Collector()
    rid = col.request(engine, PROMPTS[0], max_tokens=15, temperature=1.3, top_k=1, seed=3)
    drain(engine)
    assert col.ids(rid) == hf_greedy(PROMPTS[0], 15)


def test_end_id_stops_and_min_tokens_defers_it():
    ref = hf_greedy(PROMPTS[0], 20)
    end = ref[5]  # a token greedy decoding produces at step 6
    first = ref.index(end)
    engine = make_engine()
    col = Collector()
    a = col.request(engine, PROMPTS[0], max_tokens=20, end_id=end)
    b = col.request(engine, PROMPTS[0], max_tokens=20, end_id=end, min_tokens=first + 3)
    drain(engine)
    assert col.final(a).finish_reason == "stop" and col.ids(a) == ref[:first]
    assert end not in col.ids(b)[: first + 3] and len(col.ids(b)) >= first + 3


def test_stop_word_split_across_tokens_is_found_and_removed():
    _, tok = tiny()
    ref = hf_greedy(PROMPTS[1], 40)
    text = tok.decode(ref)
    # a stop string that straddles the boundary between two generated tokens
    cut = len(tok.decode(ref[:10]))
    stop = text[cut - 2 : cut + 2]
    assert len(stop) == 4
    for stream in (True, False):
        engine = make_engine()
        col = Collector()
        rid = col.request(engine, PROMPTS[1], stream=stream, max_tokens=40, stop_words=(stop,))
        drain(engine)
        out = col.text(rid)
        assert col.final(rid).finish_reason == "stop"
        assert out == text[: text.index(stop)]
        assert stop not in out
        if stream:  # one event per step without a dispatcher (nothing coalesces): it streamed,
            # and the pieces joined are the text before the stop, so no half of it went out early
            assert len(col.events[rid]) > 2


def test_bad_words_are_never_produced():
    _, tok = tiny()
    ref = hf_greedy(PROMPTS[0], 30)
    banned = ref[3]
    engine = make_engine()
    col = Collector()
    rid = col.request(engine, PROMPTS[0], max_tokens=30, bad_words=((banned,),))
    drain(engine)
    assert banned not in col.ids(rid) and col.ids(rid)[:3] == ref[:3]


def test_invalid_requests_are_refused_with_the_input_named():
    engine = make_engine(max_context=64)
    col = Collector()
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        col.request(engine, "hello", max_tokens=0)
    with pytest.raises(InvalidRequestError, match="text_input: the prompt has"):
        col.request(engine, "word " * 200, max_tokens=1)
    with pytest.raises(InvalidRequestError, match="ask for at most"):
        col.request(engine, "hello", max_tokens=64)
    with pytest.raises(InvalidRequestError, match="top_p"):
        col.request(engine, "hello", max_tokens=4, top_p=1.5)
    with pytest.raises(InvalidRequestError, match="temperature"):
        col.request(engine, "hello", max_tokens=4, temperature=-1.0)
    assert not engine._inbox  # nothing was queued


def test_cancel_frees_the_cache_at_once_and_others_continue():
    engine = make_engine()
    col = Collector()
    victim = col.request(engine, PROMPTS[0], max_tokens=100)
    other = col.request(engine, PROMPTS[1], max_tokens=20)
    for _ in range(5):
        engine.step()
    used = engine.cache.used_bytes
    engine.cancel(victim)
    engine.step()
    assert col.final(victim).finish_reason == "cancelled"
    assert engine.cache.used_bytes < used
    drain(engine)
    assert col.ids(other) == hf_greedy(PROMPTS[1], 20)
    assert engine.cache.used_bytes == 0


def test_a_row_whose_sampling_fails_does_not_fail_its_batch(monkeypatch):
    # a fault injected into one row's sampling (seed 666); the seven greedy rows sharing
    # its batch must come out exactly as alone, and nothing may stay in the cache
    import tritonlm.engine.executor as executor

    real = executor.sample_row

    def faulty(logits, row):
        if row.params.seed == 666:
            raise FloatingPointError("injected")
        return real(logits, row)

    monkeypatch.setattr(executor, "sample_row", faulty)
    engine = make_engine()
    col = Collector()
    bad = col.request(engine, PROMPTS[0], max_tokens=8, temperature=0.7, seed=666)
    good = [col.request(engine, p, max_tokens=8) for p in PROMPTS[:7]]
    drain(engine)
    assert col.final(bad).finish_reason == "error" and "sampling" in col.final(bad).error
    for p, rid in zip(PROMPTS[:7], good):
        assert col.final(rid).finish_reason == "length" and col.ids(rid) == hf_greedy(p, 8), p
    assert engine.cache.used_bytes == 0 and engine.cache.live_sequences() == 0


def test_one_argmax_per_pass_picks_what_sample_row_picks_row_by_row():
    from tritonlm.engine.sampler import RowState, greedy_tokens, sample_row

    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(3))  # [n, V]
    logits[1, 7] = logits[1, 30] = 99.0  # a tie: the first index wins, as in transformers' argmax
    logits[2, 11] = float("nan")
    logits[3, 4] = float("inf")
    logits[4] = float("-inf")
    logits[4, 9] = -1e30  # the one finite value wins
    row = RowState.make(SamplingParams(max_tokens=1), [1, 2], eos_id=None)
    batched = greedy_tokens(logits)
    assert batched[0] == sample_row(logits[0], row)[0] and batched[5] == sample_row(logits[5], row)[0]
    assert batched[1] == 7 == sample_row(logits[1], row)[0]
    assert batched[4] == 9 == sample_row(logits[4], row)[0]
    # a winner that is not finite is left to sample_row, which masks NaN and clips +inf
    assert batched[2:4] == [None, None]
    assert sample_row(logits[2], row)[0] == int(torch.argmax(torch.nan_to_num(logits[2], nan=float("-inf"))))
    assert sample_row(logits[3], row)[0] == 4


def test_overflowing_settings_are_greedy_or_refused():
    engine = make_engine()
    col = Collector()
    rid = col.request(engine, PROMPTS[1], max_tokens=8, temperature=1e-38, seed=1)  # greedy in effect
    drain(engine)
    assert col.ids(rid) == hf_greedy(PROMPTS[1], 8)
    for bad, field in ((dict(repetition_penalty=1e-40, temperature=1.0), "repetition_penalty"),
                       (dict(min_tokens=9, max_tokens=8), "min_tokens")):
        with pytest.raises(InvalidRequestError, match=field):
            col.request(engine, PROMPTS[1], **bad)


def test_full_queue_says_server_busy():
    engine = make_engine(max_queue_size=2, max_num_seqs=1)
    col = Collector()
    col.request(engine, "a", max_tokens=2)  # will run at once: it does not count as waiting
    col.request(engine, "b", max_tokens=2)
    col.request(engine, "c", max_tokens=2)
    with pytest.raises(ServerBusyError, match="server busy"):
        col.request(engine, "d", max_tokens=2)
    engine.step()  # "a" runs; "b" and "c" wait: the queue is full
    with pytest.raises(ServerBusyError, match="max_queue_size=2"):
        col.request(engine, "e", max_tokens=2)
    drain(engine)
    assert all(col.final(r).finish_reason == "length" for r in col.events)


def test_log_probs_are_those_of_the_model():
    model, tok = tiny()
    engine = make_engine()
    col = Collector()
    rid = col.request(engine, PROMPTS[0], max_tokens=5, return_log_probs=True)
    drain(engine)
    ids = col.ids(rid)
    lps = [lp for e in col.events[rid] for lp in e.log_probs]
    full = torch.tensor([tok(PROMPTS[0]).input_ids + ids])
    with torch.no_grad():
        logits = model(full).logits[0].log_softmax(-1)
    n = len(tok(PROMPTS[0]).input_ids)
    expected = [float(logits[n - 1 + i, t]) for i, t in enumerate(ids)]
    assert lps == pytest.approx(expected, abs=1e-4)


def test_engine_thread_serves_submissions_and_shuts_down_cleanly():
    import threading

    engine = make_engine().start()
    done = threading.Event()
    col = Collector()
    original = col._on_event

    def on_event(ev):
        original(ev)
        if ev.finished:
            done.set()

    col._on_event = on_event
    rid = col.request(engine, PROMPTS[0], max_tokens=10)
    assert done.wait(60), "the engine thread did not answer"
    assert col.ids(rid) == hf_greedy(PROMPTS[0], 10)
    pending = col.request(engine, PROMPTS[1], max_tokens=200)
    engine.shutdown()
    assert not engine._thread.is_alive()
    final = col.final(pending)  # never left without an answer
    assert final.finish_reason in ("error", "length")


def test_bfloat16_engine_halves_the_kv_bytes_and_mostly_agrees_with_fp32(tmp_path):
    from tests.genrepo import add_generation_model
    from tritonlm.engine.loader import build_engine
    from tritonlm.engine.settings import EngineSettings, SettingsError

    folder = add_generation_model(tmp_path, "tiny", dtype="bfloat16")
    params = {"task": "generate", "max_context": "256", "dtype": "bfloat16"}
    engine = build_engine(EngineSettings.from_params(params, folder))
    fp32 = make_engine()
    assert engine.runner.spec.bytes_per_token * 2 == fp32.runner.spec.bytes_per_token
    assert engine.cache.pool.k[0].dtype == torch.bfloat16
    col = Collector()
    rids = [col.request(engine, p, max_tokens=8) for p in PROMPTS]
    drain(engine)
    assert all(col.final(r).num_output_tokens == 8 for r in rids)
    # every generated token, not only the prefill's: whole 8-token continuations equal fp32
    # transformers' for all prompts but at most one (bf16 rounding may flip one near tie)
    same = [col.ids(r) == hf_greedy(p, 8) for p, r in zip(PROMPTS, rids)]
    assert sum(same) >= len(PROMPTS) - 1, same
    with pytest.raises(SettingsError, match="dtype"):
        EngineSettings.from_params({"dtype": "bfloat16", "runtime": "onnx", "onnx_model": "1/hf/config.json"}, folder)
    with pytest.raises(SettingsError, match="dtype: 'int3'"):
        EngineSettings.from_params({"dtype": "int3"}, folder)
    # the paged-attention kernel is float32: asked for by name it refuses, auto falls back
    assert engine.runner.attention == "gather"
    with pytest.raises(SettingsError, match=r"^attention_backend: 'paged' cannot run here: the kernel runs float32 on the CPU"):
        build_engine(EngineSettings.from_params({**params, "attention_backend": "paged"}, folder))


def test_engine_output_is_the_same_with_either_attention_backend(tmp_path):
    """The paged-attention kernel (the default on a float32 CPU) and the gathered copy
    give the same greedy tokens, equal to transformers' own generate()."""
    from tests.genrepo import add_generation_model
    from tritonlm.engine.loader import build_engine
    from tritonlm.engine.settings import EngineSettings

    folder = add_generation_model(tmp_path, "tiny")
    texts = {}
    for backend in ("paged", "gather"):
        engine = build_engine(EngineSettings.from_params(
            {"task": "generate", "max_context": "256", "attention_backend": backend}, folder))
        assert engine.runner.attention == backend
        col = Collector()
        rids = [col.request(engine, p, max_tokens=12) for p in PROMPTS]
        drain(engine)
        texts[backend] = [col.ids(r) for r in rids]
        engine.shutdown()
    assert texts["paged"] == texts["gather"] == [hf_greedy(p, 12) for p in PROMPTS]
