"""The planner and mover under failure, without vLLM: scenarios written as vLLM drives them.

A fake store client (an in-memory set of keys) stands in for the store on the scheduler side;
the worker-side cases use a real KVStore and the real copy extension over a numpy "engine".
"""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.keys import ModelFingerprint, chain_keys
from kvstore.offload.planner import Planner
from kvstore.store import PrefixMatch

BS = 4
FP = ModelFingerprint(model="planner-test", dtype="float16", block_size=BS, num_layers=1, num_kv_heads=1,
                      head_size=8)


class FakeClient:
    """What the scheduler side may ask of a store, in memory; ``broken`` makes every call fail."""

    def __init__(self, stored=()):
        self.stored = set(stored)
        self.pins: dict[int, list[bytes]] = {}
        self.next = 0
        self.broken = False
        self.calls: list[str] = []
        self.outcomes = []

    def _op(self, name):
        self.calls.append(name)
        if self.broken:
            raise ConnectionError("kvstore rpc: store unreachable")

    def contains_prefix(self, keys, record=False, num_tokens=None, held=0):
        self._op("contains_prefix")
        n = next((i for i, k in enumerate(keys) if k not in self.stored), len(keys))
        return PrefixMatch(n, ("dram",) * n, None if n == len(keys) else "never_stored")

    def prefetch(self, keys):
        self._op("prefetch")
        return 0

    def prefetch_done(self, token):
        return True

    def begin_load(self, keys, session=None, ttl_s=None):
        self._op("begin_load")
        n = next((i for i, k in enumerate(keys) if k not in self.stored), len(keys))
        self.next += 1
        self.pins[self.next] = list(keys[:n])
        return self.next, n, ("dram",) * n

    def end_load(self, hid):
        self._op("end_load")
        self.pins.pop(hid, None)

    def record_request(self, outcome):
        self._op("record_request")
        self.outcomes.append(outcome)

    def close(self):
        pass


def toks(n, seed=0):
    return [int(x) for x in np.random.default_rng(seed).integers(1, 1000, n)]


def keys_of(tokens):
    return chain_keys(FP, tokens, BS)


def new_request(p: Planner, rid: str, tokens, computed_local: int = 0):
    st = p.track(rid, tokens, len(tokens))
    hit = p.lookup(st, computed_local)
    return st, hit


def test_normal_flow_stores_each_block_once():
    c = FakeClient()
    p = Planner(c, FP, BS, prefetch=False)
    t = toks(18)
    st, hit = new_request(p, "a", t)
    assert hit == 0
    p.allocated(st, 0)
    plan = p.build_step([("a", [10, 11, 12, 13, 14], 0)], [], {"a": 18})
    assert [s.block_ids for s in plan.stores] == [[10, 11, 12, 13]]  # 4 full blocks of 18 tokens
    assert plan.stores[0].start == 0 and plan.stores[0].prior_ids == []  # no loads: no table carried
    t.append(5)  # decode: one token, block 4 still not full
    plan = p.build_step([], [("a", None, 18, False)], {"a": 1})
    assert plan.stores == []
    t.append(6)
    plan = p.build_step([], [("a", None, 19, False)], {"a": 1})  # tokens 16..19 computed by this step
    assert [(s.block_ids, s.start) for s in plan.stores] == [([14], 4)]
    t.append(7)
    plan = p.build_step([], [("a", None, 20, False)], {"a": 1})
    assert plan.stores == [] and p.rollbacks == 0


