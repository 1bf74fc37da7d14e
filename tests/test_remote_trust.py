"""Trust boundaries of the remote tier (issue 29), against real sockets: hostile fake servers on
loopback (a trickler sending one byte per 150 ms, one sending 2 MiB replies slowly, one that never
answers, three that answer the handshake wrongly; ``redis_servers.FakeRedis``) and a real
redis-server shared by stores with and without secrets.

- every call (a lookup through the store, a load, a store, the start-up check, close) ends
  within 1.5 x timeout_ms, nothing escapes, and the tier backs off (counted);
- with KVSTORE_REMOTE_SECRET, no block crosses between secrets and engines with different secrets
  neither see, delete nor overwrite each other's values (issue 45), a value with a valid header
  and xxh3 but no (or a wrong) MAC is refused as "unauthenticated" (deleted if no engine writes
  its shape there, kept and held absent if it is only its MAC that fails), and rotation through
  KVSTORE_REMOTE_SECRET_PREVIOUS works for three engines; the secret never shows in logs, reprs
  or errors;
- a LIST under a kvstore key heals (counted "type", deleted, stored again);
- a 64 MiB value is refused without being read (the server's sent bytes are measured);
- zstd frames that declare 4 GiB or 1 TiB, or lie about their size, are counted, deleted misses
  that allocate nothing (issue 45)."""

from __future__ import annotations

import logging
import os
import threading
import time
import tracemalloc

import numpy as np
import pytest

from kvstore.bench.faults.families import bombs
from kvstore.tiers import fileformat as ff
from kvstore.config import ConfigError, from_dict
from kvstore.keys import ModelFingerprint
from kvstore.store import KVStore
from kvstore.tiers.redis import client as remote_mod
from kvstore.tiers.redis.client import RedisClient, RemoteUnavailable
from kvstore.tiers.redis.value import MAC_BYTES

from conftest import BLOCK, blocks_for, dram_gb, make_keys
from redis_servers import MODES, FakeRedis, redis_single  # noqa: F401

T_MS = 200
BOUND = 1.5 * T_MS / 1000
FP = ModelFingerprint(model="remote-trust", block_size=16)
SECRET_A = "a-secret-for-tests-" + "a" * 24
SECRET_B = "b-secret-for-tests-" + "b" * 24
SECRET_C = "c-secret-for-tests-" + "c" * 24


def elapsed(fn, *args, **kw):
    t0 = time.monotonic()
    out = fn(*args, **kw)
    return time.monotonic() - t0, out


def _store(url, *, dram: int = 8, password: str | None = None, timeout_ms: int = 5000, codec: str = "none",
           **env) -> KVStore:
    """A store on ``url`` (no NVMe; ``dram`` 0: the remote tier alone; a real server is given a
    long timeout, a loaded CI machine must not turn its answers into misses; ``codec``: the remote
    tier's). ``env``: secret=, previous=."""
    saved = {k: os.environ.pop(k, None) for k in ("KVSTORE_REMOTE_SECRET", "KVSTORE_REMOTE_SECRET_PREVIOUS",
                                                   "KVSTORE_REDIS_PASSWORD")}
    for k, v in (("KVSTORE_REMOTE_SECRET", env.get("secret")), ("KVSTORE_REMOTE_SECRET_PREVIOUS", env.get("previous")),
                 ("KVSTORE_REDIS_PASSWORD", password)):
        if v is not None:
            os.environ[k] = v
    try:
        cfg = from_dict({"tiers": {"dram": {"capacity_gb": dram_gb(dram), "pin_memory": False, "ttl_s": None},
                                   "nvme": {"capacity_gb": 0},
                                   "remote": {"url": url, "timeout_ms": timeout_ms, "codec": codec}}})
        return KVStore(cfg, block_bytes=BLOCK, fingerprint=FP, block_tokens=16)
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None)
            if v is not None:
                os.environ[k] = v


def _failures(tier: RedisClient) -> int:
    return sum(v for k, v in tier.stats.items() if k.startswith("errors_"))


