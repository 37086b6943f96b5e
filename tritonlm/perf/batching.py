"""`tritonlm perf batching`: the same model with dynamic batching on and off, side by side.

Two variants of the model folder are written next to it (tritonlm.perf.variants)
and loaded through the model-control API: `M__batched` (dynamic_batching on) and
`M__unbatched` (no dynamic_batching: every request is its own execution). Both
are swept over the same concurrencies, interleaved point by point so noise from
neighbours hits both alike. The server's own statistics give the average batch
size it formed (inference_count / execution_count over each run).
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from pathlib import Path

from tritonlm.perf import harness, report
from tritonlm.perf.analyzer import Measure, Point, measure_point, warm_up
from tritonlm.perf.target import PerfError, Target
from tritonlm.perf.variants import VariantError, VariantSpec, make_variant, read_config, remove_variant

log = logging.getLogger(__name__)


@dataclass
class BatchingResult:
    batched: list[Point]
    unbatched: list[Point]
    batched_name: str
    unbatched_name: str

    def gains(self) -> list[float]:
        return [b.throughput / u.throughput if u.throughput else 0.0 for b, u in zip(self.batched, self.unbatched)]

    def summary_rows(self) -> list[dict]:
        rows = []
        for b, u, g in zip(self.batched, self.unbatched, self.gains()):
            rows.append(
                {
                    "concurrency": int(b.load),
                    "batched_per_s": round(b.throughput, 1),
                    "unbatched_per_s": round(u.throughput, 1),
                    "gain": round(g, 2),
                    "batched_p50_ms": round(b.p50_ms, 2),
                    "batched_p95_ms": round(b.p95_ms, 2),
                    "batched_p99_ms": round(b.p99_ms, 2),
                    "unbatched_p50_ms": round(u.p50_ms, 2),
                    "unbatched_p95_ms": round(u.p95_ms, 2),
                    "unbatched_p99_ms": round(u.p99_ms, 2),
                    "batched_avg_batch": round(b.server_avg_batch, 2),
                    "unbatched_avg_batch": round(u.server_avg_batch, 2),
                }
            )
        return rows

    def detail_rows(self) -> list[dict]:
        rows = []
        for variant, points in (("batched", self.batched), ("unbatched", self.unbatched)):
            for p in points:
                rows.append({"variant": variant, **p.row()})
        return rows


def prepare_variants(
    repo: Path, model: str, *, max_batch_size: int | None = None, max_queue_delay_us: int | None = None
) -> tuple[str, str]:
    src = Path(repo) / model
    config = read_config(src)
    if config.max_batch_size == 0 and max_batch_size is None:
        raise PerfError(
            f"model '{model}' has max_batch_size 0 (no batch dimension): dynamic batching cannot be compared"
        )
    delay = max_queue_delay_us
    if delay is None and not config.HasField("dynamic_batching"):
        delay = 1000
    batched, unbatched = f"{model}__batched", f"{model}__unbatched"
    try:
        make_variant(src, repo, batched, VariantSpec(dynamic_batching=True, max_batch_size=max_batch_size, max_queue_delay_us=delay))
        make_variant(src, repo, unbatched, VariantSpec(dynamic_batching=False, max_batch_size=max_batch_size))
    except VariantError as e:
        raise PerfError(str(e)) from None
    return batched, unbatched


def run_batching(
    target: Target,
    model: str,
    loads: list[float],
    measure: Measure,
    input_args: list[str],
    workdir: Path,
    *,
    max_batch_size: int | None = None,
    max_queue_delay_us: int | None = None,
    keep_variants: bool = False,
) -> BatchingResult:
    if target.repo is None:
        raise PerfError("--repo is needed: the variants are written into the server's model repository")
    batched, unbatched = prepare_variants(
        target.repo, model, max_batch_size=max_batch_size, max_queue_delay_us=max_queue_delay_us
    )
    loaded = []
    try:
        for name in (batched, unbatched):
            print(f"[batching] loading {name} ...", flush=True)
            target.load(name)
            loaded.append(name)
            warm_up(target, name, measure, input_args, workdir)
        result = BatchingResult([], [], batched, unbatched)
        for i, load in enumerate(loads, 1):
            for name, points in ((batched, result.batched), (unbatched, result.unbatched)):
                print(f"[batching] {name} concurrency {int(load)} ({i}/{len(loads)}) ...", end="", flush=True)
                p = measure_point(target, name, load, measure, input_args, workdir=workdir)
                points.append(p)
                print(
                    f" {p.throughput:.1f}/s  p99 {p.p99_ms:.2f} ms  server batch {p.server_avg_batch:.2f}",
                    flush=True,
                )
        return result
    finally:
        if not keep_variants:
            for name in loaded:
                target.unload(name)
            for name in (batched, unbatched):
                remove_variant(Path(target.repo) / name)


def write_outputs(result: BatchingResult, out: Path, model: str) -> list[Path]:
    files = [
        report.write_csv(out / "batching.csv", result.summary_rows()),
        report.write_csv(out / "batching_points.csv", result.detail_rows()),
    ]
    fig, (ax1, ax2) = report.pyplot().subplots(1, 2, figsize=(11, 4.2))
    conc = [int(p.load) for p in result.batched]
    ax1.plot(conc, [p.throughput for p in result.batched], "o-", label="dynamic batching")
    ax1.plot(conc, [p.throughput for p in result.unbatched], "s-", label="no batching")
    ax2.plot(conc, [p.p99_ms for p in result.batched], "o-", label="batched p99")
    ax2.plot(conc, [p.p50_ms for p in result.batched], "o--", label="batched p50")
    ax2.plot(conc, [p.p99_ms for p in result.unbatched], "s-", label="unbatched p99")
    ax2.plot(conc, [p.p50_ms for p in result.unbatched], "s--", label="unbatched p50")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xticks(conc, [str(c) for c in conc])
    report.style_axes(ax1, "concurrency", "throughput (inferences/s)", f"{model}: throughput", legend_size=None)
    ax1.legend()
    report.style_axes(ax2, "concurrency", "latency (ms)", "latency")
    files.append(report.save_figure(fig, out / "batching.png"))
    return files


def add_parser(sub) -> None:
    p = harness.harness_parser(sub, "batching", "dynamic batching on vs off: throughput, latency, server batch size")
    p.add_argument("--concurrency", default="1,2,4,8,16,32,64", help="list '1,2,4' or doubling range '1:64' (default 1..64)")
    p.add_argument("--max-batch-size", type=int, default=None, help="max_batch_size of both variants (default: the model's)")
    p.add_argument("--max-queue-delay-us", type=int, default=None, help="queue delay of the batched variant (default: the model's, else 1000)")
    p.add_argument("--keep-variants", action="store_true", help="leave the two variants loaded and on disk")
    harness.add_harness_args(p, "batching", main)


def main(args: argparse.Namespace) -> int:
    loads = harness.loads_from(args.concurrency)
    out = report.results_dir(args.results, "batching")
    with harness.open_measurement(args, out, decoupled_advice="use `tritonlm perf llm` for it") as (target, setup):
        result = run_batching(
            target, args.model, loads, setup.measure, setup.input_args, setup.workdir,
            max_batch_size=args.max_batch_size, max_queue_delay_us=args.max_queue_delay_us, keep_variants=args.keep_variants,
        )
    print()
    print(
        report.table(
            result.summary_rows(),
            ["concurrency", "batched_per_s", "unbatched_per_s", "gain", "batched_p99_ms", "unbatched_p99_ms", "batched_avg_batch", "unbatched_avg_batch"],
            title=f"dynamic batching on vs off: {args.model}",
        )
    )
    gains = result.gains()
    best = max(range(len(gains)), key=lambda i: gains[i])
    print(f"\nbest gain {gains[best]:.2f}x at concurrency {int(result.batched[best].load)}")
    for f in write_outputs(result, out, args.model):
        print(f"wrote {f}")
    return 0
