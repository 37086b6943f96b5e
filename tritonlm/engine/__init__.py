"""The generation engine: plain Python/PyTorch, no Triton imports.

kv_cache  - KV memory inside a byte budget (paged pool, block tables)
batch     - StepBatch: what one forward pass computes
runners/  - one forward pass with cache in and out (PyTorch, ONNX Runtime)
sampler   - per-row sampling (greedy, temperature, top-k/p, seed, penalties)
detok     - incremental, UTF-8-safe detokenization and stop strings
scheduler - waiting queue, admission by free cache, who runs each step
engine    - the step loop thread tying them together
"""
