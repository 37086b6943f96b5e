"""GPU checks in one prepared script, for a session that is lent a CUDA device.

    .venv/bin/python perf/gpu_check.py [--out DIR]

1. CUDA execution: the torch runner on cuda (fp32 and fp16) against the CPU fp32
   reference (max logit difference, top-1 agreement).
2. Decode tokens/s on the device, batch 1 / 8 / 32, GPT-2-small shape.
3. KV memory budgeting: a pool sized by kv_cache_fraction takes what it says
   (torch.cuda.memory_allocated before/after) and the engine never exceeds it.
4. Engine throughput: 32 concurrent requests, continuous batching, greedy tokens equal
   to the CPU engine's; GPU utilization sampled (NVML) while it runs.
5. The load path as the server takes it (config parameters -> build_engine): `dtype: auto`
   resolves to bfloat16 on a GPU of compute capability 8.0+; `kv_cache_fraction` sizes
   the pool from free memory; `dtype: int8` refuses to load on CUDA naming the field.
Prints a table, writes gpu_check.csv under --out (or $OUT). Exits 2 without CUDA.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
import time
from pathlib import Path

import torch

from tritonlm.paths import REPO_ROOT
from tritonlm.perf.machine import describe_cpu, describe_gpu


class UtilizationSampler:
    """Mean GPU utilization (NVML, percent) from now until stop(), sampled every 50 ms."""

    def __init__(self, dev: torch.device):
        import threading

        self.samples: list[int] = []
        self._stop = threading.Event()
        try:
            import pynvml

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(dev.index or 0)
            self._read = lambda: pynvml.nvmlDeviceGetUtilizationRates(handle).gpu
        except Exception as e:  # no NVML: report NaN rather than fail the other checks
            print(f"GPU utilization not sampled: {e}")
            self._read = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while self._read is not None and not self._stop.wait(0.05):
            self.samples.append(self._read())

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return sum(self.samples) / len(self.samples) if self.samples else float("nan")


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
    name = describe_gpu(args.device) if on_gpu else "cpu (dry run)"
    print(f"device: {name}, free {free_memory_bytes(args.device) / 2**30:.1f} GiB; CPU: {describe_cpu()}")

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
    util = UtilizationSampler(dev) if on_gpu else None
    gpu_out, gpu_tps, within = engine_run(TorchRunner(model, device=dev))
    busy = util.stop() if util else float("nan")
    cpu_out, cpu_tps, _ = engine_run(TorchRunner(model))
    same = sum(gpu_out[i] == cpu_out[i] for i in range(32))
    rows.append({"check": f"engine 32 requests {args.device} fp32 tok/s", "value": gpu_tps,
                 "extra": f"cpu {cpu_tps:.1f} tok/s; {same}/32 same greedy tokens as cpu; kv within budget {within}; "
                          f"GPU utilization mean {busy:.0f}%"})

    # 5. the server's load path: settings from config parameters -> build_engine
    import tempfile

    from tritonlm.engine.loader import build_engine
    from tritonlm.engine.settings import EngineSettings, SettingsError

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "gpt2s"
        model.save_pretrained(folder / "1" / "hf")
        tok.save_pretrained(folder / "1" / "hf")
        # the parameters a config.pbtxt would carry (EngineSettings reads them, not the file)
        params = {"task": "generate", "device": args.device, "dtype": "auto", "kv_cache_fraction": "0.3" if on_gpu else "0.01"}
        free_before = free_memory_bytes(args.device)
        before = allocated()
        engine = build_engine(EngineSettings.from_params(params, folder))
        kv = engine.cache.pool.nbytes
        rows.append({"check": "dtype auto -> compute dtype", "value": float(engine.runner.spec.dtype == torch.bfloat16),
                     "extra": f"{engine.runner.spec.dtype} (1 = bfloat16)"})
        rows.append({"check": f"kv_cache_fraction {params['kv_cache_fraction']}: pool / free", "value": kv / free_before,
                     "extra": f"{kv / 2**30:.2f} GiB pool of {free_before / 2**30:.1f} GiB free; "
                              f"allocated grew {(allocated() - before) / 2**30:.2f} GiB with the weights"})
        for warm in (True, False):  # the first round pays for bf16 kernels' first use
            out = {}
            for i in range(32):
                engine.submit(GenerationRequest([100 + i, 200 + i, 300], SamplingParams(max_tokens=64 if on_gpu else 4, end_id=-1),
                                                lambda ev, i=i: out.setdefault(i, []).extend(ev.token_ids), stream=False))
            before_tokens, t0 = engine.stats.tokens_generated, time.perf_counter()
            while engine.has_work() or engine._inbox:
                engine.step()
            sync()
            bf16_tps = (engine.stats.tokens_generated - before_tokens) / (time.perf_counter() - t0)
            if warm:
                rows.append({"check": f"engine 32 requests {args.device} auto, first round", "value": bf16_tps, "extra": "tok/s, cold kernels"})
        bf16_same = sum(out[i] == cpu_out[i][:len(out[i])] for i in range(32))
        rows.append({"check": f"engine 32 requests {args.device} auto tok/s", "value": bf16_tps,
                     "extra": f"{bf16_same}/32 rows equal the CPU fp32 engine's greedy tokens"})
        del engine
        try:
            build_engine(EngineSettings.from_params({**params, "dtype": "int8"}, folder))
            refused = "loaded (unexpected)"
        except SettingsError as e:
            refused = str(e)
        rows.append({"check": "dtype int8 on cuda refused", "value": float(refused.startswith("dtype:")), "extra": refused[:90]})

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
