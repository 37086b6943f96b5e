"""`tritonlm perf tune`: search max_queue_delay x max_batch_size x instance count within a p99 budget.

One variant folder `M__tune` (symlinks to M's artifacts) is written once; each
candidate config is then loaded into it with Triton's model-control API and a
config override (load_model(name, config=JSON)), swept over concurrency until
p99 leaves the budget, and scored by its best throughput within the budget.
The model's current config is measured first as the baseline.
"""

from __future__ import annotations

import argparse
import itertools
from dataclasses import dataclass, field
from pathlib import Path

from tritonlm.perf import harness, report
from tritonlm.perf.analyzer import Measure, Point, sweep, warm_up
from tritonlm.perf.sla import best_within, over_budget_stopper
from tritonlm.perf.target import PerfError, Target
from tritonlm.perf.variants import (
    ModelConfig,
    VariantError,
    VariantSpec,
    apply_variant,
    config_to_json,
    config_to_text,
    make_variant,
    read_config,
    remove_variant,
)


@dataclass
class Candidate:
    spec: VariantSpec
    label: str
    points: list[Point] = field(default_factory=list)
    best: Point | None = None
    error: str | None = None

    def row(self, budget_ms: float) -> dict:
        b = self.best
        return {
            "candidate": self.label,
            "max_batch_size": self.spec.max_batch_size if self.spec.max_batch_size is not None else "",
            "max_queue_delay_us": self.spec.max_queue_delay_us if self.spec.max_queue_delay_us is not None else "",
            "instances": self.spec.instance_count if self.spec.instance_count is not None else "",
            "best_per_s": round(b.throughput, 1) if b else 0.0,
            "at_concurrency": int(b.load) if b else "",
            "p99_ms": round(b.p99_ms, 2) if b else "",
            "server_avg_batch": round(b.server_avg_batch, 2) if b else "",
            "within_budget": b is not None,
            "error": self.error or "",
        }


def candidate_specs(queue_delays: list[int], batch_sizes: list[int], instances: list[int]) -> list[VariantSpec]:
    return [
        VariantSpec(dynamic_batching=True, max_batch_size=b, max_queue_delay_us=q, instance_count=i)
        for q, b, i in itertools.product(queue_delays, batch_sizes, instances)
    ]


def recommend(candidates: list[Candidate]) -> Candidate | None:
    """Best throughput within the budget; ties go to fewer instances, then lower p99."""
    ok = [c for c in candidates if c.best is not None]
    if not ok:
        return None
    return max(ok, key=lambda c: (round(c.best.throughput, 6), -(c.spec.instance_count or 1), -c.best.p99_ms))


def describe(config: ModelConfig) -> str:
    db = config.dynamic_batching if config.HasField("dynamic_batching") else None
    inst = sum(g.count or 1 for g in config.instance_group) or 1
    q = f"{db.max_queue_delay_microseconds}us" if db is not None else "off"
    return f"max_batch_size {config.max_batch_size}, queue delay {q}, {inst} instance(s)"


def run_tune(
    target: Target,
    model: str,
    specs: list[VariantSpec],
    loads: list[float],
    measure: Measure,
    input_args: list[str],
    workdir: Path,
    budget_ms: float,
    *,
    include_current: bool = True,
) -> tuple[list[Candidate], ModelConfig]:
    if target.repo is None:
        raise PerfError("--repo is needed: the tuning variant is written into the server's model repository")
    src = Path(target.repo) / model
    try:
        original = read_config(src)
    except VariantError as e:
        raise PerfError(str(e)) from None
    name = f"{model}__tune"
    try:
        make_variant(src, target.repo, name, VariantSpec())
    except VariantError as e:
        raise PerfError(str(e)) from None
    candidates: list[Candidate] = []
    if include_current:
        candidates.append(Candidate(VariantSpec(), f"current ({describe(original)})"))
    for spec in specs:
        candidates.append(Candidate(spec, spec.label()))
    try:
        for i, cand in enumerate(candidates, 1):
            try:
                config = apply_variant(original, cand.spec, name=name)
            except VariantError as e:
                cand.error = str(e)
                print(f"[tune] {i}/{len(candidates)} {cand.label}: skipped ({e})", flush=True)
                continue
            print(f"[tune] {i}/{len(candidates)} {cand.label}: loading ...", flush=True)
            try:
                target.load(name, config_to_json(config))
            except PerfError as e:
                cand.error = str(e)
                print(f"[tune]   load failed: {e}", flush=True)
                continue
            warm_up(target, name, measure, input_args, workdir)
            cand.points = sweep(
                target,
                name,
                loads,
                measure,
                input_args,
                workdir=workdir,
                label=f"tune {i}/{len(candidates)}",
                stop=over_budget_stopper(budget_ms, patience=1),
            )
            cand.best = best_within(cand.points, budget_ms)
    finally:
        target.unload(name)
        remove_variant(Path(target.repo) / name)
    return candidates, original