def _retry_now(tier: RedisClient) -> None:
    """Wait out the backoff (made 10 ms from now on), so the next call goes to the network again."""
    tier._backoff = (0.01, 0.01)
    give_up = time.monotonic() + 5
    while not tier.available:
        assert time.monotonic() < give_up
        time.sleep(0.01)


# -- deadlines ---------------------------------------------------------------------------------
def _within_bound(srv, tier: RedisClient, op, what: tuple):
    """``op(attempt)`` ends within BOUND, reaching the server and counting a failure. A call the
    machine stalled (once in ~1,500 tests on a loaded 2-core CI run: 0.72 s against a server that
    answers at once) is measured again, at most twice, on fresh keys: a call that is not bounded
    fails every time."""
    times = []
    for attempt in range(3):
        _retry_now(tier)
        n0, f0 = len(srv.commands), _failures(tier)
        dt, got = elapsed(op, attempt)
        assert len(srv.commands) > n0, what  # it did go to the server
        assert _failures(tier) > f0, what  # and counted a failure (a bad handshake too)
        times.append(dt)
        if dt < BOUND:
            return got
    raise AssertionError((*what, times))


@pytest.mark.parametrize("mode", MODES)
def test_store_calls_end_by_the_deadline(mode):
    """Before: the trickler held one lookup for 9.6 s and close() for 3 s (12.4 s with more
    write-throughs pending), the 2 MiB one a lookup for 80 s; HELLO answered +OK or ':x' raised
    out of KVStore()."""
    with FakeRedis(mode) as srv:
        s = _store(srv.url, timeout_ms=T_MS)  # the start-up check fails: a warning, the store runs on DRAM
        # fresh keys for each call (a lookup's "absent" is remembered for a second)
        ks = [make_keys(32, seed=1 + a) for a in range(3)]
        try:
            assert s.remote is not None and not s.remote.up
            out = np.zeros((4, BLOCK), np.uint8)
            for name, op in (("lookup", lambda a: s.contains_prefix(ks[a])),
                             ("load", lambda a: s.get(ks[a][8:12], out)),
                             ("tier load", lambda a: s.remote.client.get(ks[a][:4], list(out))),
                             ("store", lambda a: (s.put(ks[a][16:20], blocks_for(ks[a][16:20])), s.flush()))):
                got = _within_bound(srv, s.remote.client, op, (mode, name))
            assert got[0] == 4  # the store kept them in DRAM
            assert s.remote.stats["puts"] == 0 and s.remote.stats["hits"] == 0
        finally:
            times = [_close_time(s, ks[0][24:28])]
        # a close the machine stalled (twice in ~1,600 tests on loaded 2-core CI runs, 0.72 and
        # 0.73 s against a server that answers at once: a full collection of pytest's heap is that
        # long) is measured again on fresh stores, at most twice; one that is not bounded fails
        # every time
        while times[-1] >= BOUND and len(times) < 3:
            times.append(_close_time(_store(srv.url, timeout_ms=T_MS), make_keys(4, seed=10 + len(times))))
        assert times[-1] < BOUND, (mode, "close", times)
        if mode in ("trickle", "slow_big", "silent"):
            assert s.remote.stats["timeouts"] > 0


def _close_time(s: KVStore, keys) -> float:
    """How long ``s.close()`` takes with a write-through of ``keys`` in flight."""
    _retry_now(s.remote.client)
    s.put(keys, blocks_for(keys))
    dt, _ = elapsed(s.close)
    return dt


