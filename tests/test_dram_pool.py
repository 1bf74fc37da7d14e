"""The DRAM slab pool is prepared without holding up start-up: first chunk in ``__init__``, the
rest in the background, chunk by chunk; the DRAM tier admits blocks as their slots become ready.

Real memory throughout (anonymous mmap, pre-faulted): small chunks (64 KiB) of small slots
(4 KiB) give many chunks at little cost.
"""

from __future__ import annotations

import logging
import threading
import time

import numpy as np
import pytest

from kvstore.tiers.dram import pool as memory
from kvstore.tiers.dram.pool import SlabPool
from kvstore.tiers.dram import DramTier

from conftest import check_tier

SLOT = 4096
CHUNK = 64 << 10
PER_CHUNK = CHUNK // SLOT  # 16 slots a chunk


def _prefault_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "kvstore-dram-prefault" and t.is_alive()]


@pytest.fixture(autouse=True)
def _no_thread_left():
    yield
    deadline = time.monotonic() + 2
    while _prefault_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not _prefault_threads(), "a pool preparation thread outlived its test"


def test_single_chunk_pool_is_ready_at_once():
    calls = []
    pool = SlabPool(PER_CHUNK, SLOT, pin=False, chunk_bytes=CHUNK, on_ready=calls.append)
    try:
        assert pool.ready and pool.ready_slots == pool.initial_slots == PER_CHUNK
        assert pool.n_free == PER_CHUNK and pool.n_chunks == 1
        assert pool.wait_ready(0) is True and pool._thread is None
        assert pool.prepare_s is not None and pool.error is None
        assert [pool.alloc() for _ in range(PER_CHUNK)] == list(range(PER_CHUNK))
        assert pool.alloc() is None
    finally:
        pool.close()
    assert calls == []  # the synchronous first chunk is never reported through on_ready


def test_empty_pool():
    pool = SlabPool(0, SLOT, pin=False, chunk_bytes=CHUNK)
    assert pool.ready and pool.wait_ready(0) and pool.alloc() is None and pool.n_free == 0
    pool.close()


def test_background_pool_ends_ready_and_every_slot_is_distinct_and_writable():
    n = PER_CHUNK * 64 + 5  # 65 chunks, the last one partial
    calls = []
    pool = SlabPool(n, SLOT, pin=False, chunk_bytes=CHUNK, on_ready=calls.append)
    try:
        assert pool.initial_slots == PER_CHUNK and pool.n_chunks == 65
        seen = [pool.ready_slots]
        while not pool.ready:
            seen.append(pool.ready_slots)
        assert pool.wait_ready(5)
        seen.append(pool.ready_slots)
        assert seen == sorted(seen) and seen[-1] == n, "ready_slots must grow monotonically to n_slots"
        assert sum(calls) == n - pool.initial_slots and all(0 < c <= PER_CHUNK for c in calls)
        assert pool.n_free == n and pool.error is None and pool._thread is not None
        assert not pool._thread.is_alive() or pool._thread.join(1) is None
        slots = [pool.alloc() for _ in range(n)]
        assert sorted(slots) == list(range(n)) and pool.alloc() is None
        addrs = {pool.view(s).ctypes.data for s in slots}
        assert len(addrs) == n, "two slots share memory"
        for s in slots:
            v = pool.view(s)
            assert v.nbytes == SLOT and v.ctypes.data % memory.PAGE == 0
            v[:] = s % 251
            v[:8] = np.frombuffer(np.int64(s).tobytes(), np.uint8)
        for s in slots:
            v = pool.view(s)
            assert int(np.frombuffer(v[:8].tobytes(), np.int64)[0]) == s
            assert (v[8:] == s % 251).all()
        del v
        for s in slots:
            pool.free(s)
        assert pool.n_free == n
    finally:
        pool.close()


def test_alloc_only_hands_out_ready_slots_while_preparing():
    n = PER_CHUNK * 400
    ready_at_call, pool_ref = [], []
    pool = SlabPool(n, SLOT, pin=False, chunk_bytes=CHUNK,
                    on_ready=lambda k: ready_at_call.append((k, pool_ref[0].ready_slots if pool_ref else None)))
    pool_ref.append(pool)
    got = []
    try:
        while len(got) < n:
            s = pool.alloc(timeout=2)
            assert s is not None, "alloc timed out while the pool was still being prepared"
            assert 0 <= s < pool.ready_slots, f"slot {s} handed out before it was ready"
            pool.view(s)[:16] = 1  # its view is published before it is free
            got.append(s)
        assert sorted(got) == list(range(n))
        assert pool.alloc() is None and pool.n_free == 0
        assert pool.wait_ready(5)
        # each on_ready sees its chunk already counted in ready_slots
        total = pool.initial_slots
        for k, r in ready_at_call:
            total += k
            assert r is None or r >= total
        assert total == n
    finally:
        pool.close()


