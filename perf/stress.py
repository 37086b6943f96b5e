"""Stress: `tritonlm serve` at the highest request rate this host sustains, with the faults
clients cause, for a long time; the server must not crash once.

The script starts `tritonlm serve` (one tiny-gpt2 generation model, seeded weights, no
download; its supervisor restarts tritonserver after any fault, and counts it) and runs
--max-clients gRPC clients for --duration seconds. Each client sends one request after
another, each on its own decoupled stream (perf/tritonlm_bench/traffic.py): short prompts and
outputs, half streamed, --cancel-fraction (a third) cancelled by the client mid-stream,
--bad-fraction refused by name. The number of clients sending changes every --phase
seconds (1 to 64), and every --disconnect-every seconds a separate client process opens a
stream and is SIGKILLed once tokens flow (its TCP connection dies without a cancel).

Reported: requests served, tritonserver crashes (faults the supervisor saw, restarts it
counted, tritonserver pid changes; goal 0), errors by kind (goal: no unexpected one), the
server's RSS and KV cache in use at the start (after --warmup) and at the end, both idle,
and p99 TTFT per minute.

    .venv/bin/python perf/stress.py [--duration 600] [--max-clients 64]

Writes results/stress/stress_minutes.csv, stress_summary.csv and stress.png.
"""

from __future__ import annotations

import argparse
import csv
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
from tritonclient.grpc import service_pb2_grpc

from tritonlm.perf.machine import describe_cpu
from tritonlm.perf.report import add_out_arg, optional_figure, save_figure
from tritonlm.perf.serverstats import process_tree_rss, wait_idle
from tritonlm.perf.stats import percentile
from tritonlm_bench.benchrepo import tiny_model_repo
from tritonlm_bench.serve_process import ServeProcess
from tritonlm_bench.traffic import ClientPool, make_prompts, minute_rows, outcome_counts, print_minutes

MODEL = "tiny"
CONCURRENCY = (1, 8, 64, 16, 32, 4, 64, 2, 48, 24)  # clients sending, phase after phase

# A client that goes away without a word: streams a long request, says so, then waits to be killed.
ABRUPT_CLIENT = """
import sys, grpc
from tritonclient.grpc import service_pb2_grpc
from tritonlm_bench.rawgrpc import infer_request, raw_tensor
stub = service_pb2_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(sys.argv[1]))
tensors = [raw_tensor("text_input", "BYTES", [b"the city at night"]), raw_tensor("max_tokens", "INT32", [200]),
           raw_tensor("min_tokens", "INT32", [200]), raw_tensor("stream", "BOOL", [True])]
for _ in stub.ModelStreamInfer(iter([infer_request(sys.argv[2], "abrupt", tensors)])):
    print("streaming", flush=True)
    sys.stdin.read()
"""


