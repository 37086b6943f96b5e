"""Benchmark: a new pod's cold start with prebuilt C++ kernels against a compile at first load.

Each start is a fresh Python process (what a new pod or a restarted model instance runs),
timed from just before it is spawned:
    kernels_s         until tritonlm's C++ kernels are loaded (kernels_available())
    first_token_s     until tiny-gpt2 (seeded random weights) has given its first token: the
                      runner built, an 8-token prompt's prefill
    decode_token_s    until its next token: one decode step through the C++ kernels
Modes, alternated start by start (a shared host's speed drifts over minutes):
    prebuilt          the best prebuilt ISA level this CPU runs (`make setup` built them)
    compile           no prebuilt folder and an empty torch extension cache: -march=native
                      compiled at the first load, as every new pod did before prebuilt kernels
    compile_cached    the compile's cache left by the previous start (the same node restarting)

    .venv/bin/python perf/bench_kernel_cold_start.py [--starts 3]
Prints the CPU it ran on; writes results/bench_kernel_cold_start/bench_kernel_cold_start.csv.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tritonlm.perf.machine import describe_cpu
from tritonlm.perf.report import add_out_arg, table, write_csv

# the child: absolute times (time.time(), the same clock as the parent's) at each milestone
CHILD = r"""
import json, time
import torch
from tritonlm.engine.kernels import kernels_available, loaded_build
ok, why = kernels_available()
t_kernels = time.time()
from tritonlm.engine.batch import StepBatch
from tritonlm.engine.kv_cache import KVCacheManager
from tritonlm.engine.runners.torch_runner import TorchRunner
from tritonlm.models.builtin import build_tiny
model, tok = build_tiny("tiny-gpt2")
runner = TorchRunner(model)
cache = KVCacheManager(runner.spec, 64 * runner.spec.bytes_per_token, 16, allocate_kv=runner.allocate_kv)
cache.allocate(0, 9)
prompt = [5, 17, 42, 9, 33, 71, 2, 64]
logits = runner.forward(StepBatch.build([prompt], [0], [cache.slots(0, 8)]), cache.pool)
first = int(logits[0, -1].argmax())
t_first = time.time()
logits = runner.forward(StepBatch.build([[first]], [8], [cache.slots(0, 9)]), cache.pool)
second = int(logits[0, -1].argmax())
t_decode = time.time()
b = loaded_build()
print(json.dumps({"ok": ok, "build": f"{b.level}, {b.origin}" if b else why, "attention": runner.attention,
                  "t_kernels": t_kernels, "t_first": t_first, "t_decode": t_decode, "tokens": [first, second]}))
"""


def start(env: dict[str, str]) -> dict:
    t0 = time.time()
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"a start failed:\n{out.stderr[-3000:]}")
    r = json.loads(out.stdout.strip().splitlines()[-1])
    if not r["ok"] or r["attention"] != "paged":
        raise SystemExit(f"the kernels did not load: {r['build']}")
    return {"kernels_s": r["t_kernels"] - t0, "first_token_s": r["t_first"] - t0, "decode_token_s": r["t_decode"] - t0,
            "build": r["build"], "tokens": r["tokens"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--starts", type=int, default=3, help="starts per mode (default 3)")
    add_out_arg(ap, "bench_kernel_cold_start")
    args = ap.parse_args()
    cpu = describe_cpu()
    print(f"CPU: {cpu}", flush=True)
    flags = subprocess.run([sys.executable, "-c", "from tritonlm.engine.kernels.isa import cpu_flags, supported; "
                            "print(', '.join(lv.name for lv in supported(cpu_flags())))"],
                           capture_output=True, text=True, check=True).stdout.strip()
    print(f"ISA levels this CPU runs: {flags}", flush=True)
    pre = subprocess.run([sys.executable, "-m", "tritonlm.engine.kernels", "--prebuild"], capture_output=True, text=True)
    print(pre.stdout.strip(), flush=True)  # the levels are already there after `make setup`: no compile
    base = {k: v for k, v in os.environ.items() if k not in ("TRITONLM_KERNEL_ISA", "TRITONLM_KERNELS_DIR")}
    samples: dict[str, list[dict]] = {"prebuilt": [], "compile": [], "compile_cached": []}
    with tempfile.TemporaryDirectory() as scratch:
        empty = Path(scratch) / "no-prebuilt"
        empty.mkdir()
        for i in range(args.starts):
            samples["prebuilt"].append(start(base))
            cache = Path(scratch) / f"torch-extensions-{i}"  # a new pod's empty cache
            env = {**base, "TRITONLM_KERNELS_DIR": str(empty), "TORCH_EXTENSIONS_DIR": str(cache)}
            samples["compile"].append(start(env))
            samples["compile_cached"].append(start(env))
            print(f"start {i + 1}/{args.starts}: " + ", ".join(
                f"{m} {s[-1]['first_token_s']:.2f} s" for m, s in samples.items()), flush=True)
    tokens = {tuple(s["tokens"]) for ss in samples.values() for s in ss}
    assert len(tokens) == 1, f"the builds gave different tokens: {tokens}"
    rows = []
    for mode, ss in samples.items():
        rows.append({"mode": mode, **{k: round(statistics.median(s[k] for s in ss), 2)
                                      for k in ("kernels_s", "first_token_s", "decode_token_s")},
                     "build": ss[-1]["build"]})
    print(f"\nCPU: {cpu}; medians of {args.starts} fresh processes per mode, seconds from spawn")
    print(table(rows, list(rows[0])))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "bench_kernel_cold_start.csv", [{"cpu": cpu, "levels": flags, **r} for r in rows])
    print(f"wrote {out / 'bench_kernel_cold_start.csv'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
