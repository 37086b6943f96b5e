"""Engine events -> Triton custom metrics (pb_utils.MetricFamily), shown on the
metrics port beside Triton's own nv_inference_* series.

Every metric update in the Python backend is a round trip to tritonserver. Made from the
engine thread they cost it several round trips a step, and the thread that answers them
wakes so often that the engine thread is preempted far more than in-process
(docs/performance-notes.md). So the engine's hooks only
record, under a lock, and `publish()` makes the calls: every PUBLISH_S from the metrics
thread, and on the response thread before a batch that holds a request's first token or
its final response goes out (`before_delivery`), so a client that has its first token
finds its KV reservation shown and one that has its final response finds it counted.
"""

from __future__ import annotations

import dataclasses
import logging
import threading

import triton_python_backend_utils as pb_utils

from tritonlm.engine.threads import named_thread

log = logging.getLogger(__name__)

TTFT_BUCKETS = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]
TPOT_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0]
ITL_BUCKETS = TPOT_BUCKETS + [2.5, 5.0]  # a gap can hold a long prefill chunk of another request
SLO_OUTCOMES = ("met", "missed", "shed")
BATCH_BUCKETS = [1, 2, 4, 8, 16, 32, 64, 128, 256]
LORA_LOAD_BUCKETS = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]
PASS_BUCKETS = [1, 2, 3, 4, 5, 6, 8, 10, 16]
FINISH_REASONS = ("stop", "length", "cancelled", "error")
PUBLISH_S = 0.1  # the metrics thread publishes what was recorded this often


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

    def observe_all(self, values: list[float]) -> None:
        """One observe() per sample: `_count` must stay the number of samples (steps, requests)."""
        if self.metric is not None:
            for value in values:
                self.metric.observe(value)
        elif values:
            self.sum.increment(sum(values))
            self.count.increment(len(values))


