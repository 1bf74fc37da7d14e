"""TierIndex: capacity, idle TTL, pins and two-phase entries (no I/O, explicit time)."""

from __future__ import annotations

import math

import pytest

from kvstore.tiers.index import CAPACITY, EXPIRED, READY, WRITING, TierIndex
from kvstore.tiers.policy import make_policy


def idx(cap_entries=3, ttl=None, policy="lru", nbytes=10, **kw) -> TierIndex:
    return TierIndex(cap_entries * nbytes, ttl, make_policy(policy), **kw)


def put(ix: TierIndex, key, now, nbytes=10, session=None):
    e, ev = ix.reserve(key, nbytes, now)
    assert e is not None
    ix.commit(e, now, session)
    return e, ev


def test_reserve_commit_abort():
    ix = idx()
    e, ev = ix.reserve("a", 10, 0.0)
    assert ev == [] and e.state == WRITING and e.pins == 1
    assert "a" not in ix and ix.lookup("a", 0.0) is None and ix.writing_entry("a") is e
    assert ix.used == 10 and len(ix) == 1 and len(ix.policy) == 0
    ix.check()
    ix.commit(e, 1.0)
    assert e.state == READY and e.pins == 0 and "a" in ix and ix.lookup("a", 1.0) is e
    assert ix.writing_entry("a") is None and e.last_access == 1.0 and e.expire_at == math.inf
    e2, _ = ix.reserve("b", 10, 1.0)
    ix.abort(e2)
    assert "b" not in ix.entries and ix.used == 10
    ix.check()


def test_reserve_of_present_key_is_a_programming_error():
    ix = idx()
    put(ix, "a", 0.0)
    with pytest.raises(AssertionError):
        ix.reserve("a", 10, 0.0)


def test_capacity_lru_order():
    ix = idx(3)
    for i, k in enumerate("abc"):
        put(ix, k, float(i))
    ix.touch(ix.entries["a"], 5.0)
    e, ev = ix.reserve("d", 10, 6.0)
    assert [x.key for x in ev] == ["b"] and ev[0].reason == CAPACITY
    assert ix.used == 30
    ix.check()


def test_too_big_or_all_pinned_means_no_room():
    ix = idx(2)
    e, ev = ix.reserve("huge", 21, 0.0)
    assert e is None and ev == []
    a, _ = put(ix, "a", 0.0)
    b, _ = ix.reserve("b", 10, 0.0)  # WRITING: pinned
    ix.pin(a)
    e, ev = ix.reserve("c", 10, 0.0)
    assert e is None and ev == [] and set(ix.entries) == {"a", "b"}
    ix.unpin(a)
    e, ev = ix.reserve("c", 10, 0.0)
    assert e is not None and [x.key for x in ev] == ["a"]
    ix.check()


def test_a_victim_set_can_span_several_entries():
    ix = TierIndex(30, None, make_policy("lru"))
    put(ix, "a", 0, nbytes=10)
    put(ix, "b", 1, nbytes=10)
    put(ix, "c", 2, nbytes=10)
    e, ev = ix.reserve("big", 25, 3)
    assert [x.key for x in ev] == ["a", "b", "c"] and ix.used == 25
    ix.check()


def test_zero_capacity():
    ix = TierIndex(0, None, make_policy("lru"))
    assert ix.reserve("a", 1, 0)[0] is None
    assert ix.reserve("a", 0, 0)[0] is not None


def test_idle_ttl_refreshed_on_hit():
    ix = idx(3, ttl=10)
    e, _ = put(ix, "a", 0.0)
    assert e.expire_at == 10.0
    assert ix.lookup("a", 9.9) is e and ix.lookup("a", 10.0) is None  # lookup does not refresh
    ix.touch(e, 9.0)
    assert ix.lookup("a", 18.9) is e
    assert ix.expire(18.9) == []
    out = ix.expire(19.0)
    assert [x.key for x in out] == ["a"] and out[0].reason == EXPIRED
    assert len(ix) == 0 and ix.used == 0
    ix.check()


def test_expire_oldest_deadline_first_and_bounded():
    ix = idx(10, ttl=10, max_expire_per_call=3)
    for i in range(6):
        put(ix, i, float(i))
    out = ix.expire(100.0)
    assert [e.key for e in out] == [0, 1, 2]
    assert [e.key for e in ix.expire(100.0, limit=2)] == [3, 4]
    assert [e.key for e in ix.expire(100.0)] == [5]
    ix.check()


def test_expired_but_pinned_is_held_then_expires():
    ix = idx(3, ttl=10)
    a, _ = put(ix, "a", 0.0)
    ix.pin(a)
    assert ix.expire(50.0) == []
    assert "a" in ix.entries and ix.lookup("a", 50.0) is None  # invisible, but not gone
    ix.unpin(a)
    assert [e.key for e in ix.expire(50.0)] == ["a"]
    ix.check()


