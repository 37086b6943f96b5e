"""The SLO controller: the step's token budget, the running cap and admission, chosen from
the step-time model so that running streams keep slo_tpot and new requests slo_ttft
(the package's docstring says how)."""

from __future__ import annotations

import heapq
import logging
import math
from dataclasses import dataclass

from tritonlm.engine.request import ServerBusyError
from tritonlm.engine.slo.ledger import SloTargets
from tritonlm.engine.slo.step_time import StepTimeModel

log = logging.getLogger(__name__)

QUANTUM = 16  # token budgets move in steps of this many tokens (one KV block by default)
HEADROOM = 0.9  # plan steps to this fraction of slo_tpot: the fit's error and the host's noise
GROW_FRACTION = 0.1  # a decision rises only when the model allows this much more (dead band)
SMOOTH_ALPHA = 0.1  # weight of each step's targets in the smoothed ones (~10 steps)
ROW_CONTEXT_ALPHA = 0.02  # weight of each step in a decoding row's typical context
OUTPUT_RATIO_ALPHA = 0.1  # weight of each finished request in the output-length estimate
# the first steps after a load pay one-time costs (allocations, thread teams starting, caches
# cold, a GPU's kernel compiles): they are not the host's pace, and a fit that learned them
# would shed requests the host can serve
COLD_STEPS = 4


class SloShedError(ServerBusyError):
    """Refused at arrival: the request's predicted time to first token is past slo_ttft_ms.
    The message starts with "overloaded:" (the OpenAI layer answers 503 + Retry-After)."""


@dataclass(frozen=True)
class Decision:
    budget: int  # tokens in the next step
    cap: int  # running sequences
    step_s: float  # predicted seconds of a step at this budget: the running streams' TPOT


