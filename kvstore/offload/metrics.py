"""Metrics in an engine's terms: prompt tokens, tokens served per tier, tokens recomputed,
load and save latency. Registered in the store's Prometheus registry."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from kvstore.metrics import LATENCY_BUCKETS


class OffloadMetrics:
    def __init__(self, registry: CollectorRegistry):
        self.registry = r = registry
        self.requests = Counter("kvstore_engine_requests", "Requests looked up by the engine connector", registry=r)
        self.prompt_tokens = Counter("kvstore_engine_prompt_tokens", "Prompt tokens of looked-up requests", registry=r)
        self.engine_cached_tokens = Counter("kvstore_engine_local_hit_tokens",
                                            "Tokens the engine already had in its own prefix cache", registry=r)
        self.loaded_tokens = Counter("kvstore_engine_loaded_tokens", "Tokens served from kvstore, by tier",
                                     ["tier"], registry=r)
        self.recomputed_tokens = Counter("kvstore_engine_recomputed_tokens",
                                         "Prompt tokens the engine had to compute", registry=r)
        self.failed_tokens = Counter("kvstore_engine_failed_load_tokens",
                                     "Tokens promised but not loaded (recomputed instead)", registry=r)
        self.store_errors = Counter("kvstore_engine_store_errors",
                                    "Store calls that failed (a miss, a recompute or a skipped store)", ["op"],
                                    registry=r)
        self.skipped_blocks = Counter("kvstore_engine_store_skipped_blocks",
                                      "Blocks not stored, by reason (failed_load: computed over a failed load)",
                                      ["reason"], registry=r)
        self.stored_blocks = Counter("kvstore_engine_stored_blocks", "Blocks saved from the engine", registry=r)
        self.load_seconds = Histogram("kvstore_engine_load_seconds", "Worker-side load time per step",
                                      buckets=LATENCY_BUCKETS, registry=r)
        self.save_seconds = Histogram("kvstore_engine_save_seconds", "Worker-side save time per step",
                                      buckets=LATENCY_BUCKETS, registry=r)

    def _v(self, name: str, **labels) -> float:
        return self.registry.get_sample_value(name, labels or None) or 0.0

    def summary(self) -> dict:
        loaded = {t: self._v("kvstore_engine_loaded_tokens_total", tier=t) for t in ("dram", "nvme")}
        prompt = self._v("kvstore_engine_prompt_tokens_total")
        return {
            "requests": int(self._v("kvstore_engine_requests_total")),
            "prompt_tokens": int(prompt),
            "engine_local_hit_tokens": int(self._v("kvstore_engine_local_hit_tokens_total")),
            "loaded_tokens": {k: int(x) for k, x in loaded.items()},
            "recomputed_tokens": int(self._v("kvstore_engine_recomputed_tokens_total")),
            "failed_load_tokens": int(self._v("kvstore_engine_failed_load_tokens_total")),
            "stored_blocks": int(self._v("kvstore_engine_stored_blocks_total")),
            "kvstore_hit_rate": (sum(loaded.values()) / prompt) if prompt else 0.0,
        }
