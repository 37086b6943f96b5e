"""Benchmark: the SLO controller through a step in load and a switch to long prompts, open
loop: how soon the SLO holds again after each change, and the controller's trace.

One tritonserver (explicit model control) serves the model as `default` (the engine's
defaults) and as `slo` (the same, with slo_ttft_ms / slo_tpot_ms: docs/slo.md), one at a
time, each sent the same schedule over gRPC streams (tritonlm/perf/openloop.py). The
schedule has three phases of --phase-s seconds, Poisson arrivals, answers forced to
--output-tokens:

    calm    --low x the saturation rate, prompts of --prompt-tokens
    step    --high x the saturation rate, the same prompts: a step in load
    long    prompts --long-factor times as long, at the calm rate divided by that factor
            (the same prompt tokens per second as calm): a switch in the work's shape

Saturation and the SLO targets are measured as perf/bench_goodput.py measures them: the
default configuration's throughput with --count requests at once, and a lone request's TTFT
and TPOT times --ttft-factor / --tpot-factor (unless --slo-ttft-ms / --slo-tpot-ms). While
each configuration runs, its metrics are read every --scrape-s seconds: the controller's
running cap and token budget, its predicted TTFT, the requests running and waiting.

Reported per configuration and phase: requests sent, shed, admitted and the share of the
admitted within both targets, goodput; for each change (step, long), the settling time: how
long after the change the admitted requests start meeting both targets for good (from the
earliest arrival after which at most 1% of the admitted miss, to the phase's end), and how
often the controller changed its running cap in the phase's second half (oscillation).
For the controller, the engine's own count of met, missed and shed requests over the run
(its TTFT starts at the backend, the client's at the send) beside the client's.
CSVs (the summary, every request, the controller's trace) and a PNG (TTFT and TPOT of every
request against its arrival, and the trace) under results/bench_slo_step/.

    .venv/bin/python perf/bench_slo_step.py [--model smollm2-135m] [--phase-s 20] [--low 0.4]
        [--high 1.3] [--long-factor 4] [--prompt-tokens 64] [--output-tokens 32]
        [--slo-ttft-ms MS --slo-tpot-ms MS] [--out DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tritonlm.perf.goodput import Slo, meets_slo, request_metrics, summarize_run
from tritonlm.perf.machine import describe_cpu
from tritonlm.perf.openloop import GrpcTarget, PromptMaker, RequestRecord, run_schedule, warm_up
from tritonlm.perf.report import add_out_arg, optional_figure, save_figure, style_axes, table, write_csv
from tritonlm.perf.serverstats import metric_sum, read_metrics, wait_idle
from tritonlm.perf.target import Target
from tritonlm.perf.trace import ScheduledRequest, build_schedule, parse_arrivals, with_rate
from tritonlm.server import TritonServer
from tritonlm_bench.goodput_repo import GoodputRepo, lone_request, serve, switch

NAME = "bench_slo_step"
PHASES = ("calm", "step", "long")
HOLDS_SHARE = 0.01  # the SLO holds again once at most this share of the admitted miss it
TRACE = {  # trace column -> the model's metric
    "cap": "tritonlm_slo_running_cap",
    "budget": "tritonlm_slo_token_budget",
    "predicted_ttft_ms": "tritonlm_slo_predicted_ttft_seconds",
    "running": "tritonlm_requests_running",
    "waiting": "tritonlm_requests_waiting",
}


@dataclass(frozen=True)
class Phase:
    name: str
    start_s: float
    rate: float  # requests per second
    prompt_tokens: int


def phases(args, saturation: float) -> list[Phase]:
    calm = args.low * saturation
    rates = (calm, args.high * saturation, calm / args.long_factor)
    prompts = (args.prompt_tokens, args.prompt_tokens, args.prompt_tokens * args.long_factor)
    return [Phase(name, i * args.phase_s, rate, p) for i, (name, rate, p) in enumerate(zip(PHASES, rates, prompts))]


def schedule(args, plan: list[Phase]) -> list[ScheduledRequest]:
    """Every phase's Poisson arrivals, back to back (each phase its own seeded draw)."""
    out = []
    for i, phase in enumerate(plan):
        arrivals = with_rate(parse_arrivals("poisson:1"), phase.rate)
        for s in build_schedule(arrivals, seed=args.seed + i, prompt_tokens=phase.prompt_tokens,
                                output_tokens=args.output_tokens, duration_s=args.phase_s):
            out.append(ScheduledRequest(phase.start_s + s.at_s, s.prompt_tokens, s.output_tokens))
    return out


