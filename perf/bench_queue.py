"""Benchmark: does a long waiting queue slow down the requests that are running?

One tiny-gpt2 generation model (seeded random weights, no download) with max_num_seqs 4
and max_queue_size 2000, through the real server. Two phases, alternated --rounds times:

  A  4 streaming requests of --max-tokens tokens, alone;
  B  the same 4, then --queued more submitted behind them while they run. With 4
     running slots the extra requests wait; the 4's inter-token latency is measured
     only while the whole queue is waiting (from the moment the server's
     tritonlm_requests_waiting gauge shows it), until the first of the 4 ends.

Per-token time of a stream = the gap between two of its streamed responses divided by
the tokens the later one carries; both phases report the median and p90 of those gaps
and the ratio B/A (the goal: within 5%). The queued requests are cancelled at the end
(their streams are closed) and the server must return to 0 running / 0 waiting / 0 KV.

    .venv/bin/python perf/bench_queue.py [--queued 1000] [--max-tokens 200] [--rounds 3]

Writes results/bench_queue/bench_queue.csv (one row per phase and round, plus the
summary) and bench_queue.png when matplotlib is installed.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from tritonclient.grpc import service_pb2_grpc

from tritonlm.perf.machine import describe_cpu
from tritonlm.perf.report import add_out_arg, optional_figure, save_figure, style_axes
from tritonlm.perf.serverstats import engine_gauges, is_idle, wait_idle
from tritonlm.perf.stats import percentile
from tritonlm.server import TritonServer, free_ports
from tritonlm_bench.benchrepo import tiny_model_repo
from tritonlm_bench.rawgrpc import infer_request, output_int, raw_tensor

MODEL = "tiny"
PROMPTS = [
    "The history of the city begins",
    "In a quiet village by the sea, an old fisherman",
    "Machine learning systems are deployed",
    "Here is a recipe for bread: first",
]


def gauges(server: TritonServer) -> dict[str, float]:
    return engine_gauges(server.metrics_url, MODEL)


def wait_until_idle(server: TritonServer, timeout_s: float = 120.0) -> None:
    g, _ = wait_idle(server.metrics_url, MODEL, timeout_s)
    if not is_idle(g):
        raise SystemExit(f"the server did not go idle within {timeout_s:.0f} s: {g}")


# ---- requests ------------------------------------------------------------------------------


def request_proto(rid: str, prompt: str, max_tokens: int):
    return infer_request(MODEL, rid, [
        raw_tensor("text_input", "BYTES", [prompt.encode()]),
        raw_tensor("max_tokens", "INT32", [max_tokens]),
        raw_tensor("stream", "BOOL", [True]),
        raw_tensor("end_id", "INT32", [-1]),  # never stop early: every stream is max_tokens long
    ])


@dataclass
class MeasuredStream:
    """One measured streaming request: when each response arrived."""

    rid: str
    times: list[float] = field(default_factory=list)
    num_output_tokens: int = 0
    error: str | None = None
    done: threading.Event = field(default_factory=threading.Event)


def run_stream(stub, stream: MeasuredStream, prompt: str, max_tokens: int) -> None:
    try:
        for response in stub.ModelStreamInfer(iter([request_proto(stream.rid, prompt, max_tokens)]), timeout=600):
            stream.times.append(time.perf_counter())
            if response.error_message:
                stream.error = response.error_message
                continue
            tokens = output_int(response, "num_output_tokens")
            if tokens is not None:
                stream.num_output_tokens = tokens
    except grpc.RpcError as e:
        stream.error = f"{e.code().name}: {e.details()}"
    finally:
        stream.done.set()


class Queued:
    """n requests on a few gRPC streams (one request iterator each); close() cancels them."""

    def __init__(self, stub, n: int, max_tokens: int, streams: int = 8):
        self.calls = []
        self.responses = 0
        self.errors: list[str] = []
        self._lock = threading.Lock()
        self._readers = []
        per = [n // streams + (1 if i < n % streams else 0) for i in range(streams)]
        self._gates = [threading.Event() for _ in per]
        for s, count in enumerate(per):
            protos = [request_proto(f"q{s}-{i}", PROMPTS[(s + i) % len(PROMPTS)], max_tokens) for i in range(count)]
            gate = self._gates[s]

            def requests(protos=protos, gate=gate):
                yield from protos
                gate.wait()  # keep the stream open (half-closing would be fine too) until close()

            call = stub.ModelStreamInfer(requests(), timeout=3600)
            self.calls.append(call)
            t = threading.Thread(target=self._read, args=(call,), daemon=True)
            t.start()
            self._readers.append(t)

    def _read(self, call) -> None:
        try:
            for response in call:
                with self._lock:
                    self.responses += 1
                    if response.error_message:
                        self.errors.append(response.error_message)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.CANCELLED:
                with self._lock:
                    self.errors.append(f"{e.code().name}: {e.details()}")

    def close(self) -> None:
        for call in self.calls:
            call.cancel()
        for gate in self._gates:
            gate.set()
        for t in self._readers:
            t.join(timeout=30)


# ---- one phase -------------------------------------------------------------------------------


def per_token_gaps(stream: MeasuredStream, start: float, end: float) -> list[float]:
    """Gaps between consecutive responses that both arrived in [start, end] (the first
    response is the prefill's, so gaps start from it; the final one may be empty)."""
    t = [x for x in stream.times if start <= x <= end]
    return [b - a for a, b in zip(t, t[1:])]


def run_phase(server: TritonServer, stub, queued: int, running: int, max_tokens: int, queued_max_tokens: int, tag: str) -> dict:
    streams = [MeasuredStream(f"{tag}-m{i}") for i in range(running)]
    threads = [threading.Thread(target=run_stream, args=(stub, s, PROMPTS[i % len(PROMPTS)], max_tokens), daemon=True)
               for i, s in enumerate(streams)]
    for t in threads:
        t.start()
    # the 4 are running once each has its first response
    deadline = time.monotonic() + 120
    while not all(s.times for s in streams):
        if time.monotonic() > deadline or any(s.error for s in streams):
            raise SystemExit(f"{tag}: the measured requests did not start: {[s.error for s in streams]}")
        time.sleep(0.001)
    queue = None
    start = fill_start = time.perf_counter()
    full_at = None
    if queued:
        queue = Queued(stub, queued, queued_max_tokens)
        while True:  # the whole queue is waiting: measure from here
            g = gauges(server)
            if g.get("requests_waiting", 0) >= queued:
                full_at = time.perf_counter()
                break
            if all(s.done.is_set() for s in streams):
                break
            time.sleep(0.01)
        start = full_at or time.perf_counter()
    for t in threads:
        t.join(timeout=600)
    first_end = min(s.times[-1] for s in streams)
    waiting_at_end = gauges(server).get("requests_waiting", 0)
    if queue is not None:
        queue.close()
    wait_until_idle(server)
    errors = [s.error for s in streams if s.error] + (queue.errors[:3] if queue else [])
    gaps = [g for s in streams for g in per_token_gaps(s, start, first_end)]
    whole = [s.times[-1] - s.times[0] for s in streams]
    row = {
        "phase": "B" if queued else "A",
        "queued": queued,
        "running": running,
        "max_tokens": max_tokens,
        "tokens": sum(s.num_output_tokens for s in streams),
        "window_s": max(0.0, first_end - start),
        "gaps": len(gaps),
        "itl_median_ms": 1000 * percentile(gaps, 50),
        "itl_mean_ms": 1000 * statistics.fmean(gaps) if gaps else float("nan"),
        "itl_p90_ms": 1000 * percentile(gaps, 90),
        "stream_s": statistics.fmean(whole),
        "queue_fill_s": (full_at - fill_start) if full_at else float("nan"),
        "waiting_at_end": waiting_at_end,
        "errors": "; ".join(errors)[:300],
    }
    return row


# ---- main ------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_out_arg(ap, "bench_queue")
    ap.add_argument("--queued", type=int, default=1000, help="requests waiting behind the running ones in phase B")
    ap.add_argument("--running", type=int, default=4, help="measured streams (= max_num_seqs)")
    ap.add_argument("--max-tokens", type=int, default=200, help="tokens each measured stream generates")
    ap.add_argument("--queued-max-tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3, help="A, B alternated this many times")
    ap.add_argument("--goal", type=float, default=1.05, help="B/A at most this")
    args = ap.parse_args()
    out = Path(args.out)
    tiny_model_repo(out / "repo", MODEL, max_num_seqs=args.running, max_queue_size=max(2000, 2 * args.queued))
    cpu = describe_cpu()
    server = TritonServer(out / "repo", *free_ports(3), log_path=out / "tritonserver.log")
    server.start(timeout_s=300)
    rows: list[dict] = []
    try:
        channel = grpc.insecure_channel(server.grpc_url)
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        run_phase(server, stub, 0, args.running, 16, 16, "warmup")  # threads, allocator, torch kernels
        run_phase(server, stub, min(args.queued, 100), args.running, 32, args.queued_max_tokens, "warmupq")
        for r in range(args.rounds):
            for queued in (0, args.queued):
                print(f"round {r + 1}/{args.rounds}: phase {'B' if queued else 'A'} ...", flush=True)
                row = run_phase(server, stub, queued, args.running, args.max_tokens, args.queued_max_tokens, f"r{r}{queued}")
                row["round"] = r + 1
                rows.append(row)
        channel.close()
    finally:
        server.stop()

    def med(phase: str, key: str) -> float:
        values = [r[key] for r in rows if r["phase"] == phase and r[key] == r[key]]
        return statistics.median(values) if values else float("nan")

    a, b = med("A", "itl_median_ms"), med("B", "itl_median_ms")
    a90, b90 = med("A", "itl_p90_ms"), med("B", "itl_p90_ms")
    ratio = b / a if a else float("nan")
    am, bm = med("A", "itl_mean_ms"), med("B", "itl_mean_ms")
    print()
    print(f"CPU: {cpu}")
    print(f"model: tiny-gpt2 (seeded), max_num_seqs {args.running}; {args.running} streams x {args.max_tokens} tokens; "
          f"phase B: {args.queued} more requests waiting ({args.queued_max_tokens} tokens each)")
    print()
    print(f"{'round':>5} {'phase':>5} {'waiting':>7} {'window s':>8} {'gaps':>5} {'ITL med ms':>10} {'ITL p90 ms':>10} "
          f"{'stream s':>8} {'fill s':>6}  errors")
    for r in rows:
        print(f"{r['round']:>5} {r['phase']:>5} {r['queued']:>7} {r['window_s']:>8.2f} {r['gaps']:>5} {r['itl_median_ms']:>10.3f} "
              f"{r['itl_p90_ms']:>10.3f} {r['stream_s']:>8.2f} {r['queue_fill_s']:>6.2f}  {r['errors'] or '-'}")
    print()
    print(f"inter-token latency, median of rounds: A {a:.3f} ms, B {b:.3f} ms; B/A = {ratio:.3f} "
          f"({'within' if ratio <= args.goal else 'NOT within'} the goal of {args.goal:.2f}); p90 B/A = {b90 / a90:.3f}; "
          f"mean A {am:.3f} ms, B {bm:.3f} ms, B/A = {bm / am:.3f}")

    out.mkdir(parents=True, exist_ok=True)
    fields = ["round", "phase", "queued", "running", "max_tokens", "tokens", "window_s", "gaps", "itl_median_ms", "itl_mean_ms",
              "itl_p90_ms", "stream_s", "queue_fill_s", "waiting_at_end", "errors"]
    with open(out / "bench_queue.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["# cpu", cpu])
        w.writerow(fields)
        for r in rows:
            w.writerow([f"{r[k]:.4f}" if isinstance(r[k], float) else r[k] for k in fields])
        w.writerow(["# summary", "itl_median_ms A", f"{a:.4f}", "B", f"{b:.4f}", "B/A", f"{ratio:.4f}", "goal", args.goal,
                    "itl_mean_ms A", f"{am:.4f}", "B", f"{bm:.4f}", "B/A", f"{bm / am:.4f}"])
    drawn = optional_figure(figsize=(6, 4))
    if drawn:
        fig, ax = drawn
        for phase, color in (("A", "tab:blue"), ("B", "tab:orange")):
            pts = [(r["round"], r["itl_median_ms"], r["itl_p90_ms"]) for r in rows if r["phase"] == phase]
            label = "A: 4 running, none waiting" if phase == "A" else f"B: 4 running, {args.queued} waiting"
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color=color, label=label + " (median)")
            ax.plot([p[0] for p in pts], [p[2] for p in pts], marker="x", linestyle="--", color=color, label=label + " (p90)")
        ax.set_ylim(bottom=0)
        style_axes(ax, "round", "inter-token latency of the running streams, ms", legend_size=7)
        ax.set_title(f"B/A = {ratio:.3f}  ({cpu[:40]})", fontsize=9)
        save_figure(fig, out / "bench_queue.png", dpi=120)
    print(f"\nwrote {out / 'bench_queue.csv'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
