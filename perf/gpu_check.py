"""GPU checks in one prepared script, for a session that is lent a CUDA device.

    .venv/bin/python perf/gpu_check.py [--out DIR]

1. CUDA execution: the torch runner on cuda (fp32 and fp16) against the CPU fp32
   reference (max logit difference, top-1 agreement).
2. Decode tokens/s on the device, batch 1 / 8 / 32, GPT-2-small shape.
3. KV memory budgeting: a pool sized by kv_cache_fraction takes what it says
   (torch.cuda.memory_allocated before/after) and the engine never exceeds it.
4. Engine throughput: 32 concurrent requests, continuous batching, greedy tokens equal
   to the CPU engine's.
Prints a table, writes gpu_check.csv under --out (or $OUT). Exits 2 without CUDA.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or str(REPO_ROOT / "results" / "gpu_check"))
    ap.add_argument("--device", default="cuda:0", help="cpu runs the same script as a dry run of its logic")
    args = ap.parse_args()
    on_gpu = args.device.startswith("cuda")
    if on_gpu and not torch.cuda.is_available():
        print("no CUDA device visible to torch: run this on a machine with a GPU (torch CUDA build)")
        return 2
    from tritonlm.engine.batch import StepBatch
    from tritonlm.engine.engine import Engine
    from tritonlm.engine.kv_cache import KVCacheManager
    from tritonlm.engine.memory import free_memory_bytes
    from tritonlm.engine.request import GenerationRequest, SamplingParams
    from tritonlm.engine.runners.torch_runner import TorchRunner
    from tritonlm.engine.scheduler import SchedulerConfig
    from tritonlm.models.builtin import tiny_tokenizer
    from transformers import GPT2Config, GPT2LMHeadModel

    rows: list[dict] = []
    dev = torch.device(args.device)
    name = torch.cuda.get_device_name(dev) if on_gpu else "cpu (dry run)"
    print(f"device: {name}, free {free_memory_bytes(args.device) / 2**30:.1f} GiB")

    def sync() -> None:
        if on_gpu:
            torch.cuda.synchronize(dev)

    def allocated() -> int:
        return torch.cuda.memory_allocated(dev) if on_gpu else 0
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config()).eval()  # GPT-2 small shape, random weights
    tok = tiny_tokenizer()  # ids only below; text not needed

    # 1. correctness on the device
    cpu = TorchRunner(model)
    ids = torch.randint(0, 50257, (4, 24))
    def run(runner):
        cache = KVCacheManager(runner.spec, 8 * 64 * runner.spec.bytes_per_token, 16, allocate_kv=runner.allocate_kv)
        for b in range(4):
            cache.allocate(b, 32)
        batch = StepBatch.build([r.tolist() for r in ids], [0] * 4, [cache.slots(b, 24) for b in range(4)], all_logits=True)
        return runner.forward(batch, cache.pool).float().cpu()
    ref = run(cpu)
    dtypes = (torch.float32, torch.float16) if on_gpu else (torch.float32, torch.bfloat16)
    for dtype in dtypes:
        gpu = TorchRunner(model, device=dev, dtype=dtype)
        got = run(gpu)
        diff = (got - ref).abs().max().item()
        top1 = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
        rows.append({"check": f"logits {args.device} {dtype}", "value": diff, "extra": f"top-1 {top1:.3f}"})

    # 2. decode tokens/s on the device
    for dtype in dtypes:
        runner = TorchRunner(model, device=dev, dtype=dtype)
        for bsz in (1, 8, 32):
            cache = KVCacheManager(runner.spec, (bsz + 1) * 272 * runner.spec.bytes_per_token, 16, allocate_kv=runner.allocate_kv)
            for b in range(bsz):
                cache.allocate(b, 256)
            past = 128
            batch = StepBatch.build([[7]] * bsz, [past] * bsz, [cache.slots(b, past + 1) for b in range(bsz)])
            for _ in range(3):
                runner.forward(batch, cache.pool)
            sync()
            t0 = time.perf_counter()
            steps = 50 if on_gpu else 2
            for _ in range(steps):
                runner.forward(batch, cache.pool)
            sync()
            per_step = (time.perf_counter() - t0) / steps
            rows.append({"check": f"decode {dtype} batch {bsz}", "value": bsz / per_step, "extra": f"{per_step * 1000:.2f} ms/step"})

    # 3. KV budget by fraction of free memory
    runner = TorchRunner(model, device=dev, dtype=dtypes[1])
    before = allocated()
    budget = int(free_memory_bytes(args.device) * (0.25 if on_gpu else 0.01))
    cache = KVCacheManager(runner.spec, budget, 16, allocate_kv=runner.allocate_kv)
    taken = (allocated() - before) if on_gpu else cache.pool.nbytes
    rows.append({"check": "kv pool bytes / budget", "value": taken / budget,
                 "extra": f"{taken / 2**30:.2f} GiB for {cache.usable_blocks * 16} tokens at {runner.spec.bytes_per_token} B/token"})
    del cache

    # 4. engine: 32 concurrent requests, tokens equal to the CPU engine's
    def engine_run(runner):
        cache = KVCacheManager(runner.spec, 40 * 272 * runner.spec.bytes_per_token, 16, allocate_kv=runner.allocate_kv)
        engine = Engine(runner, tok, cache, SchedulerConfig(), max_context=1024)
        out = {}
        for i in range(32):
            req = GenerationRequest([100 + i, 200 + i, 300], SamplingParams(max_tokens=64 if on_gpu else 4, end_id=-1),
                                    lambda ev, i=i: out.setdefault(i, []).extend(ev.token_ids), stream=False)
            engine.submit(req)
        t0 = time.perf_counter()
        while engine.has_work() or engine._inbox:
            engine.step()
        sync()
        return out, engine.stats.tokens_generated / (time.perf_counter() - t0), engine.stats.max_kv_used_bytes <= cache.total_bytes
    gpu_out, gpu_tps, within = engine_run(TorchRunner(model, device=dev))
    cpu_out, cpu_tps, _ = engine_run(TorchRunner(model))
    same = sum(gpu_out[i] == cpu_out[i] for i in range(32))
    rows.append({"check": f"engine 32 requests {args.device} fp32 tok/s", "value": gpu_tps,
                 "extra": f"cpu {cpu_tps:.1f} tok/s; {same}/32 same greedy tokens as cpu; kv within budget {within}"})

    print(f"\n{'check':<40} {'value':>12}  detail")
    for r in rows:
        print(f"{r['check']:<40} {r['value']:>12.4g}  {r['extra']}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "gpu_check.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["check", "value", "extra"])
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {out / 'gpu_check.csv'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
