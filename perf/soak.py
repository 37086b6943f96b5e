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
import random
import re
import sys
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

import grpc
from tritonclient.grpc import service_pb2_grpc

from tritonlm.perf.benchrepo import tiny_model_repo
from tritonlm.perf.machine import describe_cpu
from tritonlm.perf.rawgrpc import RawTensor, infer_request, is_final, output_int, raw_tensor
from tritonlm.perf.report import add_out_arg, optional_figure, save_figure
from tritonlm.perf.serverstats import process_tree_rss, wait_idle
from tritonlm.perf.stats import percentile
from tritonlm.server import TritonServer, free_ports

MODEL = "tiny"
WORDS = ("the a city river old new small robot wanted to see how far it could go before night fell "
         "and every light in town came on one by one while people walked home 1 2 3 café naïve 你好").split()
REQUEST_TIMEOUT_S = 120.0  # a stream still open after this is a hung request


# ---- requests ------------------------------------------------------------------------------------


PROMPT_TOKENS = (1, 4, 16, 32, 64, 96)  # + max_tokens (at most 128) stays within tiny-gpt2's 256 positions
PROMPTS: dict[int, list[bytes]] = {}


def make_prompts(tok, per_length: int = 16, seed: int = 0) -> None:
    """A pool of prompts of each length in PROMPT_TOKENS (tokens of the model's own tokenizer)."""
    rng = random.Random(seed)
    for n in PROMPT_TOKENS:
        pool = []
        while len(pool) < per_length:
            ids = tok(" ".join(rng.choice(WORDS) for _ in range(2 * n + 4))).input_ids[:n]
            text = tok.decode(ids, skip_special_tokens=True)
            if text.strip() and len(tok(text).input_ids) <= n + 2:
                pool.append(text.encode())
        PROMPTS[n] = pool


def prompt(rng: random.Random) -> bytes:
    return rng.choice(PROMPTS[rng.choice(PROMPT_TOKENS)])


# (what is wrong, the input its error must name, the tensors)
BAD = [
    ("max_tokens -1", "max_tokens", lambda p: [raw_tensor("text_input", "BYTES", [p]), raw_tensor("max_tokens", "INT32", [-1])]),
    ("temperature NaN", "temperature", lambda p: [raw_tensor("text_input", "BYTES", [p]), raw_tensor("temperature", "FP32", [float("nan")])]),
    ("100 stop words", "stop_words", lambda p: [raw_tensor("text_input", "BYTES", [p]), raw_tensor("stop_words", "BYTES", [b"x"] * 100)]),
    ("invalid UTF-8", "text_input", lambda p: [raw_tensor("text_input", "BYTES", [b"\xff\xfe" + p])]),
    ("empty prompt", "text_input", lambda p: [raw_tensor("text_input", "BYTES", [b""])]),
    ("prompt over the context", "text_input", lambda p: [raw_tensor("text_input", "BYTES", [b"word " * 400])]),
    ("top_p 0", "top_p", lambda p: [raw_tensor("text_input", "BYTES", [p]), raw_tensor("top_p", "FP32", [0.0])]),
    ("unknown input pad_id", "pad_id", lambda p: [raw_tensor("text_input", "BYTES", [p]), raw_tensor("pad_id", "INT32", [0])]),
    ("max_tokens as FP32", "max_tokens", lambda p: [raw_tensor("text_input", "BYTES", [p]), raw_tensor("max_tokens", "FP32", [4.0])]),
    ("max_tokens shape [2]", "max_tokens", lambda p: [raw_tensor("text_input", "BYTES", [p]), raw_tensor("max_tokens", "INT32", [4, 4])]),
    ("no text_input", "text_input", lambda p: [raw_tensor("max_tokens", "INT32", [4])]),
]


@dataclass
class Record:
    kind: str  # "good" | "cancel" | "bad"
    start: float  # seconds since the soak began
    ttft: float | None = None  # streamed requests that got a first token
    end: float = 0.0
    outcome: str = ""  # "completed" | "cancelled" | "refused (expected)" | "unexpected: ..."
    tokens: int = 0