async def scrape(metrics_url: str, model: str, every_s: float, clock, stop: asyncio.Event, into: list[dict]) -> None:
    """The model's controller gauges every `every_s` until `stop` (times on the run's clock)."""
    while not stop.is_set():
        try:
            samples = await asyncio.to_thread(read_metrics, metrics_url, 2.0)
        except Exception:  # noqa: BLE001 - a missed read is a gap in the trace, not a failed run
            samples = {}
        row = {"t_s": round(clock(), 3)}
        for column, metric in TRACE.items():
            value = metric_sum(samples, metric, model)
            row[column] = (value * 1e3 if column.endswith("_ms") else value) if value is not None else math.nan
        into.append(row)
        try:
            await asyncio.wait_for(stop.wait(), every_s)
        except asyncio.TimeoutError:
            pass


async def run_config(target: GrpcTarget, metrics_url: str, model: str, plan: list[ScheduledRequest],
                     prompts: PromptMaker, every_s: float) -> tuple[list[RequestRecord], list[dict]]:
    """The schedule through one configuration, its gauges read meanwhile."""
    trace: list[dict] = []
    stop = asyncio.Event()
    origin: list[float] = []  # the run's clock starts when its prompts are made: taken at the first send

    def on_sent(record: RequestRecord) -> None:
        if not origin:
            origin.append(time.perf_counter() - record.sent_s)

    def clock() -> float:
        return time.perf_counter() - (origin[0] if origin else time.perf_counter())

    records_task = asyncio.create_task(run_schedule(target, plan, prompts, on_sent=on_sent))
    while not origin and not records_task.done():
        await asyncio.sleep(0.01)
    scraper = asyncio.create_task(scrape(metrics_url, model, every_s, clock, stop, trace))
    try:
        records = await records_task
    finally:
        stop.set()
        await scraper
    return records, trace


def engine_outcomes(metrics_url: str, model: str) -> dict[str, float]:
    """The engine's own count of the requests it judged against the SLO, by outcome (met,
    missed, shed): TTFT measured from the backend's arrival, not the client's send."""
    samples = read_metrics(metrics_url)
    return {outcome: sum(v for (name, labels), v in samples.items() if name == "tritonlm_slo_requests_total"
                         and ("model", model) in labels and ("outcome", outcome) in labels)
            for outcome in ("met", "missed", "shed")}


def settle_s(rows: list[dict], start_s: float, end_s: float) -> float:
    """Seconds after start_s from which at most HOLDS_SHARE of the admitted requests arriving
    until end_s miss the SLO (the earliest such arrival); nan with none admitted."""
    admitted = sorted((r for r in rows if start_s <= r["scheduled_s"] < end_s and r["status"] == "ok"),
                      key=lambda r: r["scheduled_s"])
    if not admitted:
        return math.nan
    for i, r in enumerate(admitted):
        rest = admitted[i:]
        if sum(not x["met"] for x in rest) <= HOLDS_SHARE * len(rest):
            return round(max(0.0, (admitted[i - 1]["scheduled_s"] if i else start_s) - start_s), 2)
    return round(end_s - start_s, 2)


def cap_changes(trace: list[dict], start_s: float, end_s: float) -> tuple[int, int]:
    """(changes of the running cap, samples) in [start_s, end_s)."""
    caps = [r["cap"] for r in trace if start_s <= r["t_s"] < end_s and not math.isnan(r["cap"])]
    return sum(1 for a, b in zip(caps, caps[1:]) if a != b), len(caps)


def summarize(config: str, rows: list[dict], trace: list[dict], plan: list[Phase], phase_s: float, slo: Slo) -> list[dict]:
    out = []
    for phase in plan:
        end = phase.start_s + phase_s
        mine = [r for r in rows if phase.start_s <= r["scheduled_s"] < end]
        admitted = [r for r in mine if r["status"] == "ok"]
        row = {"config": config, "phase": phase.name, "rate": round(phase.rate, 3), "prompt_tokens": phase.prompt_tokens,
               "sent": len(mine), "shed": sum(r["status"] == "shed" for r in mine), "admitted": len(admitted),
               "admitted_met_pct": round(100 * sum(r["met"] for r in admitted) / len(admitted), 1) if admitted else math.nan,
               "goodput_rps": round(sum(r["met"] for r in mine) / phase_s, 3)}
        if phase.start_s > 0:
            row["settle_s"] = settle_s(rows, phase.start_s, end)
        if config == "slo":
            changes, samples = cap_changes(trace, phase.start_s + phase_s / 2, end)
            row["cap_changes_2nd_half"] = f"{changes}/{samples}"
        out.append(row)
    return out


