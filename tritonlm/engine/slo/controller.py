"""The SLO controller: the step's token budget, the running cap and admission, chosen from
the step-time model so that running streams keep slo_tpot and new requests slo_ttft
(the package's docstring says how)."""

from __future__ import annotations

import heapq
import logging
import math
import time
from dataclasses import dataclass

from tritonlm.engine.request import ServerBusyError
from tritonlm.engine.slo.ledger import SloTargets
from tritonlm.engine.slo.step_time import DecayingMean, StepTimeModel

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
SLACK_SHARE = 0.5  # of a stream's TPOT slack, the most one step may spend
# the running cap leaves the share of the time prompts took (EWMA over steps), at least the
# minimum (room for a new prompt's chunk) and at most the maximum (the decodes keep some)
PREFILL_SHARE_ALPHA = 0.005
MIN_PREFILL_SHARE = 0.15
MAX_PREFILL_SHARE = 0.8
TYPICAL_ALPHA = 0.1  # weight of each step's seconds in the typical step's
# a first token planned in a few long steps keeps a margin of SLO_Z x the step model's
# relative error (z of the 99th percentile: 99% of admitted requests are to meet the SLO),
# between MIN_TTFT_MARGIN and HEADROOM of its deadline
SLO_Z = 2.33
MIN_TTFT_MARGIN = 0.5
PLANNED_STEPS = 64  # admission plans at most this many steps to a first token
# a plan's bias: the log of (time its first token took after admission / the plan), averaged
# over admitted requests (each weighs PLAN_BIAS_ALPHA, ~10 requests), from a guess of no bias
# counted as PLAN_BIAS_GUESS requests. Each request's ratio is clipped to within
# MAX_PLAN_BIAS of 1 (a stalled host's one outlier does not shed the next dozen requests),
# and plans are stretched by the bias found, never shrunk: a plan found long leaves the
# margin to the step model's error alone
PLAN_BIAS_ALPHA = 0.1
PLAN_BIAS_GUESS = 5
MAX_PLAN_BIAS = math.log(2.0)
# a chunk too small for its pass waits at most this many steps in a row: the slack those
# steps bank may not grow (a stream whose future steps are already planned at a decode
# step's time banks none), and a prompt must not wait for the streams to end
MAX_DEFERRED = 4


class SloShedError(ServerBusyError):
    """Refused at arrival: the request's predicted time to first token is past slo_ttft_ms.
    The message starts with "overloaded:" (the OpenAI layer answers 503 + Retry-After)."""


@dataclass(frozen=True)
class InFlightStep:
    """The step running when a request arrives (Scheduler.step_in_flight). The sequences'
    counts may be read before or after its passes move them: prompts_after says where each
    prompt it carries stands once it is done, either way."""
    step_s: float  # its predicted seconds
    left_s: float  # of them, those still to come
    prompts_after: dict[int, int]  # sequence id -> cached prompt positions after it


@dataclass(frozen=True)
class Decision:
    budget: int  # tokens in the next step
    cap: int  # running sequences
    step_s: float  # predicted seconds of the step at this budget