def test_failed_load_rolls_the_saved_mark_back_and_the_blocks_are_stored_again():
    """vLLM truncates a request at its first bad block: the planner must plan those blocks again."""
    t = toks(30)
    ks = keys_of(t)
    c = FakeClient(ks[:6])  # 6 of 7 full blocks stored
    p = Planner(c, FP, BS, prefetch=False)
    st, hit = new_request(p, "a", t)
    assert hit == 24
    p.allocated(st, 24)
    ids = list(range(100, 108))
    plan = p.build_step([("a", ids, 24)], [], {"a": 6})
    assert [(lp.block_ids, lp.first) for lp in plan.loads] == [(ids[:6], 0)]
    # this step stores block 6 only (0..5 were found in the store: never offered again); with a
    # load in the step it carries the table before it, so a failed load drops it
    assert [(s.start, s.block_ids, s.prior_ids) for s in plan.stores] == [(6, ids[6:7], ids[:6])]
    assert st.saved_blocks == 7
    # the worker reported block 102 bad: vLLM truncates num_computed_tokens to 2 blocks and reschedules
    plan = p.build_step([], [("a", None, 2 * BS, False)], {"a": 30 - 2 * BS})
    assert p.rollbacks == 1
    assert [(s.start, s.block_ids) for s in plan.stores] == [(2, ids[2:7])]  # recomputed: stored again
    assert plan.stores[0].keys == ks[2:7]


def test_preempted_request_restarts_from_its_hits():
    t = toks(40)
    c = FakeClient()
    p = Planner(c, FP, BS, prefetch=False)
    st, _ = new_request(p, "a", t)
    p.allocated(st, 0)
    plan = p.build_step([("a", list(range(10)), 0)], [], {"a": 16})  # chunked prefill: 4 blocks
    assert plan.stores[0].block_ids == [0, 1, 2, 3]
    # preempted, then resumed with new blocks and nothing computed (no cache hit)
    plan = p.build_step([], [("a", [50, 51, 52, 53, 54, 55, 56, 57, 58, 59], 0, True)], {"a": 16})
    assert [(s.start, s.block_ids) for s in plan.stores] == [(0, [50, 51, 52, 53])]


def test_store_plans_carry_the_block_table_before_them_when_the_step_loads():
    """A request that shares an engine block loaded (and failed) in this step must see it."""
    shared = toks(16, 1)
    a, b = shared + toks(8, 2), shared + toks(8, 3)
    c = FakeClient(keys_of(shared))
    p = Planner(c, FP, BS, prefetch=False)
    sa, ha = new_request(p, "a", a)
    p.allocated(sa, ha)
    sb, hb = new_request(p, "b", b, computed_local=16)  # b hits a's blocks in the engine's own cache
    assert hb == 0
    p.allocated(sb, 0)
    sb.saved_blocks = 4  # (as after a preemption: the shared blocks were saved before)
    plan = p.build_step([("a", [1, 2, 3, 4, 5, 6], 16), ("b", [1, 2, 3, 4, 7, 8], 16)], [], {"a": 8, "b": 8})
    sp_b = next(s for s in plan.stores if s.req_id == "b")
    assert sp_b.start == 4 and sp_b.prior_ids == [1, 2, 3, 4]


def test_an_unreachable_store_is_a_miss_and_a_lost_pin_fails_the_load():
    t = toks(30)
    c = FakeClient(keys_of(t))
    p = Planner(c, FP, BS, prefetch=False)
    st, hit = new_request(p, "a", t)
    assert hit == 28
    c.broken = True  # the socket closes between lookup and pin
    p.allocated(st, 28)
    plan = p.build_step([("a", list(range(8)), 28)], [], {"a": 2})
    assert [(lp.handle_id, lp.block_ids) for lp in plan.loads] == [(0, list(range(7)))]  # no handle: all fail
    assert p.errors >= 1
    st2, hit2 = new_request(p, "b", t)  # a lookup against a dead store: a miss, no exception
    assert hit2 == 0
    c.broken = False
    p.finished("a")
    st3, hit3 = new_request(p, "c", t)
    assert hit3 == 28  # back


# -- worker side: a real store, the real copy extension, a numpy engine ---------------------------

@pytest.fixture
def worker(tmp_path):
    from kvstore import kvcopy
    from kvstore.config import from_dict
    from kvstore.offload import LocalClient, StepRunner, acquire_shared, release_shared

    n_blocks, heads, hs = 32, 1, 8
    cache = np.zeros((n_blocks, heads, BS, 2 * hs), np.float16)  # vLLM CPU layout, one layer
    layout = kvcopy.KVLayout.from_vllm([cache])
    cfg = from_dict({"tiers": {"dram": {"capacity_gb": 0}, "nvme": {"path": str(tmp_path / "s"),
                                                                     "capacity_gb": 0.01, "header": "inline"}}})
    fp = ModelFingerprint(model="planner-test", dtype="float16", block_size=BS, num_layers=1, num_kv_heads=heads,
                          head_size=hs, layout=f"x.{layout.packing}")
    shared = acquire_shared("test/tp0", cfg, fp, layout.block_bytes, BS)
    mover = StepRunner(shared)
    mover.register([cache], layout)
    planner = Planner(LocalClient(shared), fp, BS, prefetch=False)
    yield planner, mover, shared, cache
    release_shared(shared)


