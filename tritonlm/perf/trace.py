"""Open-loop workloads: when each request arrives and how long its prompt and answer are.

Two kinds of arrival spec, one syntax:

- poisson:RATE, gamma:RATE:CV     the seeded processes of arrivals.py; every request has the
                                  same prompt and output length (--prompt-tokens, --output-tokens);
- azure-conv:RATE, azure-code:RATE, trace:PATH:RATE
                                  a recorded trace replayed: the Azure LLM inference trace 2023
                                  (a 5-minute slice of its conversation / code services ships in
                                  tritonlm/perf/data/, see its README for source and license), or
                                  any CSV of its schema (TIMESTAMP, ContextTokens, GeneratedTokens).

A trace is replayed at RATE requests per second on average by multiplying every gap between
arrivals by one factor, so the gaps' coefficient of variation (the bursts and lulls) is the
trace's own; a run of a set count of requests is a window of the trace, scaled so that its
own mean rate is RATE. The seed picks the row the replay starts at; past the last row it goes on from
the first, after one mean gap. Token counts are scaled to fit the served model: each length
is multiplied so that the trace's 99th percentile becomes the longest allowed length, then
clipped to [1, longest]. A plain linear scale keeps the shape of the length distribution; the
99th percentile rather than the maximum keeps one outlier from shrinking every other request.
"""

from __future__ import annotations

import csv
import math
import random
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from tritonlm.perf.arrivals import KINDS as PROCESS_KINDS
from tritonlm.perf.arrivals import ArrivalProcess
from tritonlm.perf.stats import percentile
from tritonlm.perf.target import PerfError

DATA_DIR = Path(__file__).resolve().parent / "data"
BUILTIN_TRACES = {
    "azure-conv": DATA_DIR / "azure_llm_2023_conv_5min.csv",
    "azure-code": DATA_DIR / "azure_llm_2023_code_5min.csv",
}
COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
FORMS = "'poisson:RATE', 'gamma:RATE:CV', 'azure-conv:RATE', 'azure-code:RATE' or 'trace:PATH:RATE'"
LENGTH_QUANTILE = 99.0  # the trace's length at this percentile becomes the longest allowed


@dataclass(frozen=True)
class TraceRow:
    at_s: float  # seconds after the trace's first row
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class ScheduledRequest:
    at_s: float  # when to send it, seconds after the run's start
    prompt_tokens: int
    output_tokens: int


def _timestamp(text: str) -> datetime:
    # the trace writes 7 fractional digits; datetime reads at most 6
    day, _, frac = text.strip().partition(".")
    return datetime.fromisoformat(day + ("." + frac[:6] if frac else ""))


