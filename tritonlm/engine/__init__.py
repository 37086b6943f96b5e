"""The generation engine: plain Python/PyTorch, no Triton imports.

engine     - the thread and the step loop: schedule -> forward -> sample/verify -> outputs
scheduler  - waiting queue, admission by free cache, who runs each step; owns the KV accounting
kv_cache   - KV tensors (KVPool) and block accounting (KVCacheManager) inside a byte budget
executor   - one step's forward pass(es), then sampling or speculative verification
output     - appends tokens, checks stops, detokenizes, emits events, retires sequences
sequence   - one request's state: THE token history, cache progress, pending text
batch      - StepBatch: what one forward pass computes
runners/   - one forward pass with cache (PyTorch Transformer, ONNX Runtime)
parallel/  - the same Transformer split over worker processes (tensor / pipeline)
sampler    - per-row sampling (greedy, temperature, top-k/p, seed, penalties)
guided     - guided decoding: guides compiled to grammar matchers, each row's matcher state
speculative- drafters (draft model, prompt lookup) and the verification rule
detok      - incremental, UTF-8-safe detokenization and stop strings
token_bytes- each token id's bytes, for byte-level BPE tokenizers (detok's fast path)
loader     - settings -> a ready Engine (tokenizer, runner, KV budget, drafter)
slo/       - latency SLOs: the step-time model, the controller, the ledger
slo_warmup - with an SLO, a synthetic workload at load that fits the step-time model

docs/architecture.md follows one request through all of them.
"""
