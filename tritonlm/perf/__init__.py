"""Performance harnesses: dynamic batching, latency SLA, config tuning, LLM streaming metrics,
operating-point diagnosis, and the KV cache capacity planner. Each harness drives the real
perf_analyzer against a real tritonserver; the arithmetic lives in pure functions."""