@pytest.mark.parametrize("mode", MODES)
def test_tier_calls_end_by_the_deadline(mode):
    """Each call of the tier itself, the start-up check and a remote-only store's put included."""
    with FakeRedis(mode) as srv:
        t = RedisClient(url=srv.url, cluster=False, namespace=os.urandom(16), block_bytes=BLOCK, ttl_s=60.0,
                       timeout_ms=T_MS, io_threads=1, backoff_s=(0.01, 0.01))
        keys = make_keys(8, seed=2)
        blocks = list(blocks_for(keys))
        calls = (("check", t.check), ("exists", lambda: t.exists(keys)),
                 ("get", lambda: t.get(keys, [np.zeros(BLOCK, np.uint8) for _ in keys])),
                 ("put", lambda: t.put(keys, blocks)), ("remove", lambda: t.remove(keys)))
        for name, op in calls:
            _retry_now(t)
            f0 = _failures(t)
            t0 = time.monotonic()
            try:
                got = op()
            except RemoteUnavailable:  # what check() says; nothing else may come out
                assert name == "check"
                got = None
            dt = time.monotonic() - t0
            assert dt < BOUND, (mode, name, dt)
            assert got in (None, [False] * 8, 0), (mode, name, got)
            assert not t.up and (name == "check" or _failures(t) > f0), (mode, name)
        s = _store(srv.url, dram=0, timeout_ms=T_MS)  # the remote tier alone: put asks, then writes, synchronously
        try:
            _retry_now(s.remote.client)
            dt, n = elapsed(s.put, keys, blocks_for(keys))
            assert dt < BOUND and n == 0, (mode, dt, n)
        finally:
            s.close()
        dt, _ = elapsed(t.close)
        assert dt < BOUND


def test_a_call_waits_for_a_pooled_connection_until_its_deadline_only():
    """One pooled connection, held by something slower than a call (``scan``, which has no
    deadline: kvstore inspect's): a call waiting for it gives up by its own deadline."""
    with FakeRedis("trickle") as srv:
        t = RedisClient(url=srv.url, cluster=False, namespace=os.urandom(16), block_bytes=BLOCK, ttl_s=None,
                       timeout_ms=T_MS, io_threads=1, backoff_s=(0.0, 0.0))
        held = threading.Event()
        scanning = threading.Thread(target=lambda: (held.set(), pytest.raises(RemoteUnavailable, list, t.scan())))
        scanning.start()
        held.wait()
        time.sleep(0.05)  # the scan holds the connection (its reply trickles in for ~0.6 s)
        dt, got = elapsed(t.exists, make_keys(4))
        scanning.join()
        assert got == [False] * 4 and dt < BOUND, dt
        t.close()


def test_a_cluster_call_is_bounded_as_a_whole():
    """Two trickling masters: their pipelines run in parallel, one deadline for the call."""
    with FakeRedis("trickle") as a, FakeRedis("trickle") as b:
        a.slots = b.slots = [(0, 8191, a.port), (8192, 16383, b.port)]
        t = RedisClient(url=[a.url, b.url], cluster=True, namespace=os.urandom(16), block_bytes=BLOCK, ttl_s=60.0,
                       timeout_ms=T_MS, io_threads=2, backoff_s=(0.01, 0.01))
        keys = make_keys(64, seed=3)
        for name, op in (("exists", lambda: t.exists(keys)),
                         ("get", lambda: t.get(keys, [np.zeros(BLOCK, np.uint8) for _ in keys]))):
            _retry_now(t)
            da, db = len(a.data_commands()), len(b.data_commands())
            dt, got = elapsed(op)
            assert dt < BOUND and got == [False] * 64, (name, dt)
            assert len(a.data_commands()) > da and len(b.data_commands()) > db  # both masters were asked
        dt, _ = elapsed(t.close)
        assert dt < BOUND


def test_a_tls_handshake_that_never_ends_is_bounded():
    with FakeRedis("silent") as srv:
        t = RedisClient(url=f"rediss://127.0.0.1:{srv.port}", cluster=False, namespace=os.urandom(16),
                       block_bytes=BLOCK, ttl_s=60.0, timeout_ms=T_MS, backoff_s=(0.01, 0.01))
        t0 = time.monotonic()
        with pytest.raises(RemoteUnavailable):
            t.check()
        assert time.monotonic() - t0 < BOUND
        _retry_now(t)
        dt, got = elapsed(t.get, make_keys(2), [np.zeros(BLOCK, np.uint8)] * 2)
        assert dt < BOUND and got == [False, False]
        t.close()


# -- authenticated values ------------------------------------------------------------------------
def _served(s: KVStore, keys) -> int:
    out = np.zeros((len(keys), BLOCK), np.uint8)
    n = s.get(keys, out)
    assert np.array_equal(out[:n], blocks_for(keys[:n]))  # what is served is always right
    return n


