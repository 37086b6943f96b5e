"""Performance measurement: the `tritonlm perf` harnesses (dynamic batching, latency SLA, config
tuning, LLM streaming metrics, operating-point diagnosis) and `tritonlm plan`, each driving the
real perf_analyzer against a real tritonserver with its arithmetic in pure functions; and the
parts the benchmark scripts in perf/ share (statistics, the machine description, streaming
clients, model repositories, server metrics). tritonlm/perf/README.md maps the modules."""
