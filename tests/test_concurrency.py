"""Many threads on a small store with evictions at both tiers: no exceptions, no wrong bytes,
index invariants hold, no leaked pins or slots, files and index agree."""

from __future__ import annotations

import random
import threading
import time

import numpy as np
import pytest

from kvstore.tiers.dram import DramTier

from conftest import BLOCK, block_for, blocks_for, check_store, check_tier, make_keys

CHAINS = [make_keys(6, seed=100 + i) for i in range(8)]  # 48 keys for 6 + 24 slots


def _worker(store, seed, stop, errors, counts):
    rnd = random.Random(seed)
    out = np.zeros((6, BLOCK), np.uint8)
    try:
        while not stop.is_set():
            chain = rnd.choice(CHAINS)[: rnd.randint(1, 6)]
            op = rnd.random()
            if op < 0.3:
                store.put(chain, blocks_for(chain))
            elif op < 0.55:
                n = store.get(chain, out[: len(chain)])
                for k, row in zip(chain[:n], out[:n]):
                    if not np.array_equal(row, block_for(k)):
                        raise AssertionError("get served wrong bytes")
                counts["got"] += n
            elif op < 0.65:
                m = store.contains_prefix(chain)
                assert 0 <= m.num_blocks <= len(chain) and len(m.tiers) == m.num_blocks
            elif op < 0.75:
                store.prefetch(chain).result(timeout=60)
            elif op < 0.88:
                h = store.begin_load(chain, session=f"s{seed % 3}")
                try:
                    for k, v in zip(chain[: h.num_blocks], h.views):
                        if not np.array_equal(v, block_for(k)):
                            raise AssertionError("a pinned view changed under the reader")
                    time.sleep(0.0005)
                    for k, v in zip(chain[: h.num_blocks], h.views):
                        if not np.array_equal(v, block_for(k)):
                            raise AssertionError("a pinned view changed under the reader")
                finally:
                    store.end_load(h)
            else:
                h = store.begin_store(chain)
                oks = []
                for k, v in zip(chain, h.views):
                    if v is not None:
                        v[:] = block_for(k)
                    oks.append(rnd.random() > 0.2)  # some writes "fail"
                store.end_store(h, oks)
            counts["ops"] += 1
    except BaseException as e:  # noqa: BLE001
        errors.append(e)
        stop.set()


@pytest.mark.parametrize("write_mode, policy", [("write_back", "lru"), ("write_through", "lru_shared"),
                                                ("write_back", "fifo")])
def test_threads_on_a_small_store(make_store, clock, write_mode, policy):
    s = make_store(dram_blocks=6, nvme_blocks=24, dram_ttl=3, nvme_ttl=30, write_mode=write_mode, policy=policy,
                   io_threads=2)
    stop, errors = threading.Event(), []
    counts = {"ops": 0, "got": 0}
    threads = [threading.Thread(target=_worker, args=(s, i, stop, errors, counts)) for i in range(4)]

    def ticker():
        while not stop.is_set():
            clock.advance(0.5)
            try:
                s.sweep()
            except BaseException as e:  # noqa: BLE001
                errors.append(e)
                stop.set()
            time.sleep(0.01)

    threads.append(threading.Thread(target=ticker))
    for t in threads:
        t.start()
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline and not stop.is_set():
        time.sleep(0.05)
        with s.dram.lock:
            s.dram.index.check()
        with s.nvme.lock:
            s.nvme.index.check()
    stop.set()
    for t in threads:
        t.join(timeout=60)
        assert not t.is_alive(), "a thread hung"
    if errors:
        raise errors[0]
    s.flush()
    check_store(s)
    assert counts["ops"] > 100 and counts["got"] > 0
    # everything still held reads back right
    for chain in CHAINS:
        out = np.zeros((6, BLOCK), np.uint8)
        n = s.get(chain, out)
        assert all(np.array_equal(out[i], block_for(chain[i])) for i in range(n))
    check_store(s)


def test_threads_on_one_tier(clock):
    """The tier alone: reserve/commit/acquire/release from several threads, tiny capacity."""
    t = DramTier(capacity_bytes=4 * BLOCK, ttl_s=None, policy="lru", block_bytes=BLOCK, clock=clock, pin=False)
    keys = [k for c in CHAINS[:3] for k in c]
    stop, errors = threading.Event(), []

    def work(seed):
        rnd = random.Random(seed)
        buf = np.zeros(BLOCK, np.uint8)
        try:
            for _ in range(1500):
                k = rnd.choice(keys)
                if rnd.random() < 0.5:
                    t.put([k], [block_for(k)])
                else:
                    (e,) = t.acquire([k])
                    if e is not None:
                        t.read(e, buf)
                        t.release([e])
                        assert np.array_equal(buf, block_for(k))
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    ths = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for th in ths:
        th.start()
    for th in ths:
        th.join()
    if errors:
        raise errors[0]
    check_tier(t)
    t.close()


def test_slab_pool_alloc_waits_for_a_freed_slot():
    from kvstore.tiers.dram.pool import SlabPool

    pool = SlabPool(2, 4096, pin=False)
    a, b = pool.alloc(), pool.alloc()
    assert {a, b} == {0, 1} and pool.alloc() is None and pool.n_free == 0
    threading.Timer(0.05, pool.free, args=(a,)).start()
    t0 = time.monotonic()
    assert pool.alloc(timeout=5) == a
    assert time.monotonic() - t0 < 4
    assert pool.alloc(timeout=0.01) is None
    pool.free(a)
    pool.free(b)
    assert pool.n_free == 2
    v = pool.view(0)
    v[:] = 7
    assert (pool.view(0) == 7).all() and (pool.view(1) == 0).all()
    del v
    pool.close()


def test_reserve_never_waits_for_a_slot_held_by_a_victim(clock):
    """A victim leaves the index at once but keeps its slot until its caller frees it (a
    demotion in flight): a reservation meanwhile finds no free slot and is dropped at once,
    counted, never waiting; once the victim is freed its slot is used again."""
    t = DramTier(capacity_bytes=BLOCK, ttl_s=1, policy="lru", block_bytes=BLOCK, clock=clock, pin=False)
    x, y = CHAINS[0][0], CHAINS[0][1]
    t.put([x], [block_for(x)])
    clock.advance(2)
    (victim,) = t.expire()  # victims as data: the slot is intact
    assert np.array_equal(t.slot_view(victim)[:BLOCK], block_for(x))
    result = []
    putter = threading.Thread(target=lambda: result.append(t.reserve([y])))
    putter.start()
    putter.join(10)
    assert not putter.is_alive() and result[0] == [None] and result[0].no_slot == 1
    assert t.stats["no_room"] == 1 and np.array_equal(t.slot_view(victim)[:BLOCK], block_for(x))
    t.free([victim])
    assert t.put([y], [block_for(y)]) == 1 and t.contains(y)
    check_tier(t)
    t.close()
