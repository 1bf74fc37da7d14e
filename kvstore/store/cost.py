"""Moving estimates of how fast things go, for the lookup's "load or recompute?" decision
(:func:`kvstore.store.placement.worth_loading`): each tier's read throughput, measured on the store's
own reads, and the engine's cost of computing prompt tokens (:class:`kvstore.store.stepcost.StepCost`,
fitted over the forward passes the connector timed). Pure: the caller passes the amounts and the
seconds it measured.

An estimate is time-weighted: the moving sums of amount and of seconds are kept apart and
divided, so one tiny read (a few blocks, dominated by a fixed cost) weighs what it took, not
as much as a large one. ``alpha`` is the weight of the newest sample (0.2: the last ~10 reads
matter). An estimate counts from its third sample (``MIN_SAMPLES``): before that the lookup
loads everything it finds, as it did before these estimates existed, so one read that met a busy
machine cannot turn hits away.
"""

from __future__ import annotations

import math
import threading
from typing import Callable

from kvstore.store.stepcost import StepCost

MIN_SAMPLES = 3


class Rate:
    def __init__(self, alpha: float = 0.2):
        assert 0 < alpha <= 1
        self.alpha = alpha
        self._amount = self._seconds = 0.0
        self.samples = 0

    def observe(self, amount: float, seconds: float) -> None:
        if amount <= 0 or seconds <= 0:
            return
        a = self.alpha if self.samples else 1.0
        self._amount += a * (amount - self._amount)
        self._seconds += a * (seconds - self._seconds)
        self.samples += 1

    @property
    def value(self) -> float | None:
        """Units per second, or None before any sample."""
        return self._amount / self._seconds if self.samples else None


class Rates:
    """Per-tier read throughput (bytes/s) and the engine's step cost."""

    def __init__(self, alpha: float = 0.2, use: bool = True):
        self._lock = threading.Lock()
        self._alpha = alpha
        self.use = use  # io.load_only_if_faster: off, the estimates are kept but never offered
        self.read: dict[str, Rate] = {}
        self.prefill = StepCost()

    def observe_read(self, tier: str, nbytes: int, seconds: float) -> None:
        with self._lock:
            self.read.setdefault(tier, Rate(self._alpha)).observe(nbytes, seconds)

    def observe_prefill(self, tokens: int, seconds: float, pairs: int = 0) -> None:
        """A timed forward pass: its scheduled ``tokens`` and their attention ``pairs``."""
        with self._lock:
            self.prefill.observe(tokens, pairs, seconds)

    def seconds_per_block(self, block_bytes: int, block_tokens: int
                          ) -> tuple[dict[str, float], Callable[[int], float] | None]:
        """(load seconds per block by tier, for the tiers measured; the seconds to recompute the
        block at a given index of the prompt); nothing while not in ``use`` (every hit is loaded)."""
        if not self.use:
            return {}, None
        with self._lock:
            load = {t: block_bytes / r.value for t, r in self.read.items() if r.samples >= MIN_SAMPLES}
            if self.prefill.samples < MIN_SAMPLES:
                return load, None
        fit: list = []

        def recompute_s(i: int) -> float:  # fitted on first use (~1.5 ms): a DRAM hit never asks
            if not fit:
                with self._lock:
                    fit.append(self.prefill.fit())
            if fit[0].a <= 0 and fit[0].b <= 0:  # no per-token cost found: load all, as without an estimate
                return math.inf
            return fit[0].seconds(i * block_tokens, block_tokens)

        return load, recompute_s
