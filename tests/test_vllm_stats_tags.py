"""Request tags on vLLM's /metrics (issue 45, finding 7): tag label slots go to the most recently
used tags, so a flood of junk tags makes and removes series all the time; vLLM's mirror of the
store's registry (connectors/vllm/stats.py) must remove them too, or it keeps one series per tag
ever seen (1,000 junk tags left 1,001 series there before)."""

from __future__ import annotations

import types

import pytest

pytest.importorskip("vllm")

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram  # noqa: E402

from kvstore.connectors.vllm.stats import KVStorePromMetrics, KVStoreStats, StatsTaker  # noqa: E402
from kvstore.offload.metrics import MAX_TAGS, OTHER_TAG, OffloadMetrics, RequestOutcome  # noqa: E402


def _vllm_side(reg: CollectorRegistry) -> KVStorePromMetrics:
    """vLLM's stat-logger side, its metrics in a registry of the test's own (not the global one)."""
    def bound(cls):
        return lambda **kw: cls(registry=reg, **{k: v for k, v in kw.items() if k != "multiprocess_mode"})
    types_ = {Counter: bound(Counter), Gauge: bound(Gauge), Histogram: bound(Histogram)}
    cfg = types.SimpleNamespace(kv_transfer_config=None)
    return KVStorePromMetrics(cfg, types_, ["engine"], {0: ["0"]})


def _tag_series(reg: CollectorRegistry, name: str) -> dict[str, float]:
    out = {}
    for fam in reg.collect():
        for s in fam.samples:
            if s.name == name and "tag" in s.labels:
                out[s.labels["tag"]] = s.value
    return out


def test_a_tag_flood_leaves_vllms_side_bounded_and_the_totals_right():
    store_reg = CollectorRegistry()
    metrics = OffloadMetrics(store_reg)
    taker = StatsTaker(store_reg, every_s=0.0)
    vllm_reg = CollectorRegistry()
    prom = _vllm_side(vllm_reg)
    now, total = 0.0, 0
    for i in range(1000):
        tag = "tenant" if i % 10 == 0 else f"junk{i}"
        metrics.record(RequestOutcome(req_id=f"r{i}", prompt=7, local=0, promised=0, got=0, tag=tag))
        total += 7
        if i % 5 == 4:  # vLLM aggregates several steps' stats before its logger records them
            now += 1.0
            agg = KVStoreStats(data={})
            for _ in range(2):
                got = taker.take(now)
                if got:
                    agg.aggregate(KVStoreStats(data=got))
            if not agg.is_empty():
                prom.observe(agg.data, 0)
    now += 1.0
    got = taker.take(now)
    if got:
        prom.observe(got, 0)
    seen = _tag_series(vllm_reg, "vllm:kvstore_engine_tag_prompt_tokens_total")
    assert len(seen) <= MAX_TAGS + 1, len(seen)  # the slots and 'other'; was one per tag ever seen
    assert "tenant" in seen and OTHER_TAG in seen
    assert sum(seen.values()) == total  # every tagged token, on vLLM's side as in the store
    assert seen == _tag_series(store_reg, "kvstore_engine_tag_prompt_tokens_total")
    assert len(taker._last) < 60  # the taker forgets removed series too
