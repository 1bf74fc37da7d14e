"""One contract through the store's public API, over every medium it can keep blocks in: DRAM (+NVMe
below it), NVMe alone, and the remote tier alone on a real Redis (a password-protected single
server and a 3-master cluster). The tier-level contract (tests/test_tiers_contract.py) covers the
local tiers' index rules (capacity, TTL, pins); Redis keeps its own index, so for the remote tier
the contract is this one: what is stored reads back byte-identical, a prefix stops at the first
missing block, present and repeated keys are not stored twice, damaged data is a counted miss."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.config import from_dict
from kvstore.keys import ModelFingerprint
from kvstore.store import KVStore

from conftest import BLOCK, blocks_for, dram_gb, make_keys, nvme_gb
from redis_servers import redis_cluster, redis_single  # noqa: F401

FP = ModelFingerprint(model="media-contract", block_size=16)
MEDIA = ["dram+nvme", "nvme", "remote", "remote-cluster"]


@pytest.fixture(params=MEDIA)
def store(request, tmp_path, monkeypatch):
    kind = request.param
    tiers = {"dram": {"capacity_gb": 0}, "nvme": {"capacity_gb": 0}}
    if kind == "dram+nvme":
        tiers = {"dram": {"capacity_gb": dram_gb(64), "pin_memory": False},
                 "nvme": {"path": str(tmp_path / "nv"), "capacity_gb": nvme_gb(64)}}
    elif kind == "nvme":
        tiers["nvme"] = {"path": str(tmp_path / "nv"), "capacity_gb": nvme_gb(64), "header": "inline"}
    else:
        srv = request.getfixturevalue("redis_single" if kind == "remote" else "redis_cluster")
        monkeypatch.setenv("KVSTORE_REDIS_PASSWORD", srv.password or "")
        tiers["remote"] = {"url": srv.url, "cluster": kind == "remote-cluster", "timeout_ms": 1000}
    # a fresh model per test: the cluster is shared by the module
    fp = ModelFingerprint(model=f"media-contract-{request.node.name}", block_size=16)
    s = KVStore(from_dict({"tiers": tiers}), block_bytes=BLOCK, fingerprint=fp, block_tokens=16)
    s.kind = kind
    yield s
    s.close(persist=False)


def test_round_trip_byte_identical(store):
    keys = make_keys(8, seed=1)
    assert store.put(keys, blocks_for(keys)) == 8
    store.flush()
    m = store.contains_prefix(keys)
    assert m.num_blocks == 8 and m.miss_reason is None
    out = np.zeros((8, BLOCK), np.uint8)
    assert store.get(keys, out) == 8 and np.array_equal(out, blocks_for(keys))


def test_missing_keys_are_a_never_stored_miss(store):
    keys = make_keys(3, seed=2)
    assert store.contains_prefix(keys) == (0, (), "never_stored")
    assert store.get(keys, np.zeros((3, BLOCK), np.uint8)) == 0


def test_a_prefix_stops_at_the_first_missing_block(store):
    keys = make_keys(6, seed=3)
    store.put(keys[:3], blocks_for(keys[:3]))
    store.put(keys[4:], blocks_for(keys[4:]))
    store.flush()
    assert store.contains_prefix(keys).num_blocks == 3
    out = np.zeros((6, BLOCK), np.uint8)
    assert store.get(keys, out) == 3 and np.array_equal(out[:3], blocks_for(keys[:3]))


def test_present_and_repeated_keys_are_stored_once(store):
    keys = make_keys(4, seed=4)
    assert store.put(keys[:2], blocks_for(keys[:2])) == 2
    store.flush()
    batch = [keys[0], keys[2], keys[2], keys[3]]
    assert store.put(batch, blocks_for(batch)) == 2  # keys[0] present; keys[2] once
    store.flush()
    out = np.zeros((4, BLOCK), np.uint8)
    assert store.get(keys, out) == 4 and np.array_equal(out, blocks_for(keys))


def _damage(store, key) -> None:
    """Flip one payload byte of the stored block, from outside the store."""
    if store.kind.startswith("remote"):
        r = store.remote.client
        c = r._connect()
        name = r.redis_key(key)
        v = bytearray(c.get(name))
        v[-1] ^= 0xFF
        c.set(name, bytes(v))
    else:
        p = store.nvme.path_of(key)
        with open(p, "r+b") as f:
            f.seek(-1, 2)
            b = f.read(1)
            f.seek(-1, 2)
            f.write(bytes([b[0] ^ 0xFF]))


@pytest.mark.parametrize("store", ["nvme", "remote", "remote-cluster"], indirect=True)  # DRAM: in-process only
def test_damaged_data_is_a_counted_miss_never_served(store):
    keys = make_keys(3, seed=5)
    store.put(keys, blocks_for(keys))
    store.flush()
    _damage(store, keys[1])
    out = np.zeros((3, BLOCK), np.uint8)
    assert store.get(keys, out) == 1 and np.array_equal(out[0], blocks_for(keys[:1])[0])
    tier = "remote" if store.kind.startswith("remote") else "nvme"
    assert sum(s.value for fam in store.metrics.registry.collect() for s in fam.samples
               if s.name == "kvstore_corrupt_files_total" and s.labels["tier"] == tier) == 1
    assert store.contains_prefix(keys).num_blocks == 1  # dropped: the next request recomputes it
