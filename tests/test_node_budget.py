"""One DRAM budget for a node daemon's models (issue 46): ``tiers.dram.capacity_gb`` is the host's,
one LRU across the models, with optional per-model quotas (``node.model_quota_gb``).

The rule (:func:`kvstore.node.budget.rebalance`) is pure: its scenarios spell out the moves. The
daemon tests drive a real daemon with two models' engines and call its rebalance round by hand
(its drain thread runs the same round every PERIOD_S)."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import FP, blocks_for, make_keys
from kvstore.config import ConfigError, from_dict
from kvstore.keys import ModelFingerprint
from kvstore.node.budget import Share, rebalance
from kvstore.node.daemon import NodeDaemon
from test_node import BB, engine, load, node_config, store

U = 100  # a slot's bytes in the rule's scenarios


def share(limit, used=None, wanted=0, oldest=math.inf, quota=None) -> Share:
    return Share(limit=limit * U, used=(limit if used is None else used) * U, wanted=wanted * U, oldest=oldest,
                 unit=U, quota=None if quota is None else quota * U)


# -- the rule --------------------------------------------------------------------------------------

def test_a_model_that_wants_room_gets_the_free_budget_first():
    assert rebalance([share(6, oldest=1.0), share(0, wanted=3)], 10 * U) == [6 * U, 3 * U]


def test_a_newcomer_takes_from_the_model_whose_least_recent_block_is_oldest():
    # a full budget: the newcomer (nothing held: its oldest is inf) takes from the oldest tail first
    got = rebalance([share(5, oldest=20.0), share(5, oldest=10.0), share(0, wanted=3)], 10 * U)
    assert got == [5 * U, 2 * U, 3 * U]
    got = rebalance([share(5, oldest=20.0), share(1, oldest=10.0), share(0, wanted=3)], 6 * U)
    assert got == [3 * U, 0, 3 * U]  # the oldest gives all it has, then the next oldest


def test_a_model_whose_own_least_recent_block_is_oldest_gives_it_up_itself():
    # one LRU: model 0 wants room, but its own tail (t=5) is older than model 1's (t=9): nothing moves
    assert rebalance([share(5, oldest=5.0, wanted=2), share(5, oldest=9.0)], 10 * U) == [5 * U, 5 * U]
    # once model 0's blocks are all newer than model 1's least recent one, model 1 gives
    assert rebalance([share(5, oldest=12.0, wanted=2), share(5, oldest=9.0)], 10 * U) == [7 * U, 3 * U]


def test_nothing_moves_without_demand():
    assert rebalance([share(7, oldest=1.0), share(3, oldest=2.0)], 12 * U) == [7 * U, 3 * U]


def test_a_quota_caps_a_model():
    got = rebalance([share(2, wanted=9, quota=4), share(8, oldest=1.0)], 10 * U)
    assert got == [4 * U, 6 * U]
    assert rebalance([share(6, quota=4), share(0, wanted=9)], 10 * U) == [4 * U, 6 * U]  # a new quota cuts


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 20), st.integers(0, 20), st.one_of(st.none(), st.floats(0, 100)),
                          st.one_of(st.none(), st.integers(1, 20))), min_size=1, max_size=6),
       st.integers(0, 60))
def test_the_budget_holds_whatever_the_demand(rows, total_slots):
    shares = [share(lim, wanted=w, oldest=math.inf if t is None else t, quota=q) for lim, w, t, q in rows]
    total = total_slots * U
    got = rebalance(shares, total)
    if sum(min(s.limit, s.quota or total) for s in shares) <= total:
        assert sum(got) <= total
    for s, g in zip(shares, got):
        assert 0 <= g <= (s.quota if s.quota is not None else max(total, s.limit))
        if s.wanted == 0:  # only a model that asked gains
            assert g <= s.limit


# -- the daemon ------------------------------------------------------------------------------------

OTHER = ModelFingerprint(model="another-model", dtype="float16", block_size=16, num_layers=2, num_kv_heads=2,
                         head_size=8)


def _dram(d: NodeDaemon, fp: ModelFingerprint):
    return next(s for s in d.stores.values() if s.root == engine_root(fp)).dram


def engine_root(fp):
    from kvstore.keys import root_of

    return root_of(fp)


def fill(e, keys) -> int:
    """Store ``keys`` 4 at a time (an engine holds at most node.engine_share of the slots at once)."""
    return sum(store(e, keys[i:i + 4], blocks_for(keys[i:i + 4], BB)) for i in range(0, len(keys), 4))


def settle(d: NodeDaemon) -> None:
    """The demotions a round started end, and the next round gives their slots' memory back (as
    the drain thread's next round would)."""
    for st in list(d.stores.values()):
        st.flush()
    d.rebalance()


def _resident(d: NodeDaemon) -> int:
    return sum(s.dram.resident_bytes() for s in d.stores.values())


def _daemon(tmp_path, **node):
    cfg = node_config(tmp_path, dram_blocks=32, **node)
    d = NodeDaemon(from_dict(cfg))
    import threading

    d.thread = threading.Thread(target=d.server.serve_forever, name="kvstore-node", daemon=True)
    d.thread.start()  # served, but no drain thread: the rebalance rounds are the test's own
    return d, cfg


