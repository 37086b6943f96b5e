"""perf/tritonlm_bench/long_prompt.py: long prompts that are the shortest to reach their length,
the TTFT summary against numpy, and which of a running stream's gaps overlap a long prompt's
prefill, on a logical clock that the scripted stream moves."""

from __future__ import annotations

import threading
import types

import numpy as np
import pytest

from tritonlm_bench import long_prompt
from tritonlm_bench.long_prompt import itl_during_prefill, long_prompts, ttft_summary
from tritonlm_bench.streaming import StreamRecord


def words(text: str) -> types.SimpleNamespace:
    """A tokenizer whose tokens are whitespace-separated words: lengths checkable by eye."""
    return types.SimpleNamespace(input_ids=text.split())


QUESTION = "\nWhat are these notes about?"


def test_long_prompts_are_distinct_seeded_and_the_shortest_that_reach_the_length():
    prompts = long_prompts(words, count=4, tokens=300, seed=1)
    assert len(set(prompts)) == 4
    assert len({p.split()[:4][-1] for p in prompts}) == 4  # "Notes, part k." differs from the first words
    assert prompts == long_prompts(words, count=4, tokens=300, seed=1)
    assert prompts != long_prompts(words, count=4, tokens=300, seed=2)
    for p in prompts:
        assert p.endswith(QUESTION)
        body = p.removesuffix(QUESTION)
        assert len(body.split()) >= 300
        shorter = body.rsplit(".", 2)[0] + "."  # the last sentence dropped
        assert len(shorter.split()) < 300


def test_the_ttft_summary_is_numpys():
    ttfts = [0.8, 0.1, 0.45, 2.0, 0.3]
    records = [StreamRecord(t, float("nan"), 1, t + 1, prompt_tokens=1500 + i) for i, t in enumerate(ttfts)]
    s = ttft_summary(records)
    assert s["requests"] == 5 and s["prompt_tokens_mean"] == pytest.approx(1502)
    assert s["ttft_mean_ms"] == pytest.approx(1000 * np.mean(ttfts))
    assert s["ttft_p50_ms"] == pytest.approx(1000 * np.percentile(ttfts, 50))
    assert s["ttft_p99_ms"] == pytest.approx(1000 * np.percentile(ttfts, 99))


class PrefillScript:
    """A stream and a long-prompt client on one logical clock (seconds): the stream sets the
    clock before each piece; each long request lets the stream send its next pieces, then
    answers with the TTFT it was given. Events order the two threads, so the times are exact."""

    def __init__(self, monkeypatch, pieces: list[list[float]], ttfts: list[float]) -> None:
        self.now = 0.0
        self.pieces, self.ttfts = pieces, ttfts
        self.go = [threading.Event() for _ in ttfts]
        self.sent = [threading.Event() for _ in ttfts]
        monkeypatch.setattr(long_prompt, "time", types.SimpleNamespace(perf_counter=lambda: self.now))

    def stream(self):
        for t in self.pieces[0]:  # warm-up, then the pieces during each long request, then the tail
            self.now = t
            yield
        for k in range(len(self.ttfts)):
            if not self.go[k].wait(600):
                return
            for t in self.pieces[k + 1]:
                self.now = t
                yield
            self.sent[k].set()  # run() has stamped the last piece: it resumed the generator
        for t in self.pieces[-1]:
            self.now = t
            yield

    def long_request(self, prompt: str) -> StreamRecord:
        k = int(prompt)
        self.go[k].set()
        assert self.sent[k].wait(600)
        return StreamRecord(self.ttfts[k], float("nan"), 1, self.ttfts[k])


def test_gaps_that_overlap_a_prefill_are_told_from_the_rest(monkeypatch):
    # warm-up pieces at 0..7 s; long prompt 0 sent at 7 with TTFT 5 (window 7-12) while pieces
    # come at 10 and 14; long prompt 1 sent at 14 with TTFT 6.5 (window 14-20.5), pieces at 20
    # and 21; then the tail, one a second
    script = PrefillScript(monkeypatch, [list(range(8)), [10, 14], [20, 21], list(range(22, 30))], ttfts=[5, 6.5])
    stall = itl_during_prefill(script.stream, script.long_request, ["0", "1"], warm_tokens=8)
    assert stall.during == [3000, 4000, 6000, 1000]  # 7-10, 10-14, 14-20, 20-21 (ms)
    assert stall.outside == [1000] * 7 + [1000] * 8  # 0-7, then 21-29
    assert stall.long_ttft_ms == [5000, 6500]
    s = stall.summary()
    assert (s["long_requests"], s["gaps_during"], s["itl_during_max_ms"]) == (2, 4, 6000)
    assert s["long_ttft_mean_ms"] == 5750 and s["itl_outside_p50_ms"] == 1000
    assert s["itl_during_p99_ms"] == pytest.approx(np.percentile([3000, 4000, 6000, 1000], 99))


def test_a_stream_that_ends_inside_the_prefill_is_refused(monkeypatch):
    script = PrefillScript(monkeypatch, [list(range(8)), [9], []], ttfts=[5])  # window 7-12, last piece at 9
    with pytest.raises(RuntimeError, match="ended before the long prompts' prefill"):
        itl_during_prefill(script.stream, script.long_request, ["0"], warm_tokens=8)


def test_a_stream_that_fails_says_so(monkeypatch):
    def broken():
        yield
        raise ConnectionError("reset by peer")

    monkeypatch.setattr(long_prompt, "time", types.SimpleNamespace(perf_counter=lambda: 0.0))
    with pytest.raises(RuntimeError, match="did not start: reset by peer"):
        itl_during_prefill(broken, lambda p: StreamRecord(1, 1, 1, 1), ["x"], warm_tokens=8)
