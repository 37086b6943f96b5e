"""`tritonlm perf goodput`: goodput against offered load, open loop.

For each offered rate the schedule (tritonlm/perf/trace.py: a Poisson or gamma process, or a
replayed trace) is sent open loop (tritonlm/perf/openloop.py) to an OpenAI-compatible server
or to the Triton generation model over gRPC, and every request is judged by vLLM's goodput
definitions (`--goodput ttft:ms tpot:ms` in its benchmark):

- TTFT = first token's arrival - the request's send;
- TPOT = (last token's arrival - first token's arrival) / (output tokens - 1), the server's
  count of output tokens; a one-token answer has no TPOT;
- a request meets the SLO when it was answered, its TTFT is within --slo-ttft-ms and its
  TPOT within --slo-tpot-ms; a target not given is not checked; a shed request (refused
  for load) or a failed one does not meet it and is counted apart;
- goodput = requests that met the SLO / the run's duration (from its start to the last
  answer or refusal); SLO attainment = met / sent.

ITL (inter-token latency) here is each gap between two successive streamed responses that
carried text, pooled over the answered requests. The functions up to `add_parser` are pure:
records in, numbers out.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tritonlm.perf import report
from tritonlm.perf.machine import describe_cpu
from tritonlm.perf.openloop import GrpcTarget, OpenAITarget, PromptMaker, RequestRecord, run_schedule, warm_up
from tritonlm.perf.stats import percentile
from tritonlm.perf.target import PerfError
from tritonlm.perf.trace import FORMS, Arrivals, ScheduledRequest, build_schedule, describe_arrivals, parse_arrivals, with_rate


@dataclass(frozen=True)
class Slo:
    ttft_ms: float | None = None  # None: not checked
    tpot_ms: float | None = None

    def __post_init__(self):
        for name, value in (("--slo-ttft-ms", self.ttft_ms), ("--slo-tpot-ms", self.tpot_ms)):
            if value is not None and not (value > 0 and math.isfinite(value)):
                raise PerfError(f"{name}: a positive number of milliseconds, got {value}")

    def describe(self) -> str:
        parts = [f"{name} <= {v:g} ms" for name, v in (("TTFT", self.ttft_ms), ("TPOT", self.tpot_ms)) if v is not None]
        return "SLO " + ", ".join(parts) if parts else "no SLO targets: every answer counts"


@dataclass(frozen=True)
class RequestMetrics:
    ttft_ms: float | None  # None: no token came
    tpot_ms: float | None  # None: fewer than 2 output tokens
    itls_ms: tuple[float, ...]
    latency_ms: float | None
    output_tokens: int


def request_metrics(record: RequestRecord) -> RequestMetrics:
    """TTFT, TPOT, ITLs and latency of one request (module docstring); output tokens are the
    server's count, else the responses that carried text."""
    chunks = record.chunk_s
    tokens = record.served_output_tokens if record.served_output_tokens is not None else len(chunks)
    if record.status != "ok" or not chunks:
        return RequestMetrics(None, None, (), None, tokens if record.status == "ok" else 0)
    ttft = (chunks[0] - record.sent_s) * 1e3
    tpot = (chunks[-1] - chunks[0]) * 1e3 / (tokens - 1) if tokens > 1 else None
    itls = tuple((b - a) * 1e3 for a, b in zip(chunks, chunks[1:]))
    return RequestMetrics(ttft, tpot, itls, (record.end_s - record.sent_s) * 1e3, tokens)


def meets_slo(record: RequestRecord, metrics: RequestMetrics, slo: Slo) -> bool:
    if record.status != "ok" or metrics.ttft_ms is None:
        return False
    if slo.ttft_ms is not None and metrics.ttft_ms > slo.ttft_ms:
        return False
    return slo.tpot_ms is None or metrics.tpot_ms is None or metrics.tpot_ms <= slo.tpot_ms


def _pct(values: Sequence[float], q: float) -> float:
    return round(percentile(values, q), 2) if values else float("nan")


