"""Open-loop arrival processes, seeded: when requests arrive, whatever the server does.

Closed-loop load (N clients, each waiting for its answer) slows down with the server and
so hides queueing delay; an SLO is about what arrivals that do not wait see. Two processes:

- poisson:RATE      independent arrivals, exponential gaps (coefficient of variation 1);
- gamma:RATE:CV     gamma-distributed gaps of mean 1/RATE and coefficient of variation CV:
                    CV > 1 is bursty (clusters of arrivals, then lulls); production LLM
                    traces sit around 2-4.

`tritonlm perf arrivals` writes a schedule as perf_analyzer's --request-intervals file (one
gap in microseconds per line), so the same seeded load can drive perf_analyzer.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
from dataclasses import dataclass
from pathlib import Path

from tritonlm.perf.target import PerfError

KINDS = ("poisson", "gamma")


@dataclass(frozen=True)
class ArrivalProcess:
    kind: str  # "poisson" | "gamma"
    rate: float  # requests per second, on average
    cv: float = 1.0  # coefficient of variation of the gaps (poisson: 1)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise PerfError(f"arrivals: {self.kind!r} is not a process; use one of {', '.join(KINDS)}")
        if not (self.rate > 0 and math.isfinite(self.rate)):
            raise PerfError(f"arrivals: the rate must be a positive number of requests per second, got {self.rate}")
        if not (self.cv > 0 and math.isfinite(self.cv)):
            raise PerfError(f"arrivals: the coefficient of variation must be positive, got {self.cv}")
        if self.kind == "poisson" and self.cv != 1.0:
            raise PerfError("arrivals: a poisson process has a coefficient of variation of 1; use gamma:RATE:CV for another")

    @staticmethod
    def parse(text: str) -> "ArrivalProcess":
        """'poisson:RATE' or 'gamma:RATE:CV'."""
        parts = text.strip().split(":")
        forms = "'poisson:RATE' or 'gamma:RATE:CV' (e.g. poisson:20, gamma:20:3)"
        if parts[0] not in KINDS or len(parts) != (2 if parts[0] == "poisson" else 3):
            raise PerfError(f"arrivals: {text!r} is not {forms}")
        try:
            numbers = [float(p) for p in parts[1:]]
        except ValueError:
            raise PerfError(f"arrivals: {text!r} is not {forms}") from None
        return ArrivalProcess(parts[0], *numbers)

    def gaps(self, count: int, seed: int) -> list[float]:
        """`count` seconds between successive arrivals (the first one's from time 0)."""
        rng = random.Random(seed)
        return [self._gap(rng) for _ in range(count)]

    def times(self, duration_s: float, seed: int) -> list[float]:
        """Arrival times in [0, duration_s): the same draws as gaps() with the same seed."""
        rng = random.Random(seed)
        out, t = [], self._gap(rng)
        while t < duration_s:
            out.append(t)
            t += self._gap(rng)
        return out

    def _gap(self, rng: random.Random) -> float:
        if self.kind == "poisson":
            return rng.expovariate(self.rate)
        shape = 1.0 / (self.cv * self.cv)  # a gamma's CV is 1 / sqrt(shape)
        return rng.gammavariate(shape, 1.0 / (self.rate * shape))  # mean = shape * scale = 1 / rate


def describe(gaps: list[float]) -> tuple[float, float]:
    """(rate per second, coefficient of variation) of a list of gaps."""
    mean = statistics.fmean(gaps)
    return 1.0 / mean, statistics.pstdev(gaps) / mean


def add_parser(sub) -> None:
    p = sub.add_parser(
        "arrivals",
        help="write a seeded open-loop arrival schedule (perf_analyzer --request-intervals)",
        description="Write COUNT gaps between arrivals of a Poisson or gamma process, one per line in "
        "microseconds: the file perf_analyzer's --request-intervals reads.",
    )
    p.add_argument("process", help="'poisson:RATE' or 'gamma:RATE:CV' (RATE per second)")
    p.add_argument("--count", type=int, default=1000, help="arrivals to write (default 1000)")
    p.add_argument("--seed", type=int, default=0, help="the schedule's seed (default 0)")
    p.add_argument("--out", type=Path, required=True, help="the file to write")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    if args.count < 2:
        raise PerfError(f"--count: at least 2 arrivals, got {args.count}")
    process = ArrivalProcess.parse(args.process)
    gaps = process.gaps(args.count, args.seed)
    args.out.write_text("".join(f"{max(1, round(g * 1e6))}\n" for g in gaps))
    rate, cv = describe(gaps)
    print(f"{args.count} arrivals ({process.kind}, seed {args.seed}): {rate:.3g}/s, gap CV {cv:.2f} -> {args.out}")
    return 0
