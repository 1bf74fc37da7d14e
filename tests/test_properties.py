"""Property tests (hypothesis): under random operation sequences with a fake clock, capacity is
never exceeded and in-flight (pinned / WRITING) blocks are never evicted."""

from __future__ import annotations

import shutil
import tempfile
from collections import Counter

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvstore.tiers.index import READY, WRITING, TierIndex
from kvstore.tiers.policy import POLICIES, make_policy
from kvstore.store import KVStore

from conftest import FP, FakeClock, block_for, check_store, make_keys, tiny_config

KEYS = st.integers(0, 11)
SIZES = st.sampled_from([5, 10, 10, 20])


class IndexMachine(RuleBasedStateMachine):
    @initialize(policy=st.sampled_from(sorted(POLICIES)), cap=st.sampled_from([0, 20, 40, 60]),
                ttl=st.sampled_from([None, 5.0, 30.0]))
    def setup(self, policy, cap, ttl):
        self.ix = TierIndex(cap, ttl, make_policy(policy), max_expire_per_call=2, max_scan_per_call=64)
        self.now = 0.0
        self.writing: dict[int, object] = {}
        self.pins: Counter = Counter()

    def _check_gone(self, evicted):
        for e in evicted:
            assert e.key not in self.writing, "a WRITING entry was evicted"
            assert self.pins[e.key] == 0, "a pinned entry was evicted"
            assert e.key not in self.ix.entries

    @rule(k=KEYS, size=SIZES, session=st.sampled_from([None, "a", "b"]))
    def reserve(self, k, size, session):
        if k in self.ix.entries:
            return
        e, ev = self.ix.reserve(k, size, self.now)
        self._check_gone(ev)
        if e is not None:
            self.writing[k] = e

    @precondition(lambda self: self.writing)
    @rule(data=st.data(), ok=st.booleans(), session=st.sampled_from([None, "a", "b"]))
    def finish(self, data, ok, session):
        k = data.draw(st.sampled_from(sorted(self.writing)))
        e = self.writing.pop(k)
        if ok:
            self.ix.commit(e, self.now, session)
        else:
            self.ix.abort(e)

    @rule(k=KEYS, session=st.sampled_from([None, "a", "b"]))
    def pin(self, k, session):
        e = self.ix.lookup(k, self.now)
        if e is not None:
            self.ix.pin(e)
            self.ix.touch(e, self.now, session)
            self.pins[k] += 1

    @precondition(lambda self: +self.pins)
    @rule(data=st.data())
    def unpin(self, data):
        k = data.draw(st.sampled_from(sorted(+self.pins)))
        self.ix.unpin(self.ix.entries[k])
        self.pins[k] -= 1

    @rule(dt=st.sampled_from([0.5, 3.0, 10.0, 40.0]))
    def advance(self, dt):
        self.now += dt

    @rule(limit=st.sampled_from([None, 1, 100]))
    def expire(self, limit):
        self._check_gone(self.ix.expire(self.now, limit))

    @rule(k=KEYS)
    def remove(self, k):
        e = self.ix.remove(k)
        if e is not None:
            self._check_gone([e])

    @invariant()
    def holds(self):
        self.ix.check()
        assert self.ix.used <= self.ix.capacity
        for k, e in self.writing.items():
            assert self.ix.entries.get(k) is e and e.state == WRITING
        for k, n in self.pins.items():
            if n:
                e = self.ix.entries.get(k)
                assert e is not None and e.state == READY and e.pins == n


TestIndexProperties = IndexMachine.TestCase
TestIndexProperties.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


CHAINS = [make_keys(4, seed=500 + i) for i in range(3)]
BB = 4096


