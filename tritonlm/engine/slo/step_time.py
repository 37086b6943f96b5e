"""How long a step takes, learned while serving:

    step_seconds ~ a + p * mixed + b_prefill * prefill_tokens + b_decode * decode_rows + c * context

`prefill_tokens` are the prompt tokens a forward pass runs in chunks, `decode_rows` the rows
that each add a token to a running answer (a speculative verify row counts as one: its
guesses run in the decode pass, and their positions count in the context),
`context` the KV positions the pass reads (each row's cached length after it, summed), and
`mixed` 1 for a step that runs prompt tokens in a pass of their own beside decoding rows
(more of them than the executor runs in the decoding rows' pass: `joined`). On a
CPU a pass streams every weight once (a), then pays per token for the projections and
per cached position for attention (c). The executor runs a step's decoding rows in one
pass (the decode-width kernels) and its prompt chunks, where they are more than that pass
takes, in another, so such a step reads the weights twice: it pays a second pass (p).
With one fixed cost per step, the fit
would spread that pass over the prompt tokens and rows and predict such steps short, and
decode-only steps long. A prefill token and a decode row cost different
amounts: a decode row also pays for its sampling, its detokenizing and its response to the
client, while a prefill chunk runs the projections as one wide matrix product but its
attention over the chunk's own positions, and on the CPU the two take different kernels.
One per-token cost fitted over both would be wrong for each, and the controller sizes the
running cap by one and the prefill budget by the other.

The two per-token costs are tied (TIE) unless the steps tell them apart: a prompt token's,
and a decoding row's with its attention over a typical row's cached positions. The fit is least
squares with exponential forgetting: every finished step adds its
sample with weight 1, and older samples fade by `forget` per step, so the fit follows a
change (another tenant on the host, longer prompts, a governor resizing the thread team)
within ~1 / (1 - forget) steps. A steady load barely moves some directions (a constant
batch does not tell the intercept from the per-row cost; the context grows with the
rows), and a short window alone would let noise swing the coefficients there. So a
second fit with a long memory is kept, and the short one is solved with a ridge toward it:
where recent steps say something, they win; where they are silent, the long-run fit holds.
"""

from __future__ import annotations

import math
from itertools import combinations
from typing import NamedTuple

import numpy as np

# features are scaled so the coefficients are of one order in a solve (a step runs tens to
# hundreds of tokens and reads thousands to hundreds of thousands of positions)
TOKEN_SCALE = 100.0
CONTEXT_SCALE = 10_000.0
RIDGE = 1e-6  # keeps the long-run solve defined before every direction has been seen
FEATURES = 5  # [1, prefill tokens, decode rows, context, mixed]
PRIOR_EVERY = 8  # steps between solves of the long-memory fit
# A prompt token and a decoding row are fitted as one cost unless the steps say otherwise:
# (b_prefill - b_decode - c * row_context)^2 is penalized with this fraction of the steps'
# own weight in the weaker of the two directions, row_context being a decoding row's typical
# cached positions: the row's cost with its attention is what is tied. Where steps barely
# tell a decoding row from the step's fixed cost (few rows, always some), a free fit trades
# one for the other (no fixed cost, a huge per-row cost); and where every row reads about
# the same positions, it can put that cost on the positions instead (a huge per-position
# cost, which a row of long context then multiplies). Tied to the prompt-token cost, which
# chunks of every size pin down, it can do neither.
TIE = 0.01
ROW_CONTEXT_ALPHA = 0.02  # weight of each step with decoding rows in a row's typical context
ERROR_ALPHA = 0.05  # weight of each step in the relative error (~20 steps)
PRIOR_ERROR = 0.2  # the relative error assumed before steps have measured it
PRIOR_ERROR_STEPS = 2  # how many steps' measurements that assumption counts for


def _tied(xtx: np.ndarray, row_context: float) -> np.ndarray:
    """Normal equations with the tie between the prompt-token cost and a decoding row's
    (its own and its `row_context` cached positions'), in the scaled coefficients; and, as
    weakly, the per-position cost held toward 0, so that where rows' contexts barely vary a
    row's cost is taken as the row's own, not as its positions' (which a row of a longer
    context would then multiply)."""
    direction = np.array([0.0, 1.0, -1.0, -row_context * TOKEN_SCALE / CONTEXT_SCALE, 0.0])
    weight = TIE * min(xtx[1, 1], xtx[2, 2])
    positions = np.zeros(FEATURES)
    positions[3] = 1.0
    return xtx + weight * (np.outer(direction, direction) + np.outer(positions, positions))


