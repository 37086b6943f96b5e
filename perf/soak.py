"""Soak: 32 concurrent clients against one tiny-gpt2 generation model for a long time.

The script starts its own tritonserver (one tiny-gpt2 model, seeded random weights, no
download) and runs --clients gRPC clients for --duration seconds. Each client sends one
request after another, each on its own decoupled stream:

  * mixed prompt lengths (1 to ~120 tokens) and max_tokens (4 to 128), streamed or not,
    greedy or sampled;
  * about --cancel-fraction (5%) of them are streamed and cancelled by the client mid-stream
    (after 1 to 8 streamed responses);
  * about --bad-fraction (5%) are bad requests (invalid values, unknown or mistyped inputs),
    each of which must be refused with an error naming the input.

The first minute (--warmup) is a warm-up: at its end the clients pause, the server goes
idle and its resident memory is measured (tritonserver plus its Python backend stub
processes, summed); at the end the same again. Reported: requests completed, errors by
kind (expected refusals vs unexpected), RSS at start and end (goal: growth < 2%), the
KV cache and request gauges at the end (goal: 0), and p99 time to first token per minute.

    .venv/bin/python perf/soak.py [--duration 600] [--clients 32]

Writes results/soak/soak_minutes.csv (per minute), soak_summary.csv, soak_rss.csv and
soak.png (when matplotlib is installed).
"""

from __future__ import annotations

import argparse
import csv
import sys
import time
from pathlib import Path

import grpc
from tritonclient.grpc import service_pb2_grpc

from tritonlm.perf.machine import describe_cpu
from tritonlm.perf.report import add_out_arg, optional_figure, save_figure
from tritonlm.perf.serverstats import process_tree_rss, wait_idle
from tritonlm.perf.stats import percentile
from tritonlm.server import TritonServer, free_ports
from tritonlm_bench.benchrepo import tiny_model_repo
from tritonlm_bench.traffic import ClientPool, make_prompts, minute_rows, outcome_counts, print_minutes

