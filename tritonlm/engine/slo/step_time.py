"""How long a step takes, learned while serving: step_seconds ~ a + b * tokens + c * context.

`tokens` are the new tokens a forward pass runs (decode rows and prefill chunks), `context`
the KV positions it reads (each row's cached length after the pass, summed). On a CPU the
pass streams every weight once (a), then pays per token for the projections (b) and per
cached position for attention (c); on a GPU the same shape holds above its launch floor.

The fit is least squares with exponential forgetting: every finished step adds its
sample with weight 1, and older samples fade by `forget` per step, so the fit follows a
change (another tenant on the host, longer prompts, a governor resizing the thread team)
within ~1 / (1 - forget) steps. A steady load barely moves some directions (a constant
batch does not tell the intercept from the per-row cost; the context grows with the
tokens), and a short window alone would let noise swing the coefficients there. So a
second fit with a long memory is kept, and the short one is solved with a ridge toward it:
where recent steps say something, they win; where they are silent, the long-run fit holds.
"""

from __future__ import annotations

import numpy as np

# features are scaled so the three coefficients are of one order in a solve (a step runs
# tens to hundreds of tokens and reads thousands to hundreds of thousands of positions)
TOKEN_SCALE = 100.0
CONTEXT_SCALE = 10_000.0
RIDGE = 1e-6  # keeps the long-run solve defined before every direction has been seen


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
        # normal equations, x = [1, tokens, context] scaled: sum of w x x^T [3, 3] and w x y [3]
        self._xtx, self._xty = np.zeros((3, 3)), np.zeros(3)
        self._long_xtx, self._long_xty = np.zeros((3, 3)), np.zeros(3)
        self._coef = np.zeros(3)  # (a, b, c) in scaled units
        self.steps = 0

    @staticmethod
    def _features(tokens: float, context: float) -> np.ndarray:
        return np.array([1.0, tokens / TOKEN_SCALE, context / CONTEXT_SCALE])

    def observe(self, tokens: int, context: int, seconds: float) -> None:
        """A finished step: refit with it."""
        x = self._features(tokens, context)
        xx, xy = np.outer(x, x), x * seconds
        self._xtx = self.forget * self._xtx + xx
        self._xty = self.forget * self._xty + xy
        self._long_xtx = self.long_forget * self._long_xtx + xx
        self._long_xty = self.long_forget * self._long_xty + xy
        self.steps += 1
        eye = np.eye(3)
        prior = _nonnegative_solve(self._long_xtx + RIDGE * eye, self._long_xty)
        w = self.prior_weight
        self._coef = _nonnegative_solve(self._xtx + w * eye, self._xty + w * prior)

    @property
    def ready(self) -> bool:
        return self.steps >= self.min_steps

    @property
    def coefficients(self) -> tuple[float, float, float]:
        """(a seconds, b seconds per token, c seconds per cached position), each at least 0."""
        a, b, c = self._coef
        return float(a), float(b) / TOKEN_SCALE, float(c) / CONTEXT_SCALE

    def predict(self, tokens: int, context: int) -> float:
        """Seconds a step of `tokens` new tokens reading `context` cached positions takes."""
        a, b, c = self.coefficients
        return a + b * tokens + c * context


_SUBSETS = [[i for i in range(3) if mask >> i & 1] for mask in range(1, 8)]


def _nonnegative_solve(m: np.ndarray, v: np.ndarray) -> np.ndarray:
    """argmin over beta >= 0 of beta' m beta - 2 beta' v (m [3, 3] positive definite).

    No cost is negative, and a fit solved freely and then clipped is not the best fit with
    that cost at 0: over too few distinct steps the free fit trades a negative intercept for
    inflated per-token and per-position costs, which clipping the intercept keeps. With three
    coefficients every set of free ones is tried; the best feasible one is the optimum."""
    best, best_value = np.zeros(3), 0.0
    for free in _SUBSETS:
        beta = np.zeros(3)
        beta[free] = np.linalg.solve(m[np.ix_(free, free)], v[free])
        if (beta < 0).any():
            continue
        value = float(beta @ m @ beta - 2 * beta @ v)
        if value < best_value:
            best, best_value = beta, value
    return best
