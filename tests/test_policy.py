"""Eviction policies: pure ordering, by name from the registry."""

from __future__ import annotations

import pytest

from kvstore.tiers.policy import POLICIES, FIFOPolicy, LRUPolicy, Policy, SharedLRUPolicy, make_policy


def order(p: Policy) -> list:
    return list(p.victims())


def test_registry():
    assert {"lru", "fifo", "lru_shared"} <= set(POLICIES)
    assert isinstance(make_policy("lru"), LRUPolicy)
    assert isinstance(make_policy("fifo"), FIFOPolicy)
    assert isinstance(make_policy("lru_shared"), SharedLRUPolicy)
    assert make_policy("lru") is not make_policy("lru")  # one instance per tier
    with pytest.raises(ValueError) as ei:
        make_policy("lfu")
    assert "lfu" in str(ei.value) and "lru" in str(ei.value)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_common_behaviour(name):
    p = make_policy(name)
    for k in "abcd":
        p.insert(k)
    assert len(p) == 4 and set(order(p)) == set("abcd")
    p.remove("b")
    p.remove("zz")  # unknown: ignored
    assert len(p) == 3 and "b" not in order(p)
    p.touch("zz")  # unknown: ignored, not added
    assert len(p) == 3
    assert order(p)[0] == "a"  # untouched: insertion order
    p.insert("a")  # re-insert moves to the back
    assert order(p)[-1] == "a" and len(p) == 3


def test_lru_touch_refreshes():
    p = LRUPolicy()
    for k in "abc":
        p.insert(k)
    p.touch("a")
    assert order(p) == ["b", "c", "a"]


def test_fifo_ignores_hits():
    p = FIFOPolicy()
    for k in "abc":
        p.insert(k)
    p.touch("a")
    assert order(p) == ["a", "b", "c"]


def test_victims_is_lazy():
    p = LRUPolicy()
    for k in range(100_000):
        p.insert(k)
    it = p.victims()
    assert next(it) == 0 and next(it) == 1


def test_lru_shared_protects_blocks_hit_by_two_sessions():
    p = SharedLRUPolicy()
    for k in "abcd":
        p.insert(k)
    p.touch("a", session="s1")
    assert order(p)[-1] == "a"  # one session: still probation (moved to its end)
    p.touch("a", session="s1")  # the same session again does not count twice
    assert "a" in p._probation
    p.touch("a", session="s2")
    assert "a" in p._protected
    p.touch("b", session="s1")
    # probation first (LRU within it), then protected
    assert order(p) == ["c", "d", "b", "a"]
    p.touch("a")  # protected keys refresh within protected
    p.insert("e")
    assert order(p) == ["c", "d", "b", "e", "a"]
    p.remove("a")
    assert "a" not in order(p) and len(p) == 4


def test_lru_shared_without_sessions_is_lru():
    p, q = SharedLRUPolicy(), LRUPolicy()
    ops = ["a", "b", "c", "d"]
    for k in ops:
        p.insert(k)
        q.insert(k)
    for k in "cadb":
        p.touch(k)
        q.touch(k)
    assert order(p) == order(q)


def test_lru_shared_session_set_is_bounded():
    p = SharedLRUPolicy(shared_after=100, max_sessions_tracked=4)
    p.insert("a")
    for i in range(50):
        p.touch("a", session=f"s{i}")
    assert len(p._sessions["a"]) == 4
