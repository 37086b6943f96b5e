"""`make bench`: the benchmark suite, each harness against its own private tritonserver.

- `tritonlm plan` for gpt2 and llama-7b
- `tritonlm perf batching`, `sla` and `diagnose` on --model (default: echo)
- `tritonlm perf llm` on --llm-model, or on the first decoupled model with a
  text_input found in --repo (skipped when there is none)
- the project's other benchmark scripts, perf/bench_*.py, when present

Results land under results/<harness>/. Exit status: non-zero if any step failed.
    python perf/run_all.py [--quick] [--model echo] [--llm-model NAME] [--p99-ms 50]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def find_llm_model(repo: Path) -> str | None:
    from tritonlm.perf.variants import VariantError, read_config

    for folder in sorted(p for p in repo.iterdir() if (p / "config.pbtxt").is_file()):
        try:
            config = read_config(folder)
        except VariantError:
            continue
        names = {i.name for i in config.input}
        if config.model_transaction_policy.decoupled and {"text_input", "max_tokens"} <= names:
            return folder.name
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repo", default="model_repository")
    ap.add_argument("--model", default="echo", help="model for batching/sla/diagnose (default echo)")
    ap.add_argument("--llm-model", default=None, help="decoupled generation model for perf llm (default: found in --repo)")
    ap.add_argument("--p99-ms", default="50")
    ap.add_argument("--quick", action="store_true", help="short windows and few points (a smoke run)")
    ap.add_argument("--no-others", action="store_true", help="skip perf/bench_*.py")
    args = ap.parse_args()

    cli = [sys.executable, "-m", "tritonlm.cli"]
    common = ["--serve", "--repo", args.repo]
    window = ["--measurement-interval", "1000"] if args.quick else []
    conc = "1,4,16" if args.quick else "1:64"
    steps = [
        ("plan gpt2", [*cli, "plan", "gpt2", "--device", "t4-16gb", "--context", "256,1024", "--results", "results/plan/gpt2"]),
        ("plan llama-7b", [*cli, "plan", "llama-7b", "--device", "a100-80gb", "--context", "512,2048,16384", "--results", "results/plan/llama-7b"]),
        ("batching", [*cli, "perf", "batching", "--model", args.model, "--concurrency", conc, *common, *window]),
        ("sla", [*cli, "perf", "sla", "--model", args.model, "--p99-ms", args.p99_ms, "--concurrency", conc, *common, *window]),
        ("diagnose", [*cli, "perf", "diagnose", "--model", args.model, "--p99-ms", args.p99_ms, *common, *window]),
    ]
    llm = args.llm_model or find_llm_model(Path(args.repo))
    if llm:
        steps.append(("llm", [*cli, "perf", "llm", "--model", llm, "--concurrency", "1,2,4" if args.quick else "1,2,4,8", *common]))
    else:
        print("no decoupled generation model in the repository: perf llm skipped (pass --llm-model)")
    if not args.no_others:
        for script in sorted(HERE.glob("bench_*.py")):
            steps.append((script.stem, [sys.executable, str(script)]))

    failed = []
    for name, cmd in steps:
        print(f"\n===== {name}: {' '.join(cmd[1:])}", flush=True)
        t0 = time.monotonic()
        rc = subprocess.call(cmd)
        # sla/tune exit 3 when the budget is not met: a result, not a failure
        status = "ok" if rc in (0, 3) else f"FAILED (exit {rc})"
        print(f"===== {name}: {status} in {time.monotonic() - t0:.0f} s", flush=True)
        if rc not in (0, 3):
            failed.append(name)
    print("\nall benchmarks done" if not failed else f"\nfailed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
