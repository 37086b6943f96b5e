"""One perf_analyzer measurement at one load point, with the server's own counters around it.

Each point is a separate perf_analyzer run (one concurrency or one request rate):
the harness can print progress between points, stop a sweep early once the
latency budget is blown, and attribute the server's statistics delta
(inference_count, execution_count) to exactly that point.

Two ways to measure:
- time windows (default): perf_analyzer's own stabilization (-p/-s/-r); figures
  come from its `-f` CSV. The server delta also counts requests sent outside the
  measured windows, so it is a little larger than perf_analyzer's request count.
- request count (`requests=N`): exactly N requests, no stability check; the
  server delta then equals N. Throughput comes from the profile export's
  timestamps (perf_analyzer's CSV divides by a fixed window in this mode).
"""

from __future__ import annotations

import csv
import json
import logging
import re
import subprocess
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path

from tritonlm.paths import StackError, perf_analyzer_binary, perf_analyzer_env
from tritonlm.perf.target import ModelStats, PerfError, Target

log = logging.getLogger(__name__)


@dataclass
class PerfResult:
    returncode: int
    stdout: str
    stderr: str


def run_perf_analyzer(args: list[str], timeout_s: float = 600.0) -> PerfResult:
    """perf_analyzer with these arguments, to its end; its output captured."""
    proc = subprocess.run(
        [str(perf_analyzer_binary()), *args],
        env=perf_analyzer_env(),
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    return PerfResult(proc.returncode, proc.stdout, proc.stderr)


def read_perf_csv(path) -> list[dict[str, float]]:
    """Rows of perf_analyzer's `-f FILE` CSV (one per concurrency or rate), numbers as floats.
    Latency columns are in microseconds, as perf_analyzer writes them."""
    rows = []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            parsed = {}
            for key, value in row.items():
                if key is None:
                    continue
                try:
                    parsed[key.strip()] = float(value)
                except (TypeError, ValueError):
                    pass
            if parsed:
                rows.append(parsed)
    return rows


@dataclass(frozen=True)
class Measure:
    measurement_ms: int = 2000
    max_trials: int = 6
    stability: float = 10.0  # perf_analyzer -s, percent
    requests: int | None = None  # request-count mode: exactly this many requests per point
    protocol: str = "http"  # "http" | "grpc"
    streaming: bool = False  # decoupled models over gRPC
    retry_unstable: bool = True  # one more try with relaxed stability when perf_analyzer gives up
    timeout_s: float = 600.0
    export: bool = True  # allow the profile export (off for warm-up runs)


@dataclass
class Point:
    model: str
    mode: str  # "concurrency" | "request_rate"
    load: float
    throughput: float  # inferences (requests) per second
    p50_ms: float
    p90_ms: float
    p95_ms: float
    p99_ms: float
    avg_ms: float
    client_requests: int  # requests perf_analyzer measured (its profile export)
    server: ModelStats  # the server's statistics delta over the whole perf_analyzer run
    pa_server_inferences: int = 0  # what perf_analyzer's report says the server did in its windows
    pa_server_executions: int = 0
    queue_us: float = 0.0
    compute_infer_us: float = 0.0
    response_throughput: float = 0.0  # decoupled models: responses per second
    relaxed: bool = False  # measured with relaxed stability after a first unstable try
    export: dict = field(default_factory=dict, repr=False)

    @property
    def server_avg_batch(self) -> float:
        return self.server.avg_batch

    def row(self) -> dict:
        return {
            "model": self.model,
            self.mode: _num(self.load),
            "throughput_per_s": round(self.throughput, 2),
            "p50_ms": round(self.p50_ms, 3),
            "p90_ms": round(self.p90_ms, 3),
            "p95_ms": round(self.p95_ms, 3),
            "p99_ms": round(self.p99_ms, 3),
            "avg_ms": round(self.avg_ms, 3),
            "pa_requests": self.client_requests,
            "server_inferences": self.server.inference_count,
            "server_executions": self.server.execution_count,
            "server_avg_batch": round(self.server_avg_batch, 3),
            "queue_us": round(self.queue_us, 1),
            "compute_infer_us": round(self.compute_infer_us, 1),
        }


def _num(v: float):
    return int(v) if float(v).is_integer() else v


_USAGE = re.compile(r"^Usage:", re.M)
_ERRORISH = re.compile(r"error|failed|unable|invalid|cannot|can't|not found|unknown|must|unsupported", re.I)


def error_text(stdout: str, stderr: str) -> str:
    """perf_analyzer's own words about why it failed, on one line (its usage text left out)."""
    chunks = []
    for text in (stderr, stdout):
        m = _USAGE.search(text)
        chunks.append(text[: m.start()] if m else text)
    lines = [ln.strip() for ln in "\n".join(chunks).splitlines() if ln.strip()]
    errs = [ln for ln in lines if _ERRORISH.search(ln)]
    picked = (errs or lines[-3:])[:3]
    seen = []
    for ln in picked:
        if ln not in seen:
            seen.append(ln)
    return " | ".join(seen) or "no output"


def _stdout_counts(stdout: str) -> dict[str, int]:
    out = {}
    for key, pattern in (
        ("requests", r"^\s*Request count:\s*(\d+)"),
        ("inferences", r"^\s*Inference count:\s*(\d+)"),
        ("executions", r"^\s*Execution count:\s*(\d+)"),
    ):
        found = re.findall(pattern, stdout, re.M)
        if found:
            out[key] = int(found[-1])
    return out


def export_span_s(export: dict) -> float:
    """Seconds from the first request sent to the last response received, over all experiments."""
    starts, ends = [], []
    for exp in export.get("experiments", []):
        for r in exp.get("requests", []):
            starts.append(r["timestamp"])
            ends.extend(r.get("response_timestamps", []) or [r["timestamp"]])
    if not starts:
        return 0.0
    return (max(ends) - min(starts)) / 1e9


def export_requests(export: dict) -> int:
    return sum(len(e.get("requests", [])) for e in export.get("experiments", []))


def wants_export(measure: Measure) -> bool:
    """The profile export holds every response's outputs (all the logits of a forward model):
    written only where the timestamps are needed, streaming metrics and request-count throughput."""
    return measure.export and bool(measure.streaming or measure.requests)


def _export_complete(export: Path) -> bool:
    """The profile export exists and is whole JSON (or was not asked for)."""
    if not export.exists():
        return True
    try:
        json.loads(export.read_text())
        return True
    except json.JSONDecodeError:
        return False


def build_command(model: str, target: Target, mode: str, load: float, measure: Measure, csv: Path, export: Path) -> list[str]:
    url = target.grpc_url if measure.protocol == "grpc" else target.http_url
    args = ["-m", model, "-u", url, "-i", measure.protocol]
    if mode == "concurrency":
        args += ["--concurrency-range", str(int(load))]
    elif mode == "request_rate":
        args += ["--request-rate-range", f"{load:g}"]
    else:
        raise ValueError(f"unknown load mode {mode!r}")
    args += ["-p", str(measure.measurement_ms), "-r", str(measure.max_trials), "-s", f"{measure.stability:g}"]
    if measure.requests:
        args += ["--request-count", str(measure.requests)]
    if measure.streaming:
        args.append("--streaming")
    args += ["-f", str(csv), "--verbose-csv"]
    if wants_export(measure):
        args += ["--profile-export-file", str(export)]
    return args


def measure_point(
    target: Target,
    model: str,
    load: float,
    measure: Measure,
    input_args: list[str],
    *,
    mode: str = "concurrency",
    workdir: Path | None = None,
    extra_args: Iterable[str] = (),
) -> Point:
    """Run perf_analyzer once at one load; raise PerfError with its own error text when it fails."""
    work = Path(workdir or tempfile.mkdtemp(prefix="tritonlm-perf-"))
    work.mkdir(parents=True, exist_ok=True)
    relaxed = False
    for attempt in range(2):
        tag = f"{model}_{mode}_{_num(load)}" + ("_retry" if attempt else "")
        csv, export = work / f"{tag}.csv", work / f"{tag}.export.json"
        for p in (csv, export):
            p.unlink(missing_ok=True)  # perf_analyzer refuses an existing export path
        cmd = build_command(model, target, mode, load, measure, csv, export) + list(input_args) + list(extra_args)
        log.debug("perf_analyzer %s", " ".join(cmd))
        before = target.stats(model)
        try:
            result = run_perf_analyzer(cmd, timeout_s=measure.timeout_s)
        except StackError as e:
            raise PerfError(str(e)) from None
        except subprocess.TimeoutExpired:
            if attempt == 0:
                # perf_analyzer can stall on its own side, with nothing in flight on the
                # server: one more try before the model is blamed
                print(f" perf_analyzer did not finish within {measure.timeout_s:.0f} s, measuring again ...",
                      end="", flush=True)
                continue
            raise PerfError(
                f"perf_analyzer did not finish within {measure.timeout_s:.0f} s at {mode} {_num(load)}: "
                "the model may never complete its requests (a decoupled model must send a final response)"
            ) from None
        after = target.stats(model)
        out = result.stdout + result.stderr
        if result.returncode == 0 and csv.exists():
            if _export_complete(export) or attempt == 1:
                break
            # perf_analyzer can exit 0 with its CSV written and an empty or cut-off export
            # (a busy host): measure this point again rather than fail
            print(" perf_analyzer left an empty profile export, measuring again ...", end="", flush=True)
            continue
        if "Failed to obtain stable measurement" in out and measure.retry_unstable and attempt == 0:
            print(" no stable window, retrying with relaxed stability ...", end="", flush=True)
            measure = replace(measure, stability=max(2 * measure.stability, 50.0), max_trials=measure.max_trials + 2)
            relaxed = True
            continue
        if result.returncode < 0:
            sig = -result.returncode
            why = f"killed by signal {sig}" + (" (SIGKILL: out of memory?)" if sig == 9 else "")
            raise PerfError(f"perf_analyzer was {why} at {mode} {_num(load)}; last output: {error_text(result.stdout, result.stderr)}")
        raise PerfError(f"perf_analyzer failed (exit {result.returncode}) at {mode} {_num(load)}: {error_text(result.stdout, result.stderr)}")
    rows = read_perf_csv(csv)
    if not rows:
        raise PerfError(f"perf_analyzer wrote no results to {csv}: {error_text(result.stdout, result.stderr)}")
    row = rows[-1]
    try:
        data = json.loads(export.read_text()) if export.exists() else {}
    except json.JSONDecodeError as e:
        raise PerfError(
            f"perf_analyzer's profile export {export} is incomplete ({export.stat().st_size} bytes: {e.msg}); "
            "was it killed, or the disk full?"
        ) from None
    counts = _stdout_counts(result.stdout)
    n_requests = export_requests(data) or counts.get("requests", 0)
    throughput = row.get("Inferences/Second", 0.0)
    if measure.requests:
        span = export_span_s(data)
        throughput = n_requests / span if span > 0 else 0.0
    us = 1e-3
    p50 = row.get("p50 latency", 0.0) * us
    return Point(
        model=model,
        mode=mode,
        load=load,
        throughput=throughput,
        p50_ms=p50,
        p90_ms=row.get("p90 latency", 0.0) * us,
        p95_ms=row.get("p95 latency", 0.0) * us,
        p99_ms=row.get("p99 latency", 0.0) * us,
        avg_ms=row.get("Avg latency", p50 / us) * us,
        client_requests=n_requests,
        server=after - before,
        pa_server_inferences=counts.get("inferences", 0),
        pa_server_executions=counts.get("executions", 0),
        queue_us=row.get("Server Queue", 0.0),
        compute_infer_us=row.get("Server Compute Infer", 0.0),
        response_throughput=row.get("Response Throughput", 0.0),
        relaxed=relaxed,
        export=data,
    )


def warm_up(
    target: Target, model: str, measure: Measure, input_args: list[str], workdir: Path | None = None,
    requests: int = 16, timeout_s: float = 180.0,
) -> None:
    """A few untimed requests, so a freshly loaded model's first executions do not land in a measurement
    (and a model that never answers is caught in minutes, not at the measurement's timeout)."""
    m = replace(measure, requests=requests, retry_unstable=False, export=False, timeout_s=min(timeout_s, measure.timeout_s))
    work = Path(workdir or tempfile.mkdtemp(prefix="tritonlm-perf-")) / "warmup"
    try:
        measure_point(target, model, 2, m, input_args, workdir=work)
    except PerfError as e:
        raise PerfError(f"warm-up of '{model}' failed: {e}") from None


def sweep(
    target: Target,
    model: str,
    loads: list[float],
    measure: Measure,
    input_args: list[str],
    *,
    mode: str = "concurrency",
    workdir: Path | None = None,
    label: str = "",
    stop: Callable[[Point], bool] | None = None,
    extra_args: Iterable[str] = (),
) -> list[Point]:
    """Measure each load in turn, printing one progress line per point; `stop(point)` ends the sweep early."""
    points = []
    for i, load in enumerate(loads, 1):
        print(f"[{label or model}] {mode} {_num(load)} ({i}/{len(loads)}) ...", end="", flush=True)
        try:
            p = measure_point(target, model, load, measure, input_args, mode=mode, workdir=workdir, extra_args=extra_args)
        except PerfError:
            print(" failed", flush=True)
            raise
        points.append(p)
        print(
            f" {p.throughput:.1f}/s  p50 {p.p50_ms:.2f} ms  p99 {p.p99_ms:.2f} ms  server batch {p.server_avg_batch:.2f}"
            + ("  (relaxed stability)" if p.relaxed else ""),
            flush=True,
        )
        if stop is not None and stop(p):
            break
    return points


def parse_loads(text: str) -> list[float]:
    """'1,2,4,8' -> those; '1:64' -> doubling 1,2,4,...,64; '10:50:10' -> 10,20,...,50."""
    text = text.strip()
    try:
        if ":" in text:
            parts = [float(x) for x in text.split(":")]
            if len(parts) == 2:
                lo, hi = parts
                if lo <= 0 or hi < lo:
                    raise ValueError
                out, v = [], lo
                while v <= hi + 1e-9:
                    out.append(v)
                    v *= 2
                return out
            lo, hi, step = parts
            if step <= 0 or hi < lo:
                raise ValueError
            n = int(round((hi - lo) / step)) + 1
            return [lo + i * step for i in range(n)]
        values = [float(x) for x in text.split(",") if x.strip()]
        if not values or any(v <= 0 for v in values):
            raise ValueError
        return values
    except ValueError:
        raise ValueError(f"load list {text!r}: use '1,2,4,8', 'START:END' (doubling) or 'START:END:STEP'") from None
