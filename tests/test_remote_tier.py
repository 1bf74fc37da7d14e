"""The Redis remote tier against real redis-server processes (one with a password, and a 3-master
cluster): byte-identical round trips in one pipeline per server, TTL set and refreshed, every kind
of bad value a counted, deleted miss, auth errors that name the env var and never the password,
a killed or sleeping server turning calls into quick misses with backoff and recovery, per-command
errors (MOVED, OOM, WRONGTYPE) as misses, concurrent writers never serving a wrong block, scan,
and codecs."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
import redis

from kvstore.tiers import fileformat as ff
from kvstore.codecs import Geometry, make_codec
from kvstore.tiers.redis.client import RemoteAuthError, RedisClient, RemoteUnavailable

from conftest import FakeClock
from redis_servers import redis_cluster, redis_launcher, redis_single  # noqa: F401

BB = 64 * 1024


def keys_and_blocks(n: int, bb: int = BB, seed: int = 0):
    rng = np.random.default_rng(seed)
    keys = [rng.bytes(16) for _ in range(n)]
    return keys, [rng.integers(0, 256, bb, dtype=np.uint8) for _ in range(n)]


def tier_for(srv, *, namespace: bytes | None = None, bb: int = BB, **kw) -> RedisClient:
    cluster = isinstance(srv.url, list)
    args = dict(url=srv.url, cluster=cluster, namespace=namespace or os.urandom(16), block_bytes=bb,
                ttl_s=600.0, timeout_ms=1000, password=srv.password, backoff_s=(0.05, 0.2))
    args.update(kw)
    return RedisClient(**args)


def outs_for(n: int, bb: int = BB):
    return [np.zeros(bb, np.uint8) for _ in range(n)]


class CountPipelines:
    """Counts the batches sent to the servers, one per pipeline (redis-py's, or the tier's own
    SET pipeline): each is one ``send_packed_command`` (the calls still go to the real server)."""

    def __init__(self, monkeypatch):
        self.n = 0
        orig = redis.connection.Connection.send_packed_command

        def send(conn, *a, **kw):
            self.n += 1
            return orig(conn, *a, **kw)
        monkeypatch.setattr(redis.connection.Connection, "send_packed_command", send)


def test_round_trip_single_one_pipeline(redis_single, monkeypatch):
    keys, blocks = keys_and_blocks(64)
    t = tier_for(redis_single)
    t.check()
    pipes = CountPipelines(monkeypatch)
    assert t.put(keys, blocks) == [True] * 64 and pipes.n == 1
    outs = outs_for(64)
    assert t.get(keys, outs) == [True] * 64 and pipes.n == 2
    assert all(np.array_equal(o, b) for o, b in zip(outs, blocks))
    stats = redis_single.client().info("commandstats")
    # length first: GETRANGE up to one byte past the longest value, PEXPIRE for the TTL (no GETEX)
    assert stats["cmdstat_getrange"]["calls"] == 64 and stats["cmdstat_pexpire"]["calls"] == 64
    assert stats["cmdstat_set"]["calls"] == 64 and "cmdstat_getex" not in stats
    assert t.stats["hits"] == 64 and t.stats["puts"] == 64 and t.stats["bytes_written"] == 64 * (BB + ff.HEADER_CORE)
    assert redis_single.password not in repr(t) and str(redis_single.port) in repr(t)
    t.close()


def test_round_trip_cluster_spreads_over_masters(redis_cluster, monkeypatch):
    keys, blocks = keys_and_blocks(64, seed=1)
    t = tier_for(redis_cluster)
    t.check()
    pipes = CountPipelines(monkeypatch)
    assert t.put(keys, blocks) == [True] * 64
    assert 1 < pipes.n <= 3  # one pipeline per master holding some of the batch
    outs = outs_for(64)
    assert t.get(keys, outs) == [True] * 64
    assert all(np.array_equal(o, b) for o, b in zip(outs, blocks))
    per_node = [sum(1 for _ in s.client().scan_iter(match=t.redis_key(keys[0])[:38] + b"*"))
                for s in redis_cluster.servers]
    assert sum(per_node) == 64 and sum(n > 0 for n in per_node) >= 2, per_node
    t.close()


def test_missing_keys_and_exists(redis_single):
    keys, blocks = keys_and_blocks(8, bb=4096)
    t = tier_for(redis_single, bb=4096)
    assert t.put(keys[:4], blocks[:4]) == [True] * 4
    assert t.exists(keys) == [True] * 4 + [False] * 4
    outs = outs_for(8, 4096)
    assert t.get(keys, outs) == [True] * 4 + [False] * 4
    assert t.stats["hits"] == 4 and t.stats["misses"] == 4 and t.stats["corrupt"] == 0
    assert t.exists([]) == [] and t.get([], []) == [] and t.put([], []) == []
    assert t.remove(keys) == 4 and t.exists(keys) == [False] * 8


def test_ttl_set_and_refreshed_by_get(redis_single):
    keys, blocks = keys_and_blocks(2, bb=4096)
    t = tier_for(redis_single, bb=4096, ttl_s=100.0)
    c = redis_single.client()
    t.put(keys, blocks)
    name = t.redis_key(keys[0])
    assert 90_000 < c.pttl(name) <= 100_000
    c.pexpire(name, 5_000)
    assert t.get(keys[:1], outs_for(1, 4096)) == [True]
    assert c.pttl(name) > 90_000  # GETEX gave it its full TTL back
    forever = tier_for(redis_single, bb=4096, ttl_s=None)
    forever.put(keys, blocks)
    assert c.pttl(forever.redis_key(keys[0])) == -1


def _corrupt(kind: str, value: bytes, other_ns_value: bytes, other_key_value: bytes) -> bytes:
    if kind == "payload_bit":
        b = bytearray(value)
        b[ff.HEADER_CORE + 100] ^= 0x01
        return bytes(b)
    if kind == "header_byte":
        b = bytearray(value)
        b[30] ^= 0xFF  # inside the payload checksum field: the header checksum fails
        return bytes(b)
    if kind == "magic":
        return b"XXXXXXXX" + value[8:]
    return {"truncated": value[:-1], "header_only": value[: ff.HEADER_CORE], "short": value[:20],
            "empty": b"", "garbage": os.urandom(len(value)), "pickle": b"\x80\x04\x95" + value[3:],
            "other_namespace": other_ns_value, "other_key": other_key_value,
            "longer": value + b"\0"}[kind]


@pytest.mark.parametrize("kind", ["payload_bit", "header_byte", "magic", "truncated", "header_only", "short",
                                  "garbage", "pickle", "other_namespace", "other_key", "longer"])
def test_bad_values_are_counted_deleted_misses(redis_single, kind):
    """Every bad value is a counted miss; a value no engine writes under its name is deleted, one
    of our format whose checksum fails (``payload_bit``) is kept and reported refused (issue 45:
    a failed check is not proof that its writer had no right to write it; a later put overwrites it)."""
    keys, blocks = keys_and_blocks(3, bb=4096, seed=2)
    t = tier_for(redis_single, bb=4096)
    other = tier_for(redis_single, bb=4096)  # another namespace writes the same key
    c = redis_single.client()
    t.put(keys, blocks)
    other.put(keys[:1], blocks[:1])
    name = t.redis_key(keys[0])
    bad = _corrupt(kind, c.get(name), c.get(other.redis_key(keys[0])), c.get(t.redis_key(keys[1])))
    c.set(name, bad)
    outs = outs_for(3, 4096)
    refused: list[bytes] = []
    assert t.get(keys, outs, refused) == [False, True, True]
    assert np.array_equal(outs[1], blocks[1]) and np.array_equal(outs[2], blocks[2])
    kept = kind == "payload_bit"
    assert t.stats["corrupt"] == 1 and t.stats["deleted_corrupt"] == int(not kept)
    assert sum(t.corrupt_reasons.values()) == 1 and refused == keys[:1] * kept
    assert c.exists(name) == int(kept) and c.exists(t.redis_key(keys[1])) == 1
    assert t.available  # a bad value is not a server failure
    assert t.put(keys[:1], blocks[:1]) == [True] and t.get(keys[:1], outs[:1]) == [True]


@pytest.mark.parametrize("ttl_s", [1e300, 1e12, float("inf"), float("nan"), 1e9])
def test_a_put_never_sends_a_px_redis_refuses(redis_single, ttl_s):
    """A request's TTL hint is clamped to the config's longest TTL (1e9 s) before it becomes PX:
    1e300 made Redis refuse the SET (the block silently not shared), 1e12 gave a PTTL of ~31,700
    years, inf and NaN raised out of put."""
    keys, blocks = keys_and_blocks(2, bb=4096, seed=9)
    t = tier_for(redis_single, bb=4096)
    assert t.put(keys, blocks, ttl_s=ttl_s) == [True, True] and t.stats["errors_put"] == 0
    assert 0.99e12 < redis_single.client().pttl(t.redis_key(keys[0])) <= 1e12
    assert t.get(keys, outs_for(2, 4096)) == [True, True]


@pytest.mark.parametrize("where", ["single", "cluster"])
def test_a_read_refreshes_the_ttl_and_never_shortens_a_longer_hint(where, redis_single, redis_cluster):
    """PEXPIRE ... GT (Redis >= 7, learnt at check()): a block stored with a 1-day hint on a 600 s
    tier kept 600 s from its first read (the hint's promise: a hit lengthens, never shortens)."""
    srv = redis_single if where == "single" else redis_cluster
    keys, blocks = keys_and_blocks(2, bb=4096, seed=11)
    t = tier_for(srv, bb=4096, ttl_s=600.0)
    t.check()
    c = srv.client()
    assert t.put(keys[:1], blocks[:1], ttl_s=86_400.0) == [True] and t.put(keys[1:], blocks[1:]) == [True]
    c.pexpire(t.redis_key(keys[1]), 5_000)
    assert t.get(keys, outs_for(2, 4096)) == [True, True]
    assert c.pttl(t.redis_key(keys[0])) > 86_000_000  # was 600,000 after the read
    assert 590_000 < c.pttl(t.redis_key(keys[1])) <= 600_000  # a shorter one is still refreshed


def test_an_empty_value_is_a_plain_miss(redis_single):
    """An empty value cannot be told from a key that another engine SET between the GETRANGE and
    the PEXPIRE of one read: a miss, never counted corrupt; exists() reports it absent, and the
    next put overwrites it."""
    keys, blocks = keys_and_blocks(2, bb=4096, seed=2)
    t = tier_for(redis_single, bb=4096)
    c = redis_single.client()
    t.put(keys, blocks)
    c.set(t.redis_key(keys[0]), b"")
    outs = outs_for(2, 4096)
    assert t.get(keys, outs) == [False, True] and np.array_equal(outs[1], blocks[1])
    assert t.exists(keys) == [False, True]
    assert t.stats["corrupt"] == 0 and t.stats["misses"] == 1
    assert t.put(keys[:1], blocks[:1]) == [True] and t.get(keys[:1], outs_for(1, 4096)) == [True]


def test_codec_mismatch_is_never_served(redis_single):
    keys, blocks = keys_and_blocks(1, bb=4096)
    ns = os.urandom(16)
    tier_for(redis_single, bb=4096, namespace=ns, codec_id=3).put(keys, blocks)
    t = tier_for(redis_single, bb=4096, namespace=ns)
    assert t.get(keys, outs_for(1, 4096)) == [False] and t.corrupt_reasons == {"codec": 1}


def test_wrong_or_missing_password(redis_single, redis_launcher):
    for pw in ("not-the-password-123", None):
        t = tier_for(redis_single, password=pw)
        with pytest.raises(RemoteAuthError) as ei:
            t.check()
        msg = str(ei.value)
        assert "KVSTORE_REDIS_PASSWORD" in msg and f"127.0.0.1:{redis_single.port}" in msg
        assert redis_single.password not in msg and (pw is None or pw not in msg)
        # later calls are misses, never exceptions
        assert t.get(keys_and_blocks(1)[0], outs_for(1)) == [False]
    with pytest.raises(ValueError) as ei:
        RedisClient(url=f"redis://:{redis_single.password}@127.0.0.1:{redis_single.port}", cluster=False,
                   namespace=os.urandom(16), block_bytes=BB, ttl_s=None, timeout_ms=100)
    assert redis_single.password not in str(ei.value) and "KVSTORE_REDIS_PASSWORD" in str(ei.value)


def test_cluster_wrong_password(redis_cluster):
    t = tier_for(redis_cluster, password="wrong-cluster-pw")
    with pytest.raises(RemoteAuthError) as ei:
        t.check()
    assert "KVSTORE_REDIS_PASSWORD" in str(ei.value) and "wrong-cluster-pw" not in str(ei.value)
    assert redis_cluster.password not in str(ei.value)


def test_unreachable_server(redis_launcher):
    s = redis_launcher.single()
    s.stop()
    t = tier_for(s, timeout_ms=200)
    with pytest.raises(RemoteUnavailable, match=f"127.0.0.1:{s.port}"):
        t.check()
    assert not t.available


def test_killed_server_misses_then_recovers(redis_launcher):
    s = redis_launcher.single(password="pw-kill")
    keys, blocks = keys_and_blocks(16, bb=4096)
    t = tier_for(s, bb=4096, timeout_ms=300)
    assert t.put(keys, blocks) == [True] * 16
    s.kill()
    t0 = time.monotonic()
    assert t.get(keys, outs_for(16, 4096)) == [False] * 16
    assert time.monotonic() - t0 < 1.0
    assert not t.available and t.stats["errors_get"] == 16
    assert t.put(keys, blocks) == [False] * 16 and t.exists(keys) == [False] * 16 and t.remove(keys) == 0
    assert t.stats["skipped_down"] > 0
    s.restart()
    deadline = time.monotonic() + 5
    while t.put(keys, blocks) != [True] * 16:  # backoff (0.05 .. 0.2 s), then a reconnect
        assert time.monotonic() < deadline, t.stats
        time.sleep(0.05)
    outs = outs_for(16, 4096)
    assert t.available and t.get(keys, outs) == [True] * 16
    assert all(np.array_equal(o, b) for o, b in zip(outs, blocks))


def test_backoff_is_exponential_and_skips_the_network(redis_launcher):
    s = redis_launcher.single()
    clock = FakeClock(100.0)
    keys, blocks = keys_and_blocks(4, bb=4096)
    t = tier_for(s, bb=4096, timeout_ms=300, backoff_s=(1.0, 4.0), clock=clock)
    s.kill()
    delays = []
    for _ in range(4):
        assert t.get(keys, outs_for(4, 4096)) == [False] * 4
        start = clock.t
        while not t.available:
            clock.advance(0.5)
        delays.append(clock.t - start)
    assert delays == [1.0, 2.0, 4.0, 4.0]
    assert t.get(keys, outs_for(4, 4096)) == [False] * 4 and not t.available
    s.restart()
    tier_for(s, bb=4096, namespace=t.namespace).put(keys, blocks)  # another engine, server up again
    skipped = t.stats["skipped_down"]
    assert t.get(keys, outs_for(4, 4096)) == [False] * 4  # still in backoff: no network, a miss
    assert t.stats["skipped_down"] == skipped + 4
    clock.advance(4.0)
    assert t.get(keys, outs_for(4, 4096)) == [True] * 4
    clock.advance(1.0)
    s.kill()
    t.get(keys, outs_for(4, 4096))
    assert not t.available
    clock.advance(1.0)  # a success reset the backoff to its first step
    assert t.available


def test_slow_server_times_out_fast(redis_single):
    keys, blocks = keys_and_blocks(8, bb=4096)
    t = tier_for(redis_single, bb=4096, timeout_ms=100)
    t.put(keys, blocks)
    slept = []
    sleeper = threading.Thread(target=lambda: slept.append(
        redis_single.client().execute_command("DEBUG", "SLEEP", "1.0")))
    sleeper.start()
    time.sleep(0.2)  # the server is asleep now
    t0 = time.monotonic()
    assert t.get(keys, outs_for(8, 4096)) == [False] * 8
    assert time.monotonic() - t0 < 0.5
    assert t.stats["timeouts"] == 8 and not t.available
    sleeper.join()
    assert slept == [b"OK"]
    time.sleep(0.25)  # past the backoff
    outs = outs_for(8, 4096)
    assert t.get(keys[::-1], outs) == [True] * 8  # no late reply of the timed-out call is read as ours
    assert all(np.array_equal(o, b) for o, b in zip(outs, blocks[::-1]))


def test_keys_evicted_between_exists_and_get(redis_single):
    keys, blocks = keys_and_blocks(6, bb=4096)
    t = tier_for(redis_single, bb=4096)
    t.put(keys, blocks)
    assert t.exists(keys) == [True] * 6
    redis_single.client().delete(*[t.redis_key(k) for k in keys[3:]])
    outs = outs_for(6, 4096)
    assert t.get(keys, outs) == [True] * 3 + [False] * 3
    assert t.stats["corrupt"] == 0 and t.stats["misses"] == 3


def test_per_command_errors_are_misses_not_an_outage(redis_launcher):
    s = redis_launcher.single(maxmemory="3mb")
    keys, blocks = keys_and_blocks(64, bb=BB)
    t = tier_for(s)
    oks = t.put(keys, blocks)  # Redis refuses the SETs that would pass maxmemory (noeviction): OOM
    assert 0 < sum(oks) < 64 and t.stats["errors_put"] == 64 - sum(oks) and t.available
    outs = outs_for(64)
    assert t.get(keys, outs) == oks
    # every stored key deleted, so the list fits under maxmemory: RPUSH met OOM where keys[0] had been
    # refused, and again (a fresh clone's CI) after deleting one stored key: the server's used memory
    # counts more than the values (allocator, buffers), and one block's worth did not take it under
    k = keys[oks.index(True)]
    s.client().delete(*[t.redis_key(x) for x, ok in zip(keys, oks) if ok])
    s.client().rpush(t.redis_key(k), b"x")  # the wrong type under a block's name: WRONGTYPE
    errors = t.stats["errors_get"]
    assert t.get([k], outs_for(1)) == [False] and t.available
    # a bad value, not a failed command: counted corrupt ("type") and deleted (issue 29: it healed never)
    assert t.stats["errors_get"] == errors and t.corrupt_reasons == {"type": 1} and t.stats["deleted_corrupt"] == 1
    assert s.client().exists(t.redis_key(k)) == 0


def test_moved_slot_is_a_miss_then_followed(redis_cluster):
    rc = redis_cluster.client()
    t = tier_for(redis_cluster, bb=4096)
    keys, blocks = keys_and_blocks(40, bb=4096, seed=7)
    t.check()  # reads the slot map now
    for k, b in zip(keys, blocks):
        slot = rc.keyslot(t.redis_key(k))
        if rc.cluster_countkeysinslot(slot) == 0:
            break
    owner = redis_cluster.node_of(t.redis_key(k))
    target = next(s for s in redis_cluster.servers if s is not owner)
    target_id = target.client().execute_command("CLUSTER", "MYID")
    owner_id = owner.client().execute_command("CLUSTER", "MYID")
    # a live resharding of the (empty) slot, in Redis's order: the importing node's SETSLOT NODE bumps
    # its config epoch, so the new owner wins the gossip (SETSLOT NODE alone, on every node, raced it:
    # a node could take the old map back, and the second put met MOVED again, once in a CI run)
    target.client().execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", owner_id)
    owner.client().execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", target_id)
    for s in [target, owner] + [s for s in redis_cluster.servers if s not in (target, owner)]:
        s.client().execute_command("CLUSTER", "SETSLOT", slot, "NODE", target_id)
    assert t.put([k], [b]) == [False]  # the old owner answers MOVED
    assert t.stats["errors_put"] == 1 and t.available
    assert t.put([k], [b]) == [True]  # the slot map was read again
    assert redis_cluster.node_of(t.redis_key(k)) is target
    out = outs_for(1, 4096)
    assert t.get([k], out) == [True] and np.array_equal(out[0], b)
    rc.close()


def test_cluster_master_killed(redis_launcher):
    c = redis_launcher.cluster(password="pw-c")
    keys, blocks = keys_and_blocks(48, bb=4096, seed=3)
    t = tier_for(c, bb=4096, timeout_ms=300)
    # the first connection to a cluster just started can take past 300 ms on a loaded 2-core
    # machine (a fresh clone's CI: "Timeout connecting to server", then a backoff): stored once it answers
    deadline = time.monotonic() + 10
    while t.put(keys, blocks) != [True] * 48:
        assert time.monotonic() < deadline, t.stats
        time.sleep(0.1)
    dead = c.servers[0]
    on_dead = [c.node_of(t.redis_key(k)) is dead for k in keys]
    assert 0 < sum(on_dead) < 48
    dead.kill()
    t0 = time.monotonic()
    oks = t.get(keys, outs_for(48, 4096))
    assert time.monotonic() - t0 < 1.5
    # the masters still up answered (the cluster has not marked the dead one failed yet)
    assert oks == [not d for d in on_dead] and not t.available
    assert t.exists(keys) == [False] * 48  # in backoff
    dead.restart()
    c.wait_ok()
    deadline = time.monotonic() + 5
    while t.put(keys, blocks) != [True] * 48:
        assert time.monotonic() < deadline, t.stats
        time.sleep(0.05)
    assert t.get(keys, outs_for(48, 4096)) == [True] * 48


def test_concurrent_writers_never_serve_a_wrong_block(redis_single):
    keys, blocks = keys_and_blocks(32, bb=16384, seed=4)
    ns = os.urandom(16)
    writers = [tier_for(redis_single, bb=16384, namespace=ns) for _ in range(2)]
    reader = tier_for(redis_single, bb=16384, namespace=ns)
    stop = threading.Event()
    seen = {"hits": 0, "reads": 0, "wrong": 0}

    def write(t):
        while not stop.is_set():
            t.put(keys, blocks)
            t.remove(keys[::3])  # an eviction now and then

    def read():
        while not stop.is_set():
            outs = [np.full(16384, 0xEE, np.uint8) for _ in keys]
            oks = reader.get(keys, outs)
            seen["reads"] += 1
            seen["hits"] += sum(oks)
            seen["wrong"] += sum(ok and not np.array_equal(o, b) for ok, o, b in zip(oks, outs, blocks))

    threads = [threading.Thread(target=write, args=(w,)) for w in writers] + [threading.Thread(target=read)]
    for th in threads:
        th.start()
    time.sleep(1.5)
    stop.set()
    for th in threads:
        th.join()
    assert seen["wrong"] == 0 and seen["hits"] > 0 and seen["reads"] > 5
    assert reader.stats["corrupt"] == 0 and all(w.stats["errors_put"] == 0 for w in writers)


@pytest.mark.parametrize("where", ["single", "cluster"])
def test_scan_lists_namespaces(where, redis_single, redis_cluster):
    srv = redis_single if where == "single" else redis_cluster
    ns_a, ns_b = os.urandom(16), os.urandom(16)
    ka, ba = keys_and_blocks(20, bb=4096, seed=5)
    kb, bb_ = keys_and_blocks(7, bb=4096, seed=6)
    tier_for(srv, bb=4096, namespace=ns_a).put(ka, ba)
    tier_for(srv, bb=4096, namespace=ns_b).put(kb, bb_)
    t = tier_for(srv, bb=4096)
    got = list(t.scan(ns_a))
    assert sorted(got) == sorted((ns_a, k, ff.HEADER_CORE + 4096) for k in ka)
    every = {(ns, k) for ns, k, _ in t.scan()}
    assert {(ns_a, k) for k in ka} | {(ns_b, k) for k in kb} <= every
    assert len(list(t.scan(ns_b, limit=3))) == 3


@pytest.mark.parametrize("codec_name", ["zstd", "int8+zstd"])
@pytest.mark.parametrize("where", ["single", "cluster"])
def test_codecs_round_trip(codec_name, where, redis_single, redis_cluster):
    srv = redis_single if where == "single" else redis_cluster
    bb = 16384
    rng = np.random.default_rng(8)
    raw = [(rng.standard_normal(bb // 2) * 0.1).astype(np.float16).view(np.uint8) for _ in range(8)]
    keys = [rng.bytes(16) for _ in raw]
    codec = make_codec(codec_name, Geometry(bb, "float16", 64))
    t = tier_for(srv, bb=bb, codec=codec)
    assert t.put(keys, raw) == [True] * 8
    outs = outs_for(8, bb)
    assert t.get(keys, outs) == [True] * 8
    stored = t.stats["bytes_written"] / 8
    assert stored < bb  # what went over the wire is the encoding
    for r, o in zip(raw, outs):
        enc = np.empty(codec.encoded_bytes, np.uint8)
        expect = np.empty(bb, np.uint8)
        codec.decode(enc, codec.encode(r, enc), expect)
        assert np.array_equal(o, expect)  # exactly what the codec gives locally
        if codec_name == "zstd":
            assert np.array_equal(o, r)
        else:
            err = np.abs(o.view(np.float16).astype(np.float32) - r.view(np.float16).astype(np.float32))
            assert err.max() <= np.abs(r.view(np.float16).astype(np.float32)).max() / 100
    # a tier without the codec never serves the encoded bytes
    plain = tier_for(srv, bb=bb, namespace=t.namespace)
    assert plain.get(keys[:1], outs_for(1, bb)) == [False] and plain.corrupt_reasons == {"codec": 1}


def test_a_refused_key_is_held_absent_until_stored_or_the_hold_ends():
    """Presence: a key whose value a read refused and kept is absent for ``refused_s`` whatever
    Redis says (so lookups stop promising a block whose every load fails), at once present again
    when this engine stores it, and asked again once the hold ends."""
    from kvstore.tiers.redis.presence import Presence

    clock = FakeClock()
    p = Presence(clock, refused_s=60.0, probe=4)
    keys = [bytes([i]) * 16 for i in range(4)]
    asked = []

    def ask(ks):
        asked.append(len(ks))
        return [True] * len(ks)

    p.refused(keys[2:3])
    assert p.walk(keys, ask) == 2 and p.unheld(keys, [True] * 4) == [True, True, False, True]
    clock.advance(30)
    assert p.walk(keys, ask) == 2
    p.stored(keys[2:3])
    assert p.walk(keys, ask) == 4 and p.unheld(keys, [True] * 4) == [True] * 4
    p.refused(keys[:1])
    clock.advance(60.5)
    assert p.walk(keys, ask) == 4 and asked[-1] == 4  # the hold ended: Redis is asked again