class SloController:
    def __init__(self, targets: SloTargets, max_num_seqs: int, max_num_batched_tokens: int,
                 model: StepTimeModel | None = None):
        """max_num_seqs / max_num_batched_tokens: the configured knobs, never exceeded; they
        hold until the model has seen enough steps, and wherever no SLO bounds them."""
        self.targets = targets
        self.max_seqs = max_num_seqs
        self.max_tokens = max_num_batched_tokens
        self.model = model or StepTimeModel()
        self.steps_seen = 0  # steps reported, the cold ones included
        self.forget_load()

    def forget_load(self) -> None:
        """Back to the configured knobs, and forget what the steps so far said of the load
        (its prompts' share, its rows' context, its typical step, its answers' lengths);
        the step-time model, which describes the host, is kept (the warm-up at load,
        slo_warmup.py, runs a load of its own)."""
        self.changes = 0  # decisions that changed budget or cap
        self.budget = self.max_tokens  # the steady budget
        self.step_budget = self.max_tokens  # the last step's: the steady one and the slack it spent
        self.cap = self.max_seqs
        self.step_s = 0.0
        self.predicted_ttft_s = 0.0  # the last admission's prediction
        self.output_ratio = 1.0  # generated / max_tokens of finished requests (EWMA): slots free sooner than max_tokens
        self.row_context = 0.0  # cached positions of a decoding row (EWMA over steps)
        self.typical_step_s = 0.0  # steps' measured seconds (EWMA)
        self._smooth_budget = float(self.max_tokens)  # the model's targets, smoothed over steps
        self._smooth_cap = float(self.max_seqs)
        self._primed = False
        self._prompt_s = 0.0  # seconds of a step spent on prompt tokens (EWMA)
        self.deferred_steps = 0  # steps in a row whose chunk waited for slack (pass_tokens)
        self._step_s = 0.0  # seconds of a step (EWMA)
        self._plan_bias = DecayingMean(0.0, PLAN_BIAS_ALPHA, PLAN_BIAS_GUESS)

    # ---- what the engine reports -------------------------------------------------------------
    def observe_step(self, prefill_tokens: int, decode_rows: int, context: int, seconds: float,
                     decode_context: int | None = None, second_pass: bool | None = None) -> None:
        self.steps_seen += 1
        if self.steps_seen > COLD_STEPS:
            # the time prompt tokens took, by the fit (before it learns the step), in the steps
            # a stream decodes in: TPOT averages those alone
            if self.model.ready and decode_rows:
                prompt_s = min(seconds, self.model.cost.prefill_token_s * prefill_tokens)
                self._prompt_s += PREFILL_SHARE_ALPHA * (prompt_s - self._prompt_s)
                self._step_s += PREFILL_SHARE_ALPHA * (seconds - self._step_s)
            self.model.observe(prefill_tokens, decode_rows, context, seconds, decode_context, second_pass)
            if self.typical_step_s == 0.0:
                self.typical_step_s = seconds
            self.typical_step_s += TYPICAL_ALPHA * (seconds - self.typical_step_s)

    @property
    def prefill_share(self) -> float:
        """The share of the recent steps' time their prompt tokens took (by the fit), over
        the steps with decoding rows. The second pass a chunk adds is left out: where every
        step runs a chunk the fit cannot tell that pass from the step's fixed cost, and a
        share that counted a pass fitted too long would shrink the cap to one sequence while
        admitted requests wait for it."""
        return min(MAX_PREFILL_SHARE, self._prompt_s / self._step_s) if self._step_s > 0 else 0.0

    def request_finished(self, generated: int, max_tokens: int) -> None:
        ratio = min(1.0, generated / max_tokens) if max_tokens > 0 else 1.0
        self.output_ratio += OUTPUT_RATIO_ALPHA * (ratio - self.output_ratio)

    def plan_kept(self, planned_s: float, took_s: float) -> None:
        """An admitted request's first token came `took_s` after its admission, whose plan
        (planned_prefill_s) said `planned_s`."""
        if planned_s > 0 and took_s > 0:
            self._plan_bias.add(_clamp(math.log(took_s / planned_s), -MAX_PLAN_BIAS, MAX_PLAN_BIAS))

    @property
    def plan_stretch(self) -> float:
        """What admission multiplies a plan by: how much longer than planned the recent
        admitted requests' first tokens took (1: no longer). A plan follows the scheduler's
        rules step by step, but under load it misses what comes between: arrivals after it
        that fill the step finishing its prompt, the slack a slow step spends that the plan
        had counted on. Each step's prediction can be close while the plan falls short."""
        return math.exp(_clamp(self._plan_bias.value, 0.0, MAX_PLAN_BIAS))

    # ---- the scheduler's knobs ----------------------------------------------------------------
    def decide(self, running) -> Decision:
        """The next step's budget and the running cap, given the running sequences."""
        budget, cap = self.max_tokens, self.max_seqs
        decoding = [s for s in running if not s.in_prefill]
        rows = len(decoding)
        context = sum(s.num_computed + 1 for s in decoding)
        if decoding:  # the cap plans for a typical row, not for the mix of this instant (the first at once)
            self.row_context += (ROW_CONTEXT_ALPHA if self.row_context else 1.0) * (context / rows - self.row_context)
        per_row = self.row_context
        cost = self.model.cost
        step_budget = budget
        if self.model.ready and self.targets.tpot_s is not None:
            tau = self.targets.tpot_s * HEADROOM
            decode_s = cost.predict(0, rows, context)  # this step without prefill
            # a prefill chunk reads its own positions too (one row's worth beside the decodes),
            # and runs a pass of its own where it is wider than the decode pass takes
            chunk_room = tau - decode_s - cost.position_s * per_row
            per_seq = cost.decode_row_s + cost.position_s * per_row
            # TPOT is a mean: a stream's steps average its decode step plus the prefill the
            # admitted load brings (the share of the time prompts took, measured), and at least
            # a small chunk's room in every step
            share = max(self.prefill_share, MIN_PREFILL_SHARE)
            cap_room = tau * (1.0 - share) - cost.predict(0, 0, 0)
            # the raw targets carry the fit's noise (a steady load barely tells the intercept
            # from the per-row cost): they are smoothed over steps before they decide
            raw_budget = min(rows + cost.tokens_within(chunk_room, rows), self.max_tokens)
            raw_cap = min(cap_room / per_seq, self.max_seqs) if per_seq > 0 else self.max_seqs
            raw_cap = max(1.0, raw_cap) if cap_room > 0 else 1.0  # not wound up below one sequence
            alpha = SMOOTH_ALPHA if self._primed else 1.0  # the first fit's targets at once
            self._primed = True
            self._smooth_budget += alpha * (raw_budget - self._smooth_budget)
            self._smooth_cap += alpha * (raw_cap - self._smooth_cap)
            budget = _quantized(int(self._smooth_budget), self.max_tokens)
            cap = _clamp(int(self._smooth_cap), 1, self.max_seqs)
            self._apply(budget, cap)
            # on top of the steady budget, this step may spend slack the running streams have
            # banked (decode steps shorter than the target) or will bank before they end
            step_budget = self._slack_budget(rows, decode_s, self._slack_limit(decoding, decode_s, tau))
        else:
            self._apply(budget, cap)
            step_budget = self.budget
        self.step_budget = step_budget
        self.step_s = cost.predict(max(0, step_budget - rows), rows, int(context + per_row))
        return Decision(step_budget, self.cap, self.step_s)

    def plan_s(self, plan) -> float:
        """The predicted seconds of a scheduled step: [(sequence, tokens it runs)], the counts
        those before it (a row past its prompt decodes; the rest are prompt tokens)."""
        rows = sum(1 for seq, _ in plan if not seq.in_prefill)
        context = sum(seq.num_computed + n for seq, n in plan)
        return self.model.predict(sum(n for _, n in plan) - rows, rows, context)

    def _slack_limit(self, decoding, decode_s: float, tau: float) -> float:
        """The longest this step may take and still let every decoding stream end within
        slo_tpot (with the headroom), planning its remaining steps at the typical step's
        time (at least `decode_s`): where steps usually carry prefill up to the target, only
        the slack already banked is offered.

        A stream's TPOT is the mean gap over its answer, not the longest one: one that has
        run decode steps shorter than the target, or that will make many more tokens, can
        carry a longer step now (a prefill chunk that gets a waiting request its first token
        sooner) and still end on target. Only tokens it is sure to make count: an answer may
        end at any token where an end token, a stop string or a guide can end it, so there
        only the slack banked so far (and what min_tokens holds) is offered; an answer forced
        to its length offers its whole max_tokens. Each stream offers SLACK_SHARE of its
        slack, so that one step does not spend all of it and the next arrivals find some."""
        future_s = max(decode_s, self.typical_step_s)
        least = min((_allowed_s(seq.num_output_tokens, _spent_s(seq), _certain_tokens(seq), tau, future_s)
                     for seq in decoding), default=math.inf)
        return _spendable(least, decode_s)

    def _slack_budget(self, rows: int, decode_s: float, limit_s: float) -> int:
        """A step's token budget: the steady one, or more where a step of `rows` decoding
        rows (decode_s seconds without prompt tokens) may take up to limit_s."""
        cost = self.model.cost
        if cost.prefill_token_s <= 0:  # a prompt cost fitted at 0 says nothing of what slack buys
            return self.budget
        chunk_s = limit_s - decode_s - cost.position_s * self.row_context
        slack_tokens = rows + cost.tokens_within(chunk_s, rows)
        return max(self.budget, _quantized(int(min(slack_tokens, self.max_tokens)), self.max_tokens))

    def _apply(self, budget: int, cap: int) -> None:
        """Down when the model asks for less than all but a sliver of the current value (the
        headroom covers the sliver), up only past a dead band: noise in the fit does not make
        the decisions flutter."""
        new_budget = _banded(self.budget, budget, QUANTUM, self.max_tokens)
        new_cap = _banded(self.cap, cap, 1, self.max_seqs)
        if (new_budget, new_cap) != (self.budget, self.cap):
            self.changes += 1
            log.info("SLO controller: token budget %d -> %d, running cap %d -> %d (step model: %s)", self.budget,
                     new_budget, self.cap, new_cap, self.model.describe())
            self.budget, self.cap = new_budget, new_cap

    def pass_tokens(self, prefilling, tokens: int, rows: int, context: int) -> int:
        """Of the `tokens` prompt tokens a step beside `rows` decoding rows (reading `context`
        cached positions) may carry, how many it carries: all of them, or none where they
        would cost less than the second pass they add (cost.pass_s) and finish no prompt
        (`prefilling`: the prompts in the order the step fills them), the step could carry
        more (below max_num_batched_tokens), the decodes alone stay within the TPOT target,
        and fewer than MAX_DEFERRED steps before it waited so. Such a chunk spends a stream's
        time mostly on the pass; a step of the decodes alone banks that time, and the slack
        it banks can carry a larger chunk a step or two later, which pays the pass once for
        more prompt tokens."""
        if not self.model.ready or self.targets.tpot_s is None or not prefilling:
            return tokens
        first = prefilling[0]
        carried, self.deferred_steps = self._worth_a_pass(tokens, rows, first.num_prompt_tokens - first.num_computed,
                                                          self.model.predict(0, rows, context), self.deferred_steps)
        return carried

    def _worth_a_pass(self, tokens: int, rows: int, first_left: int, decode_s: float,
                      deferred: int) -> tuple[int, int]:
        """pass_tokens' rule: `first_left` the first prompt's tokens still to run, `decode_s`
        the step's predicted seconds without prompt tokens, `deferred` the steps in a row
        before it that carried none so. (tokens carried, such steps in a row after it.)"""
        cost = self.model.cost
        if cost.prefill_token_s <= 0 or deferred >= MAX_DEFERRED or tokens >= min(first_left, self.max_tokens - rows):
            return tokens, 0
        small = tokens * cost.prefill_token_s < cost.chunk_pass_s(rows, tokens)
        if small and tokens and decode_s < self.targets.tpot_s * HEADROOM:
            return 0, deferred + 1
        return tokens, 0

    def deadline_tokens(self, prefilling, tokens: int, rows: int, context: int, now: float) -> int:
        """Of the `tokens` prompt tokens this step may carry (its budget less its `rows`
        decoding rows, reading `context` cached positions), how many it carries so that no
        prompt whose last chunk it runs gets its first token past slo_ttft. `prefilling`:
        the prompts in the order the step fills them.

        Slack lets a step run long, and prompts that arrive later fill it further: without
        this, a request admitted for a short step could get its first token only at the end
        of a long one. A prompt already past reach (its own chunk alone ends past its
        deadline) does not hold the others back; the steady budget is never cut (a step of
        it keeps every stream's TPOT), nor is the first prompt's chunk."""
        if self.targets.ttft_s is None or not self.model.ready:
            return tokens
        due = [(seq.num_prompt_tokens - seq.num_computed, seq.num_prompt_tokens,
                seq.request.arrival + self.targets.ttft_s - now) for seq in prefilling]
        return self._deadline_room(due, tokens, rows, context)

    def _deadline_room(self, prompts, tokens: int, rows: int, context: int) -> int:
        """deadline_tokens' rule: `prompts` in the order the step fills them, each (tokens
        left, prompt tokens, seconds from the step's start to its slo_ttft deadline)."""
        steady = max(0, self.budget - rows)
        if tokens <= steady:
            return tokens
        cost, margin = self.model.cost, self.ttft_margin()
        ends_by, carried = math.inf, 0  # the earliest deadline among the prompts finished so far
        for left, prompt_tokens, due in prompts:
            if carried + left > tokens:
                break  # a partial chunk: no first token in this step
            context += prompt_tokens  # a finished prompt's positions, as step_done counts them
            step_s = cost.predict(carried + left, rows, context)
            if step_s > ends_by and carried:
                break  # it would make a prompt before it late
            due_s = margin * due  # the fit's error, the host's noise
            if step_s <= due_s:  # else out of reach
                ends_by = min(ends_by, due_s)
            carried += left
        return min(tokens, max(carried, steady, self._tokens_within(ends_by, rows, context)))

    def _tokens_within(self, seconds: float, rows: int, context: int) -> int:
        """Prompt tokens a step of `rows` decoding rows can carry and end within `seconds`."""
        cost = self.model.cost
        tokens = cost.tokens_within(seconds - cost.predict(0, rows, context), rows)
        return int(min(tokens, self.max_tokens))

    # ---- admission ------------------------------------------------------------------------------
    def predict_ttft(self, prompt_tokens: int, running, waiting, in_flight: InFlightStep | None = None,
                     now: float | None = None) -> float:
        """Seconds from now to a new request's first token, behind `waiting` (the queued
        requests that start before it) and with `running` holding their slots, with no
        margin: the sooner of the two predictions of _ttft_plans."""
        return min(self._ttft_plans(prompt_tokens, running, waiting, in_flight, now))

    def _ttft_plans(self, prompt_tokens: int, running, waiting, in_flight: InFlightStep | None,
                    now: float | None) -> tuple[float, float]:
        """(steady, planned): seconds to a new request's first token. Its prefill waits for
        the prefill work ahead and for a running slot, then takes its own chunks; steady
        takes every step at the steady budget, after the rest of the step in flight (a chunk
        too small for its pass after the MAX_DEFERRED decode steps pass_tokens may hold it).
        in_flight: the step running now (None: none is, and the request can join the next
        step at once); no queued prompt, nor this one, is in it. now: the clock of the requests'
        arrivals (None: time.monotonic()).

        Where a slot is free for it and a TPOT target is set, the steps to its first token
        are also planned as decide() will size them (planned_prefill_s): the steady budget
        and the slack the streams can spend, the work queued ahead taking its share first.
        Where it must wait for a slot, planned is inf: the running streams' slack then goes
        to steps that cannot be foreseen."""
        # while it waits, those ahead of it decode too: the prefill share of a step shrinks
        decoding = min(self.cap, len(running) + len(waiting))
        per_step = max(1, self.budget - decoding)
        context = int(decoding * self.row_context)
        step_s = self.model.predict(per_step, decoding, context)
        decode_s = self.model.predict(0, decoding, context)
        chunk_s = step_s  # the time a chunk of per_step prompt tokens takes
        if self.targets.tpot_s is not None and not self._worth_a_pass(per_step, decoding, per_step + 1, decode_s, 0)[0]:
            chunk_s += MAX_DEFERRED * decode_s  # too small for its pass: it may wait that many decode steps
        after = in_flight.prompts_after if in_flight is not None else {}
        ahead = sum(_prompt_left(s, after) for s in running if s.in_prefill)
        ahead += sum(s.num_prompt_tokens for s in waiting)
        prefill_steps = math.ceil(ahead / per_step)
        slot_steps = self._slot_wait_steps(running, waiting, per_step)
        own_steps = max(1, math.ceil(prompt_tokens / per_step))
        steady = max(prefill_steps * chunk_s, slot_steps * step_s) + own_steps * chunk_s
        if in_flight is not None:
            steady += in_flight.left_s
        if slot_steps or self.targets.tpot_s is None:
            return steady, math.inf
        return steady, self.planned_prefill_s(prompt_tokens, running, waiting, in_flight, now)

    def ttft_margin(self) -> float:
        """The share of a first-token deadline a plan of long steps may fill: a step that runs
        prompt tokens errs by about the model's relative error over such steps, and 99% of
        first tokens are to fall inside (SLO_Z)."""
        return max(MIN_TTFT_MARGIN, min(HEADROOM, 1.0 - SLO_Z * self.model.prompt_step_error))

    def planned_prefill_s(self, prompt_tokens: int, running, waiting, in_flight: InFlightStep | None = None,
                          now: float | None = None) -> float:
        """Seconds until the step that runs the last chunk of a new prompt ends, its steps
        planned one by one as decide() sizes them: each carries the steady budget, or more
        where every decoding stream's TPOT slack allows it (_slack_limit). Prompts queued
        ahead (the running ones' rest, then `waiting` in order) take the chunks first, and
        each becomes a decoding stream once its prompt is in, with what its answer may spend.
        A step of s seconds moves each stream's slack by its planned step time less s.
        in_flight (the step running now): the plan starts once it is done, the chunks it
        carries run, and a prompt it finishes decoding. A step that finishes prompts carries
        no more than keeps their first tokens within slo_ttft, as deadline_tokens holds the
        scheduler's (`now`: the arrivals' clock, None: time.monotonic())."""
        cost = self.model.cost
        tau = self.targets.tpot_s * HEADROOM
        after = in_flight.prompts_after if in_flight is not None else {}
        # a decoding stream: [tokens made, seconds since its first token, certain tokens, max_tokens,
        # cached positions]; a prompt: [tokens left, certain tokens, max_tokens, prompt tokens,
        # seconds from now to its slo_ttft deadline]
        now = time.monotonic() if now is None else now
        ttft = self.targets.ttft_s if self.targets.ttft_s is not None else math.inf
        streams, prompts = [], []
        for s in running:  # each read once: the engine thread moves the counts
            if s.in_prefill:
                prompts.append([_prompt_left(s, after), _certain_tokens(s), s.request.params.max_tokens, s.num_prompt_tokens,
                                s.request.arrival + ttft - now])
            else:
                streams.append([s.num_output_tokens, _spent_s(s), _certain_tokens(s), s.request.params.max_tokens,
                                s.num_computed + 1])
        prompts += [[s.num_prompt_tokens, _certain_tokens(s), s.request.params.max_tokens, s.num_prompt_tokens,
                     s.request.arrival + ttft - now] for s in waiting]
        prompts.append([prompt_tokens, 0, 0, prompt_tokens, ttft])

        def decoded(streams: list, step_s: float, done: list) -> list:
            """The streams after a step of step_s seconds that finished the prompts `done`."""
            for stream in streams:
                stream[1] += step_s if stream[0] else 0.0  # a prompt just in: its first token ends the step
                stream[0] += 1
                stream[4] += 1
            return [st for st in streams if st[0] < st[3]] + [[1, 0.0, certain, max_tokens, n + 1]
                                                              for _, certain, max_tokens, n, _ in done]

        elapsed, typical_s, deferred = 0.0, self.typical_step_s, self.deferred_steps
        if in_flight is not None:  # its chunks are counted in the prompts' rest: it takes no more
            elapsed = in_flight.left_s
            typical_s += TYPICAL_ALPHA * (in_flight.step_s - typical_s)  # as observe_step will move it
            streams = decoded(streams, in_flight.step_s, [p for p in prompts if p[0] <= 0])
            prompts = [p for p in prompts if p[0] > 0]
        for _ in range(PLANNED_STEPS):
            rows = len(streams)
            context = sum(st[4] for st in streams)
            decode_s = cost.predict(0, rows, context)
            future_s = max(decode_s, typical_s)
            least = min((_allowed_s(m, sp, c, tau, future_s) for m, sp, c, *_ in streams), default=math.inf)
            budget = self._slack_budget(rows, decode_s, _spendable(least, decode_s))
            # as the scheduler: the decoding rows first, the rest to the prompts in order (a
            # step of no decoding rows carries at least one prompt token)
            room = max(0, budget - rows) if rows else max(1, budget)
            if self.targets.ttft_s is not None:  # as the scheduler holds a step to its prompts' deadlines
                room = self._deadline_room([(p[0], p[3], p[4] - elapsed) for p in prompts], room, rows, context)
            if rows and prompts:  # as the scheduler skips a chunk that would pay mostly for its pass
                room, deferred = self._worth_a_pass(room, rows, prompts[0][0], decode_s, deferred)
            chunk, positions, done = 0, 0, []
            while prompts and chunk < room:
                take = min(room - chunk, prompts[0][0])
                prompts[0][0] -= take
                chunk += take
                positions += prompts[0][3] - prompts[0][0]  # its positions after the step
                if prompts[0][0] == 0:
                    done.append(prompts.pop(0))
            step_s = cost.predict(chunk, rows, context + positions)
            elapsed += step_s
            typical_s += TYPICAL_ALPHA * (step_s - typical_s)  # as observe_step will move it
            if not prompts:  # its own prompt was the last in: this step makes its first token
                return elapsed
            streams = decoded(streams, step_s, done)
        return math.inf  # not within the steps planned: the steady prediction stands

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

    def admit(self, prompt_tokens: int, running, waiting, priority: int = 0, elapsed_s: float = 0.0,
              in_flight: InFlightStep | None = None, now: float | None = None) -> float | None:
        """SloShedError when a request of `priority` would miss slo_ttft behind the queue ahead.
        Admitted, it returns its plan (planned_prefill_s's seconds from now to its first
        token, for plan_kept), or None where it was not planned step by step. `elapsed_s`: the part of its time to first token already gone (since its arrival);
        in_flight: the step running now (None: no step is); now: the clock of the requests'
        arrivals (None: time.monotonic()).

        `waiting` (arrival order) holds requests queued before this one; those of worse
        priority will run after it, so only those of better or equal priority count: a
        high-priority arrival is not shed for a low-priority backlog.

        A plan of a few long steps errs as one step's prediction does, so it is judged with
        ttft_margin() for the step model's error, after plan_stretch; a steady prediction,
        of many short steps whose errors partly cancel, with the HEADROOM the TPOT side
        plans its steps with.

        With nothing running and nothing queued ahead the request is admitted whatever the
        prediction: refusing it protects no one, and an idle engine that refused every arrival
        would run no step that could correct a model gone wrong (a host that has sped up, a
        stray slow step), so it would refuse them all for good. Such a request that misses
        slo_ttft is counted as missed."""
        if self.targets.ttft_s is None or not self.model.ready:
            return None
        waiting = ahead_of(priority, waiting)
        steady, planned = self._ttft_plans(prompt_tokens, running, waiting, in_flight, now)
        ttft = elapsed_s + min(steady / HEADROOM, planned * self.plan_stretch / self.ttft_margin())
        self.predicted_ttft_s = ttft
        plan = planned if math.isfinite(planned) else None
        if ttft <= self.targets.ttft_s:
            return plan
        if running or waiting:
            raise SloShedError(
                f"overloaded: predicted time to first token {ttft * 1000:.4g} ms is past slo_ttft_ms="
                f"{self.targets.ttft_s * 1000:g} with {len(waiting)} requests queued ahead and {len(running)} running; "
                "retry later")
        return plan  # let in on an idle engine: what its plan said still counts (plan_kept)


