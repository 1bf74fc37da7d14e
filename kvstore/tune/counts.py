"""What the tuner's replay counts: the metrics sink of its :class:`kvstore.store.KVStore`.

The store reports to it exactly what it reports to Prometheus (:class:`kvstore.store.metrics.
StoreMetrics`, the same calls): what the chain's plans counted (evictions, expiries, blocks
skipped), blocks written into each tier, demotions and promotions. No label, no lock: a replay
runs on one thread.
"""

from __future__ import annotations

from collections import Counter


class ReplayCounts:
    def __init__(self):
        self.evicted: Counter = Counter()  # by tier, for capacity
        self.expired: Counter = Counter()  # by tier
        self.skipped: Counter = Counter()  # by reason: no_slot, pinned, not_admitted, backlog
        self.written: Counter = Counter()  # blocks written into each tier (stores, copies, demotions, promotions)
        self.demotions = 0
        self.promotions = 0

    # -- the sink's calls (kvstore.store.metrics.StoreMetrics) --------------------------------------
    def attach(self, store, fingerprint) -> None:
        pass

    def plan(self, plan) -> None:
        for event, tier, n in plan.counts:
            if event == "evicted":
                self.evicted[tier] += n
            elif event == "expired":
                self.expired[tier] += n
            else:
                self.skipped[event] += n

    def wrote(self, tier: str, ok: int, failed: int = 0, seconds: float | None = None) -> None:
        self.written[tier] += ok

    def moved(self, demoted: int = 0, promoted: int = 0) -> None:
        self.demotions += demoted
        self.promotions += promoted

    def read(self, tier: str, n: int, seconds: float | None = None) -> None:
        pass

    def failed_read(self, tier: str, n: int = 1) -> None:
        pass

    def lookup(self, n_keys: int, tiers: list[str], reason: str | None, num_tokens: int | None,
               block_tokens: int) -> None:
        pass

    def gauges(self, tiers) -> None:
        pass

    def sync(self, t) -> None:
        pass

    def close(self) -> None:
        pass