def _corrupt(s: KVStore, reason: str) -> float:
    return s.metrics.value("kvstore_corrupt_files_total", tier="remote", reason=reason)


def test_no_block_crosses_between_secrets(redis_single, caplog):  # noqa: F811
    keys = make_keys(12, seed=4)
    pw = redis_single.password
    caplog.set_level(logging.DEBUG)
    a = _store(redis_single.url, dram=0, password=pw, secret=SECRET_A)
    same = _store(redis_single.url, dram=0, password=pw, secret=SECRET_A)
    other = _store(redis_single.url, dram=0, password=pw, secret=SECRET_B)
    plain = _store(redis_single.url, dram=0, password=pw)
    try:
        assert a.put(keys, blocks_for(keys)) == 12
        ns = [s.remote.client.namespace for s in (a, same, other, plain)]
        assert ns[0] == ns[1] and len(set(ns)) == 3  # a namespace per secret, and one without
        assert plain.contains_prefix(keys).num_blocks == 0  # a store without a secret does not even see them
        assert _served(same, keys) == 12  # the same secret: every block
        assert _served(other, keys) == 0  # another secret: none, and it does not even see them
        assert other.remote.corrupt_reasons == {} and redis_single.client().dbsize() == 12
        text = caplog.text + repr(a.remote) + repr(a.remote.client.values) + repr(vars(a.remote))
        assert SECRET_A not in text and SECRET_B not in text
    finally:
        for s in (a, same, other, plain):
            s.close()


def test_an_engine_with_another_secret_deletes_and_overwrites_nothing(redis_single):  # noqa: F811
    """Issue 45 finding 3: engine B with another secret (a staging engine on the production Redis)
    looked A's prefix up, served nothing (right) and deleted all 8 blocks (dbsize 8 -> 0); its
    recomputed blocks then overwrote A's keys, and the two fleets evicted each other for good."""
    keys = make_keys(8, seed=40)
    pw = redis_single.password
    a = _store(redis_single.url, dram=0, password=pw, secret=SECRET_A)
    b = _store(redis_single.url, dram=0, password=pw, secret=SECRET_B)
    c = redis_single.client()
    try:
        assert a.put(keys, blocks_for(keys)) == 8 and c.dbsize() == 8
        assert b.contains_prefix(keys).num_blocks == 0
        assert _served(b, keys) == 0
        assert c.dbsize() == 8  # nothing of A's deleted (was 0)
        assert b.put(keys, blocks_for(keys)) == 8  # B recomputes and stores: beside A's, not over them
        assert c.dbsize() == 16
        a2 = _store(redis_single.url, dram=0, password=pw, secret=SECRET_A)  # a fresh engine of fleet A
        try:
            assert a2.contains_prefix(keys).num_blocks == 8 and _served(a2, keys) == 8
            assert _served(b, keys) == 8
            assert sum(a2.remote.corrupt_reasons.values()) == sum(b.remote.corrupt_reasons.values()) == 0
        finally:
            a2.close()
    finally:
        a.close()
        b.close()


def _forge(tier: RedisClient, key: bytes, payload: np.ndarray | bytes, *, flags: int = 0, tail: bytes = b"") -> bytes:
    """A value with a valid header and xxh3 for ``key`` in the tier's namespace, as any writer to
    Redis can build it from the key name alone."""
    payload = np.frombuffer(bytes(payload), np.uint8)
    head = ff.header_bytes(ff.Header(tier.values.codec_id, payload.nbytes, ff.checksum(payload), time.time(),
                                     tier.namespace, key, flags))
    return head + payload.tobytes() + tail


