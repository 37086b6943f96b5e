"""Engine events -> Triton custom metrics (pb_utils.MetricFamily), shown on the
metrics port beside Triton's own nv_inference_* series."""

from __future__ import annotations

import threading
import time

import triton_python_backend_utils as pb_utils

TTFT_BUCKETS = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]
TPOT_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0]
BATCH_BUCKETS = [1, 2, 4, 8, 16, 32, 64, 128, 256]
FINISH_REASONS = ("stop", "length", "cancelled", "error")


class _Histogram:
    """A Prometheus histogram where the stub has one; else a sum and a count counter."""

    def __init__(self, name: str, help_: str, labels: dict, buckets: list[float]):
        kind = getattr(pb_utils.MetricFamily, "HISTOGRAM", None)
        if kind is not None:
            self.family = pb_utils.MetricFamily(name=name, description=help_, kind=kind)
            self.metric = self.family.Metric(labels=labels, buckets=buckets)
            self.sum = self.count = None
        else:
            self.metric = None
            self.sum_family = pb_utils.MetricFamily(name=f"{name}_sum", description=help_, kind=pb_utils.MetricFamily.COUNTER)
            self.count_family = pb_utils.MetricFamily(name=f"{name}_count", description=help_, kind=pb_utils.MetricFamily.COUNTER)
            self.sum = self.sum_family.Metric(labels=labels)
            self.count = self.count_family.Metric(labels=labels)

    def observe(self, value: float) -> None:
        if self.metric is not None:
            self.metric.observe(value)
        else:
            self.sum.increment(value)
            self.count.increment(1)


REFRESH_S = 0.1  # gauges are refreshed at most this often from the engine thread


class TritonMetrics:
    def __init__(self, model: str, version: str, instance: str = ""):
        # one label set per instance: instances of one model would overwrite each other's gauges
        labels = {"model": model, "version": str(version), "instance": instance or model}
        self._families: list = []
        self.ttft = _Histogram("tritonlm_time_to_first_token_seconds", "Time from arrival to the first generated token", labels, TTFT_BUCKETS)
        self.tpot = _Histogram(
            "tritonlm_time_per_output_token_seconds", "Per request: (last token time - first token time) / (tokens - 1)", labels, TPOT_BUCKETS
        )
        self.batch = _Histogram("tritonlm_batch_size", "Sequences in each forward pass", labels, BATCH_BUCKETS)

        # a MetricFamily must outlive its Metric objects: keep every family referenced

        def family(name: str, help_: str, kind):
            fam = pb_utils.MetricFamily(name=name, description=help_, kind=kind)
            self._families.append(fam)
            return fam

        def gauge(name: str, help_: str):
            return family(name, help_, pb_utils.MetricFamily.GAUGE).Metric(labels=labels)

        def counter(name: str, help_: str, extra: dict | None = None, fam=None):
            fam = fam or family(name, help_, pb_utils.MetricFamily.COUNTER)
            return fam, fam.Metric(labels={**labels, **(extra or {})})

        self.running = gauge("tritonlm_requests_running", "Sequences in the running batch")
        self.waiting = gauge("tritonlm_requests_waiting", "Requests queued for KV cache room")
        self.kv_used = gauge("tritonlm_kv_cache_used_bytes", "KV cache bytes reserved by live sequences")
        self.kv_total = gauge("tritonlm_kv_cache_total_bytes", "KV cache budget in bytes")
        self.kv_per_token = gauge("tritonlm_kv_cache_bytes_per_token", "KV cache bytes one token costs")
        _, self.tokens = counter("tritonlm_generated_tokens_total", "Tokens generated")
        fam = family("tritonlm_requests_finished_total", "Requests finished, by reason", pb_utils.MetricFamily.COUNTER)
        self.finished = {r: counter("", "", {"reason": r}, fam)[1] for r in FINISH_REASONS}
        _, self.draft_total = counter("tritonlm_draft_tokens_total", "Speculative decoding: draft tokens proposed")
        _, self.draft_accepted = counter("tritonlm_accepted_draft_tokens_total", "Speculative decoding: draft tokens accepted")
        self.acceptance = gauge("tritonlm_draft_acceptance_rate", "Speculative decoding: accepted / proposed draft tokens so far")
        self.tokens_per_pass = _Histogram(
            "tritonlm_tokens_per_target_pass", "Speculative decoding: tokens produced per target verification pass", labels, [1, 2, 3, 4, 5, 6, 8, 10, 16]
        )
        _, self.prefix_hits = counter("tritonlm_prefix_cache_hits_total", "Prefix cache: prompt tokens found cached")
        _, self.prefix_queries = counter("tritonlm_prefix_cache_queries_total", "Prefix cache: prompt tokens looked up")
        self.prefix_blocks = gauge("tritonlm_prefix_cache_blocks", "Prefix cache: KV blocks holding a shared prefix (in use or kept)")
        self._prefix_seen = (0, 0)  # (hits, queries) already counted
        self._proposed = self._accepted = 0
        self._last_refresh = 0.0
        self._published: tuple[int, int] | None = None  # (running, waiting) last sent
        self._engine = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # EngineObserver hooks (engine thread)
    def on_step(self, batch_size: int, num_tokens: int, seconds: float, generated: int) -> None:
        self.batch.observe(batch_size)
        if generated:
            self.tokens.increment(generated)
        engine = self._engine
        changed = engine is not None and self._published != (engine.scheduler.num_running, engine.scheduler.num_waiting)
        if changed or time.monotonic() - self._last_refresh >= REFRESH_S:
            self._refresh()  # at once when requests were admitted or left, else at most every REFRESH_S
        if engine is not None and engine.cache.query_tokens != self._prefix_seen[1]:  # someone was admitted
            hits, queries = engine.cache.hit_tokens, engine.cache.query_tokens
            self.prefix_hits.increment(hits - self._prefix_seen[0])
            self.prefix_queries.increment(queries - self._prefix_seen[1])
            self._prefix_seen = (hits, queries)

    def on_first_token(self, ttft_s: float) -> None:
        self.ttft.observe(ttft_s)

    def on_finish(self, reason: str, time_per_output_token_s: float | None) -> None:
        if time_per_output_token_s is not None:
            self.tpot.observe(time_per_output_token_s)
        if reason in self.finished:
            self.finished[reason].increment(1)
        self._refresh()  # a finished request freed its cache: show it at once

    def on_speculation(self, proposed: int, accepted: int) -> None:
        self._proposed += proposed
        self._accepted += accepted
        self.draft_total.increment(proposed)
        self.draft_accepted.increment(accepted)
        self.acceptance.set(self._accepted / self._proposed if self._proposed else 0.0)
        self.tokens_per_pass.observe(accepted + 1)

    def set_kv_capacity(self, total_bytes: int, bytes_per_token: int) -> None:
        self.kv_total.set(total_bytes)
        self.kv_per_token.set(bytes_per_token)

    def _refresh(self) -> None:
        engine = self._engine
        self._last_refresh = time.monotonic()
        if engine is not None:
            self._published = (engine.scheduler.num_running, engine.scheduler.num_waiting)
            self.running.set(self._published[0])
            self.waiting.set(self._published[1])
            self.kv_used.set(engine.cache.used_bytes)
            self.prefix_blocks.set(engine.cache.cached_blocks)

    def watch(self, engine) -> None:
        """Keep gauges fresh while idle too (a cancelled request frees its cache between steps)."""
        self._engine = engine

        def loop():
            while not self._stop.wait(0.5):
                self._refresh()

        self._thread = threading.Thread(target=loop, name="tritonlm-metrics", daemon=True)
        self._thread.start()

    def unwatch(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