def test_expired_go_first_even_when_the_policy_prefers_another():
    ix = idx(3, ttl=10, policy="fifo")
    put(ix, "b", 0.0)
    put(ix, "a", 0.0)
    put(ix, "c", 6.0)
    ix.touch(ix.entries["b"], 6.0)  # FIFO keeps b first in line, but b is fresh now
    e, ev = ix.reserve("d", 10, 11.0)  # a expired (idle 11 s); the policy would pick b
    assert [(x.key, x.reason) for x in ev] == [("a", EXPIRED)]
    assert set(ix.entries) == {"b", "c", "d"}


def test_expired_go_first_beyond_the_sweep_limit():
    ix = idx(8, ttl=10, policy="fifo", max_expire_per_call=1)
    for k in "pqrs":  # fresh, first in FIFO order
        put(ix, k, 0.0)
    for k in "wxyz":
        put(ix, k, 0.0)
    for k in "pqrs":
        ix.touch(ix.entries[k], 5.0)
    # at 12: w x y z expired; the sweep takes one per call, but expired still go before p q r s
    e, ev = ix.reserve("big", 40, 12.0)
    assert e is not None and sorted(x.key for x in ev) == ["w", "x", "y", "z"]
    assert all(x.reason == EXPIRED for x in ev)
    assert {"p", "q", "r", "s"} <= set(ix.entries)
    ix.check()


def test_writing_entries_never_expire_or_evict():
    ix = idx(2, ttl=1)
    w, _ = ix.reserve("w", 10, 0.0)
    put(ix, "a", 0.0)
    assert ix.expire(100.0) and "w" in ix.entries
    for i in range(5):
        e, ev = ix.reserve(i, 10, 100.0 + i)
        assert "w" not in [x.key for x in ev]
        if e is not None:
            ix.commit(e, 100.0 + i)
    assert ix.writing_entry("w") is w
    ix.commit(w, 200.0)
    assert ix.lookup("w", 200.0) is w and ix.lookup("w", 201.0) is None
    ix.check()


def test_remove():
    ix = idx(3)
    a, _ = put(ix, "a", 0.0)
    w, _ = ix.reserve("w", 10, 0.0)
    assert ix.remove("w") is None  # WRITING: not removable
    ix.pin(a)
    assert ix.remove("a") is None  # pinned
    ix.unpin(a)
    assert ix.remove("a", "corrupt") is a and a.reason == "corrupt"
    assert ix.remove("nope") is None
    assert ix.used == 10
    ix.check()


def test_condemn_takes_a_pinned_entry_out_at_once_and_its_last_unpin_frees_it():
    ix = idx(3)
    a, _ = put(ix, "a", 0.0)
    ix.pin(a)
    ix.pin(a)  # two readers
    assert ix.condemn(a, "corrupt") is False  # still read: its medium is not freed yet
    assert ix.lookup("a", 0.0) is None and "a" not in ix.entries and ix.used == 0
    assert list(ix.policy.victims()) == [] and a.reason == "corrupt"
    ix.check()
    b, _ = put(ix, "a", 1.0)  # the key can be stored again at once
    assert ix.unpin(a) is False  # another reader left
    assert ix.unpin(a) is True  # the last: the caller frees the old medium
    assert ix.lookup("a", 1.0) is b and b.pins == 0  # the new entry is untouched
    c, _ = put(ix, "c", 2.0)
    assert ix.condemn(c, "corrupt") is True  # nobody reads it: free now
    ix.check()


def test_add_ready_rebuild_keeps_newest_and_drops_expired():
    ix = idx(3, ttl=100)
    # fed oldest first, as the start-up scan does
    for i, t in enumerate([10.0, 20.0, 150.0, 160.0, 170.0]):
        ix.add_ready(f"k{i}", 10, t, now=200.0)
    ix.expire(200.0)
    assert set(ix.entries) == {"k2", "k3", "k4"}
    assert ix.entries["k2"].last_access == 150.0 and ix.entries["k2"].expire_at == 250.0
    assert list(ix.policy.victims()) == ["k2", "k3", "k4"]
    ix.check()


def test_per_entry_ttl():
    ix = idx(3, ttl=100)
    e, _ = ix.reserve("short", 10, 0.0, ttl=5)
    ix.commit(e, 0.0)
    f, _ = ix.reserve("never", 10, 0.0, ttl=None)  # None: the tier's TTL
    ix.commit(f, 0.0)
    assert e.expire_at == 5.0 and f.expire_at == 100.0


def test_heap_stays_small_under_many_touches():
    ix = idx(4, ttl=10)
    es = [put(ix, i, 0.0)[0] for i in range(4)]
    for t in range(5000):
        ix.touch(es[t % 4], float(t))
    assert len(ix._heap) <= 2 * len(ix) + 1024 + 1
    ix.check()
    assert [e.key for e in ix.expire(10_000.0)] == [0, 1, 2, 3]


def test_check_catches_drift():
    ix = idx(3)
    put(ix, "a", 0.0)
    ix.used += 1
    with pytest.raises(AssertionError):
        ix.check()