def request_table(config: str, records: list[RequestRecord], plan: list[Phase], slo: Slo) -> list[dict]:
    rows = []
    for r in records:
        m = request_metrics(r)
        phase = max((p for p in plan if p.start_s <= r.scheduled_s), key=lambda p: p.start_s)
        rows.append({"config": config, "index": r.index, "phase": phase.name, "scheduled_s": round(r.scheduled_s, 3),
                     "prompt_tokens": r.prompt_tokens, "status": r.status, "ttft_ms": m.ttft_ms, "tpot_ms": m.tpot_ms,
                     "met": meets_slo(r, m, slo), "error": r.error})
    return rows


def draw(path: Path, rows: list[dict], trace: list[dict], plan: list[Phase], slo: Slo, title: str) -> Path | None:
    made = optional_figure(3, 1, figsize=(9, 8), sharex=True)
    if not made:
        return None
    fig, (ax_ttft, ax_tpot, ax_ctl) = made
    colors = {"default": "tab:grey", "slo": "tab:blue"}
    for config, color in colors.items():
        mine = [r for r in rows if r["config"] == config]
        for ax, key in ((ax_ttft, "ttft_ms"), (ax_tpot, "tpot_ms")):
            ok = [r for r in mine if r[key] is not None]
            ax.scatter([r["scheduled_s"] for r in ok], [r[key] for r in ok], s=6, color=color, label=config)
        shed = [r["scheduled_s"] for r in mine if r["status"] == "shed"]
        if shed:
            ax_ttft.scatter(shed, [slo.ttft_ms * 1.05] * len(shed), marker="x", s=14, color="tab:red", label=f"{config}: shed")
    ax_ttft.axhline(slo.ttft_ms, color="tab:red", linestyle="--", linewidth=1, label="target")
    ax_tpot.axhline(slo.tpot_ms, color="tab:red", linestyle="--", linewidth=1, label="target")
    ts = [r["t_s"] for r in trace]
    ax_ctl.step(ts, [r["cap"] for r in trace], where="post", label="running cap")
    ax_ctl.step(ts, [r["running"] for r in trace], where="post", label="running", alpha=0.6)
    ax_budget = ax_ctl.twinx()
    ax_budget.step(ts, [r["budget"] for r in trace], where="post", color="tab:green", alpha=0.5, label="step's token budget")
    ax_budget.set_ylabel("tokens")
    for ax in (ax_ttft, ax_tpot, ax_ctl):
        for phase in plan[1:]:
            ax.axvline(phase.start_s, color="black", linestyle=":", linewidth=1)
    style_axes(ax_ttft, "", "TTFT (ms)", title)
    style_axes(ax_tpot, "", "TPOT (ms)")
    style_axes(ax_ctl, "arrival / run time (s)", "sequences (slo)")
    ax_budget.legend(loc="upper right", fontsize=8)
    return save_figure(fig, path)