class StepCost(NamedTuple):
    """The fitted costs, each at least 0."""

    step_s: float  # a: every step
    prefill_token_s: float  # b_prefill: per prompt token in a chunk
    decode_row_s: float  # b_decode: per decoding row
    position_s: float  # c: per cached position read
    pass_s: float = 0.0  # p: the second pass of a step with prompt tokens and decoding rows
    # the most prompt tokens a step runs in its decoding rows' pass, paying no second pass
    # (ModelExecutor.chunk_rows)
    joined: int = 0

    def predict(self, prefill_tokens: float, decode_rows: float, context: float) -> float:
        return (self.step_s + self.chunk_pass_s(decode_rows, prefill_tokens) + self.prefill_token_s * prefill_tokens
                + self.decode_row_s * decode_rows + self.position_s * context)

    def chunk_pass_s(self, decode_rows: float, prefill_tokens: float) -> float:
        """The pass that `prefill_tokens` prompt tokens add to a step of `decode_rows`
        decoding rows: none for those the decoding rows' pass takes."""
        return self.pass_s if decode_rows > 0 and prefill_tokens > self.joined else 0.0

    def tokens_within(self, room_s: float, decode_rows: float) -> float:
        """Prompt tokens that fit in `room_s` seconds beside `decode_rows` decoding rows, with
        the pass they add where they are more than the decoding rows' pass takes (no limit
        where they are free)."""
        if room_s <= 0:
            return 0.0
        if self.prefill_token_s <= 0:
            return math.inf
        tokens = room_s / self.prefill_token_s
        if self.chunk_pass_s(decode_rows, tokens) == 0.0:
            return tokens
        return max(float(self.joined), (room_s - self.pass_s) / self.prefill_token_s)


class DecayingMean:
    """An exponentially weighted mean (each new sample weighs `alpha`) that starts from a
    guess counted as `guess_samples` samples. A plain EWMA started at the guess keeps
    (1 - alpha)^n of it after n samples, so a rough guess outweighs the first dozens of
    measurements; here the guess fades as measurements add up."""

    def __init__(self, guess: float, alpha: float, guess_samples: float):
        self.alpha = alpha
        self._sum = guess * alpha * guess_samples
        self._weight = alpha * guess_samples

    def add(self, sample: float) -> None:
        self._sum += self.alpha * (sample - self._sum)
        self._weight += self.alpha * (1.0 - self._weight)

    @property
    def value(self) -> float:
        return self._sum / self._weight


