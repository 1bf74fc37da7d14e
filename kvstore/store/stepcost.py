"""The engine's cost of a forward pass, fitted over the steps the connector timed, for the
lookup's "load or recompute?" decision (:func:`kvstore.store.placement.worth_loading`).

A step's seconds are modelled as ``c + a * tokens + b * pairs``: ``c`` the fixed cost of a
step (paid whether a prefix is loaded or not), ``a`` the per-token cost (the MLPs, the
projections), ``b`` the attention cost per (query token, context token) pair. A request that
computes ``n`` tokens from position ``p`` adds ``n * p + n * (n + 1) / 2`` pairs. Recomputing a
block at position ``p`` therefore costs more the later it sits in the prompt; a per-token rate
over recent steps misses that, and so undervalues the hits of long prompts.

The fit is an exponentially weighted least-squares (``forget``: the weight kept by the previous
steps at each new one; 0.95 weighs the last ~20 steps) with non-negative coefficients: each
subset of the three terms is solved and the best fit with no negative coefficient is kept. A
fixed cost is the one term that makes recomputing look cheaper, so it must earn its place: a
fit with it is kept only if it leaves under a quarter of the squared error of the best fit
without it. Steps that all look alike (a per-token cost and a fixed cost cannot be told apart,
and a fixed cost would fit their noise) are so charged per token, which values a hit more, as
the store did before these estimates. Pure: the caller passes the amounts and seconds it measured.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import compress

import numpy as np

# the candidate terms (fixed, per token, per pair), in order of preference on a tie
_SUBSETS = ((0, 1, 0), (0, 1, 1), (0, 0, 1), (1, 1, 0), (1, 1, 1), (1, 0, 1), (1, 0, 0))
FIXED_GAIN = 0.25  # a fit with a fixed cost must leave under this share of the error without one
_SCALE = np.array([1.0, 1e3, 1e6])  # tokens in thousands, pairs in millions: a well-scaled system


def pairs(start: int, n: int) -> int:
    """Attention pairs of ``n`` tokens computed from position ``start`` (causal)."""
    return n * start + n * (n + 1) // 2


@dataclass(frozen=True)
class Fit:
    c: float  # seconds per step
    a: float  # seconds per token
    b: float  # seconds per attention pair

    def seconds(self, start: int, n: int) -> float:
        """Seconds the engine spends computing ``n`` prompt tokens from position ``start``,
        beyond the step's fixed cost."""
        return self.a * n + self.b * pairs(start, n)


class StepCost:
    def __init__(self, forget: float = 0.95):
        assert 0 < forget < 1
        self.forget = forget
        self.samples = 0
        self._xx = np.zeros((3, 3))
        self._xt = np.zeros(3)
        self._tt = 0.0
        self._fit: Fit | None = None

    def observe(self, tokens: int, pairs_: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        x = np.array([1.0, tokens, max(pairs_, 0)]) / _SCALE
        self._xx = self.forget * self._xx + np.outer(x, x)
        self._xt = self.forget * self._xt + x * seconds
        self._tt = self.forget * self._tt + seconds * seconds
        self.samples += 1
        self._fit = None

    def fit(self) -> Fit | None:
        """The fitted coefficients, or None before any sample."""
        if not self.samples:
            return None
        if self._fit is None:
            self._fit = self._solve()
        return self._fit

    def _solve(self) -> Fit:
        tol = 1e-9 * max(self._tt, 1e-300)
        best = {0: (np.zeros(3), np.inf), 1: (np.zeros(3), np.inf)}  # without, with a fixed cost
        for mask in _SUBSETS:
            idx = list(compress(range(3), mask))
            a = self._xx[np.ix_(idx, idx)]
            if np.linalg.cond(a) > 1e10:
                continue  # the steps do not tell these terms apart
            beta = np.linalg.solve(a, self._xt[idx])
            if (beta < 0).any():
                continue
            full = np.zeros(3)
            full[idx] = beta
            err = self._tt - 2 * full @ self._xt + full @ self._xx @ full
            if err < best[mask[0]][1] - tol:
                best[mask[0]] = (full, err)
        (free, free_err), (fixed, fixed_err) = best[0], best[1]
        chosen = fixed if fixed_err < FIXED_GAIN * free_err - tol or free_err == np.inf else free
        c, a, b = (float(v) for v in chosen / _SCALE)
        return Fit(c, a, b)