def summarize_run(records: Sequence[RequestRecord], offered_rate: float, slo: Slo) -> dict:
    """One summary row of a run at one offered rate."""
    metrics = [request_metrics(r) for r in records]
    ok = [(r, m) for r, m in zip(records, metrics) if r.status == "ok"]
    met = sum(meets_slo(r, m, slo) for r, m in zip(records, metrics))
    ends = [r.end_s for r in records if not math.isnan(r.end_s)]
    duration = max(ends) if ends else 0.0
    span = max((r.scheduled_s for r in records), default=0.0)
    ttfts = [m.ttft_ms for _, m in ok if m.ttft_ms is not None]
    tpots = [m.tpot_ms for _, m in ok if m.tpot_ms is not None]
    itls = [g for _, m in ok for g in m.itls_ms]
    latencies = [m.latency_ms for _, m in ok if m.latency_ms is not None]
    lags = [(r.sent_s - r.scheduled_s) * 1e3 for r in records if not math.isnan(r.sent_s)]
    n = len(records)
    return {
        "offered_rate": offered_rate,
        "sent_rate": round(n / span, 3) if span > 0 else float("nan"),  # what the schedule drew
        "requests": n,
        "ok": len(ok),
        "shed": sum(r.status == "shed" for r in records),
        "errors": sum(r.status == "error" for r in records),
        "met_slo": met,
        "goodput_rps": round(met / duration, 3) if duration > 0 else 0.0,
        "throughput_rps": round(len(ok) / duration, 3) if duration > 0 else 0.0,
        "attainment_pct": round(100.0 * met / n, 1) if n else 0.0,
        "ttft_p50_ms": _pct(ttfts, 50),
        "ttft_p99_ms": _pct(ttfts, 99),
        "tpot_p50_ms": _pct(tpots, 50),
        "tpot_p99_ms": _pct(tpots, 99),
        "itl_p50_ms": _pct(itls, 50),
        "itl_p99_ms": _pct(itls, 99),
        "latency_p50_ms": _pct(latencies, 50),
        "latency_p99_ms": _pct(latencies, 99),
        "output_tok_s": round(sum(m.output_tokens for _, m in ok) / duration, 1) if duration > 0 else 0.0,
        "duration_s": round(duration, 3),
        "send_lag_max_ms": round(max(lags), 2) if lags else float("nan"),
    }


def request_rows(records: Sequence[RequestRecord], offered_rate: float, slo: Slo) -> list[dict]:
    """The per-request CSV rows of one run."""
    rows = []
    for r in records:
        m = request_metrics(r)
        rows.append({
            "offered_rate": offered_rate,
            "index": r.index,
            "scheduled_s": round(r.scheduled_s, 6),
            "sent_s": round(r.sent_s, 6),
            "status": r.status,
            "prompt_tokens": r.prompt_tokens,
            "output_tokens": r.output_tokens,
            "served_prompt_tokens": "" if r.served_prompt_tokens is None else r.served_prompt_tokens,
            "served_output_tokens": "" if r.served_output_tokens is None else r.served_output_tokens,
            "ttft_ms": "" if m.ttft_ms is None else round(m.ttft_ms, 3),
            "tpot_ms": "" if m.tpot_ms is None else round(m.tpot_ms, 3),
            "latency_ms": "" if m.latency_ms is None else round(m.latency_ms, 3),
            "met_slo": meets_slo(r, m, slo),
            "itls_ms": " ".join(f"{g:.3f}" for g in m.itls_ms),
            "error": r.error,
        })
    return rows


TABLE_COLUMNS = ("offered_rate", "requests", "ok", "shed", "errors", "goodput_rps", "attainment_pct", "ttft_p50_ms", "ttft_p99_ms",
                 "tpot_p50_ms", "tpot_p99_ms", "itl_p50_ms", "itl_p99_ms", "send_lag_max_ms")


def plot_goodput(path: Path, rows: Sequence[dict], title: str) -> Path | None:
    """Goodput and throughput against offered load, with the offered load itself for scale;
    None where matplotlib is not installed."""
    made = report.optional_figure(figsize=(7, 4.5))
    if made is None:
        return None
    fig, ax = made
    offered = [r["offered_rate"] for r in rows]
    ax.plot(offered, offered, ":", color="grey", label="offered")
    ax.plot(offered, [r["throughput_rps"] for r in rows], "s--", label="answered")
    ax.plot(offered, [r["goodput_rps"] for r in rows], "o-", label="goodput (met the SLO)")
    report.style_axes(ax, "offered load (requests/s)", "requests/s", title)
    return report.save_figure(fig, path)


# --- the command --------------------------------------------------------------------------------------
def parse_rates(text: str) -> list[float]:
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        rates = []
    if not rates or not all(r > 0 and math.isfinite(r) for r in rates):
        raise PerfError(f"--rates: a comma-separated list of positive requests per second (e.g. 0.5,1,2), got {text!r}")
    return rates


