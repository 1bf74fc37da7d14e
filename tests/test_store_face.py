"""The store face the mover uses, one contract for the embedded store and the node client.

The connector drives its store through a few calls (kvstore.offload.client, kvstore.offload.runner):
contains_prefix for the scheduler's lookup; begin_store, write the views, end_store for a save;
pin_load, read_load, read the views, end_load for a load; prefetch, stats, flush, close. In
``mode: embedded`` the store is a :class:`~kvstore.store.KVStore` in the engine's process; in
``mode: node`` it is a :class:`~kvstore.node.client.NodeStore` whose views are slots of a node
daemon's DRAM slab. The connector cannot tell which it has, so both must keep the same promises:
stored bytes read back identical, a lookup finds the leading stored blocks, a block held or being
written is not written again, an abort (whole or per key) publishes nothing it did not say was
written, a pinned block is never evicted, and a closed store serves nothing.

Every test runs against both, each over DRAM (8 slots, no headroom: evictions are exact) and NVMe
(write-back) in tmp_path; the node daemon runs in this process. ``engine_share`` is 1.0: this suite
is about the face, not about one engine's share of a daemon (tests/test_node.py).
"""

from __future__ import annotations

import time
import uuid

import numpy as np
import pytest

from conftest import FP, blocks_for, dram_gb, make_keys, nvme_gb
from kvstore.config import from_dict
from kvstore.node.client import NodeStore, NodeUnavailable
from kvstore.node.daemon import NodeDaemon
from kvstore.store import KVStore
from test_node import load

BB = 64 << 10  # a block
DRAM = 8  # slots


@pytest.fixture(params=["embedded", "node"])
def face(request, tmp_path):
    cfg = from_dict({"tiers": {"dram": {"capacity_gb": dram_gb(DRAM, BB), "pin_memory": False, "headroom_blocks": 0},
                               "nvme": {"path": str(tmp_path / "nvme"), "capacity_gb": nvme_gb(256, BB),
                                        "header": "inline"}},
                     "mode": request.param, "node": {"name": f"t-{uuid.uuid4().hex[:12]}", "engine_share": 1.0}})
    daemon = NodeDaemon(cfg).start() if request.param == "node" else None
    s = (KVStore if daemon is None else NodeStore)(cfg, block_bytes=BB, fingerprint=FP, block_tokens=FP.block_size)
    s.kind = request.param
    yield s
    s.close(persist=False)
    if daemon is not None:
        daemon.close(persist=False)


def store(s, keys, data, ok=True) -> tuple[list[bool], int]:
    """The mover's save: (which keys got a view, what end_store said was stored)."""
    h = s.begin_store(keys)
    for v, x in zip(h.views, data):
        if v is not None:
            v[:] = x
    return [v is not None for v in h.views], s.end_store(h, ok)


def same(got, data) -> bool:
    return len(got) == len(data) and all(np.array_equal(g, x) for g, x in zip(got, data))


def tiers(s, keys) -> tuple[str, ...]:
    return s.contains_prefix(keys, record=False).tiers


def press_until(s, cond, batch: int, what: str, timeout: float = 20.0) -> int:
    """Store fresh blocks, ``batch`` at a time, until ``cond()``: eviction pressure. A victim keeps
    its slot until written down (in the background: the daemon's in node mode), so it takes rounds.
    Returns the blocks stored."""
    t, n, seed = time.monotonic(), 0, 1000
    while not cond():
        assert time.monotonic() - t < timeout, what
        keys = make_keys(batch, seed=seed)
        n += store(s, keys, blocks_for(keys, BB))[1]
        s.flush()
        seed += 1
        time.sleep(0.01)
    return n


def test_stored_blocks_read_back_identical_and_a_lookup_finds_the_leading_ones(face):
    keys = make_keys(6)
    data = blocks_for(keys, BB)
    assert store(face, keys[:3], data[:3]) == ([True] * 3, 3)
    assert store(face, keys[4:5], data[4:5]) == ([True], 1)
    assert face.contains_prefix(keys, record=False) == (3, ("dram",) * 3, "diverged")  # the gap stops it
    assert face.contains_prefix(keys[4:], record=False).num_blocks == 1
    assert same(load(face, keys), data[:3])
    assert same(load(face, keys[4:]), data[4:5])


def test_a_block_held_or_being_written_is_not_written_again(face):
    keys = make_keys(4)
    data = blocks_for(keys, BB)
    assert store(face, keys[:2], data[:2]) == ([True] * 2, 2)
    writing = face.begin_store(keys[2:3])
    assert store(face, keys, data) == ([False, False, False, True], 1)  # held: 0 and 1; being written: 2
    assert face.end_store(writing, False) == 0
    assert store(face, keys, data) == ([False, False, True, False], 1)
    assert same(load(face, keys), data)


