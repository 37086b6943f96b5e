"""Benchmark: tritonlm and llama-server on a CPU they do not have to themselves, in one run.

Conditions, each on the same host in this run:
    quiet     nothing else running
    busy      another process (`python -c "while True: pass"`, its own session) spins on the
              last core of the host for the whole phase
    one-core  the server's affinity cut to one core (taskset-like), a stand-in for a CPU quota
Servers, at their defaults unless named:
    tritonlm                   num_threads auto (the default)
    tritonlm num_threads=N     fixed by hand: N = the host's cores (the old default: torch's own
                               count, no adapting) in the quiet condition, 1 under load
    llama-server -t N / -t 1   its default thread count (the host's cores) and one thread
tritonlm's two servers of a condition are up together and take turns at each level (A B B
A with --rounds 2; a row is the mean, `runs` lists each): a shared host drifts over minutes.
Workload: SmolLM2-135M-Instruct in float32 (--dtype int8: tritonlm's int8; llama-server: the F32 GGUF of the same weights,
perf/bench_peer.py says how they are made), 1 / 8 / 32 streaming clients, --requests
requests each back to back, --max-tokens new tokens, greedy, end token ignored. A run that
is not done within --run-timeout seconds is stopped and reported as not done.

Reported: output tok/s and TTFT p50 per (condition, server, clients), and the ratio to the
same server's quiet figure; CSV and PNG under results/bench_shared_cpu/. The goals (issue
text in docs/benchmarks.md): with one core busy at least 0.45x quiet and at least
llama-server's best -t; with one core at least 0.9x of num_threads 1; quiet at least 0.97x
of the old default.

    .venv/bin/python perf/bench_shared_cpu.py [--concurrency 1,8,32] [--requests 2] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import statistics
import subprocess
import sys
import threading
from pathlib import Path

from tritonlm.paths import REPO_ROOT
from tritonlm.perf.machine import describe_cpu
from tritonlm.perf.report import add_out_arg, pyplot, save_figure, style_axes, table, write_csv
from tritonlm_bench.benchrepo import link_generation_model
from tritonlm_bench.llamacpp import (
    PEER_SLOTS,
    PROMPTS,
    SLOT_CONTEXT,
    LlamaServer,
    ensure_gguf,
    ensure_llama_cpp,
    llama_stream,
    prompt_index,
)
from tritonlm_bench.streaming import closed_loop, summarize_streams, triton_sse_stream

MODEL = "smollm2"
CONDITIONS = ("quiet", "busy", "one-core")


@contextlib.contextmanager
def neighbour(condition: str):
    """The busy condition's spinning process, pinned to the last core, for the block."""
    if condition != "busy":
        yield
        return
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
    try:
        os.sched_setaffinity(proc.pid, {max(os.sched_getaffinity(0))})
        yield
    finally:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def spawn_affinity(condition: str):
    """Processes started in the block (the server) inherit one core in the one-core condition:
    a child takes the affinity of the thread that forks it."""
    if condition != "one-core":
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(before)})
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def run_level(one_request, clients: int, per_client: int, stop_server, timeout_s: float) -> dict:
    """One closed-loop phase; a phase past timeout_s has its server stopped (its streams fail)."""
    fired = threading.Event()

    def give_up() -> None:
        fired.set()  # before the stop: streams cut by it end early, but not as finished runs
        stop_server()

    timer = threading.Timer(timeout_s, give_up)
    timer.start()
    try:
        run = closed_loop(lambda conn, c, k: one_request(prompt_index(c, k, clients)), clients,
                          requests_per_client=per_client)
    finally:
        timer.cancel()
    timed_out = fired.is_set()
    if timed_out or run.errors:
        why = f"not done in {timeout_s:.0f} s" if timed_out else f"{len(run.errors)} failed: {run.errors[0]}"
        return {"tokens_per_s": float("nan"), "ttft_p50_ms": float("nan"), "note": why}
    s = summarize_streams(run.records, run.wall_s)
    return {"tokens_per_s": s["tokens_per_s"], "ttft_p50_ms": s["ttft_p50_ms"], "note": ""}


