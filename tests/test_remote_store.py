"""The remote tier inside the store (issue 14): two stores with their own DRAM and NVMe folders share
one real Redis (a password-protected single server, and a 3-master cluster); what one stores, the
other hits, byte for byte, and promotes into its DRAM. Faults: the server killed and restarted,
keys evicted between lookup and load, corrupt values, a wrong password."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from kvstore.config import ConfigError, from_dict
from kvstore.keys import ModelFingerprint
from kvstore.store import KVStore

from conftest import BLOCK, blocks_for, dram_gb, make_keys, nvme_gb
from redis_servers import redis_cluster, redis_launcher, redis_single  # noqa: F401

FP = ModelFingerprint(model="remote-store", block_size=16)


def _store(tmp_path, name, server, *, dram=8, nvme=16, monkeypatch=None, **remote):
    if monkeypatch is not None:
        monkeypatch.setenv("KVSTORE_REDIS_PASSWORD", server.password or "")
    cfg = from_dict({"tiers": {
        "dram": {"capacity_gb": dram_gb(dram), "pin_memory": False, "ttl_s": None},
        "nvme": {"path": str(tmp_path / name), "capacity_gb": nvme_gb(nvme), "ttl_s": None},
        "remote": {"url": server.url, "cluster": isinstance(server.url, list), "timeout_ms": 500, **remote}}})
    s = KVStore(cfg, block_bytes=BLOCK, fingerprint=FP, block_tokens=16)
    if s.remote is not None:
        s.remote.client._backoff = (0.05, 0.2)  # tests wait for the backoff: keep it short
    return s


def M(s, name, **labels):
    return s.metrics.value(name, **labels)


@pytest.fixture
def pair(tmp_path, redis_single, monkeypatch):  # noqa: F811
    """Two stores with their own DRAM and NVMe folders sharing one password-protected Redis."""
    a = _store(tmp_path, "a", redis_single, monkeypatch=monkeypatch)
    b = _store(tmp_path, "b", redis_single)
    yield a, b
    a.close(wait_s=0)  # pins a test left open: not waited for (30 s each)
    b.close(wait_s=0)


@pytest.fixture(params=["single", "cluster"])
def server(request, redis_single, redis_cluster):  # noqa: F811
    return redis_single if request.param == "single" else redis_cluster


def test_one_store_writes_the_other_hits(tmp_path, server, monkeypatch):
    keys = make_keys(12, seed=hash(str(server.url)) % 1000)
    a = _store(tmp_path, "a", server, monkeypatch=monkeypatch)
    b = _store(tmp_path, "b", server)
    try:
        assert a.put(keys, blocks_for(keys)) == 12
        a.flush()  # write-through runs on the I/O pool
        assert M(a, "kvstore_tier_written_bytes_total", tier="remote") == 12 * BLOCK
        m = b.contains_prefix(keys)
        assert m.num_blocks == 12 and set(m.tiers) == {"remote"}
        out = np.zeros((12, BLOCK), np.uint8)
        assert b.get(keys, out) == 12
        assert np.array_equal(out, blocks_for(keys))
        # promoted into b's DRAM (8 slots: the head of the chain stays, the rest went to NVMe)
        assert b.contains_prefix(keys[:1]).tiers == ("dram",)
        assert M(b, "kvstore_tier_read_bytes_total", tier="remote") == 12 * BLOCK
    finally:
        a.close()
        b.close()


def test_lookup_continues_past_the_local_tiers(pair):
    keys = make_keys(6, seed=3)
    a, b = pair
    a.put(keys, blocks_for(keys))
    a.flush()
    b.put(keys[:2], blocks_for(keys[:2]))  # b computed the first two itself
    assert b.contains_prefix(keys).tiers == ("dram", "dram", "remote", "remote", "remote", "remote")
    out = np.zeros((6, BLOCK), np.uint8)
    assert b.get(keys, out) == 6 and np.array_equal(out, blocks_for(keys))


def test_keys_evicted_between_lookup_and_load_are_a_miss(pair, redis_single):  # noqa: F811
    keys = make_keys(6, seed=4)
    a, b = pair
    a.put(keys, blocks_for(keys))
    a.flush()
    h = b.pin_load(keys)  # the scheduler's side: 6 remote blocks promised
    assert h.num_blocks == 6 and set(h.tier_of) == {"remote"}
    redis_single.client().delete(a.remote.client.redis_key(keys[3]))  # Redis evicts one meanwhile
    assert b.read_load(h) == 3  # the prefix ends there: blocks 3.. are recomputed
    assert all(np.array_equal(v, x) for v, x in zip(h.views, blocks_for(keys[:3])))
    b.end_load(h)
    assert M(b, "kvstore_tier_errors_total", tier="remote", op="read") == 1
    # nothing stored for the lost block; what b holds past it (read whole in the same
    # pipeline, promoted) is the right bytes, unreachable until block 3 is stored again
    assert b.contains_prefix(keys).num_blocks == 3 and not b.dram.contains(keys[3])
    for k in keys[4:]:
        if b.dram.contains(k):
            one = np.zeros((1, BLOCK), np.uint8)
            assert b.dram.get([k], one) == [True] and np.array_equal(one[0], blocks_for([k])[0])


def test_corrupt_values_are_counted_misses_and_stored_over(pair, redis_single):  # noqa: F811
    """A value whose payload checksum fails is a counted miss, kept in Redis (issue 45: a failed
    check is not proof that its writer had no right to write it), not promised again by this
    engine, and stored over by its next store."""
    keys = make_keys(3, seed=5)
    a, b = pair
    a.put(keys, blocks_for(keys))
    a.flush()
    c = redis_single.client()
    name = a.remote.client.redis_key(keys[1])
    v = bytearray(c.get(name))
    v[-1] ^= 0xFF  # one payload byte
    c.set(name, bytes(v))
    out = np.zeros((3, BLOCK), np.uint8)
    assert b.get(keys, out) == 1 and np.array_equal(out[0], blocks_for(keys[:1])[0])
    assert M(b, "kvstore_corrupt_files_total", tier="remote", reason="checksum") == 1
    assert c.exists(name) == 1 and b.contains_prefix(keys).num_blocks == 1  # kept there, held absent here
    b.put(keys, blocks_for(keys))  # the engine computes it and stores it again: over the bad value
    b.flush()
    one = [np.zeros(BLOCK, np.uint8)]
    assert b.remote.client.get(keys[1:2], one) == [True] and np.array_equal(one[0], blocks_for(keys[1:2])[0])


def test_server_killed_is_a_miss_and_hits_resume_after_restart(tmp_path, redis_launcher, monkeypatch):  # noqa: F811
    srv = redis_launcher.single(password="pw-kill")
    keys = make_keys(4, seed=6)
    a = _store(tmp_path, "a", srv, monkeypatch=monkeypatch, timeout_ms=200)
    b = _store(tmp_path, "b", srv)
    try:
        srv.kill()
        # a stores anyway (locally), b misses: no exception anywhere
        assert a.put(keys, blocks_for(keys)) == 4
        a.flush()
        assert b.contains_prefix(keys).num_blocks == 0
        out = np.zeros((4, BLOCK), np.uint8)
        assert b.get(keys, out) == 0
        assert M(b, "kvstore_remote_up") == 0
        srv.restart()  # empty (no persistence): what a stores next is shared again
        keys2 = make_keys(4, seed=16)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not a.remote.client.available:
            time.sleep(0.05)  # a's backoff
        assert M(a, "kvstore_remote_up") == 0  # the backoff is over, but nothing has answered yet
        assert a.put(keys2, blocks_for(keys2)) == 4
        a.flush()
        while time.monotonic() < deadline and b.contains_prefix(keys2).num_blocks < 4:
            time.sleep(0.05)  # b's backoff
        assert b.get(keys2, out) == 4 and np.array_equal(out, blocks_for(keys2))
        assert M(b, "kvstore_remote_up") == 1
    finally:
        a.close()
        b.close()


def test_wrong_password_is_a_clear_error_at_start_up(tmp_path, redis_single, monkeypatch):  # noqa: F811
    from kvstore.tiers.redis.client import RemoteAuthError

    monkeypatch.setenv("KVSTORE_REDIS_PASSWORD", "not-the-password-xyz")
    with pytest.raises(RemoteAuthError) as ei:
        _store(tmp_path, "a", redis_single)
    assert "KVSTORE_REDIS_PASSWORD" in str(ei.value) and "not-the-password-xyz" not in str(ei.value)
    monkeypatch.delenv("KVSTORE_REDIS_PASSWORD")
    with pytest.raises(RemoteAuthError):
        _store(tmp_path, "b", redis_single)


def test_an_unreachable_server_at_start_up_degrades_to_the_local_tiers(tmp_path, redis_launcher):  # noqa: F811
    srv = redis_launcher.single()
    srv.stop()
    s = _store(tmp_path, "a", srv, timeout_ms=100)
    try:
        keys = make_keys(3, seed=7)
        assert s.put(keys, blocks_for(keys)) == 3
        s.flush()
        assert s.contains_prefix(keys).tiers == ("dram",) * 3
        assert M(s, "kvstore_remote_up") == 0
    finally:
        s.close()


def test_credentials_never_in_the_config():
    with pytest.raises(ConfigError, match="KVSTORE_REDIS_PASSWORD") as ei:
        from_dict({"tiers": {"remote": {"url": "redis://user:hunter2@127.0.0.1:6379"}}})
    assert "hunter2" not in str(ei.value)
    with pytest.raises(ConfigError, match="tiers.remote.password") as ei:
        from_dict({"tiers": {"remote": {"password": "hunter2"}}})
    assert "hunter2" not in str(ei.value)
    with pytest.raises(ConfigError, match="tiers.remote.write_mode"):
        from_dict({"tiers": {"remote": {"url": "redis://h:1", "write_mode": "write_back"}}})
    with pytest.raises(ConfigError, match="cluster: true"):
        from_dict({"tiers": {"remote": {"url": ["redis://a:1", "redis://b:1"]}}})


def test_prefetch_promotes_remote_blocks_into_dram(pair):
    """The first design's path (io.async_loads false): the scheduler prefetches a remote prefix
    into DRAM and answers "ask again"; the next lookup is a DRAM hit."""
    keys = make_keys(5, seed=8)
    a, b = pair
    a.put(keys, blocks_for(keys))
    a.flush()
    assert b.prefetch(keys).result(timeout=30) == 5
    assert b.contains_prefix(keys).tiers == ("dram",) * 5
    out = np.zeros((5, BLOCK), np.uint8)
    assert b.get(keys, out) == 5 and np.array_equal(out, blocks_for(keys))


def _exists_calls(server) -> int:
    """The lookup's questions: STRLEN (the length before any value is read; issue 29)."""
    return int(server.client().info("commandstats").get("cmdstat_strlen", {}).get("calls", 0))