def winning_config_text(original: ModelConfig, winner: Candidate, budget_ms: float) -> str:
    config = apply_variant(original, winner.spec, name=original.name)
    b = winner.best
    header = (
        f"# Recommended by `tritonlm perf tune` for a p99 budget of {budget_ms:g} ms:\n"
        f"# {describe(config)}; measured {b.throughput:.1f} inferences/s at concurrency {int(b.load)}, p99 {b.p99_ms:.2f} ms.\n"
    )
    return header + config_to_text(config)


def _ints(text: str, what: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise PerfError(f"{what}: expected comma-separated integers, got {text!r}") from None
    if not values:
        raise PerfError(f"{what}: empty list")
    return values


def add_parser(sub) -> None:
    p = harness.harness_parser(sub, "tune", "search queue delay x max batch size x instances within a p99 budget")
    p.add_argument("--p99-ms", type=float, required=True, help="p99 latency budget in milliseconds")
    p.add_argument("--queue-delays", default="0,500,2000", help="max_queue_delay_microseconds values (default 0,500,2000)")
    p.add_argument("--batch-sizes", default="4,8,16", help="max_batch_size values (default 4,8,16)")
    p.add_argument("--instances", default="1,2", help="instance counts (default 1,2)")
    p.add_argument("--concurrency", default="1:64", help="concurrency sweep per candidate (default doubling 1:64)")
    p.add_argument("--no-current", action="store_true", help="do not measure the model's current config as a baseline")
    p.add_argument("--write", type=Path, default=None, metavar="PATH", help="write the winning config.pbtxt here")
    harness.add_harness_args(p, "tune", main)


def main(args: argparse.Namespace) -> int:
    if args.p99_ms <= 0:
        raise PerfError("--p99-ms must be positive")
    specs = candidate_specs(
        _ints(args.queue_delays, "--queue-delays"), _ints(args.batch_sizes, "--batch-sizes"), _ints(args.instances, "--instances")
    )
    loads = harness.loads_from(args.concurrency)
    out = report.results_dir(args.results, "tune")
    advice = "tune batching for it with `tritonlm perf llm`"
    with harness.open_measurement(args, out, decoupled_advice=advice) as (target, setup):
        candidates, original = run_tune(
            target, args.model, specs, loads, setup.measure, setup.input_args, setup.workdir, args.p99_ms,
            include_current=not args.no_current,
        )
    rows = [c.row(args.p99_ms) for c in candidates]
    print()
    print(report.table(rows, [k for k in rows[0] if k != "error"], title=f"{args.model}: tuning within p99 {args.p99_ms:g} ms"))
    report.write_csv(out / "tune.csv", rows)
    points = [{"candidate": c.label, **p.row()} for c in candidates for p in c.points]
    report.write_csv(out / "tune_points.csv", points)
    series = {c.label: [p.row() for p in c.points] for c in candidates if c.points}
    report.plot_latency_vs_throughput(
        out / "tune.png", series, budget_ms=args.p99_ms, title=f"{args.model}: p99 per candidate", percentiles=("p99_ms",)
    )
    print(f"wrote {out / 'tune.csv'}\nwrote {out / 'tune_points.csv'}\nwrote {out / 'tune.png'}")
    winner = recommend(candidates)
    if winner is None:
        print(f"\nno candidate kept p99 within {args.p99_ms:g} ms: relax the budget, lower the load, or use a faster model")
        return 3
    b = winner.best
    print(f"\nrecommended: {winner.label}: {b.throughput:.1f} inferences/s at concurrency {int(b.load)}, p99 {b.p99_ms:.2f} ms")
    if args.write:
        args.write.parent.mkdir(parents=True, exist_ok=True)
        args.write.write_text(winning_config_text(original, winner, args.p99_ms))
        print(f"wrote {args.write}")
    return 0
