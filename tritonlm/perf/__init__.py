"""Performance measurement: the `tritonlm perf` harnesses (dynamic batching, latency SLA, config
tuning, LLM streaming metrics, operating-point diagnosis) and `tritonlm plan`, each driving the
real perf_analyzer against a real tritonserver with its arithmetic in pure functions. Only what
those subcommands use lives here; what only the benchmark scripts use is perf/tritonlm_bench.
tritonlm/perf/README.md maps the modules."""