def test_a_request_asks_redis_once_and_a_miss_asks_a_few_keys(pair, redis_single):  # noqa: F811
    """The lookup's answer (STRLEN) is reused by the pin of the same request (the scheduler asks
    twice, milliseconds apart); a prompt Redis does not hold costs a probe of 16 keys, not 200."""
    a, b = pair
    keys = make_keys(12, seed=21)
    a.put(keys, blocks_for(keys))
    a.flush()
    e0 = _exists_calls(redis_single)
    assert b.contains_prefix(keys).num_blocks == 12
    h = b.pin_load(keys)
    assert h.num_blocks == 12 and set(h.tier_of) == {"remote"}
    assert _exists_calls(redis_single) - e0 == 12  # once per key, not twice
    assert b.read_load(h) == 12
    b.end_load(h)
    fresh = make_keys(200, seed=22)
    e0 = _exists_calls(redis_single)
    assert b.contains_prefix(fresh).num_blocks == 0 and b.pin_load(fresh).num_blocks == 0
    assert _exists_calls(redis_single) - e0 == 16  # the probe, then the memo's "absent"
    # what this engine writes through is known present without asking
    b2 = make_keys(3, seed=23)
    b.put(b2, blocks_for(b2))
    b.flush()
    e0 = _exists_calls(redis_single)
    assert b.remote.leading(b2) == 3 and _exists_calls(redis_single) == e0