def test_two_models_share_one_budget_and_the_least_recent_blocks_go(tmp_path):
    d, cfg = _daemon(tmp_path)
    a = b = None
    try:
        a = engine(cfg, "a")
        ka = make_keys(32)
        assert fill(a, ka) == 32  # model A alone: the whole budget
        da = _dram(d, FP)
        assert len(da) == 32
        time.sleep(0.01)
        b = engine(cfg, "b", fp=OTHER)
        db = _dram(d, OTHER)
        assert db.limit_bytes == 0  # a newcomer gets what is left of the budget: nothing
        kb = make_keys(8, seed=1, fp=OTHER)
        assert fill(b, kb) == 0  # no room yet: its demand is counted
        d.rebalance()
        # 8 slots moved from A to B; A's 8 least recent blocks written down to NVMe
        assert db.limit_bytes == 8 * db.slot_bytes and da.limit_bytes == 24 * da.slot_bytes
        settle(d)
        assert len(da) == 24 and a.contains_prefix(ka[:8], record=False).tiers == ("nvme",) * 8
        assert fill(b, kb) == 8
        assert len(da) + len(db) == 32
        # the stores' readouts (and their kvstore_tier_capacity_bytes gauges) show each model's share
        assert [s.stats()["tiers"]["dram"]["capacity_bytes"] for s in (a, b)] == [24 * BB, 8 * BB]
        # the memory of A's freed slots went back (the next round): the host holds the budget, not more
        settle(d)
        assert _resident(d) <= 32 * da.slot_bytes
        # every block still loads right, from DRAM or NVMe
        got = [g for i in range(0, 32, 4) for g in load(a, ka[i:i + 4])]
        assert len(got) == 32 and all(np.array_equal(g, x) for g, x in zip(got, blocks_for(ka, BB)))
        got = load(b, kb)
        assert len(got) == 8 and all(np.array_equal(g, x) for g, x in zip(got, blocks_for(kb, BB)))
    finally:
        for e in (a, b):
            if e is not None:
                e.close()
        d.close(persist=False)


def test_a_model_whose_blocks_are_older_loses_them_to_its_own_writes_first(tmp_path):
    d, cfg = _daemon(tmp_path)
    a = b = None
    try:
        a, b = engine(cfg, "a"), engine(cfg, "b", fp=OTHER)
        da, db = _dram(d, FP), _dram(d, OTHER)
        ka, kb = make_keys(24), make_keys(8, seed=1, fp=OTHER)
        fill(a, ka)
        d.rebalance()  # A takes nothing from B (B empty: no tail), B has asked nothing
        time.sleep(0.01)
        assert fill(b, kb) == 0
        d.rebalance()
        assert fill(b, kb) == 8  # B's blocks are the newest now
        limits = (da.limit_bytes, db.limit_bytes)
        # A writes 8 more: its own least recent blocks (older than all of B's) make the room
        time.sleep(0.01)
        kn = make_keys(8, seed=2)
        fill(a, kn)
        d.rebalance()
        assert (da.limit_bytes, db.limit_bytes) == limits and len(db) == 8
        # now every block A holds is used again (newer than B's): B's least recent blocks go next
        time.sleep(0.01)
        held = [k for k in ka + kn if a.contains_prefix([k], record=False).tiers == ("dram",)]
        for k in held:
            load(a, [k])
        kn2 = make_keys(4, seed=3)
        fill(a, kn2)
        d.rebalance()
        assert db.limit_bytes < limits[1] and len(db) < 8
        assert da.limit_bytes + db.limit_bytes <= 32 * da.slot_bytes
    finally:
        for e in (a, b):
            if e is not None:
                e.close()
        d.close(persist=False)


def test_a_quota_caps_a_models_dram(tmp_path):
    d, cfg = _daemon(tmp_path, model_quota_gb={FP.model: 8 * BB / (1 << 30)})
    a = None
    try:
        a = engine(cfg, "a")
        da = _dram(d, FP)
        assert da.pool.n_slots == 8  # its slab is its quota, not the budget
        ka = make_keys(20)
        fill(a, ka)
        b = engine(cfg, "b", fp=OTHER)
        try:
            kb = make_keys(8, seed=1, fp=OTHER)
            fill(b, kb)
            d.rebalance()
            fill(b, kb)
            for _ in range(3):  # however much A asks, it holds at most its quota; B has the rest
                fill(a, make_keys(8, seed=9))
                d.rebalance()
                assert da.limit_bytes <= 8 * da.slot_bytes and len(da) <= 8
            assert _dram(d, OTHER).limit_bytes <= 24 * da.slot_bytes
        finally:
            b.close()
    finally:
        if a is not None:
            a.close()
        d.close(persist=False)


def test_a_bad_quota_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"node\.model_quota_gb\.m': invalid value -1"):
        from_dict({"node": {"model_quota_gb": {"m": -1}}})
    with pytest.raises(ConfigError, match=r"node\.model_quota_gb'.*a mapping"):
        from_dict({"node": {"model_quota_gb": ["m"]}})
