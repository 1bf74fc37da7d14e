"""The engine's token accounting (kvstore.offload.metrics): every prompt token of a scheduled
request is counted once, as the engine's own hit, served by kvstore, or unsupplied with a reason;
tokens kvstore held under the engine's own hit are never hits. Scenarios on the planner with an
in-memory store client (each count spelled out), then the Prometheus side."""

from __future__ import annotations

import pytest

from kvstore.keys import ModelFingerprint
from kvstore.offload.metrics import UNSUPPLIED_REASONS, OffloadMetrics, RequestOutcome
from kvstore.offload.planner import Planner
from prometheus_client import CollectorRegistry
from test_planner_rollback import FakeClient, toks

BS = 4
FP = ModelFingerprint(model="m", revision="", dtype="float32", layout="x", block_size=BS, num_layers=1,
                      num_kv_heads=1, head_size=8)


def schedule(stored_blocks: int, prompt: list[int], local: int, *, allocate: int | None = None,
             cacheable: bool = True, broken: bool = False, rid: str = "r") -> tuple[int, RequestOutcome]:
    """One request through lookup and allocation; the store holds the prompt's first blocks."""
    c = FakeClient()
    p = Planner(c, FP, BS, prefetch=False)
    keys = p.keys_upto(p.track("probe", prompt, len(prompt)), len(prompt) // BS)
    c.stored = set(keys[:stored_blocks])
    c.broken = broken
    st = p.track(rid, prompt if cacheable else None, len(prompt))
    offered = p.lookup(st, local)
    c.broken = False
    p.allocated(st, offered if allocate is None else allocate)
    (o,) = c.outcomes
    assert o.local + o.promised + sum(o.unsupplied.values()) == o.prompt  # each token once
    return offered, o


@pytest.mark.parametrize("stored,n,local,offered,held,unsupplied", [
    # nothing stored: the full blocks are never_stored, the tail is a partial block
    (0, 10, 0, 0, {}, {"never_stored": 8, "partial_block": 2}),
    # all full blocks stored, the engine has none: kvstore offers them
    (2, 10, 0, 8, {}, {"partial_block": 2}),
    # the engine's own prefix cache has them: held by kvstore, not a hit
    (2, 10, 8, 0, {"dram": 8}, {"partial_block": 2}),
    # a prompt of whole blocks: the last block ends on the last token, never offered
    (3, 12, 0, 8, {}, {"partial_block": 4}),
    # the store's prefix ends early: what it lacks is never_stored (the store's reason)
    (1, 17, 0, 4, {}, {"never_stored": 12, "partial_block": 1}),
    # the engine holds one block, kvstore two more
    (3, 17, 4, 8, {"dram": 4}, {"never_stored": 4, "partial_block": 1}),
    # the engine holds more than kvstore: kvstore holds one block of it, supplies nothing
    (1, 17, 8, 0, {"dram": 4}, {"never_stored": 8, "partial_block": 1}),
    # shorter than a block: all partial
    (0, 3, 0, 0, {}, {"partial_block": 3}),
])
def test_accounting_scenarios(stored, n, local, offered, held, unsupplied):
    got, o = schedule(stored, toks(n, 1), local)
    assert got == offered and o.promised == offered and o.got == offered
    assert o.held == held
    assert o.unsupplied == unsupplied


def test_engine_takes_fewer_tokens_than_offered():
    offered, o = schedule(3, toks(17, 2), 0, allocate=4)
    assert offered == 12 and o.promised == 4
    assert o.unsupplied == {"not_loaded": 8, "never_stored": 4, "partial_block": 1}


def test_store_errors_and_uncacheable_requests():
    _, o = schedule(3, toks(17, 3), 4, broken=True)
    assert o.unsupplied == {"store_error": 13} and o.errors == 1
    _, o = schedule(3, toks(17, 3), 0, cacheable=False)
    assert o.unsupplied == {"uncacheable": 17} and o.held == {}


def test_outcome_travels_as_json_and_bad_labels_are_refused():
    o = RequestOutcome("r", 17, 4, 8, 8, ("dram", "nvme"), {"dram": 4}, {"partial_block": 1, "never_stored": 4})
    assert RequestOutcome.from_json(o.to_json()) == o
    m = OffloadMetrics(CollectorRegistry())
    m.record(o)
    s = m.summary()
    assert s["prompt_tokens"] == 17 and s["engine_local_hit_tokens"] == 4 and s["needed_tokens"] == 13
    assert s["held_tokens"]["dram"] == 4 and s["unsupplied_tokens"] == {"never_stored": 4, "partial_block": 1}
    for bad in (RequestOutcome("r", 1, 0, 0, 0, held={"gpu": 1}),
                RequestOutcome("r", 1, 0, 0, 0, unsupplied={"x" * 9: 1})):
        with pytest.raises(ValueError, match="unknown tier or reason"):
            m.record(bad)
    assert m.summary()["requests"] == 1  # refused outcomes count nothing
    assert set(UNSUPPLIED_REASONS) >= {"never_stored", "evicted", "expired", "diverged", "corrupt",
                                       "partial_block", "load_failed"}


def test_the_metrics_doc_lists_every_metric():
    """Every metric the store and the connector register is in docs/metrics.md's lists."""
    import os

    from kvstore.store.metrics import StoreMetrics

    m = StoreMetrics()
    OffloadMetrics(m.registry)
    readme = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs",
                               "metrics.md")).read()
    names = [f.name + ("_total" if f.type == "counter" else "") for f in m.registry.collect()]
    assert len(names) >= 30
    missing = [n for n in names if f"`{n}`" not in readme]
    assert not missing, f"docs/metrics.md does not list {missing}"
    for n in names:  # Prometheus conventions: a prefix, base units, _total on counters
        assert n.startswith("kvstore_") and n == n.lower()
        assert not any(n.endswith(s) for s in ("_ms", "_kb", "_mb", "_gb", "_count")), n