@pytest.mark.parametrize("dram", [0, 2])  # DRAM off: NVMe is the top; 2 slots for 6 blocks: put overflows to NVMe
def test_a_put_leaves_nothing_that_reads_the_callers_rows_after_it_returns(tmp_path, redis_single, monkeypatch,  # noqa: F811
                                                                          dram):
    """Blocks ``put`` writes into NVMe were copied to Redis (write-through) in the background from
    the caller's own rows: a caller that reused its buffer once put returned got the new bytes
    stored in Redis under the old keys, with a good checksum: wrong KV for every engine."""
    from kvstore.tiers.redis import RedisTier

    keys = make_keys(6, seed=77)
    a = _store(tmp_path, "a", redis_single, dram=dram, monkeypatch=monkeypatch)
    b = _store(tmp_path, "b", redis_single, dram=0, nvme=0)  # reads Redis only
    slow = RedisTier.write_many

    def late(self, entries, srcs):  # the copy runs a moment after put returned
        time.sleep(0.3)
        return slow(self, entries, srcs)

    monkeypatch.setattr(RedisTier, "write_many", late)
    try:
        rows = blocks_for(keys)
        assert a.put(keys, rows) == 6
        rows[:] = 0  # the caller reuses its buffer
        a.flush()
        out = np.zeros((6, BLOCK), np.uint8)
        got = b.get(keys, out)
        assert got == 6 and np.array_equal(out, blocks_for(keys)), got
    finally:
        a.close()
        b.close()


