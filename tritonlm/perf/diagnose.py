"""`tritonlm perf diagnose`: where is this model's operating point, and what to change.

While perf_analyzer holds a load on the model, Triton's metrics endpoint
(Prometheus text) is sampled: device utilization (nv_gpu_utilization where a GPU
exists, else nv_cpu_utilization), time in queue vs in compute per request
(nv_inference_queue_duration_us, nv_inference_compute_infer_duration_us over
nv_inference_request_success), and the average batch the server formed
(nv_inference_count / nv_inference_exec_count). `classify` (a pure function)
turns that plus the measured p99 and the budget into a verdict:

- utilization < 60%                      under-batched: raise max_batch_size / max_queue_delay
- > 95% and p99 above the budget          over-batched (queue dominates) or model too big (compute dominates)
- 70-85% with p99 within the budget      on target
- otherwise: light load, near saturation, or over budget without saturation, each with its advice.
"""

from __future__ import annotations

import argparse
import threading
import time
from dataclasses import dataclass, field

from tritonlm.perf import harness, report
from tritonlm.perf.analyzer import Measure, Point, measure_point, warm_up
from tritonlm.perf.serverstats import metric_sum, parse_prometheus
from tritonlm.perf.target import Target

UNDER_BATCHED = "under-batched"
OVER_BATCHED = "over-batched"
MODEL_TOO_BIG = "model too big"
ON_TARGET = "on target"
LIGHT_LOAD = "light load"
NEAR_SATURATION = "near saturation"
OVER_BUDGET = "over budget"


@dataclass
class Sample:
    t: float  # seconds (monotonic)
    values: dict

    def total(self, name: str, model: str | None = None) -> float | None:
        """Sum of a metric over its series (only the model's series when given); None if absent."""
        return metric_sum(self.values, name, model)

    def mean(self, name: str) -> float | None:
        found = [v for (n, _), v in self.values.items() if n == name]
        return sum(found) / len(found) if found else None


@dataclass
class OperatingPoint:
    """What the classification needs; built from metric samples (or written by hand in tests)."""

    utilization: float  # 0..1
    source: str  # "gpu" | "cpu"
    p99_ms: float
    budget_ms: float
    queue_us: float = 0.0  # per request
    compute_us: float = 0.0  # per request
    avg_batch: float = 0.0
    max_batch_size: int = 0
    requests: int = 0


@dataclass
class Diagnosis:
    state: str
    summary: str
    advice: list[str] = field(default_factory=list)


def summarize_samples(samples: list[Sample], model: str) -> dict:
    """Deltas of the model's counters between the first and last sample, and mean utilization."""
    if len(samples) < 2:
        raise ValueError("need at least two metric samples")
    first, last = samples[0], samples[-1]

    def delta(name: str) -> float:
        a, b = first.total(name, model), last.total(name, model)
        return (b or 0.0) - (a or 0.0)

    gpu = [s.mean("nv_gpu_utilization") for s in samples[1:]]
    gpu = [g for g in gpu if g is not None]
    if gpu:
        source, util = "gpu", gpu
    else:
        cpu = [s.total("nv_cpu_utilization") for s in samples[1:]]
        source, util = "cpu", [c for c in cpu if c is not None]
    success = delta("nv_inference_request_success")
    inferences, executions = delta("nv_inference_count"), delta("nv_inference_exec_count")
    return {
        "source": source,
        "utilization": sum(util) / len(util) if util else float("nan"),
        "requests": int(success),
        "inferences": int(inferences),
        "executions": int(executions),
        "avg_batch": inferences / executions if executions else 0.0,
        "queue_us": delta("nv_inference_queue_duration_us") / success if success else 0.0,
        "compute_us": delta("nv_inference_compute_infer_duration_us") / success if success else 0.0,
        "seconds": last.t - first.t,
    }


def classify(op: OperatingPoint) -> Diagnosis:
    u, pct = op.utilization, f"{op.utilization * 100:.0f}%"
    over = op.p99_ms > op.budget_ms
    lat = f"p99 {op.p99_ms:.1f} ms vs budget {op.budget_ms:g} ms"
    batch = f"average batch {op.avg_batch:.1f}" + (f" of max {op.max_batch_size}" if op.max_batch_size else "")
    queue_share = op.queue_us / (op.queue_us + op.compute_us) if (op.queue_us + op.compute_us) > 0 else 0.0
    if u < 0.60:
        advice = [
            "raise max_batch_size and/or max_queue_delay_microseconds so each execution carries more requests",
            "or send more concurrent requests: the device waits for work",
        ]
        if over:
            advice.append(
                f"latency is over budget while the device idles: {queue_share * 100:.0f}% of request time is queueing; "
                "check max_queue_delay_microseconds is not larger than the budget allows"
            )
        return Diagnosis(UNDER_BATCHED, f"{op.source} utilization {pct} < 60% ({batch}; {lat})", advice)
    if u > 0.95 and over:
        if queue_share >= 0.5:
            return Diagnosis(
                OVER_BATCHED,
                f"{op.source} saturated at {pct}, {lat}; requests spend {queue_share * 100:.0f}% of their time queued ({batch})",
                [
                    "lower max_queue_delay_microseconds / max_batch_size: batches wait too long to fill",
                    "add model instances (instance_group count) or devices to drain the queue",
                ],
            )
        return Diagnosis(
            MODEL_TOO_BIG,
            f"{op.source} saturated at {pct}, {lat}; compute is {100 - queue_share * 100:.0f}% of request time ({batch})",
            [
                "each execution alone is too slow for the budget: quantize (int8), use a smaller model",
                "or add instances / devices; batching harder will not help",
            ],
        )
    if 0.70 <= u <= 0.85 and not over:
        advice = ["this is the operating point to hold; alert when utilization leaves 70-85%"]
        if op.p99_ms < 0.5 * op.budget_ms:
            advice.append("p99 is well under budget: a longer queue delay could trade latency for larger batches")
        return Diagnosis(ON_TARGET, f"{op.source} utilization {pct} with {lat} ({batch})", advice)
    if over:
        return Diagnosis(
            OVER_BUDGET,
            f"{lat} at {op.source} utilization {pct}; {queue_share * 100:.0f}% of request time is queueing ({batch})",
            [
                "lower max_queue_delay_microseconds (queueing adds straight to latency)",
                "add instances, or admit fewer concurrent requests per instance",
            ],
        )
    if u < 0.70:
        return Diagnosis(
            LIGHT_LOAD,
            f"{op.source} utilization {pct} with {lat} ({batch})",
            ["there is headroom: more load or larger batches (max_queue_delay_microseconds) fit the budget"],
        )
    return Diagnosis(
        NEAR_SATURATION,
        f"{op.source} utilization {pct} with {lat} ({batch})",
        ["little headroom left: more load will push p99 over the budget; plan instances or devices before it grows"],
    )