@pytest.mark.parametrize("how", ["no_mac", "random_mac", "mac_unflagged"])
def test_a_forged_value_is_refused(redis_single, how):  # noqa: F811
    """Found at the lookup (an unMAC'd value's length) or at the load (the MAC): refused, counted
    "unauthenticated"; before, a value with a valid header and xxh3 was served. A value of a shape
    no engine writes there (no MAC, or a MAC behind a header that does not announce one) is
    deleted; one whose MAC alone fails is kept (issue 45: that a MAC fails is not proof that its
    writer had no right to write it) and held absent by this engine, whose next store overwrites it."""
    keys = make_keys(3, seed=5)
    s = _store(redis_single.url, dram=0, password=redis_single.password, secret=SECRET_A)
    reader = _store(redis_single.url, dram=0, password=redis_single.password, secret=SECRET_A)
    try:
        assert s.put(keys, blocks_for(keys)) == 3
        c = redis_single.client()
        name = s.remote.client.redis_key(keys[1])
        honest = c.get(name)
        evil = np.full(BLOCK, 7, np.uint8)
        if how == "no_mac":  # valid header and xxh3, flags 0, no MAC
            forged = _forge(s.remote.client, keys[1], evil, flags=0, tail=b"")
        elif how == "random_mac":  # flagged, of the right length, a MAC made without the secret
            forged = _forge(s.remote.client, keys[1], evil, flags=ff.FLAG_MAC, tail=os.urandom(MAC_BYTES))
        else:  # the honest value's MAC after an unflagged header: the header is inside the MAC
            forged = _forge(s.remote.client, keys[1], blocks_for(keys[1:2])[0], flags=0, tail=honest[-MAC_BYTES:])
        c.set(name, forged)
        assert _served(reader, keys) == 1  # the prefix ends at the forged block; nothing wrong is served
        kept = how == "random_mac"
        assert _corrupt(reader, "unauthenticated") == 1 and c.exists(name) == int(kept)
        assert reader.contains_prefix(keys).num_blocks == 1  # not promised again (held, or gone)
        assert reader.put(keys, blocks_for(keys)) == 1  # stored again over it (the others are there)
        assert _served(reader, keys) == 3 and _served(s, keys) == 3
        assert _corrupt(reader, "unauthenticated") == 1
    finally:
        s.close()
        reader.close()


def test_rotation_through_the_previous_secret(redis_single):  # noqa: F811
    keys = make_keys(6, seed=6)
    pw = redis_single.password
    old = _store(redis_single.url, dram=0, password=pw, secret=SECRET_A)
    new = _store(redis_single.url, dram=0, password=pw, secret=SECRET_B, previous=SECRET_A)
    stale = _store(redis_single.url, dram=0, password=pw, secret=SECRET_A)
    phase1 = _store(redis_single.url, dram=0, password=pw, secret=SECRET_A, previous=SECRET_B)
    try:
        assert old.put(keys[:3], blocks_for(keys[:3])) == 3
        assert _served(new, keys[:3]) == 3  # values of the secret being rotated out are still read
        assert new.put(keys[3:], blocks_for(keys[3:])) == 3
        assert _served(phase1, keys[3:]) == 3  # phase 1 (old secret, new one accepted) reads the new ones
        assert _served(stale, keys[3:]) == 0  # an engine that has neither the new secret nor phase 1: refused
    finally:
        for s in (old, new, stale, phase1):
            s.close()