def tritonlm_runs(args, hf: Path, out: Path, condition: str, variants: list[str], levels: list[int]) -> list[dict]:
    """tritonlm with each num_threads in `variants`, one server each, all up at once; at each
    level the variants take turns, A B B A for --rounds 2, and a row is their mean: a shared
    host drifts over minutes, which back-to-back servers would read as a difference."""
    from tritonlm.server import TritonServer, free_ports

    servers: dict[str, TritonServer] = {}
    rows = []
    try:
        for threads in variants:
            repo = out / f"repo-{threads}"
            link_generation_model(repo, MODEL, hf, SLOT_CONTEXT, dtype=args.dtype, num_threads=threads,
                                  enable_prefix_caching="false", max_num_seqs=str(PEER_SLOTS))
            with spawn_affinity(condition):
                servers[threads] = TritonServer(repo, *free_ports(3), log_path=out / f"tritonserver-{condition}-{threads}.log")
                servers[threads].start(timeout_s=900)
            triton_sse_stream(servers[threads].http_url, MODEL, PROMPTS[0], 8)  # warm-up
        order = [v for r in range(args.rounds) for v in (variants if r % 2 == 0 else variants[::-1])]
        with neighbour(condition):
            for c in levels:
                runs: dict[str, list[dict]] = {v: [] for v in variants}
                for threads in order:
                    name = "tritonlm" if threads == "auto" else f"tritonlm num_threads={threads}"
                    print(f"[{condition}] {name}: {c} clients ...", flush=True)
                    url = servers[threads].http_url
                    runs[threads].append(run_level(lambda i: triton_sse_stream(url, MODEL, PROMPTS[i], args.max_tokens), c,
                                                   args.requests, servers[threads].stop, args.run_timeout))
                for threads, got in runs.items():
                    name = "tritonlm" if threads == "auto" else f"tritonlm num_threads={threads}"
                    note = "; ".join(r["note"] for r in got if r["note"])
                    rows.append({"condition": condition, "server": name, "clients": c,
                                 "tokens_per_s": statistics.mean(r["tokens_per_s"] for r in got),
                                 "ttft_p50_ms": statistics.mean(r["ttft_p50_ms"] for r in got), "note": note,
                                 "runs": " ".join(f"{r['tokens_per_s']:.1f}" for r in got)})
                if any(r["note"] for r in rows[-len(variants):]):
                    break
    finally:
        for server in servers.values():
            server.stop()
    return rows


def llama_runs(args, gguf: Path, out: Path, condition: str, threads: int, levels: list[int]) -> list[dict]:
    from tritonlm.server import free_ports

    name = f"llama-server -t {threads}"
    rows = []
    with spawn_affinity(condition):
        server = LlamaServer(gguf, free_ports(1)[0], threads, out / f"llama-{condition}-{threads}.log").start()
    try:
        ids = args.prompt_ids
        llama_stream(server.port, ids[0], 8)  # warm-up
        with neighbour(condition):
            for c in levels:
                print(f"[{condition}] {name}: {c} clients ...", flush=True)
                r = run_level(lambda i: llama_stream(server.port, ids[i], args.max_tokens), c, args.requests,
                              server.stop, args.run_timeout)
                rows.append({"condition": condition, "server": name, "clients": c, **r})
                if r["note"]:
                    break
    finally:
        server.stop()
    return rows


def add_ratios(rows: list[dict]) -> None:
    """vs_quiet: tok/s over the same server's quiet tok/s at the same clients (num_threads=1
    rows against tritonlm's quiet figure: what the default would have given)."""
    quiet = {(r["server"], r["clients"]): r["tokens_per_s"] for r in rows if r["condition"] == "quiet"}
    for r in rows:
        base = quiet.get((r["server"], r["clients"])) or quiet.get(("tritonlm", r["clients"]))
        r["vs_quiet"] = r["tokens_per_s"] / base if base else float("nan")


