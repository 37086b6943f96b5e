"""int8's greedy agreement with float32 on SmolLM2-135M (real weights), with 8-bit and 7-bit activations.

Through fbgemm (TRITONLM_INT8_KERNEL=fbgemm), `dtype: int8` quantizes each token's
activations to 8 bits on CPUs with VNNI and to 7 elsewhere (fbgemm's kernel without VNNI
sums pairs of u8 x s8 products in int16, which 8-bit activations can saturate;
layers.int8_reduce_range). The integer sums are exact in both ranges, so a CPU with VNNI
forced to 7 bits (TRITONLM_INT8_REDUCE_RANGE=1) gives what an AVX2-only CPU gives.
tritonlm's own kernel (TRITONLM_INT8_KERNEL=tritonlm, kernels/int8_act8.cpp) keeps 8 bits
on every x86 level with the same bits on each; its row runs it forced to its AVX2 path,
what an AVX2-only CPU runs by default. This script measures all of them on one host.
    agree     teacher-forced greedy agreement with transformers' float32 generate() on
              --prompts prompts x --tokens tokens (tritonlm_bench.agreement, bench_precision.py's prompts)

    .venv/bin/python perf/int8_activation_bits.py             # 32 prompts x 128 tokens
    .venv/bin/python perf/int8_activation_bits.py --quick     # 8 x 32
    FBGEMM_ENABLE_INSTRUCTIONS=AVX2 .venv/bin/python perf/int8_activation_bits.py
        # fbgemm's AVX2 kernel on a CPU with VNNI: the 7-bit row must not change, and the
        # 8-bit row (which tritonlm refuses to serve there) shows the int16 saturation
On a CPU without VNNI fbgemm's 8-bit row is left out. On a shared host, OMP_NUM_THREADS=1 keeps torch's
threads from waiting on each other. Prints the CPU it ran on; writes
results/int8_activation_bits/int8_activation_bits.csv.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

from tritonlm.engine.runners import layers
from tritonlm.engine.runners.torch_runner import TorchRunner
from tritonlm.perf.machine import describe_cpu
from tritonlm.perf.report import add_out_arg, write_csv
from tritonlm_bench.agreement import smollm2_reference, teacher_forced_agreement


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--quick", action="store_true", help="8 prompts x 32 tokens")
    add_out_arg(ap, "int8_activation_bits")
    args = ap.parse_args()
    if args.quick:
        args.prompts, args.tokens = 8, 32
    cpu = describe_cpu()
    fbgemm_isa = os.environ.get("FBGEMM_ENABLE_INSTRUCTIONS", "")  # fbgemm's own ISA cap, for diagnosis
    cpu_vnni = bool(torch.cpu._is_vnni_supported())
    print(f"CPU: {cpu}; VNNI (torch): {'yes' if cpu_vnni else 'no'}; fbgemm runs VNNI: "
          f"{'yes' if layers.INT8_VNNI else 'no'}; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads" + (f"; FBGEMM_ENABLE_INSTRUCTIONS={fbgemm_isa}" if fbgemm_isa else ""))
    if fbgemm_isa:
        print("fbgemm runs the kernel that cap allows: without VNNI there, the 8-bit row shows its int16 saturation")
    model, prompts, reference = smollm2_reference(args.prompts, args.tokens)
    rows = []
    envs = (layers.INT8_REDUCE_RANGE_ENV, layers.INT8_KERNEL_ENV)
    before = {name: os.environ.get(name) for name in envs}
    # (kernel, bits, the environment that picks it)
    configs = [("fbgemm", 8, ("0", "fbgemm")), ("fbgemm", 7, ("1", "fbgemm")), ("tritonlm_avx2", 8, ("", "tritonlm"))]
    configs = [(k, b, dict(zip(envs, e))) for k, b, e in configs if cpu_vnni or (k, b) != ("fbgemm", 8)]
    print(f"\n{'kernel':<14} {'activations':<12} {'agree':>7} {'agreed/total':>13} {'s':>5}", flush=True)
    try:
        for kernel, bits, env in configs:
            # 8 bits under fbgemm's cap is refused when an int8 model is made: made at 7 bits,
            # its projections are switched to 8 afterwards, op by op (no decoder stack)
            saturating = kernel == "fbgemm" and bits == 8 and not layers.INT8_VNNI
            os.environ.update({**env, layers.INT8_REDUCE_RANGE_ENV: "1"} if saturating else env)
            t0 = time.perf_counter()
            runner = TorchRunner(model, int8=True)
            if saturating:
                runner.transformer.decoder_stack = None
                for p in runner.transformer.projections():
                    if isinstance(p, layers.Int8Linear):
                        p.reduce_range = False
            if kernel == "tritonlm_avx2":  # forced: the path an AVX2-only CPU runs (every path gives the same bits)
                ps = [p for p in runner.transformer.projections() if isinstance(p, layers.Int8Linear)]
                if not all(p.act8 is not None for p in ps):
                    sys.exit("tritonlm's int8 kernel did not load here (the C++ kernels: tritonlm doctor)")
                for p in ps:
                    p.act8.isa = "avx2"
            agree = teacher_forced_agreement(runner, prompts, reference)
            seconds = time.perf_counter() - t0
            rows.append({"kernel": kernel, "activation_bits": bits, "agree": round(agree.fraction, 4), "agreed": agree.agreed,
                         "total": agree.total, "prompts": args.prompts, "tokens": args.tokens, "cpu": cpu,
                         "fbgemm_isa": fbgemm_isa or "native"})
            print(f"{kernel:<14} {f'{bits}-bit':<12} {agree.fraction:>7.4f} {f'{agree.agreed}/{agree.total}':>13} {seconds:>5.0f}",
                  flush=True)
            del runner
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "int8_activation_bits.csv", rows)
    print(f"wrote {out / 'int8_activation_bits.csv'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
