"""How long a runner's decode step takes, timed in-process (no server, no scheduler).

A decode step is one new token for each of `batch` sequences that already hold
context - 1 tokens in the KV cache: what every generated token costs once the
prompt is in.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

from tritonlm.engine.batch import StepBatch
from tritonlm.engine.kv_cache import KVCacheManager

BLOCK = 16  # KV cache block size, in tokens


def row_counts(text: str) -> list[int]:
    """A --rows argument ("1,8,32") as row counts, each at least 1; ValueError naming what is wrong."""
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise ValueError(f"--rows {text!r}: comma-separated row counts of at least 1")
    return counts


def time_calls(fn: Callable[[], object], reps: int, warmup: int = 1) -> list[float]:
    """Seconds each of `reps` calls of fn took, after `warmup` untimed calls (first calls
    pay for allocations and kernel choices a steady server has behind it)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def decode_step_ms(runner, batch: int, context: int, reps: int) -> float:
    """Median milliseconds of one decode step: `batch` rows, each with context - 1 tokens cached."""
    cache = KVCacheManager(runner.spec, (batch * (context // BLOCK + 2) + 1) * BLOCK * runner.spec.bytes_per_token, BLOCK,
                           allocate_kv=runner.allocate_kv)
    for b in range(batch):
        cache.allocate(b, context)
    step = StepBatch.build([[7]] * batch, [context - 1] * batch, [cache.slots(b, context) for b in range(batch)])
    return statistics.median(time_calls(lambda: runner.forward(step, cache.pool), reps)) * 1000