def test_three_engines_through_a_rotation(redis_single):  # noqa: F811
    """Issue 45: an engine with the old secret, one with the new secret and the old as previous,
    and an unrelated one (another secret) on one Redis. Hits are followed through the rotation:
    the new engine reads the old one's values (and does not keep them alive), writes only its
    own namespace; the unrelated engine serves, deletes and overwrites nothing of either (before:
    it deleted every value it looked at, both fleets' included)."""
    keys = make_keys(8, seed=41)
    pw = redis_single.password
    c = redis_single.client()
    old = _store(redis_single.url, dram=0, password=pw, secret=SECRET_A)
    new = _store(redis_single.url, dram=0, password=pw, secret=SECRET_B, previous=SECRET_A)
    unrelated = _store(redis_single.url, dram=0, password=pw, secret=SECRET_C)
    try:
        assert old.put(keys[:4], blocks_for(keys[:4])) == 4
        assert unrelated.contains_prefix(keys).num_blocks == 0 and _served(unrelated, keys) == 0
        assert c.dbsize() == 4
        # the new engine finds and serves the old one's prefix, without refreshing its TTL
        c.pexpire(old.remote.client.redis_key(keys[0]), 50_000)
        assert new.contains_prefix(keys).num_blocks == 4 and _served(new, keys[:4]) == 4
        assert 0 < c.pttl(old.remote.client.redis_key(keys[0])) <= 50_000
        # it computes the rest and stores all it was asked to: into its own namespace only
        assert new.put(keys, blocks_for(keys)) == 8 - 4  # the 4 the old secret's namespace holds are skipped
        assert c.dbsize() == 8
        assert _served(new, keys) == 8
        assert _served(old, keys) == 4  # the old engine: its own, never the new secret's
        assert unrelated.contains_prefix(keys).num_blocks == 0 and _served(unrelated, keys) == 0
        assert unrelated.put(keys, blocks_for(keys)) == 8 and c.dbsize() == 16
        # the rotation's last step: the new secret alone still serves what it wrote
        done = _store(redis_single.url, dram=0, password=pw, secret=SECRET_B)
        try:
            assert done.contains_prefix(keys).num_blocks == 0  # keys[:4] were only under the old secret
            assert _served(done, keys[4:]) == 4
        finally:
            done.close()
        assert _served(old, keys[:4]) == 4 and _served(new, keys) == 8 and _served(unrelated, keys) == 8
        for s in (old, new, unrelated):
            assert s.remote.corrupt_reasons == {}, s.remote.corrupt_reasons
    finally:
        for s in (old, new, unrelated):
            s.close()


def test_secrets_come_only_from_a_sound_environment(redis_single):  # noqa: F811
    pw = redis_single.password
    with pytest.raises(ConfigError, match="KVSTORE_REMOTE_SECRET") as ei:
        _store(redis_single.url, password=pw, secret="short-secret")
    assert "short-secret" not in str(ei.value)
    with pytest.raises(ConfigError, match="KVSTORE_REMOTE_SECRET_PREVIOUS") as ei:
        _store(redis_single.url, password=pw, previous=SECRET_A)
    assert SECRET_A not in str(ei.value)
    with pytest.raises(ConfigError, match="tiers.remote"):
        from_dict({"tiers": {"remote": {"url": "redis://h:1", "secret": SECRET_A}}})


def test_one_warning_without_a_secret(redis_single, caplog):  # noqa: F811
    remote_mod._warned_unauthenticated.clear()
    caplog.set_level(logging.WARNING, logger="kvstore.tiers.redis.client")
    stores = [_store(redis_single.url, password=redis_single.password) for _ in range(2)]
    for s in stores:
        s.close()
    said = [r for r in caplog.records if "trusts every writer" in r.getMessage()]
    assert len(said) == 1 and "KVSTORE_REMOTE_SECRET" in said[0].getMessage()


# -- healing and length first --------------------------------------------------------------------
def test_a_list_under_a_kvstore_key_heals(redis_single):  # noqa: F811
    keys = make_keys(4, seed=7)
    pw = redis_single.password
    a = _store(redis_single.url, dram=0, password=pw)
    b = _store(redis_single.url, dram=0, password=pw)
    try:
        assert a.put(keys, blocks_for(keys)) == 4
        c = redis_single.client()
        name = a.remote.client.redis_key(keys[2])
        c.delete(name)
        c.rpush(name, b"not a block")
        # found at the lookup: absent there, counted and deleted (before: present, every load failed)
        assert b.contains_prefix(keys).num_blocks == 2
        assert _corrupt(b, "type") == 1 and c.exists(name) == 0
        assert a.put(keys[2:3], blocks_for(keys[2:3])) == 1
        time.sleep(1.1)  # b's memo of the lookup's "absent" (1 s, kvstore/tiers/presence.py)
        assert _served(b, keys) == 4
        # swapped in after the lookup: the load refuses it once, counts it, deletes it
        h = b.pin_load(keys)
        assert h.num_blocks == 4
        c.delete(name)
        c.rpush(name, b"x")
        assert b.read_load(h) == 2
        b.end_load(h)
        assert _corrupt(b, "type") == 2 and c.exists(name) == 0
    finally:
        a.close()
        b.close()


