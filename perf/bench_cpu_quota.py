"""Benchmark: the engine under a real cgroup CPU quota of one core, against one core by affinity.

A Kubernetes CPU limit is a CFS quota: the pod may use N cores' worth of time per period
on any of the node's CPUs. tritonlm sizes its compute team from the quota at load and,
while serving, lowers it from the cgroup's own throttling and the compute threads'
run-queue wait (tritonlm/engine/cpu_cores.py). This run checks that a one-core quota
(`cpu.max` 100000 100000, or v1 cpu.cfs_quota_us) serves as well as one core would.

Conditions, each a fresh Python process running the in-process engine:
    quota auto        in a child cgroup with a one-core quota, num_threads auto
    quota N threads   the same quota, num_threads = the host's CPUs (what a count blind to
                      the quota starts: torch's own default)
    affinity auto     affinity cut to one CPU, no quota, num_threads auto
    1 thread          no limit, num_threads 1: the reference for one core's work
Each process builds the engine, runs one warm-up round, then --clients requests at once,
--max-tokens tokens each (greedy, end token ignored), and reports tok/s, the team at load
and at the end, and how often the governor changed it. Conditions take turns (A B C D D C
B A with --rounds 2): a shared host drifts over minutes. The model is a seeded GPT-2 of
--width / --layers (no download) or --hf-dir.

Needs root on a writable cgroup file system (perf/tritonlm_bench/quota_group.py); prints why not
and stops elsewhere.

    .venv/bin/python perf/bench_cpu_quota.py [--clients 8] [--max-tokens 64] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

from tritonlm.paths import REPO_ROOT
from tritonlm.perf.machine import describe_cpu
from tritonlm.perf.report import table
from tritonlm_bench.quota_group import NoQuotaGroup, join_line, quota_group

CHILD = """
    import json, sys, threading, time
    from pathlib import Path
    import torch
    from tritonlm.engine.loader import build_engine
    from tritonlm.engine.request import GenerationRequest, SamplingParams
    from tritonlm.engine.settings import EngineSettings

    repo, threads, clients, max_tokens = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    params = {"task": "generate", "hf_dir": "1/hf"} | ({"num_threads": threads} if threads != "auto" else {})
    engine = build_engine(EngineSettings.from_params(params, repo))
    at_load = torch.get_num_threads()
    engine.start()

    def round_():
        made, done = [0] * clients, [threading.Event() for _ in range(clients)]
        for i in range(clients):
            def on_event(ev, i=i):
                made[i] += len(ev.token_ids)
                if ev.finished:
                    done[i].set()
            params = SamplingParams(max_tokens=max_tokens, end_id=-1)
            engine.submit(GenerationRequest(list(range(5, 5 + 32 + i)), params, on_event))
        t0 = time.perf_counter()
        for d in done:
            d.wait()
        return sum(made) / (time.perf_counter() - t0)

    round_()
    tok_s = round_()
    gov = engine.threads
    engine.shutdown()
    print(json.dumps({"tok_s": tok_s, "at_load": at_load, "at_end": gov.current if gov else at_load,
                      "changes": gov.changes if gov else 0}))
"""


def build_model(folder: Path, width: int, layers: int, hf_dir: str | None) -> None:
    """folder/1/hf: a link to --hf-dir, or a seeded GPT-2 with the built-in tokenizer."""
    target = folder / "1" / "hf"
    target.parent.mkdir(parents=True)
    if hf_dir:
        target.symlink_to(Path(hf_dir).resolve())
        return
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from tritonlm.models.builtin import tiny_tokenizer

    tok = tiny_tokenizer()
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(tok), n_positions=512, n_embd=width, n_layer=layers, n_head=max(1, width // 64),
                        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    GPT2LMHeadModel(config).eval().save_pretrained(target)
    tok.save_pretrained(target)


def run(repo: Path, threads: str, args, procs: Path | None = None, cpu: int | None = None) -> dict:
    script = (join_line(procs) if procs else "") + textwrap.dedent(CHILD)
    # a child takes its parent's affinity at start: preexec_fn sets it in the child alone
    preexec = (lambda: os.sched_setaffinity(0, {cpu})) if cpu is not None else None
    out = subprocess.run([sys.executable, "-c", script, str(repo), threads, str(args.clients), str(args.max_tokens)],
                         cwd=REPO_ROOT, capture_output=True, text=True, preexec_fn=preexec)
    if out.returncode:
        raise SystemExit(f"{threads} threads: the child failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2, help="each condition runs this many times, order alternating")
    ap.add_argument("--width", type=int, default=576)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--hf-dir", help="a Hugging Face model folder instead of the seeded GPT-2")
    args = ap.parse_args()

    host_cpus = len(os.sched_getaffinity(0))
    one = min(os.sched_getaffinity(0))
    names = ["quota auto", f"quota {host_cpus} threads", "affinity auto", "1 thread"]
    runs: dict[str, list[dict]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp)
        build_model(repo, args.width, args.layers, args.hf_dir)
        try:
            with quota_group(100_000) as procs:
                conditions = {
                    names[0]: lambda: run(repo, "auto", args, procs=procs),
                    names[1]: lambda: run(repo, str(host_cpus), args, procs=procs),
                    names[2]: lambda: run(repo, "auto", args, cpu=one),
                    names[3]: lambda: run(repo, "1", args),
                }
                for r in range(args.rounds):
                    for name in (names if r % 2 == 0 else names[::-1]):
                        runs[name].append(conditions[name]())
                        print(f"  {name}: {runs[name][-1]}", file=sys.stderr, flush=True)
        except NoQuotaGroup as e:
            print(f"no quota to run under: {e}")
            return 1
    reference = statistics.mean(x["tok_s"] for x in runs["1 thread"])
    rows = []
    for name in names:
        tok_s = [x["tok_s"] for x in runs[name]]
        rows.append({"condition": name, "tok/s": round(statistics.mean(tok_s), 1),
                     "runs": " / ".join(f"{t:.0f}" for t in tok_s),
                     "x 1 thread": round(statistics.mean(tok_s) / reference, 2),
                     "threads at load": runs[name][-1]["at_load"], "at end": runs[name][-1]["at_end"],
                     "changes": " / ".join(str(x["changes"]) for x in runs[name])})
    model = args.hf_dir or f"seeded GPT-2 {args.layers} x {args.width}"
    print(f"{describe_cpu()}\n{model}, float32, {args.clients} requests x {args.max_tokens} tokens at once, "
          f"one-core quota = cpu.max 100000 100000 (v1: cfs_quota_us)")
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