def ahead_of(priority: int, waiting) -> list:
    """The queued requests that run before a new one of `priority`: better priority (lower),
    or equal and there first (all of `waiting` arrived before it)."""
    return [s for s in waiting if s.request.priority <= priority]


def _prompt_left(seq, after: dict[int, int]) -> int:
    """Prompt tokens of a running sequence still to run once the step in flight is done
    (`after`: its prompts' positions then)."""
    return max(0, seq.num_prompt_tokens - max(seq.num_computed, after.get(seq.id, 0)))


def _spent_s(seq) -> float:
    """Seconds from the sequence's first token to its last (0 before both are set: read off
    the engine thread, one may be set and not yet the other)."""
    first, last = seq.first_token_time, seq.last_token_time
    return last - first if first is not None and last is not None else 0.0


def _spendable(least_s: float, decode_s: float) -> float:
    """The longest a step may take: SLACK_SHARE of the way from a decode step's decode_s to
    least_s, the most the stream that allows least accepts (inf with no stream decoding)."""
    return decode_s + SLACK_SHARE * (least_s - decode_s) if math.isfinite(least_s) else math.inf


def _allowed_s(made: int, spent_s: float, certain: int, tau: float, future_s: float) -> float:
    """The longest the next step may take and let a stream that has made `made` tokens in
    `spent_s` since its first end within `tau` per token, its later steps planned at
    `future_s` and counting only the `certain` tokens it is sure to make."""
    expected = max(made + 1, certain)
    return tau * (expected - 1) - spent_s - (expected - made - 1) * future_s