def add_parser(sub) -> None:
    p = sub.add_parser(
        "goodput",
        help="open-loop load: goodput and SLO attainment against offered load (OpenAI API or Triton gRPC)",
        description="Send a seeded open-loop schedule at each offered rate and report goodput (requests that met "
        "the TTFT/TPOT SLO per second), SLO attainment, shed requests and latency percentiles: a CSV per request, "
        "a summary CSV, a table and a PNG of goodput against offered load.",
    )
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--openai", metavar="URL", help="an OpenAI-compatible server (tritonlm's frontend, llama-server): streaming /v1/completions")
    where.add_argument("--grpc", metavar="HOST:PORT", help="tritonserver's gRPC endpoint: the decoupled generation model")
    p.add_argument("--model", required=True, help="the model name the server serves")
    p.add_argument("--arrivals", default="poisson:1", help=f"{FORMS} (default poisson:1)")
    p.add_argument("--rates", default=None, help="offered rates to sweep, requests/s (e.g. 0.5,1,2); default: the one in --arrivals")
    many = p.add_mutually_exclusive_group()
    many.add_argument("--count", type=int, default=None, help="requests per rate (default 100)")
    many.add_argument("--duration", type=float, default=None, metavar="S", help="send for S seconds per rate instead")
    p.add_argument("--prompt-tokens", type=int, default=128,
                   help="a process: every prompt's length; a trace: the longest (its 99th percentile scales to it) (default 128)")
    p.add_argument("--output-tokens", type=int, default=32, help="the same for answers, forced with ignore_eos (default 32)")
    p.add_argument("--tokenizer", default=None, help="tokenizer.json or HF folder: prompts of exactly --prompt-tokens tokens")
    p.add_argument("--slo-ttft-ms", type=float, default=None, help="time to first token target (default: not checked)")
    p.add_argument("--slo-tpot-ms", type=float, default=None, help="time per output token target (default: not checked)")
    p.add_argument("--seed", type=int, default=0, help="seed of the schedule and the prompts (default 0)")
    p.add_argument("--warmup", type=int, default=2, help="requests sent one by one before each rate, not counted (default 2)")
    p.add_argument("--timeout", type=float, default=600.0, metavar="S", help="give up on one request after S seconds (default 600)")
    p.add_argument("--api-key", default=None, help="OpenAI API key (default: $OPENAI_API_KEY, else none)")
    p.add_argument("--out", type=Path, default=None, help="results folder (default results/goodput)")
    p.set_defaults(func=main)


def _target(args: argparse.Namespace):
    if args.openai:
        return OpenAITarget(args.openai, args.model, args.api_key or os.environ.get("OPENAI_API_KEY") or "none", args.timeout)
    return GrpcTarget(args.grpc, args.model, args.timeout)


def schedules(args: argparse.Namespace) -> list[tuple[float, Arrivals, list[ScheduledRequest]]]:
    """(offered rate, its arrivals, its schedule) for each rate; every bad option is found here,
    before anything is sent."""
    arrivals = parse_arrivals(args.arrivals)
    rates = parse_rates(args.rates) if args.rates else [arrivals.rate]
    count = args.count if args.count is not None or args.duration is not None else 100
    out = []
    for rate in rates:
        process = with_rate(arrivals, rate)
        schedule = build_schedule(process, seed=args.seed, prompt_tokens=args.prompt_tokens, output_tokens=args.output_tokens,
                                  count=count, duration_s=args.duration)
        if not schedule:
            raise PerfError(f"--duration {args.duration:g} s holds no arrival at {describe_arrivals(process)}: send for longer")
        out.append((rate, process, schedule))
    return out


async def sweep(args: argparse.Namespace, slo: Slo, runs: list[tuple[float, Arrivals, list[ScheduledRequest]]],
                prompts: PromptMaker) -> tuple[list[dict], list[dict]]:
    """Every rate in turn: (summary rows, per-request rows)."""
    target = _target(args)
    summaries, per_request = [], []
    try:
        for rate, process, schedule in runs:
            if args.warmup > 0:
                for w in await warm_up(target, schedule[: args.warmup], prompts):
                    if w.status == "error":
                        raise PerfError(f"warm-up request to {args.model} failed: {w.error}")
            print(f"[goodput {args.model}] {describe_arrivals(process)}: {len(schedule)} requests over "
                  f"{schedule[-1].at_s:.1f} s ...", end="", flush=True)
            records = await run_schedule(target, schedule, prompts)
            row = summarize_run(records, rate, slo)
            summaries.append({"arrivals": describe_arrivals(process), **row})
            per_request.extend(request_rows(records, rate, slo))
            print(f" goodput {row['goodput_rps']:g}/s, attainment {row['attainment_pct']:g}%, shed {row['shed']},"
                  f" errors {row['errors']}", flush=True)
            first_error = next((r.error for r in records if r.status == "error"), None)
            if first_error:
                print(f"  first error: {first_error}", flush=True)
    finally:
        await target.close()
    return summaries, per_request


def main(args: argparse.Namespace) -> int:
    slo = Slo(args.slo_ttft_ms, args.slo_tpot_ms)
    if args.warmup < 0:
        raise PerfError(f"--warmup: 0 or more requests, got {args.warmup}")
    runs = schedules(args)
    prompts = PromptMaker(args.tokenizer, args.seed)
    out = report.results_dir(args.out, "goodput")
    cpu = describe_cpu()
    print(f"CPU: {cpu}")
    summaries, per_request = asyncio.run(sweep(args, slo, runs, prompts))
    targets = slo.describe()
    where = f"OpenAI {args.openai}" if args.openai else f"gRPC {args.grpc}"
    print()
    print(report.table(summaries, ["arrivals", *TABLE_COLUMNS], title=f"{args.model} ({where}): goodput, {targets}"))
    files = [report.write_csv(out / "summary.csv", [{**r, "slo_ttft_ms": slo.ttft_ms, "slo_tpot_ms": slo.tpot_ms, "cpu": cpu}
                                                    for r in summaries]),
             report.write_csv(out / "requests.csv", per_request)]
    png = plot_goodput(out / "goodput.png", summaries, f"{args.model}: goodput, {targets}")
    if png:
        files.append(png)
    for f in files:
        print(f"wrote {f}")
    return 0