def test_close_while_preparing_is_prompt_and_stops_the_thread():
    n = PER_CHUNK * 1000

    def slow(_k):
        time.sleep(0.01)  # a 10 s preparation

    pool = SlabPool(n, SLOT, pin=False, chunk_bytes=CHUNK, on_ready=slow)
    assert not pool.ready and pool._thread.is_alive()
    assert pool.wait_ready(0.05) is False
    t0 = time.monotonic()
    pool.close()
    assert time.monotonic() - t0 < 3  # vs the 10 s a preparation would take
    assert not pool._thread.is_alive()
    assert pool.ready_slots < n and not pool.ready and pool.wait_ready(0) is False
    assert pool.alloc() is None
    pool.close()  # twice is fine


def test_preparation_failure_keeps_what_is_ready(monkeypatch, caplog):
    """Fault injection: the 4th chunk cannot be mapped (out of memory)."""
    real, calls = memory.alloc_aligned, []

    def failing(nbytes, **kw):
        calls.append(nbytes)
        if len(calls) == 4:
            raise MemoryError("no more memory")
        return real(nbytes, **kw)

    monkeypatch.setattr(memory, "alloc_aligned", failing)
    caplog.set_level(logging.INFO, logger="kvstore.tiers.dram.pool")
    pool = SlabPool(PER_CHUNK * 10, SLOT, pin=False, chunk_bytes=CHUNK)
    try:
        assert pool.wait_ready(5) is False and not pool.ready
        assert pool.ready_slots == 3 * PER_CHUNK and pool.n_free == 3 * PER_CHUNK
        assert isinstance(pool.error, MemoryError)
        assert any(r.levelno == logging.ERROR and "stopped" in r.getMessage() for r in caplog.records)
    finally:
        pool.close()


def test_log_lines(caplog):
    caplog.set_level(logging.INFO, logger="kvstore.tiers.dram.pool")
    n = PER_CHUNK * 8
    pool = SlabPool(n, SLOT, pin=False, chunk_bytes=CHUNK)
    assert pool.wait_ready(5)
    pool.close()
    msgs = [r.getMessage() for r in caplog.records if r.name == "kvstore.tiers.dram.pool"]
    start = [m for m in msgs if "background" in m]
    done = [m for m in msgs if "DRAM pool ready" in m]
    assert len(start) == 1 and len(done) == 1, msgs
    gib = n * SLOT / 2**30
    assert f"{gib:.2f} GiB" in start[0] and f"{PER_CHUNK * SLOT / 2**30:.2f} GiB" in start[0]
    assert f"{gib:.2f} GiB in 8 chunks" in done[0] and "not pinned" in done[0] and " s (" in done[0]


def test_synchronous_mode_is_ready_on_return():
    pool = SlabPool(PER_CHUNK * 20, SLOT, pin=False, chunk_bytes=CHUNK, background=False)
    try:
        assert pool.ready and pool.ready_slots == pool.initial_slots == PER_CHUNK * 20 and pool._thread is None
    finally:
        pool.close()


# -- the DRAM tier ---------------------------------------------------------------------------------
def _key(i: int) -> bytes:
    return i.to_bytes(4, "little") * 4


def _block(i: int) -> np.ndarray:
    return np.full(SLOT, i % 256, dtype=np.uint8)


def _tier(n_slots: int, clock) -> DramTier:
    """A DRAM tier of ``n_slots`` slots in small chunks (prepared in the background)."""
    return DramTier(capacity_bytes=n_slots * SLOT, ttl_s=None, policy="lru", block_bytes=SLOT, clock=clock,
                    pin=False, chunk_bytes=CHUNK)