async def measure(args, server: TritonServer, control: Target, repo: GoodputRepo, prompts: PromptMaker):
    """The lone requests, saturation, then each configuration through the phases."""
    short = [ScheduledRequest(0.0, args.prompt_tokens, args.output_tokens)] * args.count
    target = GrpcTarget(server.grpc_url, "default", timeout_s=600)
    ttft0, tpot0 = await lone_request(target, short, prompts)
    slo = Slo(args.slo_ttft_ms or round(ttft0 * args.ttft_factor, 1), args.slo_tpot_ms or round(tpot0 * args.tpot_factor, 1))
    print(f"a lone request: TTFT {ttft0:.1f} ms, TPOT {tpot0:.1f} ms -> {slo.describe()}", flush=True)
    saturation = summarize_run(await run_schedule(target, short, prompts), 0.0, slo)["throughput_rps"]
    print(f"saturation (default, {args.count} at once): {saturation:.3f} requests/s", flush=True)
    repo.add("slo", {"slo_ttft_ms": f"{slo.ttft_ms:g}", "slo_tpot_ms": f"{slo.tpot_ms:g}"})
    plan = phases(args, saturation)
    requests = schedule(args, plan)
    rows, traces = [], {}
    loaded = "default"
    for config in ("default", "slo"):
        target, loaded = await switch(control, server, target, loaded, config), config
        await warm_up(target, short[:4], prompts)  # the controller's first fit happens here, not in the calm phase
        before = await asyncio.to_thread(engine_outcomes, server.metrics_url, config)
        records, trace = await run_config(target, server.metrics_url, config, requests, prompts, args.scrape_s)
        rows += request_table(config, records, plan, slo)
        traces[config] = trace
        print(f"[{config}] {len(records)} requests: {sum(r.status == 'shed' for r in records)} shed, "
              f"{sum(r.status == 'error' for r in records)} errors", flush=True)
        if config == "slo":  # the misses the engine saw itself, against the client's
            await asyncio.to_thread(wait_idle, server.metrics_url, config)
            after = await asyncio.to_thread(engine_outcomes, server.metrics_url, config)
            mine = [r for r in rows if r["config"] == config and r["status"] == "ok"]
            print(f"[{config}] the engine judged {after['met'] - before['met']:g} met, {after['missed'] - before['missed']:g} "
                  f"missed, {after['shed'] - before['shed']:g} shed; the client {sum(r['met'] for r in mine)} met, "
                  f"{sum(not r['met'] for r in mine)} missed", flush=True)
    await target.close()
    return slo, saturation, plan, rows, traces


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m", help="a built-in model (default smollm2-135m; tiny-gpt2 for a smoke run)")
    ap.add_argument("--phase-s", type=float, default=20.0, help="seconds of each phase (default 20)")
    ap.add_argument("--low", type=float, default=0.4, help="the calm phase's load, x saturation (default 0.4)")
    ap.add_argument("--high", type=float, default=1.3, help="the step's load, x saturation (default 1.3)")
    ap.add_argument("--long-factor", type=int, default=4, help="the long phase's prompts, x --prompt-tokens (default 4)")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--count", type=int, default=40, help="requests at once for the saturation rate (default 40)")
    ap.add_argument("--slo-ttft-ms", type=float, default=None)
    ap.add_argument("--slo-tpot-ms", type=float, default=None)
    ap.add_argument("--ttft-factor", type=float, default=5.0, help="TTFT target: a lone request's times this (default 5)")
    ap.add_argument("--tpot-factor", type=float, default=3.0, help="TPOT target: a lone request's times this (default 3)")
    ap.add_argument("--scrape-s", type=float, default=0.2, help="seconds between reads of the controller's gauges")
    ap.add_argument("--seed", type=int, default=0)
    add_out_arg(ap, NAME)
    args = ap.parse_args()
    for name in ("phase_s", "low", "high", "scrape_s"):
        if not getattr(args, name) > 0:
            raise SystemExit(f"--{name.replace('_', '-')}: a positive number, got {getattr(args, name)}")
    if args.long_factor < 1:
        raise SystemExit(f"--long-factor: at least 1, got {args.long_factor}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cpu = describe_cpu()
    print(f"CPU: {cpu}", flush=True)
    repo = GoodputRepo(out, args.model, args.prompt_tokens * args.long_factor + args.output_tokens)
    repo.add("default", {})
    repo.add("slo", {})  # again once its targets are known
    prompts = PromptMaker(str(repo.weights), args.seed)
    served = serve(repo, out)
    if served is None:
        return 1
    server, control = served
    try:
        slo, saturation, plan, rows, traces = asyncio.run(measure(args, server, control, repo, prompts))
    finally:
        control.close()
        server.stop()
    summary = []
    for config in ("default", "slo"):
        summary += summarize(config, [r for r in rows if r["config"] == config], traces[config], plan, args.phase_s, slo)
    title = (f"{args.model}: {slo.describe()}, saturation {saturation:.2f}/s, phases of {args.phase_s:g} s "
             f"(CPU: {cpu})")
    print()
    columns = ["config", "phase", "rate", "prompt_tokens", "sent", "shed", "admitted", "admitted_met_pct", "goodput_rps",
               "settle_s", "cap_changes_2nd_half"]
    print(table(summary, columns, title=title))
    extra = {"slo_ttft_ms": slo.ttft_ms, "slo_tpot_ms": slo.tpot_ms, "saturation_rps": saturation, "cpu": cpu}
    print(f"wrote {write_csv(out / f'{NAME}.csv', [{**r, **extra} for r in summary])}")
    print(f"wrote {write_csv(out / f'{NAME}_requests.csv', rows)}")
    print(f"wrote {write_csv(out / f'{NAME}_trace.csv', traces['slo'])}")
    png = draw(out / f"{NAME}.png", rows, traces["slo"], plan, slo, f"{args.model}, {slo.describe()}")
    if png:
        print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