def one_request(stub, rng: random.Random, rid: str, t_zero: float, cancel_fraction: float, bad_fraction: float) -> Record:
    u = rng.random()
    p = prompt(rng)
    if u < bad_fraction:
        what, name, build = rng.choice(BAD)
        rec = Record("bad", time.perf_counter() - t_zero)
        tensors, cancel_after = build(p), None
    else:
        cancel = u < bad_fraction + cancel_fraction
        rec = Record("cancel" if cancel else "good", time.perf_counter() - t_zero)
        stream = cancel or rng.random() < 0.7
        max_tokens = rng.choice([64, 96, 128]) if cancel else rng.choice([4, 8, 16, 32, 64, 128])
        tensors = [raw_tensor("text_input", "BYTES", [p]), raw_tensor("max_tokens", "INT32", [max_tokens]),
                   raw_tensor("stream", "BOOL", [stream]), raw_tensor("end_id", "INT32", [-1])]
        if rng.random() < 0.3:
            tensors += [raw_tensor("temperature", "FP32", [0.8]), raw_tensor("top_k", "INT32", [40]),
                        raw_tensor("seed", "UINT64", [rng.randrange(2**32)])]
        if rng.random() < 0.1:
            tensors.append(raw_tensor("stop_words", "BYTES", [b"robot", b"night"]))
        cancel_after = rng.randint(1, 8) if cancel else None
        what = name = ""
    t0 = time.perf_counter()
    call = stub.ModelStreamInfer(iter([infer_request(MODEL, rid, tensors)]), timeout=REQUEST_TIMEOUT_S)
    responses = finals = 0
    error = None
    try:
        for response in call:
            now = time.perf_counter()
            responses += 1
            if rec.ttft is None and not response.error_message:
                rec.ttft = now - t0
            if response.error_message:
                error = response.error_message
                finals += 1
                continue
            if is_final(response):
                finals += 1
                rec.tokens = output_int(response, "num_output_tokens") or 0
            elif cancel_after is not None and responses >= cancel_after:
                call.cancel()
    except grpc.RpcError as e:
        if cancel_after is not None and e.code() == grpc.StatusCode.CANCELLED and not finals:
            rec.outcome = "cancelled"
        elif e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            rec.outcome = "unexpected: hung stream (no end within the deadline)"
        else:
            rec.outcome = f"unexpected: gRPC {e.code().name}"
    rec.end = time.perf_counter() - t_zero
    if rec.outcome:
        return rec
    if finals != 1:
        rec.outcome = f"unexpected: {finals} final responses"
    elif rec.kind == "bad":
        rec.outcome = ("refused (expected): " + what) if error and name in error else (
            f"unexpected: bad request ({what}) " + (f"refused without naming {name}" if error else "served"))
    elif error:
        rec.outcome = "unexpected: error " + re.sub(r"\d+", "N", error)[:80]
    else:
        rec.outcome = "completed"
    if rec.kind == "bad" or not stream_of(tensors):
        rec.ttft = None  # time to first token: streamed requests only
    return rec


