"""Precision settings side by side on SmolLM2-135M (real weights): speed and agreement.

For each `dtype` (float32, bfloat16, int8, and what `auto` picks here) in one run, plus
float32 with plain [in, out] weights (`x @ w`, the layout before the runner reordered them
into oneDNN's blocked layout at load), and float32 / int8 with `attention_backend: gather`
(each row's K/V copied, then SDPA; the default reads them in place with the paged-attention
kernel), and float32 / int8 with the layers run by the Python loop (`-loop`; the default
runs a decode step's layers in one C++ call, the DecoderStack), to show what those changes buy:
    step_ms   median decode step of the torch runner, batch B, context --context
    tok_s     B / step_ms
    vs_fp32   float32's step time / this one's (higher is faster)
    agree     teacher-forced greedy agreement with transformers' float32 generate() on
              --prompts prompts x --tokens tokens (tritonlm.perf.agreement)

    .venv/bin/python perf/bench_precision.py                 # 32 prompts x 128 tokens
    .venv/bin/python perf/bench_precision.py --quick         # 8 x 32, batches 1 and 32
Prints the CPU it ran on; writes results/bench_precision/bench_precision.csv and .png.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402

from tritonlm.engine.batch import StepBatch  # noqa: E402
from tritonlm.engine.kv_cache import KVCacheManager  # noqa: E402
from tritonlm.engine.precision import resolve_precision  # noqa: E402
from tritonlm.engine.runners.torch_runner import TorchRunner  # noqa: E402
from tritonlm.engine.runners.transformer import Transformer  # noqa: E402
from tritonlm.perf.agreement import reference_continuations, teacher_forced_agreement  # noqa: E402
from tritonlm.perf.machine import describe_cpu  # noqa: E402
from tritonlm.perf.report import write_csv  # noqa: E402

SUBJECTS = ["a harbour town", "black holes", "the printing press", "a jazz trio", "desert plants",
            "a lost passport", "solar panels", "ancient Egypt"]
FORMS = ["Describe {} in a few sentences.", "What is interesting about {}?", "Write a diary entry about {}.",
         "Notes on {}:\n-"]


def step_ms(runner: TorchRunner, batch: int, context: int, reps: int) -> float:
    """Median wall time of one decode step: `batch` rows, each with context-1 tokens cached."""
    cache = KVCacheManager(runner.spec, (batch * (context // 16 + 2) + 1) * 16 * runner.spec.bytes_per_token, 16,
                           allocate_kv=runner.allocate_kv)
    for b in range(batch):
        cache.allocate(b, context)
    past = context - 1
    step = StepBatch.build([[7]] * batch, [past] * batch, [cache.slots(b, context) for b in range(batch)])
    runner.forward(step, cache.pool)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        runner.forward(step, cache.pool)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


def smollm2_and_reference(n_prompts: int, tokens: int):
    """(SmolLM2-135M float32, prompt ids, transformers' float32 greedy continuations):
    the first n_prompts of this script's prompts, `tokens` new tokens each."""
    from tritonlm.models.loading import load_model

    model, tok, _ = load_model("smollm2-135m", progress=lambda *a, **k: None)
    prompts = [tok(f.format(s)).input_ids for s in SUBJECTS for f in FORMS][:n_prompts]
    t0 = time.perf_counter()
    reference = reference_continuations(model, prompts, tokens)
    print(f"reference: transformers float32 greedy, {len(prompts)} x {tokens} tokens ({time.perf_counter() - t0:.0f} s)")
    return model, prompts, reference


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--context", type=int, default=192)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(REPO_ROOT / "results" / "bench_precision"))
    args = ap.parse_args()
    if args.quick:
        args.prompts, args.tokens, args.batches, args.reps = 8, 32, "1,32", 5
    cpu = describe_cpu()
    print(f"CPU: {cpu}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    model, prompts, reference = smollm2_and_reference(args.prompts, args.tokens)
    auto = resolve_precision("auto", "cpu")
    print(f"dtype auto here: {auto.name} ({auto.reason})")
    settings = [("float32", {}), ("float32-gather", {"attention": "gather"}), ("float32-plain", {}),
                ("bfloat16", {"dtype": torch.bfloat16}), ("int8", {"int8": True}),
                ("int8-gather", {"int8": True, "attention": "gather"}),
                ("float32-loop", {}), ("int8-loop", {"int8": True})]
    rows = []
    for name, kwargs in settings:
        runner = TorchRunner(model, **kwargs)
        if name == "float32-plain":
            runner.transformer = Transformer.from_hf(model)  # the same weights, [in, out], not blocked
            runner.transformer.use_paged_kernel()
        if name.endswith("-loop"):
            runner.transformer.decoder_stack = None  # the layers through the Python loop, not the C++ stack
        agree = teacher_forced_agreement(runner, prompts, reference)
        for batch in map(int, args.batches.split(",")):
            ms = step_ms(runner, batch, args.context, args.reps)
            rows.append({"dtype": name, "attention": runner.attention, "auto_picks": name == auto.name, "batch": batch,
                         "context": args.context,
                         "step_ms": round(ms, 2), "tok_s": round(batch / ms * 1000, 1),
                         "agree": round(agree.fraction, 4), "agreed": agree.agreed, "total": agree.total, "cpu": cpu})
        del runner
    fp32 = {r["batch"]: r["step_ms"] for r in rows if r["dtype"] == "float32"}
    for r in rows:
        r["vs_fp32"] = round(fp32[r["batch"]] / r["step_ms"], 2)
    print(f"\n{'dtype':<15} {'attention':<9} {'batch':>5} {'step_ms':>9} {'tok_s':>8} {'vs_fp32':>8} {'agree':>7}")
    for r in rows:
        mark = " (auto)" if r["auto_picks"] else ""
        print(f"{r['dtype']:<15} {r['attention']:<9} {r['batch']:>5} {r['step_ms']:>9.1f} {r['tok_s']:>8.1f} "
              f"{r['vs_fp32']:>8.2f} {r['agree']:>7.4f}{mark}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "bench_precision.csv", rows)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for name, _ in settings:
            pts = [r for r in rows if r["dtype"] == name]
            ax.plot([r["batch"] for r in pts], [r["tok_s"] for r in pts], marker="o",
                    label=f"{name} (agree {pts[0]['agree']:.3f})")
        ax.set_xlabel("batch")
        ax.set_ylabel("decode tokens/s (in-process)")
        ax.set_title(f"SmolLM2-135M decode, context {args.context}\n{cpu}", fontsize=8)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "bench_precision.png", dpi=120)
    except ImportError:
        pass
    print(f"wrote {out / 'bench_precision.csv'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