def test_a_huge_value_is_refused_without_being_read(redis_single):  # noqa: F811
    keys = make_keys(2, seed=8)
    t = RedisClient(url=redis_single.url, cluster=False, namespace=os.urandom(16), block_bytes=BLOCK, ttl_s=60.0,
                   timeout_ms=2000, password=redis_single.password)
    assert t.put(keys, list(blocks_for(keys))) == [True, True]
    c = redis_single.client()
    name = t.redis_key(keys[0])
    c.set(name, b"\0" * (64 << 20))

    def sent() -> int:
        return int(c.info("stats")["total_net_output_bytes"])

    s0 = sent()
    outs = [np.zeros(BLOCK, np.uint8) for _ in keys]
    assert t.get(keys, outs) == [False, True] and np.array_equal(outs[1], blocks_for(keys[1:])[0])
    read = sent() - s0
    assert read < 1 << 20, read  # the value's length cap (8 KiB + header + 1), not 64 MiB
    assert t.corrupt_reasons == {"length": 1} and c.exists(name) == 0
    c.set(name, b"\0" * (64 << 20))
    s0 = sent()
    assert t.exists(keys) == [False, True]  # the lookup reads its length only
    assert sent() - s0 < 1 << 20 and c.exists(name) == 0 and t.corrupt_reasons == {"length": 2}
    t.close()


def test_inspect_reads_macd_values_as_blocks(redis_single):  # noqa: F811
    """``kvstore inspect`` knows a MAC'd value's length (header + payload + 32 bytes)."""
    from kvstore.ops.inspect import inspect_remote

    s = _store(redis_single.url, dram=0, password=redis_single.password, secret=SECRET_A)
    try:
        keys = make_keys(3, seed=9)
        assert s.put(keys, blocks_for(keys)) == 3
        info = inspect_remote(redis_single.url, password=redis_single.password)
        ns = info["namespaces"][s.remote.client.namespace.hex()]
        assert ns["blocks"] == 3 and ns["bad_values"] == 0 and info["bad_values"] == 0
        assert ns["bytes"] == 3 * (BLOCK + ff.HEADER_CORE + MAC_BYTES)
    finally:
        s.close()


# -- decode bombs (issue 45 findings 1 and 2) -----------------------------------------------------
@pytest.mark.parametrize("frame", sorted(bombs.hostile_payloads(BLOCK, BLOCK + 1)))
def test_a_zstd_bomb_in_redis_is_a_counted_deleted_miss_that_allocates_nothing(redis_single, frame):  # noqa: F811
    """With ``tiers.remote.codec: zstd`` and no secret anyone who may write to Redis can plant a
    value with a valid header and xxh3 whose zstd frame declares 4 GiB (finding 1: one get took
    10.3 s and 4.1 GiB of RSS, python-zstandard allocating what the frame declares) or 1 TiB
    (finding 2: every get raised MemoryError, uncounted, the value kept and promised for a day),
    or lies about its size. Each is now refused before it allocates (the traced peak of the whole
    get stays under a MiB; it was 4,096 MiB for the 4 GiB frame), counted ``decode``, deleted,
    not promised again, and stored over by the next put."""
    keys = make_keys(3, seed=42)
    s = _store(redis_single.url, dram=0, password=redis_single.password, codec="zstd")
    c = redis_single.client()
    try:
        assert s.put(keys, blocks_for(keys)) == 3
        t = s.remote.client
        payload = bombs.hostile_payloads(t.values.codec.inner.encoded_bytes, t.values.payload_max)[frame]
        name = t.redis_key(keys[1])
        c.set(name, _forge(t, keys[1], payload, flags=0))
        assert s.contains_prefix(keys).num_blocks == 3  # its length is a zstd value's
        tracemalloc.start()
        try:
            assert _served(s, keys) == 1  # never an exception, never served
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 1 << 20, (frame, peak)
        assert _corrupt(s, "decode") == 1 and c.exists(name) == 0
        assert s.contains_prefix(keys).num_blocks == 1
        assert s.put(keys, blocks_for(keys)) == 1 and _served(s, keys) == 3
    finally:
        s.close()