def test_dram_tier_capacity_grows_with_the_pool(clock):
    n = PER_CHUNK * 64
    t = _tier(n, clock)
    try:
        assert t.target_capacity_bytes == n * SLOT
        caps = []
        while not t.ready:
            with t.lock:
                cap = t.capacity_bytes
                caps.append(cap)
                assert cap <= t.pool.ready_slots * SLOT <= t.target_capacity_bytes
        assert t.wait_ready(5)
        assert t.capacity_bytes == t.target_capacity_bytes
        assert caps == sorted(caps)
        assert t.put([_key(i) for i in range(n)], [_block(i) for i in range(n)]) == n
        assert len(t) == n and t.pool.n_free == 0
        outs = [np.empty(SLOT, np.uint8) for _ in range(n)]
        assert all(t.get([_key(i) for i in range(n)], outs))
        assert all((o == i % 256).all() for i, o in enumerate(outs))
        check_tier(t)
        assert t.put([_key(n)], [_block(n)]) == 1  # full: the oldest goes
        assert len(t) == n and t.stats["evicted"] == 1
        check_tier(t)
    finally:
        t.close()


def test_dram_tier_admits_blocks_while_preparing(clock):
    """Puts during preparation: never more entries than ready slots, never a wait for a slot."""
    n = PER_CHUNK * 200
    t = _tier(n, clock)
    try:
        i, longest = 0, 0.0
        while not t.ready:
            t0 = time.monotonic()
            assert t.put([_key(i)], [_block(i)]) == 1
            longest = max(longest, time.monotonic() - t0)
            i += 1
            with t.lock:
                assert len(t) * SLOT <= t.capacity_bytes <= t.pool.ready_slots * SLOT
        # each put is bounded, not the whole preparation (8 s on the 2-core CI): a put never waits
        # for the pool, it takes the slots that are ready
        assert longest < 5 and t.stats.get("no_room", 0) == 0
        assert t.wait_ready(5) and t.capacity_bytes == t.target_capacity_bytes
        check_tier(t)
    finally:
        t.close()


def test_dram_tier_close_while_preparing_under_the_tier_lock(clock):
    """close() may run while the caller holds the tier lock the pool's callback needs."""
    n = PER_CHUNK * 2000
    t = _tier(n, clock)
    with t.lock:
        time.sleep(0.05)  # the background thread is now waiting for the lock in its callback
        t0 = time.monotonic()
        t.close()
        assert time.monotonic() - t0 < 5  # a deadlock would hang; a slot wait is 10 s
    assert not t.pool._thread.is_alive() and not t.ready


def test_a_pool_that_cannot_be_pinned_is_an_error_at_start_up(tmp_path):
    """Asked to pin (``pin_memory: true``, or ``auto`` with CUDA) and registration fails: the pool is not
    made and the error names the config key; never a silently unpinned (slower) tier. Here the failure is
    real on a machine without CUDA, and made by a failpoint where there is one."""
    from kvstore import failpoints
    from kvstore.config import from_dict
    from kvstore.keys import ModelFingerprint
    from kvstore.tiers.dram.pool import PinError
    from kvstore.store import KVStore

    failpoints.arm("memory.pin=raise")
    try:
        with pytest.raises(PinError, match="tiers.dram.pin_memory"):
            SlabPool(4, 4096, pin=True, background=False)
        with pytest.raises(PinError, match=r"tiers.dram.pin_memory: false"):
            KVStore(from_dict({"tiers": {"dram": {"capacity_gb": 0.001, "pin_memory": True},
                                         "nvme": {"path": str(tmp_path / "s")}}}),
                    block_bytes=4096, fingerprint=ModelFingerprint("m"))
    finally:
        failpoints.clear()
    assert not list((tmp_path / "s").glob("**/*.kv"))  # nothing half-made was left to read
    pool = SlabPool(4, 4096, pin=False)  # unpinned on request: fine
    assert not pool.pinned and pool.ready
    pool.close()


def test_resident_bytes_match_the_capacity_once_ready(tmp_path):
    """RSS against capacity (issue 13): the pool's mappings are resident whole once prepared, and the
    store reports it at scrape time beside the capacity."""
    from kvstore.config import from_dict
    from kvstore.keys import ModelFingerprint
    from kvstore.store import KVStore

    pool = SlabPool(3 * PER_CHUNK, SLOT, pin=False, chunk_bytes=CHUNK)
    assert pool.wait_ready(30)
    assert pool.resident_bytes() == 3 * PER_CHUNK * SLOT
    pool.close()
    s = KVStore(from_dict({"tiers": {"dram": {"capacity_gb": 0.01, "pin_memory": False},
                                     "nvme": {"path": str(tmp_path / "s")}}}),
                block_bytes=SLOT, fingerprint=ModelFingerprint("m"))
    try:
        assert s.wait_ready(30)
        cap = s.metrics.value("kvstore_tier_capacity_bytes", tier="dram")
        assert cap > 0 and s.metrics.value("kvstore_tier_resident_bytes", tier="dram") == cap
    finally:
        s.close()