def test_worker_drops_stores_computed_over_a_failed_load(worker):
    """The step that meets a damaged file stores nothing from the bad block on; the next one heals."""
    planner, mover, shared, cache = worker
    store = shared.store
    t = toks(30, 7)  # 7 full blocks: 6 stored, the 7th computed in the step that loads the 6
    ks = chain_keys(store.root, t, BS)
    rng = np.random.default_rng(0)
    good = rng.standard_normal((6,) + cache.shape[1:]).astype(np.float16)
    store.put(ks[:6], [g.view(np.uint8).reshape(-1) for g in good])
    # damage block 2's file on disk
    f = store.nvme.path_of(ks[2])
    data = bytearray(f.read_bytes())
    data[4096 + 10] ^= 0xFF  # inline header: the payload starts at 4 KiB
    f.write_bytes(bytes(data))
    st, hit = new_request(planner, "a", t)
    assert hit == 24
    planner.allocated(st, 24)
    ids = list(range(10, 18))
    cache[ids] = 99  # stale engine memory: what a failed block holds
    plan = planner.build_step([("a", ids, 24)], [], {"a": 6})
    # the loaded blocks are not offered to the store again; block 6 carries the table before it
    assert [(sp.start, sp.block_ids, sp.prior_ids) for sp in plan.stores] == [(6, ids[6:7], ids[:6])]
    mover.load(plan)
    bad = mover.take_load_errors()
    assert bad == set(ids[2:6])  # from the first failed block on (the rest of the prefix is not read)
    assert np.array_equal(cache[ids[:2]], good[:2])
    mover.save(plan)  # the forward pass ran over garbage in 12..15: block 6 (16) is not stored
    assert store.contains_prefix(ks, record=False).num_blocks == 2
    assert shared.metrics.registry.get_sample_value("kvstore_engine_store_skipped_blocks_total",
                                                    {"reason": "failed_load"}) == 1
    # vLLM recomputes from block 2 (the engine now holds the right KV) and reschedules
    cache[ids[2:6]] = good[2:6]
    cache[ids[6]] = 7
    plan = planner.build_step([], [("a", None, 8, False)], {"a": 22})
    assert plan.loads == [] and plan.stores[0].start == 2
    mover.load(plan)
    mover.save(plan)
    assert store.contains_prefix(ks, record=False).num_blocks == 7  # healed
    out = np.zeros((6, store.block_bytes), np.uint8)
    assert store.get(ks[:6], out) == 6
    assert np.array_equal(out[:6].view(np.float16).reshape(good.shape), good)


def test_scatter_failure_fails_every_block_and_stores_nothing_after(worker, monkeypatch):
    from kvstore import failpoints

    planner, mover, shared, cache = worker
    store = shared.store
    t = toks(20, 8)
    ks = chain_keys(store.root, t, BS)
    blocks = np.random.default_rng(1).integers(0, 255, (4, store.block_bytes), dtype=np.uint8)
    store.put(ks[:4], blocks)
    st, hit = new_request(planner, "a", t)
    planner.allocated(st, hit)
    failpoints.arm("mover.scatter=raise*1")
    try:
        plan = planner.build_step([("a", [1, 2, 3, 4, 5], hit)], [], {"a": 4})
        mover.load(plan)
    finally:
        failpoints.clear()
    assert mover.take_load_errors() == {1, 2, 3, 4}
    n0 = store.metrics.value("kvstore_tier_written_bytes_total", tier="nvme")
    mover.save(plan)
    assert store.metrics.value("kvstore_tier_written_bytes_total", tier="nvme") == n0  # nothing stored
