"""`tritonlm perf sla`: the highest throughput whose p99 latency stays within a budget.

A concurrency (or request-rate) sweep; once two points in a row exceed the budget
the sweep stops (more load only adds queueing). The answer is the point with the
best throughput among those within the budget; the SLA is met when one exists.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass

from tritonlm.perf import harness, report
from tritonlm.perf.analyzer import Point, sweep, warm_up
from tritonlm.perf.target import PerfError


@dataclass
class SlaResult:
    points: list[Point]
    budget_ms: float
    best: Point | None

    @property
    def met(self) -> bool:
        return self.best is not None

    def rows(self) -> list[dict]:
        return [{**p.row(), "within_budget": p.p99_ms <= self.budget_ms} for p in self.points]


def best_within(points: Sequence[Point], budget_ms: float) -> Point | None:
    """The highest-throughput point whose p99 is within the budget (ties: lower p99)."""
    ok = [p for p in points if p.p99_ms <= budget_ms]
    if not ok:
        return None
    return max(ok, key=lambda p: (p.throughput, -p.p99_ms))


def over_budget_stopper(budget_ms: float, patience: int = 2):
    """stop(point) for sweep(): True after `patience` consecutive points above the budget."""
    state = {"over": 0}

    def stop(p: Point) -> bool:
        state["over"] = state["over"] + 1 if p.p99_ms > budget_ms else 0
        return state["over"] >= patience

    return stop


def write_outputs(result: SlaResult, out, model: str, mode: str) -> list:
    rows = result.rows()
    files = [report.write_csv(out / "sla.csv", rows)]
    files.append(
        report.plot_latency_vs_throughput(
            out / "sla.png",
            {model: rows},
            budget_ms=result.budget_ms,
            title=f"{model}: latency vs throughput ({mode} sweep)",
        )
    )
    return files


def add_parser(sub) -> None:
    p = harness.harness_parser(
        sub,
        "sla",
        "highest throughput within a p99 latency budget",
        description="Sweep load, report the best throughput whose p99 stays within --p99-ms. "
        "Exit status: 0 SLA met, 3 not met, 1 error.",
    )
    p.add_argument("--p99-ms", type=float, required=True, help="p99 latency budget in milliseconds")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--concurrency", default=None, help="concurrencies: '1,2,4' or doubling '1:64' (default 1:64)")
    load.add_argument("--request-rate", default=None, help="request rates per second instead: '50,100,200' or '50:800'")
    p.add_argument("--full", action="store_true", help="measure every load even after the budget is exceeded")
    harness.add_harness_args(p, "sla", main)


def main(args: argparse.Namespace) -> int:
    if args.p99_ms <= 0:
        raise PerfError("--p99-ms must be positive")
    mode = "request_rate" if args.request_rate else "concurrency"
    loads = harness.loads_from(args.request_rate or args.concurrency or "1:64")
    out = report.results_dir(args.results, "sla")
    with harness.open_measurement(args, out) as (target, setup):
        warm_up(target, args.model, setup.measure, setup.input_args, setup.workdir)
        stop = None if args.full else over_budget_stopper(args.p99_ms)
        points = sweep(target, args.model, loads, setup.measure, setup.input_args, mode=mode, workdir=setup.workdir,
                       label=f"sla {args.model}", stop=stop)
    result = SlaResult(points, args.p99_ms, best_within(points, args.p99_ms))
    print()
    print(
        report.table(
            result.rows(),
            [mode, "throughput_per_s", "p50_ms", "p95_ms", "p99_ms", "server_avg_batch", "within_budget"],
            title=f"{args.model}: p99 budget {args.p99_ms:g} ms",
        )
    )
    if result.best is not None:
        b = result.best
        print(
            f"\nSLA met: best {b.throughput:.1f} inferences/s within p99 {args.p99_ms:g} ms "
            f"({mode.replace('_', ' ')} {b.load:g}, p99 {b.p99_ms:.2f} ms)"
        )
    else:
        lowest = min(points, key=lambda p: p.p99_ms)
        print(f"\nSLA not met: no load kept p99 within {args.p99_ms:g} ms (lowest p99 {lowest.p99_ms:.2f} ms at {mode} {lowest.load:g})")
    for f in write_outputs(result, out, args.model, mode):
        print(f"wrote {f}")
    return 0 if result.met else 3