class StepTimeModel:
    def __init__(self, forget: float = 0.99, long_forget: float = 0.999, prior_weight: float = 1.0, min_steps: int = 8):
        """forget in (0, 1]: each older sample's weight per newer step (1: never forget);
        long_forget: the same for the long-run fit; prior_weight: how many samples' worth the
        long-run fit counts for in the short one. min_steps: samples before `ready`."""
        for name, value in (("forget", forget), ("long_forget", long_forget)):
            if not 0.0 < value <= 1.0:
                raise ValueError(f"{name}: must be in (0, 1], got {value}")
        self.forget = forget
        self.long_forget = long_forget
        self.prior_weight = prior_weight
        self.min_steps = min_steps
        self.joined = 0  # StepCost.joined: set where the executor runs small chunks in the decode pass
        # normal equations, x = [1, prefill tokens, decode rows, context, mixed] scaled:
        # sum of w x x^T [5, 5] and w x y [5]
        self._xtx, self._xty = np.zeros((FEATURES, FEATURES)), np.zeros(FEATURES)
        self._long_xtx, self._long_xty = np.zeros((FEATURES, FEATURES)), np.zeros(FEATURES)
        self._coef = np.zeros(FEATURES)  # in scaled units
        self._prior = np.zeros(FEATURES)  # the long-memory fit, the short one's ridge target
        self.steps = 0
        self.row_context = 0.0  # a decoding row's cached positions (EWMA over steps)
        # (measured / predicted - 1)^2 of the steps once ready, EWMA, over all steps and over
        # those with prompt tokens (a first token ends such a step); each starts at
        # PRIOR_ERROR's square, so that a fit just ready is not taken for an exact one, and
        # counts it as PRIOR_ERROR_STEPS steps, so that a few dozen measured steps (the
        # warm-up's at load: slo_warmup.py) replace the guess
        self._square_error = DecayingMean(PRIOR_ERROR**2, ERROR_ALPHA, PRIOR_ERROR_STEPS)
        self._prompt_square_error = DecayingMean(PRIOR_ERROR**2, ERROR_ALPHA, PRIOR_ERROR_STEPS)

    def _features(self, prefill_tokens: float, decode_rows: float, context: float,
                  second_pass: bool | None = None) -> np.ndarray:
        """second_pass: whether the step ran its prompt tokens in a pass of their own beside
        its decoding rows (None: by StepCost's rule, more than `joined` of them)."""
        if second_pass is None:
            second_pass = prefill_tokens > self.joined
        mixed = 1.0 if second_pass and prefill_tokens > 0 and decode_rows > 0 else 0.0
        return np.array([1.0, prefill_tokens / TOKEN_SCALE, decode_rows / TOKEN_SCALE, context / CONTEXT_SCALE, mixed])

    def observe(self, prefill_tokens: int, decode_rows: int, context: int, seconds: float,
                decode_context: int | None = None, second_pass: bool | None = None) -> None:
        """A finished step: refit with it. decode_context: the positions its decoding rows
        read (None: `context`, where the step ran no prompt tokens); second_pass: whether
        its prompt tokens ran in a pass of their own beside the decoding rows, as the
        executor ran it (None: by StepCost's rule; a verify row or a scored prompt keeps a
        small chunk apart too)."""
        x = self._features(prefill_tokens, decode_rows, context, second_pass)
        predicted = float(x @ self._coef)
        if self.ready and predicted > 0:  # how far the fit was off, before it learns from this step
            square = (seconds / predicted - 1.0) ** 2
            self._square_error.add(square)
            if prefill_tokens:
                self._prompt_square_error.add(square)
        xx, xy = np.outer(x, x), x * seconds
        self._xtx = self.forget * self._xtx + xx
        self._xty = self.forget * self._xty + xy
        self._long_xtx = self.long_forget * self._long_xtx + xx
        self._long_xty = self.long_forget * self._long_xty + xy
        self.steps += 1
        if decode_context is None and not prefill_tokens:
            decode_context = context
        if decode_rows and decode_context is not None:
            per_row = decode_context / decode_rows
            self.row_context += (per_row - self.row_context) * (ROW_CONTEXT_ALPHA if self.row_context else 1.0)
        eye = np.eye(FEATURES)
        if self.steps % PRIOR_EVERY == 1 or PRIOR_EVERY == 1:  # the long memory moves slowly
            self._prior = _nonnegative_solve(_tied(self._long_xtx, self.row_context) + RIDGE * eye, self._long_xty)
        w = self.prior_weight
        self._coef = _nonnegative_solve(_tied(self._xtx, self.row_context) + w * eye, self._xty + w * self._prior)

    @property
    def ready(self) -> bool:
        return self.steps >= self.min_steps

    @property
    def relative_error(self) -> float:
        """The typical relative error of a step's prediction (root mean square, recent steps
        weighted most): the host's noise and what the linear model misses."""
        return float(np.sqrt(self._square_error.value))

    @property
    def prompt_step_error(self) -> float:
        """relative_error over the steps that ran prompt tokens: how far the step that makes
        a first token lands from its prediction. Decode-only steps, the many, err otherwise
        (one pass of the decode-width kernels, no chunk)."""
        return float(np.sqrt(self._prompt_square_error.value))

    @property
    def cost(self) -> StepCost:
        a, bp, bd, c, p = (float(v) for v in self._coef)
        return StepCost(a, bp / TOKEN_SCALE, bd / TOKEN_SCALE, c / CONTEXT_SCALE, p, self.joined)

    def predict(self, prefill_tokens: int, decode_rows: int, context: int) -> float:
        """Seconds a step of `prefill_tokens` prompt tokens and `decode_rows` decoding rows,
        reading `context` cached positions, takes."""
        return self.cost.predict(prefill_tokens, decode_rows, context)

    def describe(self) -> str:
        """The fitted costs and errors, for a log line."""
        cost = self.cost
        chunk = f"a chunk past {cost.joined} prompt tokens" if cost.joined else "a chunk"
        return (f"{cost.step_s * 1e3:.2f} ms + {cost.prefill_token_s * 1e3:.3f} ms/prompt token + "
                f"{cost.decode_row_s * 1e3:.3f} ms/decoding row + {cost.position_s * 1e6:.2f} us/cached position + "
                f"{cost.pass_s * 1e3:.2f} ms the pass of {chunk} beside decodes, steps off by {100 * self.relative_error:.0f}%, "
                f"those with prompt tokens by {100 * self.prompt_step_error:.0f}%")


_SUBSETS = [list(free) for k in range(1, FEATURES + 1) for free in combinations(range(FEATURES), k)]


def _nonnegative_solve(m: np.ndarray, v: np.ndarray) -> np.ndarray:
    """argmin over beta >= 0 of beta' m beta - 2 beta' v (m [n, n] positive definite).

    No cost is negative, and a fit solved freely and then clipped is not the best fit with
    that cost at 0: over too few distinct steps the free fit trades a negative intercept for
    inflated per-token and per-position costs, which clipping the intercept keeps. Where the
    free solve is feasible it is the optimum; else every set of free coefficients (31 for
    five) is tried, and the best feasible one is the optimum. It runs at every step, so the
    common case takes one solve."""
    n = len(v)
    free_fit = np.linalg.solve(m, v)
    if (free_fit >= 0).all():
        return free_fit
    subsets = _SUBSETS if n == FEATURES else [list(f) for k in range(1, n + 1) for f in combinations(range(n), k)]
    best, best_value = np.zeros(n), 0.0
    for free in subsets:
        beta = np.zeros(n)
        beta[free] = np.linalg.solve(m[np.ix_(free, free)], v[free])
        if (beta < 0).any():
            continue
        value = float(beta @ m @ beta - 2 * beta @ v)
        if value < best_value:
            best, best_value = beta, value
    return best