def abrupt_disconnect(grpc_url: str) -> str:
    """One client process that streams, then dies by SIGKILL mid-stream. Its outcome."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    p = subprocess.Popen([sys.executable, "-c", ABRUPT_CLIENT, grpc_url, MODEL], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    first = p.stdout.readline()
    p.kill()
    p.wait()
    return "killed mid-stream" if first.startswith("streaming") else f"never streamed: {first.strip()[:80]}"


def clients_in_minute(phases: list[tuple[float, int]], minute: int) -> str:
    """The numbers of clients sending during a minute: the phase it began in, then any later."""
    start, end = 60.0 * (minute - 1), 60.0 * minute
    before = [n for t, n in phases if t <= start]
    inside = [n for t, n in phases if start < t < end]
    return ",".join(str(n) for n in before[-1:] + inside)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of load in all, warm-up included")
    ap.add_argument("--warmup", type=float, default=120.0,
                    help="seconds of load before the starting RSS is measured (120: the phases up to 64 clients are in it)")
    ap.add_argument("--max-clients", type=int, default=64)
    ap.add_argument("--phase", type=float, default=30.0, help="seconds between changes of the number of clients sending")
    ap.add_argument("--cancel-fraction", type=float, default=1 / 3)
    ap.add_argument("--bad-fraction", type=float, default=0.02)
    ap.add_argument("--disconnect-every", type=float, default=30.0)
    ap.add_argument("--seed", type=int, default=1)
    add_out_arg(ap, "stress")
    args = ap.parse_args()
    warmup = min(args.warmup, args.duration / 4)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    _, tok = tiny_model_repo(out / "repo", MODEL)
    make_prompts(tok, seed=args.seed)
    serve = ServeProcess(out / "repo", "--log-file", str(out / "tritonserver.log"), "--max-restarts", "100")
    phases: list[tuple[float, int]] = []
    disconnects: list[str] = []
    pids: set[int] = set()
    try:
        serve.wait_ready()
        pids.add(serve.tritonserver_pid())
        channel = grpc.insecure_channel(f"127.0.0.1:{serve.grpc}")
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        pool = ClientPool(stub, MODEL, args.max_clients, args.seed, args.cancel_fraction, args.bad_fraction,
                          stream_fraction=0.5)
        records = pool.records
        pool.allowed = 1

        def quiesce() -> tuple[int, dict]:
            pool.pause()
            g, _ = wait_idle(serve.metrics_url, MODEL)
            time.sleep(1.0)
            rss, _ = process_tree_rss(serve.tritonserver_pid())
            return rss, g

        pool.start()
        t_zero = pool.t_zero
        print(f"up to {args.max_clients} clients for {args.duration:.0f} s (warm-up {warmup:.0f} s), "
              f"{args.cancel_fraction:.0%} cancelled, an abrupt disconnect every {args.disconnect_every:g} s ...", flush=True)
        rng = random.Random(args.seed)
        phase_i = 0
        next_phase = next_disconnect = time.perf_counter()
        end_at = t_zero + args.duration
        rss_start = g_start = None
        while time.perf_counter() < end_at:
            now = time.perf_counter()
            if rss_start is None and now - t_zero >= warmup:
                rss_start, g_start = quiesce()
                print(f"after warm-up ({len(records)} requests): RSS {rss_start / 2**20:.1f} MiB; {g_start}", flush=True)
                pool.resume()
            if now >= next_phase:
                pool.allowed = min(args.max_clients, CONCURRENCY[phase_i % len(CONCURRENCY)])
                phases.append((now - t_zero, pool.allowed))
                phase_i += 1
                next_phase += args.phase
            if now >= next_disconnect:
                next_disconnect += args.disconnect_every * rng.uniform(0.9, 1.1)
                threading.Thread(target=lambda: disconnects.append(abrupt_disconnect(f"127.0.0.1:{serve.grpc}")),
                                 daemon=True).start()
            pid = serve.tritonserver_pid()
            if pid is not None:
                pids.add(pid)
            if serve.proc.poll() is not None:
                print("tritonlm serve exited:\n" + "".join(serve.lines[-20:]), flush=True)
                break
            time.sleep(0.5)
        rss_end, g_end = quiesce()
        pool.finish()
        restarts = sum(serve.restarts().values())
        faults = serve.faults()
        channel.close()
    finally:
        serve.stop()

    # ---- report ----
    outcomes, bad_kinds, unexpected = outcome_counts(records)
    rows = minute_rows(records)
    per_minute_clients = {r["minute"]: clients_in_minute(phases, r["minute"]) for r in rows}
    crashes = len(faults) + (len(pids) - 1)
    all_ttft = [r.ttft for r in records if r.ttft is not None and r.outcome == "completed"]
    served = outcomes.get("completed", 0) + outcomes.get("cancelled", 0)
    summary = [
        ("duration_s", f"{args.duration:.0f}"),
        ("max_clients", args.max_clients),
        ("requests", len(records)),
        ("requests_per_s", f"{len(records) / args.duration:.1f}"),
        ("served (completed + cancelled)", served),
        ("completed", outcomes.get("completed", 0)),
        ("cancelled_by_client", outcomes.get("cancelled", 0)),
        ("refused_expected", outcomes.get("refused (expected)", 0)),
        ("unexpected", sum(unexpected.values())),
        ("abrupt_disconnects", f"{sum(d == 'killed mid-stream' for d in disconnects)} of {len(disconnects)}"),
        ("tritonserver_crashes", crashes),
        ("supervisor_restarts", f"{restarts:g}"),
        ("ttft_p50_ms", f"{1000 * percentile(all_ttft, 50):.1f}"),
        ("ttft_p99_ms", f"{1000 * percentile(all_ttft, 99):.1f}"),
        ("rss_start_mib", f"{(rss_start or 0) / 2**20:.1f}"),
        ("rss_end_mib", f"{rss_end / 2**20:.1f}"),
        ("kv_cache_used_bytes_start", (g_start or {}).get("kv_cache_used_bytes")),
        ("kv_cache_used_bytes_end", g_end.get("kv_cache_used_bytes")),
        ("requests_running_end", g_end.get("requests_running")),
        ("requests_waiting_end", g_end.get("requests_waiting")),
    ]
    print()
    print(f"CPU: {describe_cpu()}")
    print(f"stress: 1-{args.max_clients} clients, {args.duration:.0f} s, tiny-gpt2 (seeded), through tritonlm serve")
    print_minutes(rows, per_minute_clients, "clients")
    print()
    for key, value in summary:
        print(f"  {key:<32} {value}")
    print("  expected refusals by kind: " + (", ".join(f"{k} {v}" for k, v in sorted(bad_kinds.items())) or "none"))
    print("  unexpected by kind: " + (", ".join(f"{k} {v}" for k, v in sorted(unexpected.items())) or "none"))
    print("  faults: " + ("; ".join(faults) or "none"))
    odd = [d for d in disconnects if d != "killed mid-stream"]
    if odd:
        print("  abrupt clients that never streamed: " + "; ".join(odd[:5]))
    print(f"  goals: tritonserver crashes {crashes} ({'ok' if crashes == 0 else 'NOT 0'}); "
          f"unexpected errors {sum(unexpected.values())} ({'ok' if not unexpected else 'NOT 0'}); "
          f"KV at end {g_end.get('kv_cache_used_bytes')} ({'ok' if g_end.get('kv_cache_used_bytes') == 0 else 'NOT 0'})")

    with open(out / "stress_minutes.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=(list(rows[0]) if rows else ["minute"]) + ["clients"])
        w.writeheader()
        for row in rows:
            w.writerow({**{k: (f"{v:.2f}" if isinstance(v, float) else v) for k, v in row.items()},
                        "clients": per_minute_clients.get(row["minute"], "")})
    with open(out / "stress_summary.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["key", "value"])
        w.writerows(summary)
        for k, v in sorted(unexpected.items()):
            w.writerow([k, v])
    drawn = optional_figure(1, 1, figsize=(7, 3.5))
    if drawn:
        fig, ax = drawn
        ax.plot([r["minute"] for r in rows], [r["ttft_p99_ms"] for r in rows], marker="o", label="TTFT p99")
        ax.plot([r["minute"] for r in rows], [r["ttft_p50_ms"] for r in rows], marker=".", label="TTFT p50")
        ax.set_xlabel("minute")
        ax.set_ylabel("ms")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
        ax.set_title(f"stress: 1-{args.max_clients} clients, {len(records)} requests, {crashes} crashes", fontsize=9)
        save_figure(fig, out / "stress.png", dpi=120)
    print(f"\nwrote {out / 'stress_minutes.csv'}, {out / 'stress_summary.csv'}")
    return 0 if crashes == 0 and not unexpected and g_end.get("kv_cache_used_bytes") == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