# --- the harness -------------------------------------------------------------------------------
def sample_during(target: Target, run, interval_s: float = 0.25) -> tuple[list[Sample], object]:
    """Call run() in a thread and sample the metrics endpoint until it returns (one sample before, one after)."""
    samples = [Sample(time.monotonic(), parse_prometheus(target.metrics_text()))]
    box: dict = {}

    def work():
        try:
            box["result"] = run()
        except BaseException as e:  # re-raised in the caller's thread
            box["error"] = e

    th = threading.Thread(target=work, daemon=True)
    th.start()
    while th.is_alive():
        th.join(timeout=interval_s)
        samples.append(Sample(time.monotonic(), parse_prometheus(target.metrics_text())))
    if "error" in box:
        raise box["error"]
    return samples, box.get("result")


def run_diagnose(
    target: Target, model: str, load: float, measure: Measure, input_args: list[str], workdir, budget_ms: float,
    *, mode: str = "concurrency", interval_s: float = 0.25,
) -> tuple[Diagnosis, OperatingPoint, Point, dict, list[Sample]]:
    samples, point = sample_during(
        target, lambda: measure_point(target, model, load, measure, input_args, mode=mode, workdir=workdir), interval_s
    )
    s = summarize_samples(samples, model)
    max_batch = int(target.config(model).get("max_batch_size", 0))
    op = OperatingPoint(
        utilization=s["utilization"] if s["utilization"] == s["utilization"] else 0.0,
        source=s["source"],
        p99_ms=point.p99_ms,
        budget_ms=budget_ms,
        queue_us=s["queue_us"],
        compute_us=s["compute_us"],
        avg_batch=s["avg_batch"],
        max_batch_size=max_batch,
        requests=s["requests"],
    )
    return classify(op), op, point, s, samples


def add_parser(sub) -> None:
    p = harness.harness_parser(sub, "diagnose", "sample Triton metrics under load and classify the operating point")
    p.add_argument("--p99-ms", type=float, required=True, help="p99 latency budget in milliseconds")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=float, default=None, help="load to hold (default concurrency 8)")
    load.add_argument("--request-rate", type=float, default=None, help="hold this request rate instead")
    p.add_argument("--sample-interval-ms", type=int, default=250, help="metrics sampling period (default 250)")
    harness.add_harness_args(p, "diagnose", main, interval_ms=3000)


def main(args: argparse.Namespace) -> int:
    mode = "request_rate" if args.request_rate else "concurrency"
    load = args.request_rate or args.concurrency or 8
    out = report.results_dir(args.results, "diagnose")
    with harness.open_measurement(args, out) as (target, setup):
        target.metrics_text()  # fail before the measurement, with a clear message, if the metrics port is wrong
        warm_up(target, args.model, setup.measure, setup.input_args, setup.workdir)
        print(
            f"[diagnose {args.model}] holding {mode.replace('_', ' ')} {load:g} while sampling {target.metrics_url} ...",
            end="",
            flush=True,
        )
        diagnosis, op, point, summary, samples = run_diagnose(
            target, args.model, load, setup.measure, setup.input_args, setup.workdir, args.p99_ms, mode=mode, interval_s=args.sample_interval_ms / 1000
        )
    print(f" {len(samples)} samples", flush=True)
    row = {
        mode: int(load) if float(load).is_integer() else load,
        "throughput_per_s": round(point.throughput, 1),
        "p99_ms": round(point.p99_ms, 2),
        "budget_ms": args.p99_ms,
        f"{op.source}_utilization": round(op.utilization, 3),
        "queue_us_per_request": round(op.queue_us, 1),
        "compute_us_per_request": round(op.compute_us, 1),
        "avg_batch": round(op.avg_batch, 2),
        "max_batch_size": op.max_batch_size,
        "state": diagnosis.state,
    }
    print()
    print(report.table([row], title=f"{args.model}: operating point"))
    print(f"\n{diagnosis.state.upper()}: {diagnosis.summary}")
    for a in diagnosis.advice:
        print(f"  - {a}")
    report.write_csv(out / "diagnose.csv", [row])
    t0 = samples[0].t
    util_name = "nv_gpu_utilization" if op.source == "gpu" else "nv_cpu_utilization"
    series = {
        f"{op.source} utilization (%)": (
            [s.t - t0 for s in samples],
            [100 * (s.mean(util_name) or 0.0) for s in samples],
        )
    }
    report.plot_xy(out / "diagnose.png", "seconds", "%", series, title=f"{args.model}: {diagnosis.state}")
    print(f"wrote {out / 'diagnose.csv'}\nwrote {out / 'diagnose.png'}")
    return 0
