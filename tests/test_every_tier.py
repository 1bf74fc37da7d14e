"""The Tier contract (kvstore.tiers.base) over every medium: DRAM, NVMe, Redis (a real server), a
shared file system's folder,
and the tuner's NoBytesTier for the parts that do not read bytes back.

Exactly the calls the chain makes (kvstore.store.chain): begin_reserve / attach / write_many /
commit for a store, leading / holds for a lookup, acquire / read_many / release for a load. The
local tiers' own index rules (capacity, TTL, pins, policies) are tests/test_tiers_contract.py's;
these are what every tier promises, the shared one included: stored bytes read back identical, a
lookup finds the leading stored blocks, a repeated key is written once, an aborted write leaves
nothing, and a read that fails (damaged data) is a miss from then on, never served.
"""

from __future__ import annotations

import math
import time

import numpy as np
import pytest

from kvstore.tiers.dram import DramTier
from kvstore.tiers.nvme import NvmeTier
from kvstore.tiers.fileformat import round_up
from kvstore.tiers.nobytes import NoBytesTier
from kvstore.tiers.redis import RedisTier
from kvstore.tiers.redis.client import RedisClient
from kvstore.tiers.redis.presence import Presence
from kvstore.tiers.sharedfs import SharedFsTier

from conftest import BLOCK, block_for, one_key
from redis_servers import redis_single  # noqa: F401

KINDS = ["dram", "nvme", "redis", "sharedfs", "nobytes"]
SHARED = ("redis", "sharedfs")


@pytest.fixture(params=KINDS)
def tier(request, tmp_path, clock, monkeypatch):
    kind = request.param
    if kind == "dram":
        t = DramTier(capacity_bytes=16 * round_up(BLOCK), ttl_s=None, policy="lru", block_bytes=BLOCK,
                     clock=clock, pin=False)
    elif kind == "nvme":
        t = NvmeTier(path=tmp_path / "nv", namespace=bytes(range(16)), capacity_bytes=1 << 30, ttl_s=None,
                     policy="lru", block_bytes=BLOCK, header="inline", clock=clock)
    elif kind == "redis":
        srv = request.getfixturevalue("redis_single")
        client = RedisClient(url=srv.url, cluster=False, namespace=bytes(16 * [7]), block_bytes=BLOCK, ttl_s=60.0,
                             timeout_ms=2000, password=srv.password)
        t = RedisTier(client, Presence(time.monotonic, ttl_s=0.0), BLOCK)
    elif kind == "sharedfs":
        t = SharedFsTier(path=str(tmp_path / "sfs"), namespace=bytes(range(16)), block_bytes=BLOCK,
                         capacity_bytes=1 << 30, ttl_s=None, clock=clock, sweep=False)
    else:
        t = NoBytesTier("nobytes", capacity_bytes=1 << 30, ttl_s=None, policy="lru", entry_bytes=BLOCK, clock=clock)
    t.kind = kind
    yield t
    t.close()


def store(t, keys, blocks) -> list[bool]:
    """The chain's store into a tier without slots: reserve, write, commit."""
    res = t.attach(t.begin_reserve(keys))
    assert not res.victims
    idx = [i for i, e in enumerate(res) if e is not None]
    oks = t.write_many([res[i] for i in idx], [blocks[i] for i in idx])
    t.commit([res[i] for i in idx], oks)
    out = [False] * len(keys)
    for i, ok in zip(idx, oks):
        out[i] = ok
    return out


def load(t, keys) -> list[np.ndarray | None]:
    """The chain's load: acquire the keys a lookup found, read them, release (failed reads drop)."""
    entries = t.acquire(keys, touch=False)
    got = [i for i, e in enumerate(entries) if e is not None]
    outs = [np.zeros(BLOCK, np.uint8) for _ in got]
    oks = t.read_many([entries[i] for i in got], outs)
    t.release([entries[i] for i in got], oks)
    out = [None] * len(keys)
    for i, o, ok in zip(got, outs, oks):
        out[i] = o if ok else None
    return out


def test_stored_blocks_read_back_identical_and_a_lookup_finds_the_prefix(tier):
    keys = [one_key(i) for i in range(5)]
    assert store(tier, keys[:3], [block_for(k) for k in keys[:3]]) == [True] * 3
    assert tier.leading(keys) == 3 and tier.leading(keys[3:]) == 0
    assert tier.holds(keys) == [True, True, True, False, False]
    if tier.kind == "nobytes":
        return  # holds no bytes: nothing to read back
    got = load(tier, keys[:3])
    assert all(np.array_equal(g, block_for(k)) for g, k in zip(got, keys[:3]))


def test_a_repeated_key_is_written_once_and_an_abort_leaves_nothing(tier):
    k, j = one_key(10), one_key(11)
    res = tier.begin_reserve([k, k])
    assert res[0] is not None and res[1] is None  # a repeated key is reserved once
    tier.abort(tier.attach(res))
    assert tier.leading([k]) == 0 and not tier.holds([k])[0]
    assert store(tier, [j], [block_for(j)]) == [True] and tier.leading([j]) == 1


def test_damaged_data_is_a_miss_from_then_on(tier):
    if tier.kind == "nobytes":
        pytest.skip("holds no bytes to damage")
    keys = [one_key(20 + i) for i in range(3)]
    store(tier, keys, [block_for(k) for k in keys])
    if tier.kind == "dram":
        pytest.skip("memory cannot be damaged from outside the process")
    if tier.kind in ("nvme", "sharedfs"):
        with open(tier.path_of(keys[1]), "r+b") as f:
            f.seek(-1, 2)
            b = f.read(1)
            f.seek(-1, 2)
            f.write(bytes([b[0] ^ 0xFF]))
    else:
        c = tier.client._connect()
        name = tier.client.redis_key(keys[1])
        v = bytearray(c.get(name))
        v[-1] ^= 0xFF
        c.set(name, bytes(v))
    got = load(tier, keys)
    assert got[1] is None and got[0] is not None and got[2] is not None  # never served
    assert tier.leading(keys) == 1 and not tier.holds([keys[1]])[0]  # gone: the next lookup misses it
    assert sum(tier.corrupt_reasons.values()) >= 1  # counted
    assert store(tier, keys[1:2], [block_for(keys[1])]) == [True]  # and storable again
    assert np.array_equal(load(tier, keys[1:2])[0], block_for(keys[1]))


def test_shared_and_local_tiers_say_which_they_are(tier):
    assert tier.shared == (tier.kind in SHARED)
    assert tier.addressable == (tier.kind == "dram")
    assert (tier.ttl is None) == (tier.kind != "redis") and (tier.ttl is None or math.isfinite(tier.ttl))