MODEL = "tiny"
# ---- the run ---------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of load in all, warm-up included")
    ap.add_argument("--warmup", type=float, default=60.0, help="seconds of load before the starting RSS is measured")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--cancel-fraction", type=float, default=0.05)
    ap.add_argument("--bad-fraction", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--rss-every", type=float, default=10.0, help="seconds between RSS samples under load")
    add_out_arg(ap, "soak")
    args = ap.parse_args()
    warmup = min(args.warmup, args.duration / 4)
    out = Path(args.out)
    _, tok = tiny_model_repo(out / "repo", MODEL)
    make_prompts(tok, seed=args.seed)
    server = TritonServer(out / "repo", *free_ports(3), log_path=out / "tritonserver.log")
    server.start(timeout_s=300)
    rss_samples: list[tuple[float, int, int]] = []
    try:
        channel = grpc.insecure_channel(server.grpc_url)
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        pool = ClientPool(stub, MODEL, args.clients, args.seed, args.cancel_fraction, args.bad_fraction)
        records = pool.records

        def quiesce() -> tuple[int, int, dict, float]:
            """Pause the clients, let the server go idle, measure its memory."""
            pool.pause()
            g, waited = wait_idle(server.metrics_url, MODEL)
            time.sleep(1.0)  # a last metrics refresh, freed memory returned
            rss, procs = process_tree_rss(server.process.pid)
            return rss, procs, g, waited

        pool.start()
        t_zero = pool.t_zero
        print(f"{args.clients} clients for {args.duration:.0f} s (warm-up {warmup:.0f} s) against {MODEL} on {server.grpc_url} ...",
              flush=True)
        time.sleep(warmup)
        rss_start, procs_start, g_start, _ = quiesce()
        t_start = time.perf_counter() - t_zero
        print(f"after warm-up ({len(records)} requests): RSS {rss_start / 2**20:.1f} MiB over {procs_start} processes; {g_start}",
              flush=True)
        pool.resume()
        next_sample = time.perf_counter() + args.rss_every
        end_at = t_zero + args.duration
        while time.perf_counter() < end_at:
            time.sleep(min(1.0, max(0.0, end_at - time.perf_counter())))
            if time.perf_counter() >= next_sample:
                rss, procs = process_tree_rss(server.process.pid)
                rss_samples.append((time.perf_counter() - t_zero, rss, procs))
                next_sample += args.rss_every
                if server.process.poll() is not None:
                    raise SystemExit(f"tritonserver exited with code {server.process.returncode}")
        rss_end, procs_end, g_end, idle_wait = quiesce()
        t_end = time.perf_counter() - t_zero
        pool.finish()
        live = server.is_ready() and server.process.poll() is None
        channel.close()
    finally:
        server.stop()

    # ---- report ----
    outcomes, bad_kinds, unexpected = outcome_counts(records)
    rows = minute_rows(records)
    growth = (rss_end - rss_start) / rss_start if rss_start else float("nan")
    all_ttft = [r.ttft for r in records if r.ttft is not None and r.outcome == "completed"]
    summary = [
        ("duration_s", f"{args.duration:.0f}"),
        ("clients", args.clients),
        ("requests", len(records)),
        ("completed", outcomes.get("completed", 0)),
        ("cancelled_by_client", outcomes.get("cancelled", 0)),
        ("refused_expected", outcomes.get("refused (expected)", 0)),
        ("unexpected", sum(unexpected.values())),
        ("ttft_p50_ms", f"{1000 * percentile(all_ttft, 50):.1f}"),
        ("ttft_p99_ms", f"{1000 * percentile(all_ttft, 99):.1f}"),
        ("rss_start_mib", f"{rss_start / 2**20:.1f}"),
        ("rss_start_at_s", f"{t_start:.0f}"),
        ("rss_end_mib", f"{rss_end / 2**20:.1f}"),
        ("rss_end_at_s", f"{t_end:.0f}"),
        ("rss_growth_pct", f"{100 * growth:+.2f}"),
        ("processes", f"{procs_start} -> {procs_end}"),
        ("kv_cache_used_bytes_end", g_end.get("kv_cache_used_bytes")),
        ("requests_running_end", g_end.get("requests_running")),
        ("requests_waiting_end", g_end.get("requests_waiting")),
        ("idle_after_s", f"{idle_wait:.1f}"),
        ("server_ready_at_end", live),
    ]
    print()
    print(f"CPU: {describe_cpu()}")
    print(f"soak: {args.clients} clients, {args.duration:.0f} s, tiny-gpt2 (seeded), server started by the script")
    print_minutes(rows)
    print()
    for key, value in summary:
        print(f"  {key:<26} {value}")
    print("  expected refusals by kind: " + ", ".join(f"{k} {v}" for k, v in sorted(bad_kinds.items())))
    print("  unexpected by kind: " + (", ".join(f"{k} {v}" for k, v in sorted(unexpected.items())) or "none"))
    verdict = [
        f"RSS growth {100 * growth:+.2f}% ({'<' if growth < 0.02 else 'NOT <'} 2%)",
        f"KV at end {g_end.get('kv_cache_used_bytes')} ({'ok' if g_end.get('kv_cache_used_bytes') == 0 else 'NOT 0'})",
        f"unexpected errors {sum(unexpected.values())}",
    ]
    print("  goals: " + "; ".join(verdict))

    out.mkdir(parents=True, exist_ok=True)
    with open(out / "soak_minutes.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["minute"])
        w.writeheader()
        for row in rows:
            w.writerow({k: (f"{v:.2f}" if isinstance(v, float) else v) for k, v in row.items()})
    with open(out / "soak_summary.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["key", "value"])
        w.writerows(summary)
        for k, v in sorted(bad_kinds.items()):
            w.writerow([f"refused_expected: {k}", v])
        for k, v in sorted(unexpected.items()):
            w.writerow([k, v])
    with open(out / "soak_rss.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["t_s", "rss_mib", "processes", "when"])
        w.writerow([f"{t_start:.1f}", f"{rss_start / 2**20:.2f}", procs_start, "start (idle, after warm-up)"])
        for t, rss, procs in rss_samples:
            w.writerow([f"{t:.1f}", f"{rss / 2**20:.2f}", procs, "under load"])
        w.writerow([f"{t_end:.1f}", f"{rss_end / 2**20:.2f}", procs_end, "end (idle)"])
    drawn = optional_figure(2, 1, figsize=(7, 6), sharex=True)
    if drawn:
        fig, (ax1, ax2) = drawn
        ax1.plot([r["minute"] for r in rows], [r["ttft_p99_ms"] for r in rows], marker="o", label="TTFT p99")
        ax1.plot([r["minute"] for r in rows], [r["ttft_p50_ms"] for r in rows], marker=".", label="TTFT p50")
        ax1.set_ylabel("ms")
        ax1.set_ylim(bottom=0)
        ax1.legend(fontsize=8)
        ax1.set_title(f"soak: {args.clients} clients, {args.duration:.0f} s; RSS growth {100 * growth:+.2f}%", fontsize=9)
        ax2.plot([t / 60 for t, _, _ in rss_samples], [rss / 2**20 for _, rss, _ in rss_samples], marker=".", label="under load")
        ax2.plot([t_start / 60, t_end / 60], [rss_start / 2**20, rss_end / 2**20], "s", color="tab:red", label="idle: start / end")
        ax2.set_xlabel("minute")
        ax2.set_ylabel("server RSS (all processes), MiB")
        ax2.legend(fontsize=8)
        save_figure(fig, out / "soak.png", dpi=120)
    print(f"\nwrote {out / 'soak_minutes.csv'}, {out / 'soak_summary.csv'}, {out / 'soak_rss.csv'}")
    return 0 if not unexpected and g_end.get("kv_cache_used_bytes") == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
