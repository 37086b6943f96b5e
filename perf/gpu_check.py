"""GPU checks and figures in one prepared script, for a session that is lent a CUDA device.

    python3 perf/gpu_check.py [--out DIR] [--budget SECONDS] [--device cpu]

Models have random weights in real shapes (no weights travel to the device): SmolLM2-135M's
(Llama, 30 layers, 9 query / 3 kv heads, vocab 49152) and, for comparisons against the CPU
engine, the same shape cut to 4 layers. Sections, each guarded so one failure does not hide
the others, and skipped when the time budget runs out:

 1. kernel     the Triton paged decode kernel against a float64 reference (fp32, bf16),
               and its time per call at 1 / 32 / 128 / 256 rows, context 512
               (perf/bench_paged_decode.py's bench)
 2. graphs     decode logits with CUDA graphs on vs off: bitwise equal (batch 1, 3, 64);
               the CUDA fp32 step (kernel + graphs) against the CPU fp32 runner
 3. exactness  greedy and seeded-sampled tokens of the GPU engine (fp32) against the CPU engine
 4. step time  one decode step at 1 / 32 / 128 / 256 rows, context 512: graphs, eager
               kernel, and the old gather + SDPA path
 5. engine     served tok/s at 1, 32, 128, 256 streams (bf16), graphs on and off; GPU busy
               (NVML) at 64 streams x 256 tokens
 6. reference  the same model through perf's static-cache torch.compile decode loop
               (perf/tritonlm_bench/static_decode.py) at 64 rows: the served/reference ratio
 7. draft      speculative decoding on the GPU with a 4-layer draft of the same shape
               (random weights: acceptance is near zero, so this measures its cost) and
               with the target as its own draft (every guess right: its ceiling), each
               also with adaptive_speculation (speculation only where it is faster)
 8. compiled   decode steps through torch.compile before capture (`compile_decode`):
               step time and logits against the graph alone, served tok/s, GPU busy
 9. compiled exactness  greedy and seeded tokens of the compiled GPU engine (fp32) against
               the CPU engine
10. ahead      schedule_ahead (the next step launched before the host reads this step's
               tokens): greedy and seeded tokens against the CPU engine, and served tok/s
               at 1 and 64 streams with it off and on (bf16, graphs), GPU busy at 64
Section 6 runs last: a compiler failure there can leave torch unusable in the process.
Prints a table, writes gpu_check.csv under --out (or $OUT). Exits 2 without CUDA.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
import threading
import time
import traceback
from pathlib import Path

import torch

from tritonlm.paths import REPO_ROOT
from tritonlm.perf.machine import describe_cpu, describe_gpu

ROWS: list[dict] = []


def record(section: str, check: str, value: float, extra: str = "") -> None:
    ROWS.append({"section": section, "check": check, "value": value, "extra": extra})
    print(f"  {check:<58} {value:>12.5g}  {extra}", flush=True)


class UtilizationSampler:
    """Mean GPU utilization (NVML, percent) from now until stop(), sampled every 20 ms."""

    def __init__(self, dev: torch.device):
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
        while self._read is not None and not self._stop.wait(0.02):
            self.samples.append(self._read())

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return sum(self.samples) / len(self.samples) if self.samples else float("nan")


def smollm2_shape(layers: int = 30):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers,
        num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, initializer_range=0.2,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or str(REPO_ROOT / "results" / "gpu_check"))
    ap.add_argument("--device", default="cuda:0", help="cpu: a quick dry run of the script's logic")
    ap.add_argument("--budget", type=float, default=480.0, help="seconds; later sections are skipped past it")
    ap.add_argument("--sections", default="1,2,3,4,5,6,7,10", help="which sections to run, by number")
    args = ap.parse_args()
    on_gpu = args.device.startswith("cuda")
    if on_gpu and not torch.cuda.is_available():
        print("no CUDA device visible to torch: run this on a machine with a GPU (torch CUDA build)")
        return 2
    started = time.perf_counter()
    dev = torch.device(args.device)
    import triton  # noqa: F401 - its version goes in the header

    print(f"device: {describe_gpu(args.device) if on_gpu else 'cpu (dry run)'}; torch {torch.__version__}; "
          f"triton {triton.__version__}; CPU: {describe_cpu()}", flush=True)
    small = not on_gpu  # the dry run shrinks every workload

    def sync() -> None:
        if on_gpu:
            torch.cuda.synchronize(dev)

    wanted = set(args.sections.split(","))

    def section(name: str, fn) -> None:
        if name.split(".")[0] not in wanted:
            return
        left = args.budget - (time.perf_counter() - started)
        print(f"\n== {name} ({left:.0f} s of budget left)", flush=True)
        if left < 20:
            record(name, "skipped: time budget spent", float("nan"))
            return
        t0 = time.perf_counter()
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - the other sections still run
            traceback.print_exc()
            record(name, f"FAILED: {type(e).__name__}", float("nan"), str(e)[:160])
        print(f"   ({time.perf_counter() - t0:.1f} s)", flush=True)

    from tritonlm.engine.batch import StepBatch
    from tritonlm.engine.engine import Engine
    from tritonlm.engine.kv_cache import KVCacheManager
    from tritonlm.engine.request import GenerationRequest, SamplingParams
    from tritonlm.engine.runners.torch_runner import TorchRunner
    from tritonlm.engine.scheduler import SchedulerConfig
    from tritonlm.models.builtin import tiny_tokenizer

    tok = tiny_tokenizer()
    full = smollm2_shape(2 if small else 30)
    short = smollm2_shape(2 if small else 4)

    def runner_for(model, dtype, graphs="auto", attention="auto", device=dev):
        r = TorchRunner(model, device=device, dtype=dtype, attention=attention, cuda_graphs=graphs, max_batch=256)
        r.max_context = 1024
        if not on_gpu and attention != "gather":  # dry run: the Triton kernel through its interpreter
            r.transformer.cpp_ops, r.transformer.decoder_stack = False, None
            r.transformer.use_decode_kernel()
        return r

    # ---- 1. the kernel
    def kernel() -> None:
        from bench_paged_decode import bench  # beside this script

        from tritonlm.engine.kernels.paged_decode import paged_decode_attention

        g = torch.Generator().manual_seed(1)
        bs, heads, kv, d = 16, 9, 3, 64
        lens = [1, 17, 300, 513, 64]
        blocks = sum(-(-n // bs) for n in lens) + 1
        perm = (torch.randperm(blocks - 1, generator=g) + 1).tolist()
        table = torch.zeros(len(lens), 40, dtype=torch.int32)
        at = 0
        for b, n in enumerate(lens):
            nb = -(-n // bs)
            table[b, :nb] = torch.tensor(perm[at:at + nb], dtype=torch.int32)
            at += nb
        kc = torch.randn(blocks * bs, kv, d, generator=g, dtype=torch.float64)
        vc = torch.randn(blocks * bs, kv, d, generator=g, dtype=torch.float64)
        q = torch.randn(len(lens), heads, d, generator=g, dtype=torch.float64)
        ref = torch.empty_like(q)
        for b, n in enumerate(lens):
            pos = torch.arange(n)
            slots = table[b, pos // bs].long() * bs + pos % bs
            k, v = kc[slots].repeat_interleave(heads // kv, 1), vc[slots].repeat_interleave(heads // kv, 1)  # [n, H, D]
            w = torch.softmax(torch.einsum("hd,nhd->hn", q[b], k) * d**-0.5, -1)
            ref[b] = torch.einsum("hn,nhd->hd", w, v)
        for dtype in (torch.float32, torch.bfloat16):
            got = paged_decode_attention(q.to(dev, dtype), kc.to(dev, dtype), vc.to(dev, dtype), table.to(dev),
                                         torch.tensor(lens, dtype=torch.int32, device=dev), bs, d**-0.5)
            err = (got.double().cpu() - ref).abs().max().item()
            record("kernel", f"kernel vs float64 reference, {dtype}", err, "max abs error, rows of 1..513 keys")
        if on_gpu:
            for row in bench(iters=100):
                record("kernel", f"kernel bf16 B={row['batch']} ctx 512 (splits {row['splits']})", row["us"],
                       f"us/call, {row['gb_per_s']:.0f} GB/s K/V read")

    # ---- 2. graphs on vs off, and the CUDA step against the CPU
    def graphs() -> None:
        for dtype in (torch.float32, torch.bfloat16):
            on, off = runner_for(full, dtype, "auto"), runner_for(full, dtype, "off")
            if on_gpu:
                assert on.transformer.decode_kernel, on.attention_why
            for bsz in (1, 3, 64):
                logits = []
                for r in (on, off):
                    cache = KVCacheManager(r.spec, (bsz + 2) * 80 * r.spec.bytes_per_token, 16, allocate_kv=r.allocate_kv,
                                           device_tables=True)
                    for b in range(bsz):
                        cache.allocate(b, 64)
                    ids = list(range(bsz))
                    torch.manual_seed(5)
                    prompts = [torch.randint(0, 49152, (8 + b % 5,)).tolist() for b in range(bsz)]
                    r.forward(StepBatch.from_block_table(prompts, [0] * bsz, cache.device_table.gather(ids), 16), cache.pool)
                    step = []
                    for i in range(3):  # three decode steps
                        pasts = [len(p) + i for p in prompts]
                        step.append(r.forward(StepBatch.from_block_table([[7 + i]] * bsz, pasts, cache.device_table.gather(ids), 16),
                                              cache.pool))
                    logits.append(torch.stack(step))
                same = torch.equal(logits[0], logits[1])
                record("graphs", f"graphs on == off, {dtype}, batch {bsz}", float(same),
                       f"1 = bitwise equal; captured buckets {on.decode_graphs.captured if on.decode_graphs else []}")
        # the CUDA fp32 decode step (kernel + graph) against the CPU fp32 runner, same weights
        outs = []
        for r in (runner_for(short, torch.float32), TorchRunner(short, attention="gather")):
            cache = KVCacheManager(r.spec, 10 * 80 * r.spec.bytes_per_token, 16, allocate_kv=r.allocate_kv,
                                   device_tables=r.device.type == "cuda")
            for b in range(8):
                cache.allocate(b, 64)
            torch.manual_seed(6)
            prompts = [torch.randint(0, 49152, (5 + 3 * b,)).tolist() for b in range(8)]
            ids = list(range(8))

            def batch(feeds, pasts):
                if cache.device_table is not None:
                    return StepBatch.from_block_table(feeds, pasts, cache.device_table.gather(ids), 16)
                return StepBatch.from_slot_table(feeds, pasts, cache.slot_table(ids, [p + len(f) for p, f in zip(pasts, feeds)]))
            r.forward(batch(prompts, [0] * 8), cache.pool)
            outs.append(r.forward(batch([[11]] * 8, [len(p) for p in prompts]), cache.pool).float().cpu())
        diff = (outs[0] - outs[1]).abs().max().item()
        top1 = (outs[0].argmax(-1) == outs[1].argmax(-1)).float().mean().item()
        record("graphs", "CUDA fp32 decode (kernel, graph) vs CPU fp32 logits", diff, f"max abs diff; top-1 agreement {top1:.3f}")

    # ---- engines
    def engine_run(runner, streams: int, tokens: int, prompt_len: int = 16, seed_base: int | None = None,
                   temperature: float | None = None, drafter=None, k: int = 4,
                   ahead: bool = False, ends: dict[int, int] | None = None, adaptive: bool = False,
                   ) -> tuple[dict[int, list[int]], float, Engine]:
        cache = KVCacheManager(runner.spec, (streams + 2) * (prompt_len + tokens + 32) * runner.spec.bytes_per_token, 16,
                               allocate_kv=runner.allocate_kv)
        sched = SchedulerConfig(max_num_seqs=max(streams, 1), max_num_batched_tokens=max(512, streams * 2))
        engine = Engine(runner, tok, cache, sched, max_context=1024, drafter=drafter(cache) if drafter else None,
                        num_draft_tokens=k, schedule_ahead=ahead, adaptive_speculation=adaptive)
        out: dict[int, list[int]] = {}
        gen = torch.Generator().manual_seed(123)
        for i in range(streams):
            prompt = torch.randint(3, 49152, (prompt_len,), generator=gen).tolist()
            params = SamplingParams(max_tokens=tokens, end_id=(ends or {}).get(i, -1), temperature=temperature,
                                    seed=None if seed_base is None else seed_base + i)
            engine.submit(GenerationRequest(prompt, params, lambda ev, i=i: out.setdefault(i, []).extend(ev.token_ids),
                                            stream=False))
        t0 = time.perf_counter()
        while engine.has_work() or engine._inbox:
            engine.step()
        sync()
        return out, engine.stats.tokens_generated / (time.perf_counter() - t0), engine

    def compare_engines(section_name: str, what: str, gpu, ahead: bool = False) -> None:
        """The GPU runner's engine against the CPU engine (gather path), greedy and seeded."""
        cpu = TorchRunner(short, attention="gather")
        n, t = (32, 32) if not small else (4, 4)
        for label, kw in (("greedy", {}), ("seeded sampling (T=0.8)", {"seed_base": 1000, "temperature": 0.8})):
            g_out, _, _ = engine_run(gpu, n, t, ahead=ahead, **kw)
            c_out, _, _ = engine_run(cpu, n, t, **kw)
            same = sum(g_out[i] == c_out[i] for i in range(n))
            tok_same = sum(a == b for i in range(n) for a, b in zip(g_out[i], c_out[i])) / (n * t)
            record(section_name, f"GPU fp32 engine{what} == CPU engine, {label}", same,
                   f"of {n} rows x {t} tokens identical; {tok_same:.4f} of tokens equal position by position")

    def exactness() -> None:
        compare_engines("exactness", "", runner_for(short, torch.float32))

    def decode_batch(r, bsz: int, past: int, random_kv: bool = False) -> tuple[KVCacheManager, StepBatch]:
        """A pool with bsz rows of `past` cached tokens and their decode step's batch. random_kv:
        the pool filled with seeded noise (the same in every pool), so rows differ."""
        cache = KVCacheManager(r.spec, (bsz + 1) * (past + 32) * r.spec.bytes_per_token, 16, allocate_kv=r.allocate_kv,
                               device_tables=True)
        ids = list(range(bsz))
        for b in ids:
            cache.allocate(b, past + 16)
        if random_kv:
            torch.manual_seed(9)
            for t in cache.pool.k + cache.pool.v:
                t.normal_()
        return cache, StepBatch.from_block_table([[7]] * bsz, [past] * bsz, cache.device_table.gather(ids), 16)

    def step_ms(r, batch: StepBatch, cache: KVCacheManager) -> float:
        """Milliseconds per decode step, after 3 warm-up steps."""
        for _ in range(3):
            r.forward(batch, cache.pool)
        sync()
        n = 30 if on_gpu else 2
        t0 = time.perf_counter()
        for _ in range(n):
            r.forward(batch, cache.pool)
        sync()
        return (time.perf_counter() - t0) / n * 1000

    def step_time() -> None:
        for name, graphs_mode, attention in (("graphs", "auto", "auto"), ("eager kernel", "off", "auto"),
                                             ("gather + SDPA", "off", "gather")):
            r = runner_for(full, torch.bfloat16 if on_gpu else torch.float32, graphs_mode, attention)
            for bsz in ((1, 32, 128, 256) if on_gpu else (1, 4)):
                past = 512 if on_gpu else 16
                cache, batch = decode_batch(r, bsz, past)
                ms = step_ms(r, batch, cache)
                record("step time", f"decode step bf16, {name}, batch {bsz}, context {past}", ms,
                       f"ms/step = {bsz / ms * 1000:.0f} tok/s")

    def engine_speed() -> None:
        dtype = torch.bfloat16 if on_gpu else torch.float32
        for mode in ("auto", "off"):
            r = runner_for(full, dtype, mode)
            engine_run(r, 4, 4)  # captures the small buckets' graphs, compiles the kernel
            for streams, tokens in (((1, 256), (32, 128), (128, 128), (256, 128)) if on_gpu else ((1, 4), (4, 4))):
                _, tps, _ = engine_run(r, streams, tokens)
                record("engine", f"engine bf16 graphs {mode}: {streams} streams x {tokens} tokens", tps, "tok/s")
        r = runner_for(full, dtype, "auto")
        streams, tokens = (64, 256) if on_gpu else (4, 4)
        engine_run(r, streams, 8)
        util = UtilizationSampler(dev) if on_gpu else None
        _, tps, _ = engine_run(r, streams, tokens)
        busy = util.stop() if util else float("nan")
        record("engine", f"GPU busy (NVML), {streams} streams x {tokens} tokens, bf16, graphs", busy,
               f"percent; {tps:.0f} tok/s")
        ROWS.append({"section": "engine", "check": "_engine64", "value": tps, "extra": ""})

    def reference() -> None:
        if not on_gpu:
            record("reference", "skipped on cpu (torch.compile reduce-overhead needs CUDA)", float("nan"))
            return
        from tritonlm_bench.static_decode import StaticDecoder

        r = runner_for(full, torch.bfloat16)
        ref = StaticDecoder(r.transformer, 64, 16 + 256 + 8)
        tps, warm = ref.tokens_per_second(16, 256)
        served = next((x["value"] for x in reversed(ROWS) if x["check"] == "_engine64"), None)
        if served is None:  # section 5 did not run in this process: the same workload, served
            engine_run(r, 64, 8)
            _, served, _ = engine_run(r, 64, 256)
        record("reference", "static cache + torch.compile(reduce-overhead), 64 rows x 256 tokens", tps,
               f"tok/s (compile + warm-up {warm:.0f} s); served engine / reference = {served / tps:.2f}")
        ahead = next((x["value"] for x in reversed(ROWS) if x["check"] == "_engine64_ahead"), None)
        if ahead is not None:
            record("reference", "served engine with schedule_ahead / reference, 64 rows x 256 tokens", ahead / tps,
                   f"({ahead:.0f} tok/s served)")

    def scheduled_ahead() -> None:
        r32 = runner_for(short, torch.float32)
        n, t = (32, 32) if not small else (4, 6)
        for label, kw in (("greedy", {}), ("seeded sampling (T=0.8)", {"seed_base": 1000, "temperature": 0.8})):
            plain, _, _ = engine_run(r32, n, t, **kw)
            # every other stream ends on a token of its own answer: rows end mid-run, as on EOS
            ends = {i: plain[i][len(plain[i]) // 2] for i in range(1, n, 2)}
            off, _, _ = engine_run(r32, n, t, ends=ends, **kw)
            on, _, _ = engine_run(r32, n, t, ends=ends, ahead=True, **kw)
            record("ahead", f"schedule_ahead on == off, same GPU runner, {label}", sum(on[i] == off[i] for i in range(n)),
                   f"of {n} rows identical (odd rows end on an end token, at {sum(len(off[i]) for i in ends) / len(ends):.1f} tokens)")
        compare_engines("ahead", " (schedule_ahead)", r32, ahead=True)
        dtype = torch.bfloat16 if on_gpu else torch.float32
        r = runner_for(full, dtype)
        engine_run(r, 4, 4)  # captures the small buckets' graphs, compiles the kernel
        for streams, tokens in (((1, 256), (64, 256)) if on_gpu else ((1, 4), (4, 4))):
            engine_run(r, streams, 8)
            tps = {}
            for on in (False, True, False, True):  # alternated: drift on the device hits both alike
                util = UtilizationSampler(dev) if on_gpu and streams == 64 else None
                _, rate, _ = engine_run(r, streams, tokens, ahead=on)
                busy = util.stop() if util else float("nan")
                record("ahead", f"engine {dtype} graphs, schedule_ahead {'on' if on else 'off'}: "
                       f"{streams} streams x {tokens} tokens", rate, "tok/s" + (f"; GPU busy {busy:.0f}%" if util else ""))
                tps.setdefault(on, []).append(rate)
            best_on, best_off = max(tps[True]), max(tps[False])
            record("ahead", f"schedule_ahead on / off, {streams} streams (best of 2 each)", best_on / best_off, "")
            if streams == 64:
                ROWS.append({"section": "ahead", "check": "_engine64_ahead", "value": best_on, "extra": ""})

    def draft() -> None:
        from tritonlm.engine.speculative import DraftModelDrafter

        dtype = torch.bfloat16 if on_gpu else torch.float32
        r = runner_for(full, dtype)
        n, t = (1, 128) if on_gpu else (1, 4)
        _, base, _ = engine_run(r, n, t)
        _, base, _ = engine_run(r, n, t)
        record("draft", f"1 stream, no speculation, bf16, {t} tokens", base, "tok/s")
        for label, model in (("4-layer random draft", short), ("self-draft (every guess right)", full)):
            d = runner_for(model, dtype)
            engine_run(r, n, 8, drafter=lambda cache, d=d: DraftModelDrafter(d, cache))
            _, tps, eng = engine_run(r, n, t, drafter=lambda cache, d=d: DraftModelDrafter(d, cache))
            record("draft", f"1 stream, speculative K=4, {label}", tps, f"tok/s = {tps / base:.2f}x no speculation")
            # adaptive_speculation (served models' default): its first timings are part of the run
            _, tps, eng = engine_run(r, n, t, drafter=lambda cache, d=d: DraftModelDrafter(d, cache), adaptive=True)
            record("draft", f"1 stream, speculative K=4, {label}, adaptive_speculation", tps,
                   f"tok/s = {tps / base:.2f}x no speculation; governor {eng.executor.governor.state()}")

    def compiled() -> None:
        dtype = torch.bfloat16 if on_gpu else torch.float16
        plain = runner_for(full, dtype)
        fused = runner_for(full, dtype)
        fused.compile_decode = True
        # the first decode steps compile (one static size-1 graph, one dynamic for the rest)
        t0 = time.perf_counter()
        steps = {}
        for bsz in ((1, 32, 128, 256) if on_gpu else (1, 4)):
            past = 512 if on_gpu else 16
            for name, r in (("plain", plain), ("compiled", fused)):
                cache, batch = decode_batch(r, bsz, past, random_kv=True)
                first = r.forward(batch, cache.pool).float()
                steps[name, bsz] = (step_ms(r, batch, cache), first.cpu())
            (ms_p, lp), (ms_c, lc) = steps["plain", bsz], steps["compiled", bsz]
            top1 = (lp.argmax(-1) == lc.argmax(-1)).float().mean().item()
            record("compiled", f"decode step {dtype}, batch {bsz}, context {past}: compiled + graph", ms_c,
                   f"ms/step vs {ms_p:.2f} graph alone; logits max diff {(lp - lc).abs().max().item():.3g}, "
                   f"top-1 agreement {top1:.3f}")
        record("compiled", "compile + capture, all buckets above", time.perf_counter() - t0, "seconds (both runners)")
        for streams, tokens in (((1, 256), (32, 128), (64, 256), (128, 128), (256, 128)) if on_gpu else ((1, 4), (4, 4))):
            util = UtilizationSampler(dev) if on_gpu and streams == 64 else None
            _, tps, _ = engine_run(fused, streams, tokens)
            busy = util.stop() if util else float("nan")
            record("compiled", f"engine {dtype} compiled + graphs: {streams} streams x {tokens} tokens", tps,
                   "tok/s" + (f"; GPU busy {busy:.0f}%" if util else ""))
            if streams == 64:
                ROWS.append({"section": "compiled", "check": "_engine64", "value": tps, "extra": ""})

    def compiled_exactness() -> None:
        """compile_decode against the CPU engine, on distinct prefilled rows (fp32, 4 layers)."""
        if not on_gpu:  # float32 CPU weights are oneDNN-blocked, which inductor does not take
            record("compiled exactness", "skipped on cpu (compile_decode runs on CUDA)", float("nan"))
            return
        fused = runner_for(short, torch.float32)
        fused.compile_decode = True
        compare_engines("compiled exactness", ", compiled + graphs,", fused)

    section("1. kernel", kernel)
    section("2. graphs on vs off", graphs)
    section("3. exactness vs the CPU engine", exactness)
    section("10. schedule ahead", scheduled_ahead)  # early: the open question
    section("5. engine throughput and GPU busy", engine_speed)
    section("4. decode step time", step_time)
    section("7. speculative decoding on the GPU", draft)
    section("8. decode steps through torch.compile", compiled)
    section("9. compiled steps against the CPU engine", compiled_exactness)
    section("6. static-cache torch.compile reference", reference)  # last: a compiler failure can leave torch unusable

    rows = [r for r in ROWS if not r["check"].startswith("_")]
    print(f"\n{'check':<70} {'value':>12}  detail")
    for r in rows:
        print(f"{r['check']:<70} {r['value']:>12.5g}  {r['extra']}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "gpu_check.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["section", "check", "value", "extra"])
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {out / 'gpu_check.csv'} in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
