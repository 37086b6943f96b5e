"""Long-prompt workloads for perf/bench_peer.py, the same for every server.

    long_prompts(tokenizer, count, tokens)   distinct prompts of at least `tokens` tokens, made
                                             from a seeded walk over the words of the benchmark's
                                             own prompts (nothing downloaded)
    ttft_summary(records)                    TTFT mean / p50 / p99 (ms) of a run's StreamRecords
    itl_during_prefill(stream, long_request, prompts)
                                             the gaps between a running stream's tokens while other
                                             requests' long prompts are prefilled one after another

A server that prefills a long prompt in one step stalls every running stream for that
long; chunked prefill bounds the stall to one chunk's step.
"""

from __future__ import annotations

import random
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from tritonlm.perf.stats import percentile
from tritonlm_bench.llamacpp import PROMPTS
from tritonlm_bench.streaming import StreamRecord

_WORDS = sorted({w.strip(".,:;?!\"'()").lower() for p in PROMPTS for w in p.split()} - {""})


def long_prompts(tokenizer, count: int, tokens: int, seed: int = 0) -> list[str]:
    """`count` different texts, each the shortest run of seeded sentences that reaches `tokens`
    tokens under `tokenizer`, ending in a question about it (so the first tokens differ too)."""
    out = []
    for k in range(count):
        rng = random.Random(seed * 100_003 + k)
        sentences = [f"Notes, part {k + 1}."]
        while True:
            for _ in range(40):
                words = [rng.choice(_WORDS) for _ in range(rng.randint(6, 16))]
                sentences.append(" ".join(words).capitalize() + ".")
            text = " ".join(sentences)
            if len(tokenizer(text).input_ids) >= tokens:
                break
        while len(sentences) > 2 and len(tokenizer(" ".join(sentences[:-1])).input_ids) >= tokens:
            sentences.pop()
        out.append(" ".join(sentences) + "\nWhat are these notes about?")
    return out


def ttft_summary(records: list[StreamRecord]) -> dict[str, float]:
    ttft = [r.ttft_s for r in records]
    return {
        "requests": len(records),
        "prompt_tokens_mean": statistics.mean(r.prompt_tokens for r in records) if records else 0.0,
        "ttft_mean_ms": 1000 * statistics.mean(ttft) if ttft else float("nan"),
        "ttft_p50_ms": 1000 * percentile(ttft, 50),
        "ttft_p99_ms": 1000 * percentile(ttft, 99),
    }


@dataclass
class PrefillStall:
    """A running stream's inter-token gaps (ms): those that overlap a long prompt's prefill
    (from its send to its first token) and those that do not."""

    during: list[float]
    outside: list[float]
    long_ttft_ms: list[float]

    def summary(self) -> dict[str, float]:
        return {
            "long_requests": len(self.long_ttft_ms),
            "long_ttft_mean_ms": statistics.mean(self.long_ttft_ms) if self.long_ttft_ms else float("nan"),
            "itl_outside_p50_ms": percentile(self.outside, 50),
            "itl_during_p99_ms": percentile(self.during, 99),
            "itl_during_max_ms": max(self.during) if self.during else float("nan"),
            "gaps_during": len(self.during),
        }


def itl_during_prefill(stream: Callable[[], Iterator[None]], long_request: Callable[[str], StreamRecord],
                       prompts: list[str], warm_tokens: int = 8, hang_guard_s: float = 900.0) -> PrefillStall:
    """Start `stream()` (a generator yielding once per streamed piece of a long generation;
    closing it ends the request); after its first `warm_tokens` pieces, send each of
    `prompts` with long_request (one at a time, each to its first token), then stop the
    stream. RuntimeError when the stream ends before the long prompts are done or fails."""
    stamps: list[float] = []
    started, finished = threading.Event(), threading.Event()
    stop = threading.Event()
    failure: list[BaseException] = []

    def run() -> None:
        gen = stream()
        try:
            for _ in gen:
                stamps.append(time.perf_counter())
                if len(stamps) == warm_tokens:
                    started.set()
                if stop.is_set():
                    break
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            failure.append(e)
        finally:
            gen.close()
            finished.set()
            started.set()

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    if not started.wait(hang_guard_s) or failure:
        raise RuntimeError(f"the running stream did not start: {failure[0] if failure else 'hang guard'}")
    windows: list[tuple[float, float]] = []
    ttfts: list[float] = []
    for p in prompts:
        t0 = time.perf_counter()
        rec = long_request(p)
        windows.append((t0, t0 + rec.ttft_s))
        ttfts.append(1000 * rec.ttft_s)
    stop.set()  # the stream's next piece closes the gap that spans the last window's end
    finished.wait(hang_guard_s)
    if failure:
        raise RuntimeError(f"the running stream failed: {failure[0]}")
    if not stamps or stamps[-1] < windows[-1][1]:
        raise RuntimeError("the running stream ended before the long prompts' prefill: give it more tokens")
    during, outside = [], []
    for a, b in zip(stamps, stamps[1:]):
        overlaps = any(a < hi and b > lo for lo, hi in windows)
        (during if overlaps else outside).append(1000 * (b - a))
    return PrefillStall(during, outside, ttfts)
