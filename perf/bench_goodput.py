"""Benchmark: goodput against offered load, open loop: the SLO controller against the default
configuration (and a small grid of static ones), the same schedules, in one run.

One tritonserver (explicit model control) serves the model under one name per configuration,
loaded one at a time:

    default         the engine's defaults (max_num_seqs 64, max_num_batched_tokens 512)
    slo             the same, with slo_ttft_ms / slo_tpot_ms set: the controller sizes each step
                    and sheds arrivals it predicts would miss TTFT (docs/slo.md)
    s<N>_t<T>       static max_num_seqs N, max_num_batched_tokens T (--grid N:T,...)

and, with --peer-slots N,..., llama.cpp's llama-server on the same weights (SmolLM2 F32 GGUF,
perf/tritonlm_bench/llamacpp.py) with --parallel N, started for each repetition after
tritonlm's configurations and sent the same schedules through the official openai client
(/v1/completions, ignore_eos, cache_prompt off; tritonlm's configurations get gRPC streams).

Every configuration gets the same KV room, prefix caching off and greedy answers forced to
their length (end_id -1). Workload: --arrivals (default the Azure conversation trace, its
lengths scaled to --prompt-tokens / --output-tokens: tritonlm/perf/trace.py), sent open loop
over gRPC (tritonlm/perf/openloop.py), --count requests per point.

Saturation: the default configuration's throughput when --count requests of the workload
arrive at once (answered requests / time to the last answer). The offered loads are
--loads times that rate. The SLO targets, unless given, are multiples of one request alone
on the default configuration (its median TTFT x --ttft-factor, TPOT x --tpot-factor): what a
user of this host could ask for, set before any load. Reported per configuration and load:
goodput (requests within both targets per second, vLLM's definition: tritonlm/perf/goodput.py),
SLO attainment, shed, p99 TTFT and TPOT, and goodput / the default's at the same load.
CSV (per point, and per request) and PNG under results/bench_goodput/.

    .venv/bin/python perf/bench_goodput.py [--model smollm2-135m] [--arrivals azure-conv]
        [--loads 0.5,1,1.5,2] [--count 40] [--prompt-tokens 128] [--output-tokens 32]
        [--grid 4:128,16:512] [--slo-ttft-ms MS --slo-tpot-ms MS] [--reps 3] [--peer-slots 4,16]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

from tritonlm.perf.goodput import Slo, parse_rates, request_rows, summarize_run
from tritonlm.perf.machine import describe_cpu
from tritonlm.perf.openloop import GrpcTarget, OpenAITarget, PromptMaker, run_schedule, warm_up
from tritonlm.perf.report import add_out_arg, optional_figure, save_figure, style_axes, table, write_csv
from tritonlm.perf.stats import mean_ci95
from tritonlm.perf.target import Target
from tritonlm.perf.trace import BUILTIN_TRACES, ScheduledRequest, build_schedule, parse_arrivals, with_rate
from tritonlm.server import TritonServer, free_ports
from tritonlm_bench.goodput_repo import GoodputRepo, lone_request, serve, switch, unload
from tritonlm_bench.llamacpp import LlamaServer, ensure_gguf, ensure_llama_cpp

def parse_grid(text: str) -> list[tuple[int, int]]:
    grid = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        try:
            seqs, tokens = (int(x) for x in item.split(":"))
        except ValueError:
            raise SystemExit(f"--grid: {item!r} is not MAX_NUM_SEQS:MAX_NUM_BATCHED_TOKENS (e.g. 4:128)") from None
        grid.append((seqs, tokens))
    return grid


async def measure(args, server: TritonServer, control: Target, repo: GoodputRepo, configs: dict[str, dict[str, str]],
                  loads: list[float], schedule_at, prompts: PromptMaker, rows: list[dict],
                  per_request: list[dict]) -> tuple[Slo, float]:
    """The lone requests, the saturation run, then every configuration at every load (rows,
    and per_request's one row per request, appended as they come); (the SLO, the saturation
    rate)."""
    target = GrpcTarget(server.grpc_url, "default", timeout_s=600)
    ttft0, tpot0 = await lone_request(target, schedule_at(1.0), prompts)
    slo = Slo(args.slo_ttft_ms or round(ttft0 * args.ttft_factor, 1), args.slo_tpot_ms or round(tpot0 * args.tpot_factor, 1))
    print(f"a lone request: TTFT {ttft0:.1f} ms, TPOT {tpot0:.1f} ms -> {slo.describe()}", flush=True)
    records = await run_schedule(target, schedule_at(None), prompts)
    saturation = summarize_run(records, 0.0, slo)["throughput_rps"]
    print(f"saturation (default, {args.count} at once): {saturation:.3f} requests/s", flush=True)
    repo.add("slo", {"slo_ttft_ms": f"{slo.ttft_ms:g}", "slo_tpot_ms": f"{slo.tpot_ms:g}"})

    async def sweep_loads(target, name: str, rep: int) -> None:
        for load in loads:
            rate = round(load * saturation, 4)
            records = await run_schedule(target, schedule_at(rate, rep), prompts)
            row = {"config": name, "load": load, "rep": rep, **summarize_run(records, rate, slo)}
            rows.append(row)
            per_request.extend({"config": name, "load": load, "rep": rep, **r} for r in request_rows(records, rate, slo))
            write_csv(Path(args.out) / "bench_goodput.csv", rows)  # so far: a run cut short keeps its points
            write_csv(Path(args.out) / "bench_goodput_requests.csv", per_request)
            print(f"[{name}] rep {rep} load {load:g} ({rate:.3f}/s): goodput {row['goodput_rps']:.3f}/s, attainment "
                  f"{row['attainment_pct']:g}%, shed {row['shed']}, errors {row['errors']}", flush=True)

    loaded = "default"
    # repetitions outside the configurations: drift on a shared host falls on every one alike
    for rep in range(args.reps):
        for name in configs:
            target, loaded = await switch(control, server, target, loaded, name), name
            await warm_up(target, schedule_at(1.0)[:2], prompts)
            await sweep_loads(target, name, rep)
        if args.peer_slots:  # llama-server runs alone too
            await unload(control, loaded)
            loaded = ""
        for slots in args.peer_slots:
            name = f"llama-server np{slots}"
            peer = LlamaServer(args.peer_gguf, free_ports(1)[0], args.peer_threads, Path(args.out) / "llama-server.log",
                               slots=slots, slot_context=repo.context).start()
            try:
                await target.close()
                target = OpenAITarget(f"http://127.0.0.1:{peer.port}", "smollm2", "none", 600,
                                      extra_body={"cache_prompt": False})
                await warm_up(target, schedule_at(1.0)[:2], prompts)
                await sweep_loads(target, name, rep)
            finally:
                peer.stop()
    await target.close()
    return slo, saturation


def summarize_reps(rows: list[dict]) -> list[dict]:
    """One row per configuration and load: the mean over repetitions of each figure, and
    the 95% confidence half-widths of goodput and attainment."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["config"], r["load"]), []).append(r)
    summary = []
    for (config, load), reps in groups.items():
        row = {"config": config, "load": load, "reps": len(reps), "offered_rate": reps[0]["offered_rate"]}
        for key in ("goodput_rps", "attainment_pct", "shed", "errors", "ttft_p99_ms", "tpot_p99_ms"):
            mean, half = mean_ci95([float(r[key]) for r in reps])
            row[key] = round(mean, 3)
            if key in ("goodput_rps", "attainment_pct"):
                row[key.replace("_rps", "").replace("_pct", "") + "_ci95"] = round(half, 3)
        summary.append(row)
    return summary


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help="a built-in model (default smollm2-135m; tiny-gpt2 for a smoke run)")
    ap.add_argument("--arrivals", default="azure-conv", help=f"a trace ({', '.join(BUILTIN_TRACES)}) or poisson / gamma:CV, no rate")
    ap.add_argument("--loads", default="0.5,1,1.5,2", help="offered loads, times the measured saturation rate (default 0.5,1,1.5,2)")
    ap.add_argument("--count", type=int, default=40, help="requests per point (default 40)")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--grid", default="", help="static configurations MAX_NUM_SEQS:MAX_NUM_BATCHED_TOKENS,... (default none)")
    ap.add_argument("--slo-ttft-ms", type=float, default=None)
    ap.add_argument("--slo-tpot-ms", type=float, default=None)
    ap.add_argument("--ttft-factor", type=float, default=5.0, help="TTFT target: a lone request's times this (default 5)")
    ap.add_argument("--tpot-factor", type=float, default=2.0, help="TPOT target: a lone request's times this (default 2)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reps", type=int, default=1,
                    help="repetitions, each with its own draw of the workload (seed + rep); with 2 or more the "
                         "table shows means with 95%% confidence intervals (default 1)")
    ap.add_argument("--peer-slots", default="",
                    help="also llama-server with each --parallel N here, e.g. 4,16 (default none; SmolLM2 only)")
    ap.add_argument("--peer-threads", type=int, default=2, help="llama-server -t (default 2)")
    add_out_arg(ap, "bench_goodput")
    args = ap.parse_args()
    if args.reps < 1:
        raise SystemExit(f"--reps: at least 1, got {args.reps}")
    try:
        args.peer_slots = [int(x) for x in args.peer_slots.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--peer-slots: {args.peer_slots!r} is not a list of slot counts (e.g. 4,16)") from None
    if args.peer_slots:
        if args.model != "smollm2-135m":
            raise SystemExit("--peer-slots: llama-server gets SmolLM2's GGUF; use it with --model smollm2-135m")
        ensure_llama_cpp(jobs=os.cpu_count() or 2)
        args.peer_gguf = ensure_gguf("F32")
    loads = parse_rates(args.loads)
    grid = parse_grid(args.grid)
    kind, _, rest = args.arrivals.partition(":")
    # the rate is set per point
    spec = f"trace:{rest}:1" if kind == "trace" else f"{kind}:1" + (f":{rest}" if rest else "")
    arrivals = parse_arrivals(spec)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cpu = describe_cpu()
    print(f"CPU: {cpu}", flush=True)

    def schedule_at(rate: float | None, rep: int = 0) -> list[ScheduledRequest]:
        """The workload at `rate` (None: all at once); each repetition draws its own."""
        if rate is None:  # everything at once: the saturation run
            return [ScheduledRequest(0.0, s.prompt_tokens, s.output_tokens) for s in schedule_at(1.0)]
        return build_schedule(with_rate(arrivals, rate), seed=args.seed + rep, prompt_tokens=args.prompt_tokens,
                              output_tokens=args.output_tokens, count=args.count)

    configs: dict[str, dict[str, str]] = {"default": {}, "slo": {}}
    configs.update({f"s{n}_t{t}": {"max_num_seqs": str(n), "max_num_batched_tokens": str(t)} for n, t in grid})
    repo = GoodputRepo(out, args.model, args.prompt_tokens + args.output_tokens)
    for name, params in configs.items():
        repo.add(name, params)  # slo: again once its targets are known
    prompts = PromptMaker(str(repo.weights), args.seed)
    served = serve(repo, out)
    if served is None:
        return 1
    server, control = served
    rows: list[dict] = []
    per_request: list[dict] = []  # one row per request sent
    try:
        slo, saturation = asyncio.run(measure(args, server, control, repo, configs, loads, schedule_at, prompts, rows,
                                                  per_request))
    finally:
        control.close()
        server.stop()
    # the controller's decisions, as its model logged them: why it admitted or shed
    decisions = [line.split("SLO controller:", 1)[1].strip().rstrip('"') for line in server.log_text().splitlines()
                 if "SLO controller:" in line]
    print("\nSLO controller decisions:" if decisions else "\nSLO controller: no decision logged")
    shown = decisions if len(decisions) <= 20 else decisions[:5] + [f"... {len(decisions) - 20} more ..."] + decisions[-15:]
    for line in shown:  # the first ones, as it learned the host, and the last, where it settled
        print(f"  {line}")

    summary = summarize_reps(rows) if args.reps > 1 else rows
    default = {r["load"]: r["goodput_rps"] for r in summary if r["config"] == "default"}
    for r in summary:
        r["goodput_vs_default"] = round(r["goodput_rps"] / default[r["load"]], 2) if default.get(r["load"]) else float("nan")
    columns = ["config", "load", "offered_rate", "sent_rate", "goodput_rps", "goodput_vs_default", "attainment_pct", "ok", "shed", "errors",
               "ttft_p99_ms", "tpot_p99_ms", "send_lag_max_ms"]
    if args.reps > 1:
        columns = ["config", "load", "offered_rate", "goodput_rps", "goodput_ci95", "goodput_vs_default", "attainment_pct",
                   "attainment_ci95", "shed", "ttft_p99_ms", "tpot_p99_ms"]
    print()
    reps = f", {args.reps} repetitions (means, 95% CI half-widths)" if args.reps > 1 else ""
    print(table(summary, columns, title=f"{args.model}, {args.arrivals}, {args.count} requests a point{reps}, {slo.describe()}, "
                                        f"saturation {saturation:.3f}/s (CPU: {cpu})"))
    extra = {"slo_ttft_ms": slo.ttft_ms, "slo_tpot_ms": slo.tpot_ms, "cpu": cpu}
    print(f"wrote {write_csv(out / 'bench_goodput.csv', [{**r, **extra} for r in rows])}")
    if args.reps > 1:
        print(f"wrote {write_csv(out / 'bench_goodput_summary.csv', [{**r, **extra} for r in summary])}")
    made = optional_figure(figsize=(7, 4.5))
    if made:
        fig, ax = made
        for name in dict.fromkeys(r["config"] for r in summary):
            mine = [r for r in summary if r["config"] == name]
            ax.errorbar([r["offered_rate"] for r in mine], [r["goodput_rps"] for r in mine],
                        yerr=[r.get("goodput_ci95", 0.0) for r in mine], fmt="o-", capsize=3, label=name)
        offered = [r["offered_rate"] for r in summary if r["config"] == "default"]
        ax.plot(offered, offered, ":", color="grey", label="offered")
        style_axes(ax, "offered load (requests/s)", "goodput (requests/s)", f"{args.model}: {slo.describe()}")
        print(f"wrote {save_figure(fig, out / 'bench_goodput.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