def test_staged_copies_to_a_slow_remote_are_capped_and_counted(tmp_path, redis_single, monkeypatch):  # noqa: F811
    """DRAM off: a store's blocks are staged in private buffers, written to NVMe, then copied to
    Redis in the background, each copy holding its buffers. A Redis slower than the stores (yet
    under its deadline) queued them without end; past the cap a copy is skipped and counted."""
    from kvstore.store import transfers as moves_mod
    from kvstore.tiers.redis import RedisTier

    monkeypatch.setattr(moves_mod, "STAGED_MAX_BYTES", 4 * BLOCK)
    gate = threading.Event()
    slow = RedisTier.write_many

    def stuck(self, entries, srcs):
        gate.wait(10)
        return slow(self, entries, srcs)

    monkeypatch.setattr(RedisTier, "write_many", stuck)
    a = _store(tmp_path, "a", redis_single, dram=0, monkeypatch=monkeypatch)
    try:
        peak = 0
        for r in range(6):  # 6 stores of 2 blocks while Redis takes none
            keys = make_keys(2, seed=300 + r)
            h = a.begin_store(keys)
            for v, b in zip(h.views, blocks_for(keys)):
                v[:] = b
            assert a.end_store(h) == 2  # stored in NVMe all the same
            peak = max(peak, a.transfers._staged)
        assert peak <= 4 * BLOCK
        assert M(a, "kvstore_tier_skipped_blocks_total", tier="remote", reason="backlog") == 8  # 2 of 6 copies went
        gate.set()
        a.flush()
        assert a.transfers._staged == 0
        assert M(a, "kvstore_tier_written_bytes_total", tier="remote") == 4 * BLOCK
    finally:
        gate.set()
        a.close()


def test_one_staged_copy_larger_than_the_cap_goes_when_nothing_else_is_in_flight(tmp_path, redis_single,  # noqa: F811
                                                                                  monkeypatch):
    """A long prefill's step can stage more than the cap in one move (512 blocks of 2 MiB): it
    must not be skipped for that alone."""
    from kvstore.store import transfers as moves_mod

    monkeypatch.setattr(moves_mod, "STAGED_MAX_BYTES", BLOCK)
    a = _store(tmp_path, "a", redis_single, dram=0, monkeypatch=monkeypatch)
    try:
        keys = make_keys(4, seed=400)
        h = a.begin_store(keys)
        for v, b in zip(h.views, blocks_for(keys)):
            v[:] = b
        assert a.end_store(h) == 4
        a.flush()
        assert M(a, "kvstore_tier_written_bytes_total", tier="remote") == 4 * BLOCK
        assert M(a, "kvstore_tier_skipped_blocks_total", tier="remote", reason="backlog") == 0
    finally:
        a.close()


def test_a_write_skipped_in_the_backoff_is_counted_down_not_failed(tmp_path, redis_launcher, monkeypatch):  # noqa: F811
    """A write Redis never saw (its tier in a backoff) is one count: ``down``; a write that was
    tried and failed is ``write``. Each block was counted twice before (both)."""
    srv = redis_launcher.single()
    s = _store(tmp_path, "a", srv, monkeypatch=monkeypatch, timeout_ms=300)
    s.remote.client._backoff = (30.0, 30.0)  # the backoff outlasts the test
    try:
        srv.kill()
        first, then = make_keys(4, seed=1), make_keys(4, seed=2)
        s.put(first, blocks_for(first))  # tried: Redis is gone; the backoff begins
        s.flush()
        w0, d0 = M(s, "kvstore_tier_errors_total", tier="remote", op="write"), \
            M(s, "kvstore_tier_errors_total", tier="remote", op="down")
        assert w0 >= 1 and not s.remote.up
        s.put(then, blocks_for(then))  # in the backoff: never sent
        s.flush()
        s.update_gauges()
        w1, d1 = M(s, "kvstore_tier_errors_total", tier="remote", op="write"), \
            M(s, "kvstore_tier_errors_total", tier="remote", op="down")
        assert (w1 - w0, d1 - d0) == (0, 4)
    finally:
        s.close(wait_s=0)