def test_an_aborted_store_leaves_nothing_and_the_keys_can_be_stored_again(face):
    keys = make_keys(4)
    data = blocks_for(keys, BB)
    assert store(face, keys, np.full_like(data, 0xAB), ok=False) == ([True] * 4, 0)
    assert face.contains_prefix(keys, record=False) == (0, (), "never_stored")
    assert load(face, keys) == []
    assert store(face, keys, data) == ([True] * 4, 4)
    assert same(load(face, keys), data)


def test_per_key_results_store_only_the_blocks_said_written(face):
    keys = make_keys(4)
    data = blocks_for(keys, BB)
    assert store(face, keys, data, ok=[True, False, True, True]) == ([True] * 4, 3)
    assert face.contains_prefix(keys, record=False).num_blocks == 1  # the prefix stops at the first False
    assert face.contains_prefix(keys[2:], record=False).num_blocks == 2
    assert store(face, keys, data) == ([False, True, False, False], 1)
    assert same(load(face, keys), data)


def test_a_handle_ends_once(face):
    keys = make_keys(2)
    h = face.begin_store(keys)
    face.end_store(h, False)
    with pytest.raises(RuntimeError):
        face.end_store(h, True)
    assert face.contains_prefix(keys, record=False).num_blocks == 0  # the second end published nothing
    store(face, keys, blocks_for(keys, BB))
    h = face.pin_load(keys)
    face.end_load(h)
    with pytest.raises(RuntimeError):
        face.read_load(h)
    with pytest.raises(RuntimeError):
        face.end_load(h)


def test_a_pinned_block_survives_eviction_and_can_go_once_unpinned(face):
    keys = make_keys(2)
    data = blocks_for(keys, BB)
    store(face, keys, data)
    h = face.pin_load(keys)
    assert face.read_load(h) == 2
    first = make_keys(6, seed=1000)  # press_until's first batch: evicted once the pressure cycled DRAM
    press_until(face, lambda: "nvme" in tiers(face, first), 6, "no eviction pressure")
    assert tiers(face, keys) == ("dram", "dram") and same(h.views[:2], data)
    face.end_load(h)
    press_until(face, lambda: tiers(face, keys) == ("nvme", "nvme"), 6, "an unpinned block was never evicted")
    t = time.monotonic()  # read back from NVMe (node: into slab slots, free once the victims are written)
    while len(got := load(face, keys)) < 2 and time.monotonic() - t < 10:
        assert same(got, data[:len(got)])
        time.sleep(0.01)
    assert same(got, data)


def test_two_loads_of_the_same_blocks_each_read_them_and_each_pins_them(face):
    keys = make_keys(3)
    data = blocks_for(keys, BB)
    store(face, keys, data)
    h1, h2 = face.pin_load(keys), face.pin_load(keys)
    assert face.read_load(h1) == 3 and face.read_load(h2) == 3
    assert same(h1.views[:3], data) and same(h2.views[:3], data)
    face.end_load(h1)  # h2 still pins them
    first = make_keys(5, seed=1000)
    press_until(face, lambda: "nvme" in tiers(face, first), 5, "no eviction pressure")
    assert tiers(face, keys) == ("dram",) * 3 and same(h2.views[:3], data)
    face.end_load(h2)


def test_prefetch_brings_lower_tier_blocks_up(face):
    keys = make_keys(2)
    data = blocks_for(keys, BB)
    store(face, keys, data)
    press_until(face, lambda: tiers(face, keys) == ("nvme", "nvme"), 6, "never evicted")
    t = time.monotonic()  # promoted into free slots: once the victims its first try made are written down
    while tiers(face, keys) != ("dram", "dram"):
        assert time.monotonic() - t < 10, "never promoted"
        assert isinstance(face.prefetch(keys).result(timeout=10), int)
        time.sleep(0.01)
    assert same(load(face, keys), data)


def test_a_closed_store_finds_and_stores_nothing(face):
    keys = make_keys(2)
    store(face, keys, blocks_for(keys, BB))
    face.close()
    # KVStore refuses every call (RuntimeError); NodeStore's lookups and pins raise NodeUnavailable
    # (the planner's miss) and its stores are skipped (no views), as for a daemon that is down
    refused = RuntimeError if face.kind == "embedded" else NodeUnavailable
    with pytest.raises(refused):
        face.contains_prefix(keys, record=False)
    with pytest.raises(refused):
        face.pin_load(keys)
    if face.kind == "embedded":
        with pytest.raises(RuntimeError):
            face.begin_store(keys)
    else:
        h = face.begin_store(make_keys(2, seed=1))
        assert h.views == [None, None] and face.end_store(h, True) == 0
    face.close()  # again: nothing


def test_stats_count_the_blocks_of_each_tier(face):
    keys = make_keys(3)
    store(face, keys, blocks_for(keys, BB))
    st = face.stats()
    assert isinstance(st, dict) and st["tiers"]["dram"]["blocks"] == 3 and st["tiers"]["nvme"]["blocks"] == 0
