"""Whether speculative decoding pays on this host, decided from the engine's own steps.

A speculating step makes more tokens per target pass, and costs more: the drafter's work (a
draft model's passes; little for prompt lookup) and a verify pass K + 1 tokens wide. Where
guesses are often wrong, or a guess costs nearly what a target token does (a draft model
close to the target's size, a GPU whose small steps are bound by their launches), it is
slower than decoding plainly. How much depends on the host, the batch and the text, so the
engine measures it: decode steps (no prompt chunk in them) are timed, as seconds per token
they made, with and without speculation, per bucket of batch sizes (1, 2-3, 4-7, ...). The
cheaper way runs, and now and then the other way runs PROBE_STEPS steps to bring its figure
up to date (the text changes: a quote in the prompt makes prompt lookup pay for a while):
after PROBE_EVERY steps times how many times dearer the other way was, so that timing it
costs about the same share of the time however much dearer it is (a speculating step can
cost many plain ones, as on a GPU whose small steps are bound by their launches). A bucket starts speculating, as configured, and first
tries the other way after FIRST_PROBE steps. A timing's first step is not timed: it pays for
what the other way left undone (a draft model catching up on the tokens it did not see).
Steps that ran the governor's way but whose time is not that way's alone (a prompt chunk in
them, rows that speculate whatever it says, nothing to guess) count toward these schedules
without a figure; a timing that got no figure decides nothing.

It switches only rows whose output cannot change with it: greedy rows (speculation verifies
against the target's own argmax) and sampled rows without a seed (not reproducible anyway).
A seeded sampled row speculates as configured: its tokens are a function of its seed and of
the draws that speculation makes, and must not depend on how fast the host is.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

FIRST_PROBE = 8  # steps of a bucket's first way before the other is first timed
PROBE_EVERY = 64  # steps of the chosen way between two timings of the other, times its cost ratio
PROBE_STEPS = 4  # steps of the other way per timing
SMOOTHING = 0.25  # weight of a new step in a way's running figure
HYSTERESIS = 0.95  # the other way must cost at most this share of the chosen one's to take over


@dataclass
class _Bucket:
    cost: dict[bool, float] = field(default_factory=dict)  # speculating? -> running seconds per token
    way: bool = True  # speculating, unless measured slower
    steps: int = 0  # steps of `way` since the last timing of the other
    probing: int = 0  # steps of the other way still to run (the first of them untimed)
    timed: int = 0  # of those, the steps that got a figure
    probed: bool = False  # the other way has been tried once


class SpeculationGovernor:
    """speculate(rows) before a decode step, observe(...) after it."""

    def __init__(self) -> None:
        self._buckets: dict[int, _Bucket] = {}

    @staticmethod
    def bucket_of(rows: int) -> int:
        return max(rows, 1).bit_length()  # 1, 2-3, 4-7, ...

    def _bucket(self, rows: int) -> _Bucket:
        return self._buckets.setdefault(self.bucket_of(rows), _Bucket())

    def speculate(self, rows: int) -> bool:
        """Whether a step of `rows` decoding rows speculates (for the rows it may switch)."""
        b = self._bucket(rows)
        return b.way if b.probing == 0 else not b.way

    def observe(self, rows: int, speculated: bool, seconds: float | None, tokens: int) -> None:
        """A step of `rows` rows ran the way speculate() said (`speculated`), in `seconds`,
        making `tokens`; seconds None: its time is not that way's alone, so it only counts."""
        b = self._bucket(rows)
        timed = seconds is not None and seconds > 0 and tokens > 0
        if b.probing:
            if speculated == b.way:  # not the way speculate() gave
                return
            if timed and b.probing <= PROBE_STEPS:  # a timing's first step is not timed
                self._record(b, speculated, seconds / tokens)
                b.timed += 1
            b.probing -= 1
            if b.probing == 0 and b.timed:
                self._decide(b, rows)
            return
        if speculated != b.way:
            return
        if timed:
            self._record(b, speculated, seconds / tokens)
        b.steps += 1
        if not b.probed:
            due = FIRST_PROBE
        elif len(b.cost) < 2:  # a way not timed yet: its steps were never the governor's alone
            due = PROBE_EVERY
        else:
            due = PROBE_EVERY * max(1.0, b.cost[not b.way] / b.cost[b.way])
        if b.steps >= due:
            b.steps, b.probing, b.timed, b.probed = 0, PROBE_STEPS + 1, 0, True

    @staticmethod
    def _record(b: _Bucket, way: bool, per_token: float) -> None:
        before = b.cost.get(way)
        b.cost[way] = per_token if before is None else before + SMOOTHING * (per_token - before)

    @staticmethod
    def _decide(b: _Bucket, rows: int) -> None:
        other = not b.way
        if b.way in b.cost and b.cost[other] < HYSTERESIS * b.cost[b.way]:
            log.info("speculation %s for steps of %d+ rows: %.3f ms a token with it, %.3f ms without",
                     "on" if other else "off", 1 << (SpeculationGovernor.bucket_of(rows) - 1),
                     b.cost[True] * 1e3, b.cost[False] * 1e3)
            b.way = other

    def state(self) -> dict[int, tuple[bool, dict[bool, float]]]:
        """bucket -> (speculating?, its figures): for logs and tests."""
        return {k: (b.way, dict(b.cost)) for k, b in self._buckets.items()}
