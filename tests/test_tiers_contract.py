"""One contract, every tier (DRAM; NVMe buffered and O_DIRECT) x every registered policy.

Plus scenario tests that spell out expected evictions and expirations with a fake clock.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.tiers import fileformat as ff
from kvstore.tiers.memory import alloc_aligned
from kvstore.tiers.policy import POLICIES
from kvstore.tiers.dram import DramTier
from kvstore.tiers.nvme import NvmeTier
from kvstore.tiers.nvme.folder import probe_o_direct, probe_xattr

from conftest import BLOCK, ODD_BLOCK, block_for, check_tier, nvme_files, one_key

NS = bytes(range(16))
KINDS = ["dram", "nvme", "nvme_direct", "nvme_xattr"]


def _direct_supported(tmp_path_factory) -> bool:
    return probe_o_direct(tmp_path_factory.mktemp("probe"))


def build(kind: str, policy: str, clock, folder, cap: int = 4, ttl=None, block_bytes: int = BLOCK):
    if kind == "dram":
        return DramTier(capacity_bytes=cap * ff.round_up(block_bytes), ttl_s=ttl, policy=policy,
                        block_bytes=block_bytes, clock=clock, pin=False)
    xattr = kind == "nvme_xattr"
    per_block = ff.round_up(block_bytes) if xattr else ff.file_bytes(block_bytes)
    t = NvmeTier(path=folder, namespace=NS, capacity_bytes=cap * per_block, ttl_s=ttl, policy=policy,
                 block_bytes=block_bytes, o_direct=True if xattr else (kind == "nvme_direct"),
                 header="xattr" if xattr else "inline", clock=clock)
    if kind == "nvme_direct":
        assert t.o_direct
    if xattr:
        assert t.header == "xattr"
    return t


@pytest.fixture(params=[(k, p) for k in KINDS for p in sorted(POLICIES)], ids=lambda kp: f"{kp[0]}-{kp[1]}")
def make_tier(request, tmp_path, tmp_path_factory, clock):
    kind, policy = request.param
    if kind == "nvme_direct" and not _direct_supported(tmp_path_factory):
        pytest.skip("this file system does not take O_DIRECT")
    if kind == "nvme_xattr" and not probe_xattr(tmp_path_factory.mktemp("xprobe")):
        pytest.skip("this file system keeps no user xattrs")
    made = []

    def _make(cap=4, ttl=None, block_bytes=BLOCK, policy=policy):
        t = build(kind, policy, clock, tmp_path / f"nv{len(made)}", cap, ttl, block_bytes)
        made.append(t)
        return t

    _make.kind = kind
    yield _make
    for t in made:
        check_tier(t)
        t.close()


def K(i):
    return one_key(i)


def B(k, bb=BLOCK):
    return block_for(k, bb)


def read(t, k, bb=BLOCK):
    out = np.zeros(bb, np.uint8)
    ok = t.get([k], [out])[0]
    return out if ok else None


def present(t, keys):
    return [k for k in keys if t.contains(k)]


# -- the contract -----------------------------------------------------------------------------


@pytest.mark.parametrize("bb", [BLOCK, ODD_BLOCK, 3 * 4096 + 1])
def test_round_trip_byte_identical(make_tier, bb):
    t = make_tier(block_bytes=bb)
    keys = [K(i) for i in range(3)]
    assert t.put(keys, [B(k, bb) for k in keys]) == 3
    for k in keys:
        assert np.array_equal(read(t, k, bb), B(k, bb))
    # into a page-aligned buffer with room for the padding (the O_DIRECT in-place path)
    m, buf = alloc_aligned(ff.round_up(bb))
    assert t.get([keys[1]], [buf])[0] and np.array_equal(buf[:bb], B(keys[1], bb))
    del buf
    assert len(t) == 3 and t.used_bytes == 3 * t.entry_bytes


def test_get_of_missing_keys(make_tier):
    t = make_tier()
    assert t.get([K(0)], [np.zeros(BLOCK, np.uint8)]) == [False]
    assert not t.contains(K(0))


def test_capacity_never_exceeded(make_tier):
    t = make_tier(cap=4)
    for i in range(12):
        assert t.put([K(i)], [B(K(i))]) == 1
        assert len(t) <= 4 and t.used_bytes <= t.capacity_bytes
        t.index.check()
    assert present(t, [K(i) for i in range(12)]) == [K(i) for i in range(8, 12)]
    for i in range(8, 12):
        assert np.array_equal(read(t, K(i)), B(K(i)))
    if make_tier.kind != "dram":
        assert len(nvme_files(t)) == 4
    assert t.stats["evicted"] == 8


def test_batch_larger_than_capacity(make_tier):
    t = make_tier(cap=4)
    keys = [K(i) for i in range(6)]
    # one reserve for 6 keys: the first 4 are WRITING (pinned) when the 5th asks for room
    assert t.put(keys, [B(k) for k in keys]) == 4
    assert present(t, keys) == keys[:4]


def test_present_keys_are_skipped(make_tier):
    t = make_tier()
    k = K(0)
    assert t.put([k], [B(k)]) == 1
    other = np.full(BLOCK, 7, np.uint8)
    assert t.put([k], [other]) == 0
    assert np.array_equal(read(t, k), B(k))  # the first write stands
    assert t.put([k, K(1), K(1)], [other, B(K(1)), other]) == 1  # a repeated key in one batch counts once
    assert np.array_equal(read(t, K(1)), B(K(1)))
    assert len(t) == 2


def test_ttl_expiry_with_a_fake_clock(make_tier, clock):
    t = make_tier(ttl=10)
    a, b = K(0), K(1)
    t.put([a, b], [B(a), B(b)])
    clock.advance(6)
    assert read(t, a) is not None  # a hit refreshes a's idle TTL
    clock.advance(5)  # b idle 11 s, a idle 5 s
    assert t.contains(a) and not t.contains(b)
    assert read(t, b) is None
    assert t.sweep() == 1 and t.stats["expired"] == 1
    assert set(t.index.entries) == {a}
    clock.advance(10)
    assert not t.contains(a)
    # an expired key can be stored again right away
    assert t.put([a], [B(a)]) == 1 and t.contains(a)


def test_pinned_entries_are_never_evicted(make_tier):
    t = make_tier(cap=2)
    a, b = K(0), K(1)
    t.put([a, b], [B(a), B(b)])
    (ea,) = t.acquire([a])
    for i in range(2, 8):
        t.put([K(i)], [B(K(i))])
        assert t.index.entries.get(a) is ea
    t.index.check()
    out = np.zeros(BLOCK, np.uint8)
    assert t.read(ea, out) and np.array_equal(out, B(a))
    t.release([ea])
    t.put([K(9)], [B(K(9))])
    assert not t.contains(a)  # unpinned: evictable again


def test_all_pinned_means_no_room(make_tier):
    t = make_tier(cap=2)
    a, b = K(0), K(1)
    t.put([a, b], [B(a), B(b)])
    pins = t.acquire([a, b])
    assert t.put([K(2)], [B(K(2))]) == 0 and not t.contains(K(2))
    res = t.reserve([K(2), K(3)])  # the index has no room: counted, as a full slab's is
    assert list(res) == [None, None] and res.pinned == 2 and res.no_slot == 0
    t.release(pins)
    assert t.put([K(2)], [B(K(2))]) == 1


def test_writing_entries_are_never_evicted(make_tier):
    t = make_tier(cap=2)
    w = K(100)
    (ew,) = t.reserve([w])
    assert ew is not None
    for i in range(6):
        t.put([K(i)], [B(K(i))])
        assert t.index.entries.get(w) is ew
    assert t.write(ew, B(w))
    t.commit([ew], [True])
    assert np.array_equal(read(t, w), B(w))


def test_two_phase_visibility(make_tier):
    t = make_tier()
    k = K(0)
    (e,) = t.reserve([k])
    assert e is not None
    assert not t.contains(k) and t.acquire([k]) == [None]  # WRITING: invisible
    assert t.reserve([k]) == [None]  # and cannot be reserved twice
    assert t.present_or_writing(k)
    assert t.write(e, B(k))
    assert not t.contains(k)  # written, not yet committed
    t.commit([e], [True])
    assert t.contains(k) and np.array_equal(read(t, k), B(k))


def test_abort_leaves_nothing(make_tier):
    t = make_tier()
    k = K(0)
    (e,) = t.reserve([k])
    t.commit([e], [False])  # nothing written
    assert not t.contains(k) and not t.present_or_writing(k) and len(t) == 0 and t.used_bytes == 0
    if make_tier.kind != "dram":
        assert nvme_files(t) == []


def test_failed_write_leaves_nothing(make_tier):
    t = make_tier()
    k = K(0)
    (e,) = t.reserve([k])
    assert t.write(e, B(k))  # the bytes reached the medium...
    t.commit([e], [False])  # ...but the caller reports failure (e.g. a partial GPU copy)
    assert not t.contains(k) and len(t) == 0 and t.used_bytes == 0
    assert read(t, k) is None
    if make_tier.kind != "dram":
        assert nvme_files(t) == [] and not t.path_of(k).exists()
    # and the key can be stored properly afterwards
    assert t.put([k], [B(k)]) == 1 and np.array_equal(read(t, k), B(k))


def test_commit_length_mismatch_is_refused(make_tier):
    t = make_tier()
    es = t.reserve([K(0), K(1)])
    with pytest.raises(ValueError):
        t.commit(es, [True])
    t.commit(es, [False, False])


def test_remove(make_tier):
    t = make_tier()
    a, b = K(0), K(1)
    t.put([a, b], [B(a), B(b)])
    assert t.remove([a, K(50)]) == 1
    assert not t.contains(a) and t.contains(b) and len(t) == 1
    if make_tier.kind != "dram":
        assert not t.path_of(a).exists() and t.path_of(b).exists()
    (eb,) = t.acquire([b])
    assert t.remove([b]) == 0  # pinned: not removed
    t.release([eb])
    assert t.remove([b]) == 1 and len(t) == 0 and t.used_bytes == 0


def test_release_with_failed_read_removes(make_tier):
    t = make_tier()
    a = K(0)
    t.put([a], [B(a)])
    (e,) = t.acquire([a])
    t.release([e], [False])
    assert not t.contains(a) and len(t) == 0


# -- scenarios ----------------------------------------------------------------------------------


@pytest.fixture(params=["dram", "nvme"])
def scenario_tier(request, tmp_path, clock):
    made = []

    def _make(policy, cap=3, ttl=None):
        t = build(request.param, policy, clock, tmp_path / f"s{len(made)}", cap, ttl)
        made.append(t)
        return t

    yield _make
    for t in made:
        check_tier(t)
        t.close()


def _put1(t, k, clock, dt=1.0):
    clock.advance(dt)
    assert t.put([k], [B(k)]) == 1


def _touch(t, k, clock, session=None, dt=1.0):
    clock.advance(dt)
    es = t.acquire([k], session=session)
    assert es[0] is not None
    t.release(es)


@pytest.mark.parametrize("policy, evicted", [("lru", "B"), ("fifo", "A"), ("lru_shared", "B")])
def test_scenario_put_abc_touch_a_put_d(scenario_tier, clock, policy, evicted):
    t = scenario_tier(policy, cap=3)
    k = {n: K(i) for i, n in enumerate("ABCD")}
    for n in "ABC":
        _put1(t, k[n], clock)
    _touch(t, k["A"], clock)
    _put1(t, k["D"], clock)
    assert {n for n in "ABCD" if not t.contains(k[n])} == {evicted}


def test_scenario_ttl_expired_go_first(scenario_tier, clock):
    # FIFO would evict A (first in); A was hit 5 s ago, B has been idle 11 s: B goes.
    t = scenario_tier("fifo", cap=3, ttl=10)
    k = {n: K(i) for i, n in enumerate("ABCD")}
    for n in "ABC":
        _put1(t, k[n], clock, dt=0)
    clock.advance(6)
    _touch(t, k["A"], clock, dt=0)
    _touch(t, k["C"], clock, dt=0)
    clock.advance(5)
    _put1(t, k["D"], clock, dt=0)
    assert [n for n in "ABCD" if t.contains(k[n])] == ["A", "C", "D"]
    assert t.stats["expired"] == 1 and t.stats["evicted"] == 0


def test_scenario_ttl_all_expired(scenario_tier, clock):
    t = scenario_tier("lru", cap=3, ttl=10)
    keys = [K(i) for i in range(3)]
    for kk in keys:
        _put1(t, kk, clock, dt=0)
    clock.advance(11)
    assert present(t, keys) == []
    assert len(t) == 3  # still indexed until swept or needed
    _put1(t, K(9), clock, dt=0)  # the reserve sweeps what is due first
    assert len(t) == 1 and t.stats["expired"] == 3


def test_scenario_lru_shared_protects_a_block_hit_by_two_sessions(scenario_tier, clock):
    for policy, survives in (("lru_shared", True), ("lru", False)):
        t = scenario_tier(policy, cap=3)
        k = {n: K(i) for i, n in enumerate("ABCDEF")}
        for n in "ABC":
            _put1(t, k[n], clock)
        _touch(t, k["A"], clock, session="s1")
        _touch(t, k["A"], clock, session="s2")  # A: a system prompt shared by two sessions
        _touch(t, k["B"], clock, session="s1")
        for n in "DE":
            _put1(t, k[n], clock)
        assert t.contains(k["A"]) is survives, policy
        if policy == "lru_shared":
            assert [n for n in "ABCDE" if t.contains(k[n])] == ["A", "D", "E"]


def test_scenario_a_batch_is_evicted_from_its_tail(scenario_tier, clock):
    """Blocks of one prefix chain: the head stays longest (a chain without its head is useless)."""
    t = scenario_tier("lru", cap=4)
    chain = [K(i) for i in range(4)]
    clock.advance(1)
    t.put(chain, [B(k) for k in chain])
    for i in range(2):
        _put1(t, K(10 + i), clock)
    assert present(t, chain) == chain[:2]
    # a hit on the whole chain refreshes it the same way
    t2 = scenario_tier("lru", cap=4)
    for kk in chain:  # one by one: the tail is the most recent
        _put1(t2, kk, clock)
    clock.advance(1)
    t2.release(t2.acquire(chain))
    _put1(t2, K(20), clock)
    assert present(t2, chain) == chain[:3]