@dataclasses.dataclass
class _Recorded:
    """What the engine thread recorded since the last publish."""

    tokens: int = 0
    batch_sizes: list[int] = dataclasses.field(default_factory=list)
    ttft_s: list[float] = dataclasses.field(default_factory=list)
    tpot_s: list[float] = dataclasses.field(default_factory=list)
    finished: dict[str, int] = dataclasses.field(default_factory=dict)
    proposed: int = 0
    accepted: int = 0
    tokens_per_pass: list[int] = dataclasses.field(default_factory=list)


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
            return fam.Metric(labels={**labels, **(extra or {})})

        self.running = gauge("tritonlm_requests_running", "Sequences in the running batch")
        self.waiting = gauge("tritonlm_requests_waiting", "Requests queued for KV cache room")
        self.kv_used = gauge("tritonlm_kv_cache_used_bytes", "KV cache bytes reserved by live sequences")
        self.kv_total = gauge("tritonlm_kv_cache_total_bytes", "KV cache budget in bytes")
        self.kv_per_token = gauge("tritonlm_kv_cache_bytes_per_token", "KV cache bytes one token costs")
        self.tokens = counter("tritonlm_generated_tokens_total", "Tokens generated")
        fam = family("tritonlm_requests_finished_total", "Requests finished, by reason", pb_utils.MetricFamily.COUNTER)
        self.finished = {r: counter("", "", {"reason": r}, fam) for r in FINISH_REASONS}
        self.draft_total = counter("tritonlm_draft_tokens_total", "Speculative decoding: draft tokens proposed")
        self.draft_accepted = counter("tritonlm_accepted_draft_tokens_total", "Speculative decoding: draft tokens accepted")
        self.acceptance = gauge("tritonlm_draft_acceptance_rate", "Speculative decoding: accepted / proposed draft tokens so far")
        self.tokens_per_pass = _Histogram(
            "tritonlm_tokens_per_target_pass", "Speculative decoding: tokens produced per target verification pass", labels, PASS_BUCKETS
        )
        self.prefix_hits = counter("tritonlm_prefix_cache_hits_total", "Prefix cache: prompt tokens found cached")
        self.prefix_queries = counter("tritonlm_prefix_cache_queries_total", "Prefix cache: prompt tokens looked up")
        self.prefix_blocks = gauge("tritonlm_prefix_cache_blocks", "Prefix cache: KV blocks holding a shared prefix (in use or kept)")
        self.itl = _Histogram(
            "tritonlm_inter_token_latency_seconds", "Per step that gave a request tokens: the time since its previous ones",
            labels, ITL_BUCKETS)
        # latency SLOs (tritonlm/engine/slo/): vLLM's goodput is the rate of "met"
        fam = family("tritonlm_slo_requests_total",
                     "Requests judged against slo_ttft_ms / slo_tpot_ms: met both, missed one, or shed at arrival",
                     pb_utils.MetricFamily.COUNTER)
        self.slo_requests = {o: counter("", "", {"outcome": o}, fam) for o in SLO_OUTCOMES}
        self.slo_budget = gauge("tritonlm_slo_token_budget", "SLO controller: new tokens allowed in the last step (the steady budget and the TPOT slack it spent)")
        self.slo_cap = gauge("tritonlm_slo_running_cap", "SLO controller: sequences allowed to run")
        self.slo_ttft = gauge("tritonlm_slo_predicted_ttft_seconds", "SLO controller: the last arrival's predicted time to first token")
        self.slo_tpot = gauge("tritonlm_slo_predicted_tpot_seconds", "SLO controller: the next step's predicted seconds (the running streams' TPOT)")

        # LoRA adapters (engine.lora_registry): requests per adapter, residency, loads and evictions
        self._labels = labels
        self._lora_requests = family("tritonlm_lora_requests_total", "Requests that named a LoRA adapter, by adapter",
                                     pb_utils.MetricFamily.COUNTER)
        self._lora_request_metrics: dict[str, object] = {}  # adapter -> its counter, made at its first request
        self.lora_resident = gauge("tritonlm_lora_adapters_resident", "LoRA adapters loaded in memory (max_cpu_loras)")
        self.lora_loads = counter("tritonlm_lora_loads_total", "LoRA adapters loaded from their folders")
        self.lora_evictions = counter("tritonlm_lora_evictions_total",
                                      "LoRA adapters dropped from memory for another (least recently used first)")
        self.lora_load_s = _Histogram("tritonlm_lora_load_seconds", "Seconds each cold LoRA adapter load took", labels,
                                      LORA_LOAD_BUCKETS)
        self._lora_seen: tuple[dict, int, int] = ({}, 0, 0)  # (requests by adapter, loads, evictions) counted

        self._lock = threading.Lock()  # guards _recorded, _urgent, _admitted (engine thread vs publishers)
        self._recorded = _Recorded()
        self._urgent = False  # a first token, a finish or an admission waits to be shown
        self._admitted = (0, 0)  # (running, waiting) at the engine's last step
        self._publish_lock = threading.Lock()  # one publisher at a time: gauges never go back
        self._shown: dict[str, float] = {}  # gauge name -> value last set
        self._prefix_seen = (0, 0)  # (hits, queries) already counted
        self._slo_seen = dict.fromkeys(SLO_OUTCOMES, 0)  # the ledger's counts already counted
        self._proposed = self._accepted = 0  # totals, for the acceptance rate
        self._engine = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- EngineObserver hooks (engine thread): record only ---------------------------------
    def on_step(self, batch_size: int, num_tokens: int, seconds: float, generated: int) -> None:
        engine = self._engine
        live = (engine.scheduler.num_running, engine.scheduler.num_waiting) if engine is not None else (0, 0)
        with self._lock:
            self._recorded.batch_sizes.append(batch_size)
            self._recorded.tokens += generated
            if live != self._admitted:  # requests were admitted or left: show it with the next response
                self._admitted, self._urgent = live, True

    def on_first_token(self, ttft_s: float) -> None:
        with self._lock:
            self._recorded.ttft_s.append(ttft_s)
            self._urgent = True

    def on_finish(self, reason: str, time_per_output_token_s: float | None) -> None:
        with self._lock:
            if time_per_output_token_s is not None:
                self._recorded.tpot_s.append(time_per_output_token_s)
            if reason in self.finished:
                self._recorded.finished[reason] = self._recorded.finished.get(reason, 0) + 1
            self._urgent = True  # its cache was freed: show it before the final response

    def on_speculation(self, proposed: int, accepted: int) -> None:
        with self._lock:
            self._recorded.proposed += proposed
            self._recorded.accepted += accepted
            self._recorded.tokens_per_pass.append(accepted + 1)

    # ---- publishing (the response thread and the metrics thread) --------------------------
    def before_delivery(self, batch) -> None:
        """Called by the engine's event dispatcher before it sends each batch."""
        # a publish under way on the metrics thread may hold this batch's news: wait for it
        if self._urgent or self._publish_lock.locked():
            self.publish()

    def publish(self) -> None:
        """Make the Triton metric calls for what was recorded since the last publish, and set
        the gauges that changed (each call is a round trip to tritonserver)."""
        with self._publish_lock:
            with self._lock:
                rec, self._recorded, self._urgent = self._recorded, _Recorded(), False
            engine = self._engine
            if engine is not None:
                # Gauges first: the engine frees a finished request's cache before it records
                # the finish, so a scrape that sees the finish counted also sees the cache back.
                # The engine thread changes these while we read them: each read is one int, and
                # a value one step old is corrected by the next publish.
                self._set("running", engine.scheduler.num_running)
                self._set("waiting", engine.scheduler.num_waiting)
                self._set("kv_used", engine.cache.used_bytes)
                self._set("prefix_blocks", engine.cache.cached_blocks)
            if rec.tokens:
                self.tokens.increment(rec.tokens)
            for reason, n in rec.finished.items():
                self.finished[reason].increment(n)
            self.batch.observe_all(rec.batch_sizes)
            self.ttft.observe_all(rec.ttft_s)
            self.tpot.observe_all(rec.tpot_s)
            if rec.proposed:
                self._proposed += rec.proposed
                self._accepted += rec.accepted
                self.draft_total.increment(rec.proposed)
                self.draft_accepted.increment(rec.accepted)
                self._set("acceptance", self._accepted / self._proposed)
                self.tokens_per_pass.observe_all(rec.tokens_per_pass)
            if engine is None:
                return
            hits, queries = engine.cache.hit_tokens, engine.cache.query_tokens
            if queries != self._prefix_seen[1]:
                self.prefix_hits.increment(hits - self._prefix_seen[0])
                self.prefix_queries.increment(queries - self._prefix_seen[1])
                self._prefix_seen = (hits, queries)
            self._publish_slo(engine.scheduler)
            registry = getattr(engine, "lora_registry", None)
            if registry is not None:
                self._publish_lora(registry)

    def _publish_lora(self, registry) -> None:
        """The registry's counts since the last publish, its residency and its cold loads."""
        seen, loads, evictions = self._lora_seen
        requests = dict(registry.requests)  # one C-level copy: request threads add names
        for name, count in requests.items():
            if count != seen.get(name, 0):
                if name not in self._lora_request_metrics:
                    self._lora_request_metrics[name] = self._lora_requests.Metric(labels={**self._labels, "adapter": name})
                self._lora_request_metrics[name].increment(count - seen.get(name, 0))
        if registry.loads != loads:
            self.lora_loads.increment(registry.loads - loads)
        if registry.evictions != evictions:
            self.lora_evictions.increment(registry.evictions - evictions)
        self._lora_seen = (requests, registry.loads, registry.evictions)
        self._set("lora_resident", len(registry.resident))
        self.lora_load_s.observe_all(registry.drain_load_seconds())

    def _publish_slo(self, scheduler) -> None:
        """The ledger's inter-token gaps and SLO counts, and the controller's state."""
        ledger = scheduler.ledger
        self.itl.observe_all(ledger.drain_gaps())
        for outcome in SLO_OUTCOMES:
            count = getattr(ledger, outcome)
            if count != self._slo_seen[outcome]:
                self.slo_requests[outcome].increment(count - self._slo_seen[outcome])
                self._slo_seen[outcome] = count
        slo = scheduler.slo
        if slo is None:  # no SLO: the configured knobs are the decisions
            self._set("slo_budget", scheduler.config.max_num_batched_tokens)
            self._set("slo_cap", scheduler.config.max_num_seqs)
            return
        self._set("slo_budget", slo.step_budget)
        self._set("slo_cap", slo.cap)
        self._set("slo_ttft", slo.predicted_ttft_s)
        self._set("slo_tpot", slo.step_s)

    def _set(self, gauge: str, value: float) -> None:
        if self._shown.get(gauge) != value:
            getattr(self, gauge).set(value)
            self._shown[gauge] = value

    def set_kv_capacity(self, total_bytes: int, bytes_per_token: int) -> None:
        self.kv_total.set(total_bytes)
        self.kv_per_token.set(bytes_per_token)

    def watch(self, engine) -> None:
        """Publish every PUBLISH_S from a thread of its own, idle or not (a cancelled request
        frees its cache between steps)."""
        self._engine = engine
        self.publish()

        def loop():
            while not self._stop.wait(PUBLISH_S):
                try:
                    self.publish()
                except Exception:  # a failed update must not end the metrics for good
                    log.exception("publishing metrics failed")

        self._thread = named_thread(loop, "tritonlm-metrics")
        self._thread.start()

    def unwatch(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
