"""Store metrics, exported through prometheus-client (one registry per store).

Per tier: hits and misses in blocks and tokens, bytes in/out, evictions, expirations, corrupt
files dropped, put/get latency. Lookups also count misses by reason: never stored, evicted
for capacity, expired by TTL, prefix diverged, below the minimum length.
"""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.exposition import generate_latest

LATENCY_BUCKETS = (1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
MISS_REASONS = ("never_stored", "evicted", "expired", "diverged", "below_min", "corrupt")


class StoreMetrics:
    def __init__(self, registry: CollectorRegistry | None = None, port: int | None = None):
        self.registry = registry or CollectorRegistry(auto_describe=True)
        r = self.registry
        self.hit_blocks = Counter("kvstore_hit_blocks", "Blocks found, by tier", ["tier"], registry=r)
        self.hit_tokens = Counter("kvstore_hit_tokens", "Tokens found, by tier", ["tier"], registry=r)
        self.lookup_blocks = Counter("kvstore_lookup_blocks", "Full blocks looked up", registry=r)
        self.lookup_tokens = Counter("kvstore_lookup_tokens", "Tokens in full blocks looked up", registry=r)
        self.miss_blocks = Counter("kvstore_miss_blocks", "Blocks not found, by reason of the first miss", ["reason"], registry=r)
        self.miss_tokens = Counter("kvstore_miss_tokens", "Tokens not found, by reason of the first miss", ["reason"], registry=r)
        self.bytes_in = Counter("kvstore_bytes_in", "Bytes written into a tier", ["tier"], registry=r)
        self.bytes_out = Counter("kvstore_bytes_out", "Bytes read out of a tier", ["tier"], registry=r)
        self.evictions = Counter("kvstore_evictions", "Blocks evicted for capacity", ["tier"], registry=r)
        self.expirations = Counter("kvstore_expirations", "Blocks expired by TTL", ["tier"], registry=r)
        self.corrupt = Counter("kvstore_corrupt_files", "Bad files dropped (a miss, never served)", ["tier", "reason"], registry=r)
        self.demotions = Counter("kvstore_demotions", "Blocks moved DRAM -> NVMe", registry=r)
        self.promotions = Counter("kvstore_promotions", "Blocks moved NVMe -> DRAM", registry=r)
        self.failed = Counter("kvstore_failed_ops", "Failed block writes/reads", ["tier", "op"], registry=r)
        self.put_latency = Histogram("kvstore_put_seconds", "put() latency per call", ["tier"], buckets=LATENCY_BUCKETS, registry=r)
        self.get_latency = Histogram("kvstore_get_seconds", "get() latency per call", ["tier"], buckets=LATENCY_BUCKETS, registry=r)
        self.blocks = Gauge("kvstore_blocks", "Blocks held, by tier", ["tier"], registry=r)
        self.bytes_held = Gauge("kvstore_bytes", "Bytes held, by tier", ["tier"], registry=r)
        self.capacity = Gauge("kvstore_capacity_bytes", "Capacity, by tier", ["tier"], registry=r)
        self.info = Gauge("kvstore_store_info", "The store's identity (value 1): model, key-chain root and NVMe "
                          "namespace, so a tool can find a prompt's blocks (keys = chain_keys(root, tokens))",
                          ["model", "root", "namespace"], registry=r)
        self._server = None
        self._lock = threading.Lock()
        if port:
            self._server = start_http_server(port, registry=r)

    def text(self) -> str:
        """The Prometheus exposition text."""
        return generate_latest(self.registry).decode()

    def snapshot(self) -> dict:
        """All samples as {"name{label=v}": value} (for ``kvstore stats`` and tests)."""
        out = {}
        for fam in self.registry.collect():
            for s in fam.samples:
                if s.name.endswith("_created"):
                    continue
                lab = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{lab}}}" if lab else s.name] = s.value
        return out

    def value(self, name: str, **labels) -> float:
        v = self.registry.get_sample_value(name, labels or None)
        return 0.0 if v is None else v

    def close(self) -> None:
        if self._server is not None:
            try:
                srv, thread = self._server
                srv.shutdown()
                srv.server_close()
            except Exception:
                pass
            self._server = None
