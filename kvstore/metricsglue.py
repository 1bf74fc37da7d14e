"""Metrics glue of :class:`kvstore.store.KVStore`: lookups, evictions, gauges, corrupt files."""

from __future__ import annotations

from kvstore.index import EXPIRED, Entry
from kvstore.metrics import TIERS
from kvstore.tiers import Tier


class MetricsGlue:
    def _record_lookup(self, n_keys: int, tiers: list[str], reason: str | None, num_tokens: int | None) -> None:
        m, bt = self.metrics, self.block_tokens
        m.lookup_blocks.inc(n_keys)
        m.lookup_tokens.inc(n_keys * bt)
        for name in TIERS:
            c = tiers.count(name)
            if c:
                m.hit_blocks.labels(name).inc(c)
                m.hit_tokens.labels(name).inc(c * bt)
        if reason is not None:
            missed = n_keys - len(tiers)
            m.miss_blocks.labels(reason).inc(missed)
            m.miss_tokens.labels(reason).inc(missed * bt if n_keys else (num_tokens or 0))

    def _count_evictions(self, tier: Tier, entries: list[Entry]) -> None:
        exp = sum(1 for e in entries if e.reason == EXPIRED)
        if exp:
            self.metrics.expirations.labels(tier.name).inc(exp)
        if len(entries) - exp:
            self.metrics.evictions.labels(tier.name).inc(len(entries) - exp)

    def _update_gauges(self) -> None:
        for t in self.tiers:
            self.metrics.blocks.labels(t.name).set(len(t))
            self.metrics.bytes_held.labels(t.name).set(t.used_bytes)
        self._sync_corrupt_metrics()

    def _sync_corrupt_metrics(self) -> None:
        """Bring the corrupt-file counter up to the NVMe tier's own counts (cheap when unchanged)."""
        if self.nvme is None or not self.nvme.corrupt_reasons:
            return
        with self._ghost_lock:
            for reason, c in list(self.nvme.corrupt_reasons.items()):
                cur = self._corrupt_synced.get(reason, 0)
                if c > cur:
                    self.metrics.corrupt.labels("nvme", reason).inc(c - cur)
                    self._corrupt_synced[reason] = c