class SloController:
    def __init__(self, targets: SloTargets, max_num_seqs: int, max_num_batched_tokens: int,
                 model: StepTimeModel | None = None):
        """max_num_seqs / max_num_batched_tokens: the configured knobs, never exceeded; they
        hold until the model has seen enough steps, and wherever no SLO bounds them."""
        self.targets = targets
        self.max_seqs = max_num_seqs
        self.max_tokens = max_num_batched_tokens
        self.model = model or StepTimeModel()
        self.budget = max_num_batched_tokens
        self.cap = max_num_seqs
        self.step_s = 0.0
        self.predicted_ttft_s = 0.0  # the last admission's prediction
        self.output_ratio = 1.0  # generated / max_tokens of finished requests (EWMA): slots free sooner than max_tokens
        self.changes = 0  # decisions that changed budget or cap
        self.row_context = 0.0  # cached positions of a decoding row (EWMA over steps)
        self._smooth_budget = float(max_num_batched_tokens)  # the model's targets, smoothed over steps
        self._smooth_cap = float(max_num_seqs)
        self._primed = False
        self.steps_seen = 0  # steps reported, the cold ones included

    # ---- what the engine reports -------------------------------------------------------------
    def observe_step(self, tokens: int, context: int, seconds: float) -> None:
        self.steps_seen += 1
        if self.steps_seen > COLD_STEPS:
            self.model.observe(tokens, context, seconds)

    def request_finished(self, generated: int, max_tokens: int) -> None:
        ratio = min(1.0, generated / max_tokens) if max_tokens > 0 else 1.0
        self.output_ratio += OUTPUT_RATIO_ALPHA * (ratio - self.output_ratio)

    # ---- the scheduler's knobs ----------------------------------------------------------------
    def decide(self, running) -> Decision:
        """The next step's budget and the running cap, given the running sequences."""
        budget, cap = self.max_tokens, self.max_seqs
        decoding = [s for s in running if not s.in_prefill]
        context = sum(s.num_computed + 1 for s in decoding)
        if decoding:  # the cap plans for a typical row, not for the mix of this instant
            self.row_context += ROW_CONTEXT_ALPHA * (context / len(decoding) - self.row_context)
        per_row = self.row_context
        if self.model.ready and self.targets.tpot_s is not None:
            a, b, c = self.model.coefficients
            tau = self.targets.tpot_s * HEADROOM
            # a prefill chunk reads its own positions too: one row's worth beside the decodes
            room = tau - a - c * (context + per_row)
            per_seq = b + c * per_row
            cap_room = tau - a - (b * QUANTUM + c * per_row)  # every step keeps room for a prefill chunk
            # the raw targets carry the fit's noise (a steady load barely tells the intercept
            # from the per-row cost): they are smoothed over steps before they decide
            raw_budget = min(room / b, self.max_tokens) if b > 0 else self.max_tokens
            raw_cap = min(cap_room / per_seq, self.max_seqs) if per_seq > 0 else self.max_seqs
            alpha = SMOOTH_ALPHA if self._primed else 1.0  # the first fit's targets at once
            self._primed = True
            self._smooth_budget += alpha * (raw_budget - self._smooth_budget)
            self._smooth_cap += alpha * (raw_cap - self._smooth_cap)
            budget = int(self._smooth_budget)
            if budget > QUANTUM:
                budget -= budget % QUANTUM
            # decode rows run whatever the budget: a budget below them only stops prefill,
            # which the cap prevents; this floor keeps a chunk moving when the host slows
            budget = _clamp(budget, min(QUANTUM, self.max_tokens), self.max_tokens)
            cap = _clamp(int(self._smooth_cap), 1, self.max_seqs)
        self._apply(budget, cap)
        self.step_s = self.model.predict(self.budget, int(context + per_row))
        return Decision(self.budget, self.cap, self.step_s)

    def _apply(self, budget: int, cap: int) -> None:
        """Down when the model asks for less than all but a sliver of the current value (the
        headroom covers the sliver), up only past a dead band: noise in the fit does not make
        the decisions flutter."""
        new_budget = _banded(self.budget, budget, QUANTUM, self.max_tokens)
        new_cap = _banded(self.cap, cap, 1, self.max_seqs)
        if (new_budget, new_cap) != (self.budget, self.cap):
            self.changes += 1
            a, b, c = self.model.coefficients
            log.info(
                "SLO controller: token budget %d -> %d, running cap %d -> %d (step model: %.2f ms + %.3f ms/token "
                "+ %.2f us/cached position)", self.budget, new_budget, self.cap, new_cap, a * 1e3, b * 1e3, c * 1e6)
            self.budget, self.cap = new_budget, new_cap

    # ---- admission ------------------------------------------------------------------------------
    def predict_ttft(self, prompt_tokens: int, running, waiting) -> float:
        """Seconds from now to a new request's first token, behind `waiting` (the queued
        requests that start before it) and with `running` holding their slots: its prefill
        waits for the prefill work ahead and for a running slot, then takes its own chunks."""
        # while it waits, those ahead of it decode too: the prefill share of a step shrinks
        decoding = min(self.cap, len(running) + len(waiting))
        per_step = max(1, self.budget - decoding)  # prefill tokens a step carries
        step_s = self.step_s or self.model.predict(self.budget, 0)
        ahead = sum(s.num_prompt_tokens - s.num_computed for s in running if s.in_prefill)
        ahead += sum(s.num_prompt_tokens for s in waiting)
        prefill_steps = math.ceil(ahead / per_step)
        slot_steps = self._slot_wait_steps(running, waiting, per_step)
        own_steps = max(1, math.ceil(prompt_tokens / per_step))
        return (max(prefill_steps, slot_steps) + own_steps) * step_s

    def _slot_wait_steps(self, running, waiting, per_step: int) -> int:
        """Steps until a running slot is free for a request behind `waiting`: each running
        sequence holds its slot for its expected remaining output; each waiting one takes
        the first slot to free and holds it for its prefill and expected output."""
        free = self.cap - len(running)
        if len(waiting) < free:
            return 0
        frees = [max(0, s.num_prompt_tokens - s.num_computed) // per_step + self._expected_left(s) for s in running]
        frees += [0] * max(0, free)
        heapq.heapify(frees)
        for seq in waiting:
            at = heapq.heappop(frees) if frees else 0
            heapq.heappush(frees, at + math.ceil(seq.num_prompt_tokens / per_step) + self._expected_left(seq))
        return frees[0] if frees else 0

    def _expected_left(self, seq) -> int:
        expected = math.ceil(seq.request.params.max_tokens * self.output_ratio)
        return max(1, expected - seq.num_output_tokens)

    def admit(self, prompt_tokens: int, running, waiting, priority: int = 0) -> None:
        """SloShedError when a request of `priority` would miss slo_ttft behind the queue ahead.

        `waiting` (arrival order) holds requests queued before this one; those of worse
        priority will run after it, so only those of better or equal priority count: a
        high-priority arrival is not shed for a low-priority backlog.

        With nothing running and nothing queued ahead the request is admitted whatever the
        prediction: refusing it protects no one, and an idle engine that refused every arrival
        would run no step that could correct a model gone wrong (a host that has sped up, a
        stray slow step), so it would refuse them all for good. Such a request that misses
        slo_ttft is counted as missed."""
        if self.targets.ttft_s is None or not self.model.ready:
            return
        waiting = ahead_of(priority, waiting)
        ttft = self.predict_ttft(prompt_tokens, running, waiting)
        self.predicted_ttft_s = ttft
        if ttft > self.targets.ttft_s and (running or waiting):
            raise SloShedError(
                f"overloaded: predicted time to first token {ttft * 1000:.4g} ms is past slo_ttft_ms="
                f"{self.targets.ttft_s * 1000:g} with {len(waiting)} requests queued ahead and {len(running)} running; "
                "retry later")


def ahead_of(priority: int, waiting) -> list:
    """The queued requests that run before a new one of `priority`: better priority (lower),
    or equal and there first (all of `waiting` arrived before it)."""
    return [s for s in waiting if s.request.priority <= priority]


def _clamp(value: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, value))


def _banded(current: int, wanted: int, step: int, limit: int) -> int:
    """The next value of a decision: `wanted` when it is clearly below `current`, or above
    it by the dead band (or at the configured limit); else `current`."""
    if wanted < current * (1 - GROW_FRACTION / 2):
        return wanted
    if wanted >= min(limit, current * (1 + GROW_FRACTION) + step):
        return wanted
    return current