def test_a_resumed_request_whose_own_hit_covers_generated_tokens():
    """After a preemption vLLM's own hit may run past the prompt (it covers generated tokens):
    the prompt is still counted once, all of it engine-local."""
    _, o = schedule(0, toks(10, 4), 12)
    assert o.local == 10 and o.unsupplied == {}


def test_negative_counts_are_refused_before_anything_is_counted():
    m = OffloadMetrics(CollectorRegistry())
    with pytest.raises(ValueError, match="negative"):
        m.record(RequestOutcome("r", 5, 0, 0, 0, unsupplied={"partial_block": -1}))
    assert m.summary()["requests"] == 0 and m.summary()["prompt_tokens"] == 0


def test_blocks_the_engine_holds_are_never_prefetched():
    """Only the NVMe blocks past the engine's own hit are prefetched (a read for nothing, and a
    request kept waiting, otherwise)."""
    class NvmeClient(FakeClient):
        def contains_prefix(self, keys, record=False, num_tokens=None, held=0):
            m = super().contains_prefix(keys, record, num_tokens)
            return type(m)(m.num_blocks, ("nvme",) * m.num_blocks, m.miss_reason)

        def prefetch(self, keys):
            self.prefetched = list(keys)
            return super().prefetch(keys)

    ids = toks(17, 5)
    for local, want in ((16, None), (8, 2), (0, 4)):
        c = NvmeClient()
        p = Planner(c, FP, BS, prefetch=True)
        keys = p.keys_upto(p.track("probe", ids, 17), 4)
        c.stored = set(keys)
        st = p.track("r", ids, 17)
        first = p.lookup(st, local)
        if want is None:  # all of it in the engine already: no prefetch, nothing to offer
            assert first == 0 and "prefetch" not in c.calls
        else:
            assert first is None and c.prefetched == keys[4 - want:]
            assert p.lookup(st, local) == 16 - local  # the prefetch is done: offered