def goals(rows: list[dict], levels: list[int]) -> list[str]:
    def tps(cond: str, server: str, c: int) -> float:
        return next((r["tokens_per_s"] for r in rows if (r["condition"], r["server"], r["clients"]) == (cond, server, c)),
                    float("nan"))

    lines = []
    cores = len(os.sched_getaffinity(0))
    for c in [c for c in levels if c >= 8]:
        busy, quiet = tps("busy", "tritonlm", c), tps("quiet", "tritonlm", c)
        llama_best = max((r["tokens_per_s"] for r in rows if r["condition"] == "busy" and r["clients"] == c
                          and r["server"].startswith("llama") and r["tokens_per_s"] == r["tokens_per_s"]), default=0.0)
        one, by_hand = tps("one-core", "tritonlm", c), tps("one-core", "tritonlm num_threads=1", c)
        old = tps("quiet", f"tritonlm num_threads={cores}", c)
        lines += [
            f"{c} clients: busy / quiet {busy / quiet:.2f} (goal >= 0.45); busy vs llama-server's best -t "
            f"{busy / llama_best if llama_best else float('nan'):.2f} (goal >= 1.0)",
            f"{c} clients: one core, auto / num_threads=1 {one / by_hand:.2f} (goal >= 0.9); "
            f"quiet, auto / num_threads={cores} {quiet / old:.2f} (goal >= 0.97)",
        ]
    return lines


def plot(path: Path, rows: list[dict], cpu: str) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, len(CONDITIONS), figsize=(15, 4.5), sharey=True)
    for ax, cond in zip(axes, CONDITIONS):
        for server in sorted({r["server"] for r in rows}):
            pts = [(r["clients"], r["tokens_per_s"]) for r in rows if r["condition"] == cond and r["server"] == server]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=server)
        style_axes(ax, "streaming clients", "output tok/s", cond, legend_size=8 if ax.get_lines() else None)
        ax.set_xscale("log", base=2)
    fig.suptitle(f"SmolLM2-135M on a shared CPU: {cpu}", fontsize=9)
    save_figure(fig, path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_out_arg(ap, "bench_shared_cpu")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--requests", type=int, default=2, help="requests per client, back to back")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--run-timeout", type=float, default=240.0, help="seconds before a phase counts as not done")
    ap.add_argument("--conditions", default=",".join(CONDITIONS))
    ap.add_argument("--rounds", type=int, default=2, help="runs of each tritonlm variant per level, taking turns")
    ap.add_argument("--no-llama", action="store_true", help="tritonlm's rows only")
    ap.add_argument("--dtype", default="float32", help="tritonlm's dtype (llama-server: F32 whatever this is)")
    ap.add_argument("--build-jobs", type=int, default=2)
    args = ap.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    conditions = [c for c in args.conditions.split(",") if c]
    if max(levels) > PEER_SLOTS:
        ap.error(f"at most {PEER_SLOTS} clients")
    signal.signal(signal.SIGTERM, lambda s, f: (_ for _ in ()).throw(KeyboardInterrupt(f"signal {s}")))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cores = len(os.sched_getaffinity(0))

    from tritonlm.engine.tokenizer import load_tokenizer
    from tritonlm.models.loading import load_model

    hf = REPO_ROOT / ".cache" / "bench_peer" / "smollm2-135m-hf"
    if not (hf / "config.json").is_file():
        model, tok, _ = load_model("smollm2-135m", progress=lambda *a, **k: None)
        model.save_pretrained(hf)
        tok.save_pretrained(hf)
        del model
    tokenizer = load_tokenizer(hf)
    args.prompt_ids = [list(tokenizer(p).input_ids) for p in PROMPTS]
    gguf = None
    if not args.no_llama:
        ensure_llama_cpp(args.build_jobs)
        gguf = ensure_gguf("F32")
    cpu = describe_cpu()
    print(f"CPU: {cpu}; {cores} cores; tritonlm {args.dtype}; {levels} clients x {args.requests} x "
          f"{args.max_tokens} tokens", flush=True)

    rows: list[dict] = []
    for cond in conditions:
        rows += tritonlm_runs(args, hf, out, cond, ["auto", str(cores) if cond == "quiet" else "1"], levels)
        if gguf is not None:
            for t in sorted({cores, 1}, reverse=True):
                rows += llama_runs(args, gguf, out, cond, t, levels)
    add_ratios(rows)
    cols = ["condition", "server", "clients", "tokens_per_s", "ttft_p50_ms", "vs_quiet", "runs", "note"]
    print(f"\nCPU: {cpu}")
    print(table(rows, cols))
    for line in goals(rows, levels):
        print(line)
    write_csv(out / "bench_shared_cpu.csv", [{c: r.get(c, "") for c in cols} for r in rows])
    plot(out / "bench_shared_cpu.png", rows, cpu)
    return 0


if __name__ == "__main__":
    sys.exit(main())
