"""Benchmark: `dtype: int8_weight_only` against int8 and float32, step times side by side.

SmolLM2-135M (real weights), the torch runner in-process, the three runners loaded in one
process and timed in alternating rounds (a shared host's speed drifts over minutes, which
runs minutes apart would read as a difference between them):
    decode_b1_ms   median decode step, 1 sequence at context 192 (one stream's time per token)
    decode_b8_ms   the same with 8 sequences
    prefill_ms     one prefill chunk of --prefill tokens (a long prompt's cost per chunk)
The medians over --rounds rounds, and each dtype's ratio to int8's and float32's. Where int8's
kernel has an AMX path (an Intel Sapphire Rapids or later host), which it runs for calls of
several rows (prefill chunks, batched decode steps), a fourth runner, `int8 (<path>)`, runs
every call on the best vector path instead: the gaps between the two are AMX's.

    .venv/bin/python perf/bench_weight_only.py [--rounds 3] [--prefill 512]
Prints the CPU it ran on; writes results/bench_weight_only/bench_weight_only.csv.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

from tritonlm.engine.batch import StepBatch
from tritonlm.engine.kernels import kernels_available
from tritonlm.engine.kv_cache import KVCacheManager
from tritonlm.engine.runners.decoder_stack import build_decoder_stack
from tritonlm.engine.runners.layers import Int8Linear
from tritonlm.engine.runners.torch_runner import TorchRunner
from tritonlm.perf.machine import describe_cpu
from tritonlm.perf.report import add_out_arg, table, write_csv
from tritonlm_bench.steptime import BLOCK, decode_step_ms, time_calls

DTYPES = {"float32": {}, "int8": {"int8": True}, "int8_weight_only": {"int8_weight_only": True}}


def prefill_ms(runner, tokens: int, reps: int) -> float:
    """Median ms of one forward pass over `tokens` new tokens of one sequence (a prefill chunk)."""
    cache = KVCacheManager(runner.spec, (tokens // BLOCK + 4) * BLOCK * runner.spec.bytes_per_token, BLOCK,
                           allocate_kv=runner.allocate_kv)
    cache.allocate(0, tokens)
    step = StepBatch.build([[7] * tokens], [0], [cache.slots(0, tokens)])
    return statistics.median(time_calls(lambda: runner.forward(step, cache.pool), reps)) * 1000


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prefill", type=int, default=512, help="tokens of the prefill chunk (default 512)")
    add_out_arg(ap, "bench_weight_only")
    args = ap.parse_args()
    from tritonlm.models.loading import load_model

    cpu = describe_cpu()
    print(f"CPU: {cpu}", flush=True)
    model, _, _ = load_model("smollm2-135m", progress=lambda *a, **k: None)
    runners = {name: TorchRunner(model, **kwargs) for name, kwargs in DTYPES.items()}
    paths = torch.ops.tritonlm.i8_isas() if kernels_available()[0] else []
    if paths[:1] == ["amx"]:
        vector = TorchRunner(model, int8=True)
        for proj in vector.transformer.projections():
            if isinstance(proj, Int8Linear) and proj.act8 is not None:
                proj.act8.isa = paths[1]
        if vector.transformer.decoder_stack is not None:  # built at load, with the path then set
            vector.transformer.decoder_stack = build_decoder_stack(vector.transformer)
        runners[f"int8 ({paths[1]})"] = vector
    times: dict[str, dict[str, list[float]]] = {n: {"decode_b1_ms": [], "decode_b8_ms": [], "prefill_ms": []} for n in runners}
    for rnd in range(args.rounds):
        for name, runner in runners.items():
            times[name]["decode_b1_ms"].append(decode_step_ms(runner, 1, 192, 20))
            times[name]["decode_b8_ms"].append(decode_step_ms(runner, 8, 192, 10))
            times[name]["prefill_ms"].append(prefill_ms(runner, args.prefill, 2))
        print(f"round {rnd + 1}/{args.rounds} done", flush=True)
    rows = [{"dtype": name, **{k: round(statistics.median(v), 2) for k, v in t.items()}} for name, t in times.items()]
    base = {r["dtype"]: r for r in rows}
    for r in rows:
        for ref in ("int8", "float32"):
            r[f"b1_speed_vs_{ref}"] = round(base[ref]["decode_b1_ms"] / r["decode_b1_ms"], 2)
        r["prefill_vs_float32"] = round(r["prefill_ms"] / base["float32"]["prefill_ms"], 2)
    print(f"\nCPU: {cpu}; SmolLM2-135M, decode at context 192, prefill chunk {args.prefill} tokens, "
          f"medians of {args.rounds} alternating rounds")
    print(table(rows, list(rows[0])))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "bench_weight_only.csv", [{"cpu": cpu, **r} for r in rows])
    print(f"wrote {out / 'bench_weight_only.csv'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