def read_trace(path: Path) -> list[TraceRow]:
    """The rows of a trace CSV, times relative to its first row; a clear error for a file that
    is not one."""
    path = Path(path)
    try:
        f = open(path, newline="")
    except OSError as e:
        raise PerfError(f"trace {path}: cannot read it ({e.strerror})") from None
    rows: list[TraceRow] = []
    start = None
    with f:
        reader = csv.DictReader(f)
        missing = [c for c in COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise PerfError(f"trace {path}: no column {', '.join(missing)}; a trace CSV has the columns {', '.join(COLUMNS)}")
        for line, r in enumerate(reader, 2):
            try:
                when = _timestamp(r["TIMESTAMP"])
                prompt, output = int(r["ContextTokens"]), int(r["GeneratedTokens"])
            except (TypeError, ValueError):
                raise PerfError(f"trace {path}:{line}: expected a timestamp and two token counts, got {list(r.values())}") from None
            if prompt < 1 or output < 1:
                raise PerfError(f"trace {path}:{line}: token counts must be positive, got {prompt} and {output}")
            start = start or when
            at = (when - start).total_seconds()
            if rows and at < rows[-1].at_s:
                raise PerfError(f"trace {path}:{line}: timestamps must not go back in time ({r['TIMESTAMP']})")
            rows.append(TraceRow(at, prompt, output))
    if len(rows) < 2 or rows[-1].at_s <= 0:
        raise PerfError(f"trace {path}: needs at least two rows at different times, has {len(rows)}")
    return rows


def gaps_cv(gaps: list[float]) -> float:
    """Coefficient of variation of gaps (population standard deviation / mean)."""
    mean = sum(gaps) / len(gaps)
    return math.sqrt(sum((g - mean) ** 2 for g in gaps) / len(gaps)) / mean


def scale_lengths(lengths: list[int], longest: int) -> list[int]:
    """Each length times longest / (the lengths' 99th percentile), rounded, clipped to [1, longest]."""
    if longest < 1:
        raise PerfError(f"the longest length must be at least 1 token, got {longest}")
    factor = longest / percentile(lengths, LENGTH_QUANTILE)
    return [min(longest, max(1, round(n * factor))) for n in lengths]


@dataclass(frozen=True)
class TraceArrivals:
    """A trace replayed at `rate` requests per second on average (see the module's docstring)."""

    name: str  # azure-conv, azure-code or trace:PATH
    path: Path
    rate: float
    _rows: list[TraceRow] = field(default_factory=list, compare=False, repr=False)

    def __post_init__(self):
        if not (self.rate > 0 and math.isfinite(self.rate)):
            raise PerfError(f"arrivals: the rate must be a positive number of requests per second, got {self.rate}")
        if not self._rows:
            self._rows.extend(read_trace(self.path))

    @property
    def rows(self) -> list[TraceRow]:
        return self._rows

    @property
    def recorded_rate(self) -> float:
        """The trace's own mean rate, requests per second."""
        return (len(self.rows) - 1) / self.rows[-1].at_s

    def _cycle(self, seed: int):
        """(gap before this arrival in seconds at `rate`, its row's index), forever, from a seeded row."""
        rows = self.rows
        mean_gap = rows[-1].at_s / (len(rows) - 1)
        factor = self.recorded_rate / self.rate  # one factor for every gap: their CV stays the trace's
        i = random.Random(seed).randrange(len(rows))
        while True:
            gap = rows[i].at_s - rows[i - 1].at_s if i > 0 else mean_gap  # the wrap from the last row: one mean gap
            yield gap * factor, i
            i = (i + 1) % len(rows)

    def requests(self, seed: int, *, count: int | None = None, duration_s: float | None = None) -> list[tuple[float, int]]:
        """(arrival time, row index) of `count` arrivals, or of those in [0, duration_s).

        `count` arrivals are a window of the trace, and a short window can be far busier or
        quieter than the whole trace: their times are scaled once more so that the window's
        own mean rate is `rate` (the gaps' shape within it is untouched), else the load
        offered would not be the load asked for."""
        out, t = [], 0.0
        for gap, i in self._cycle(seed):
            t += gap
            if (count is not None and len(out) >= count) or (duration_s is not None and t >= duration_s):
                break
            out.append((t, i))
        if count is not None and out and out[-1][0] > 0:  # a window of simultaneous arrivals stays a burst at 0
            stretch = count / self.rate / out[-1][0]  # the mean gap (first one from 0) becomes 1 / rate
            out = [(t * stretch, i) for t, i in out]
        return out

    def gaps(self, count: int, seed: int) -> list[float]:
        """`count` gaps between arrivals (the first one's from time 0), as ArrivalProcess.gaps."""
        times = [t for t, _ in self.requests(seed, count=count)]
        return [b - a for a, b in zip([0.0, *times], times)]


Arrivals = ArrivalProcess | TraceArrivals


def parse_arrivals(text: str) -> Arrivals:
    """One of FORMS."""
    spec = text.strip()
    kind, _, rest = spec.partition(":")
    if kind in PROCESS_KINDS:
        try:
            return ArrivalProcess.parse(spec)
        except PerfError as e:
            raise PerfError(f"{e}; or a trace: {FORMS}") from None
    if kind in BUILTIN_TRACES or kind == "trace":
        path_text, _, rate_text = rest.rpartition(":")
        if kind in BUILTIN_TRACES and path_text:
            raise PerfError(f"arrivals: {text!r} is not {FORMS}")
        path = BUILTIN_TRACES[kind] if kind in BUILTIN_TRACES else Path(path_text)
        if kind == "trace" and not path_text:
            raise PerfError(f"arrivals: {text!r} names no trace file; use 'trace:PATH:RATE' (e.g. trace:conv.csv:2)")
        try:
            rate = float(rate_text)
        except ValueError:
            raise PerfError(f"arrivals: {text!r} is not {FORMS}") from None
        return TraceArrivals(kind if kind in BUILTIN_TRACES else f"trace:{path}", path, rate)
    raise PerfError(f"arrivals: {text!r} is not {FORMS}")


def with_rate(arrivals: Arrivals, rate: float) -> Arrivals:
    """The same arrivals at another mean rate."""
    if isinstance(arrivals, TraceArrivals):
        return TraceArrivals(arrivals.name, arrivals.path, rate, list(arrivals.rows))
    return ArrivalProcess(arrivals.kind, rate, arrivals.cv)


def describe_arrivals(arrivals: Arrivals) -> str:
    if isinstance(arrivals, TraceArrivals):
        return f"{arrivals.name}:{arrivals.rate:g}"
    return f"{arrivals.kind}:{arrivals.rate:g}" + (f":{arrivals.cv:g}" if arrivals.kind == "gamma" else "")


def build_schedule(
    arrivals: Arrivals, *, seed: int, prompt_tokens: int, output_tokens: int, count: int | None = None, duration_s: float | None = None
) -> list[ScheduledRequest]:
    """The requests of one run, in arrival order: `count` of them, or those arriving within
    duration_s. A process gives every request prompt_tokens and output_tokens; a trace scales
    its lengths so that its 99th percentiles become those (the module's docstring)."""
    if (count is None) == (duration_s is None):
        raise PerfError("a schedule needs either a count of requests or a duration")
    if count is not None and count < 1:
        raise PerfError(f"--count: at least 1 request, got {count}")
    if duration_s is not None and not (duration_s > 0 and math.isfinite(duration_s)):
        raise PerfError(f"--duration: a positive number of seconds, got {duration_s}")
    for name, value in (("--prompt-tokens", prompt_tokens), ("--output-tokens", output_tokens)):
        if value < 1:
            raise PerfError(f"{name}: at least 1 token, got {value}")
    if isinstance(arrivals, TraceArrivals):
        prompts = scale_lengths([r.prompt_tokens for r in arrivals.rows], prompt_tokens)
        outputs = scale_lengths([r.output_tokens for r in arrivals.rows], output_tokens)
        return [ScheduledRequest(t, prompts[i], outputs[i]) for t, i in arrivals.requests(seed, count=count, duration_s=duration_s)]
    if count is not None:
        times, t = [], 0.0
        for gap in arrivals.gaps(count, seed):
            t += gap
            times.append(t)
    else:
        times = arrivals.times(duration_s, seed)
    return [ScheduledRequest(t, prompt_tokens, output_tokens) for t in times]