class StoreMachine(RuleBasedStateMachine):
    """A 3-slot DRAM over a 6-file NVMe tier; loads and stores held open across steps."""

    @initialize(policy=st.sampled_from(sorted(POLICIES)), write_mode=st.sampled_from(["write_back", "write_through"]))
    def setup(self, policy, write_mode):
        self.dir = tempfile.mkdtemp(prefix="kvprop-")
        self.clock = FakeClock()
        cfg = tiny_config(self.dir, dram_blocks=3, nvme_blocks=6, block_bytes=BB, dram_ttl=10, nvme_ttl=30,
                          policy=policy, write_mode=write_mode, io_threads=1)
        self.s = KVStore(cfg, block_bytes=BB, fingerprint=FP, clock=self.clock)
        self.loads = []
        self.stores = []

    def teardown(self):
        if not hasattr(self, "s"):
            return
        try:
            for h in self.loads:
                self.s.end_load(h)
            for h in self.stores:
                self.s.end_store(h, False)
            self.s.flush()
            check_store(self.s)
        finally:
            self.s.close()
            shutil.rmtree(self.dir, ignore_errors=True)

    @rule(c=st.integers(0, 2), n=st.integers(1, 4))
    def put(self, c, n):
        keys = CHAINS[c][:n]
        self.s.put(keys, np.stack([block_for(k, BB) for k in keys]))

    @rule(c=st.integers(0, 2), n=st.integers(1, 4))
    def get(self, c, n):
        keys = CHAINS[c][:n]
        out = np.zeros((n, BB), np.uint8)
        got = self.s.get(keys, out)
        for k, row in zip(keys[:got], out[:got]):
            assert np.array_equal(row, block_for(k, BB))

    @precondition(lambda self: len(self.loads) < 2)
    @rule(c=st.integers(0, 2), n=st.integers(1, 3))
    def begin_load(self, c, n):
        self.loads.append(self.s.begin_load(CHAINS[c][:n]))

    @precondition(lambda self: self.loads)
    @rule()
    def end_load(self):
        self.s.end_load(self.loads.pop(0))

    @precondition(lambda self: len(self.stores) < 2)
    @rule(c=st.integers(0, 2), n=st.integers(1, 2))
    def begin_store(self, c, n):
        h = self.s.begin_store(CHAINS[c][:n])
        for k, v in zip(h.keys, h.views):
            if v is not None:
                v[:] = block_for(k, BB)
        self.stores.append(h)

    @precondition(lambda self: self.stores)
    @rule(ok=st.booleans())
    def end_store(self, ok):
        self.s.end_store(self.stores.pop(0), ok)
        self.s.flush()

    @rule(dt=st.sampled_from([1.0, 6.0, 11.0, 31.0]))
    def advance(self, dt):
        self.clock.advance(dt)

    @rule()
    def sweep(self):
        self.s.sweep()

    @rule()
    def persist(self):
        self.s.persist()

    @rule(c=st.integers(0, 2))
    def contains(self, c):
        m = self.s.contains_prefix(CHAINS[c])
        assert m.num_blocks == len(m.tiers) and (m.miss_reason is None) == (m.num_blocks == 4)

    @invariant()
    def in_flight_blocks_stay(self):
        if not hasattr(self, "s"):
            return
        for t in self.s.tiers:
            with t.lock:
                t.index.check()
                assert t.used_bytes <= t.capacity_bytes
        d = self.s.dram
        for h in self.loads:
            for k, e, v in zip(h.keys, h.entries, h.views):
                if e is not None:  # a DRAM slot: pinned, so still indexed (or being demoted) and intact
                    assert (d.index.entries.get(k) is e or e in self.s.chain.demotions.held) and e.pins >= 1
                assert np.array_equal(v, block_for(k, BB))
        for h in self.stores:
            for k, e in zip(h.keys, h.entries):
                if e is not None:
                    assert h.tier.index.entries.get(k) is e and e.state == WRITING


TestStoreProperties = StoreMachine.TestCase
TestStoreProperties.settings = settings(max_examples=40, stateful_step_count=25, deadline=None,
                                        suppress_health_check=[HealthCheck.too_slow])