def stream_of(tensors: list[RawTensor]) -> bool:
    return any(t.name == "stream" and t.data == b"\x01" for t in tensors)


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
    records: list[Record] = []
    lock = threading.Lock()
    running = threading.Event()  # set: clients may start new requests
    running.set()
    stop = threading.Event()
    active = [0]
    rss_samples: list[tuple[float, int, int]] = []
    try:
        channel = grpc.insecure_channel(server.grpc_url)
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        t_zero = time.perf_counter()

        def client(c: int) -> None:
            rng = random.Random(args.seed * 1000 + c)
            k = 0
            while not stop.is_set():
                if not running.is_set():
                    running.wait(1.0)
                    continue
                with lock:
                    active[0] += 1
                try:
                    rec = one_request(stub, rng, f"c{c}-{k}", t_zero, args.cancel_fraction, args.bad_fraction)
                finally:
                    with lock:
                        active[0] -= 1
                with lock:
                    records.append(rec)
                k += 1

        def quiesce() -> tuple[int, int, dict, float]:
            """Pause the clients, let the server go idle, measure its memory."""
            running.clear()
            deadline = time.monotonic() + REQUEST_TIMEOUT_S
            while active[0] and time.monotonic() < deadline:
                time.sleep(0.05)
            g, waited = wait_idle(server.metrics_url, MODEL)
            time.sleep(1.0)  # a last metrics refresh, freed memory returned
            rss, procs = process_tree_rss(server.process.pid)
            return rss, procs, g, waited

        threads = [threading.Thread(target=client, args=(c,), daemon=True) for c in range(args.clients)]
        for t in threads:
            t.start()
        print(f"{args.clients} clients for {args.duration:.0f} s (warm-up {warmup:.0f} s) against {MODEL} on {server.grpc_url} ...",
              flush=True)
        time.sleep(warmup)
        rss_start, procs_start, g_start, _ = quiesce()
        t_start = time.perf_counter() - t_zero
        print(f"after warm-up ({len(records)} requests): RSS {rss_start / 2**20:.1f} MiB over {procs_start} processes; {g_start}",
              flush=True)
        running.set()
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
        stop.set()
        running.set()
        for t in threads:
            t.join(timeout=REQUEST_TIMEOUT_S + 10)
        live = server.is_ready() and server.process.poll() is None
        channel.close()
    finally:
        server.stop()

    # ---- report ----
    outcomes = Counter(r.outcome if not r.outcome.startswith("refused (expected)") else "refused (expected)" for r in records)
    bad_kinds = Counter(r.outcome.split(": ", 1)[1] for r in records if r.outcome.startswith("refused (expected)"))
    unexpected = {k: v for k, v in outcomes.items() if k.startswith("unexpected")}
    minutes: dict[int, list[Record]] = defaultdict(list)
    for r in records:
        minutes[int(r.start // 60)].append(r)
    minute_rows = []
    for m in sorted(minutes):
        rs = minutes[m]
        ttfts = [r.ttft for r in rs if r.ttft is not None and r.outcome == "completed"]
        span = min(60.0, max(1e-9, max(r.end for r in rs) - 60 * m))
        minute_rows.append({
            "minute": m + 1,
            "requests": len(rs),
            "completed": sum(r.outcome == "completed" for r in rs),
            "cancelled": sum(r.outcome == "cancelled" for r in rs),
            "refused_expected": sum(r.outcome.startswith("refused (expected)") for r in rs),
            "unexpected": sum(r.outcome.startswith("unexpected") for r in rs),
            "tokens_per_s": sum(r.tokens for r in rs) / span,
            "ttft_n": len(ttfts),
            "ttft_p50_ms": 1000 * percentile(ttfts, 50),
            "ttft_p99_ms": 1000 * percentile(ttfts, 99),
        })
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
    print(f"{'minute':>6} {'requests':>8} {'completed':>9} {'cancelled':>9} {'refused':>7} {'unexpected':>10} "
          f"{'tok/s':>7} {'TTFT p50 ms':>11} {'TTFT p99 ms':>11}")
    for row in minute_rows:
        print(f"{row['minute']:>6} {row['requests']:>8} {row['completed']:>9} {row['cancelled']:>9} {row['refused_expected']:>7} "
              f"{row['unexpected']:>10} {row['tokens_per_s']:>7.0f} {row['ttft_p50_ms']:>11.1f} {row['ttft_p99_ms']:>11.1f}")
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
        w = csv.DictWriter(f, fieldnames=list(minute_rows[0]) if minute_rows else ["minute"])
        w.writeheader()
        for row in minute_rows:
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
        ax1.plot([r["minute"] for r in minute_rows], [r["ttft_p99_ms"] for r in minute_rows], marker="o", label="TTFT p99")
        ax1.plot([r["minute"] for r in minute_rows], [r["ttft_p50_ms"] for r in minute_rows], marker=".", label="TTFT p50")
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