def _certain_tokens(seq) -> int:
    """Output tokens the sequence will make whatever it generates: max_tokens when nothing
    but the length can end it, min_tokens when only an end token can (min_tokens holds those
    back), none when a stop string or a finished guide can end it at any token."""
    params = seq.request.params
    if params.stop_words or params.guided is not None:
        return 0
    ends = seq.sampling.end_ids if seq.sampling is not None else ()
    return params.min_tokens if ends else params.max_tokens


def _quantized(budget: int, limit: int) -> int:
    """A budget in whole QUANTUM steps, at least one (or `limit`, when smaller): decode rows
    run whatever the budget, so a budget below them only stops prefill (which the cap
    prevents); the floor keeps a chunk moving when the host slows."""
    if budget > QUANTUM:
        budget -= budget % QUANTUM
    return _clamp(budget, min(QUANTUM, limit), limit)


def _clamp(value: float, lo: float, hi: float) -> float:
    return max(lo, min(hi, value))


def _banded(current: int, wanted: int, step: int, limit: int) -> int:
    """The next value of a decision: `wanted` when it is clearly below `current`, or above
    it by the dead band (or at the configured limit); else `current`."""
    if wanted < current * (1 - GROW_FRACTION / 2):
        return wanted
    if wanted >= min(limit, current * (1 + GROW_FRACTION) + step):
        return wanted
    return current
