"""The store's side of the KV events (issue 32, kvstore.store.events): what each tier's index says
became servable or left, with the engine's names of the blocks, and what a restart's scan found in
the block files. vLLM's side: tests/test_vllm_events.py."""

from __future__ import annotations

import os

import pytest

from kvstore.store import KVStore
from kvstore.store.events import REMOVED, STORED, BlockMeta
from kvstore.tiers import fileformat as ff

from conftest import BLOCK, FP, FakeClock, blocks_for, make_keys, tiny_config
from redis_servers import redis_single  # noqa: F401


def meta(i: int, parent: int | None = None) -> BlockMeta:
    return BlockMeta(bytes([i]) * 32, None if parent is None else bytes([parent]) * 32, tuple(range(i, i + 16)),
                     0, None, None, (("salt-x",) if i % 2 else None))


def open_store(path, clock, *, events=True, header="inline", **kw) -> KVStore:
    cfg = tiny_config(path, header=header, **kw)
    return KVStore(cfg, block_bytes=BLOCK, fingerprint=FP, block_tokens=FP.block_size, clock=clock, events=events)


def put(store: KVStore, keys, first: int = 0) -> None:
    store.events.remember(keys, [meta(first + i, first + i - 1 if first + i else None) for i in range(len(keys))])
    store.put(keys, blocks_for(keys))
    store.flush()


def records(store: KVStore) -> set[tuple[bool, str, int]]:
    return {(s, t, m.block_hash[0]) for s, t, m in store.take_events()}


def test_meta_round_trip_and_frames():
    m = BlockMeta(b"\x01" * 32, None, (1, 2, 70000), 3, 7, "lora-a", ("salt", ("mm-id", 4)))
    assert BlockMeta.decode(m.encode()) == m
    key, other = make_keys(2)
    framed = ff.pack_meta(m.encode(), key)
    assert ff.unpack_meta(framed, key) == m.encode()
    assert ff.unpack_meta(framed, other) is None  # a recycled file's metadata never passes for another key's
    assert ff.unpack_meta(framed[:-1] + bytes([framed[-1] ^ 1]), key) is None
    assert ff.unpack_meta(bytes(64), key) is None  # a file written without it
    assert ff.pack_meta(b"x" * (ff.META_MAX + 1), key) == b""  # too long: not kept


@pytest.mark.parametrize("header", ["inline", "xattr"])
def test_stored_evicted_demoted_expired_and_found_after_a_restart(tmp_path, header):
    clock = FakeClock()
    path = tmp_path / "c"
    keys, later = make_keys(8), make_keys(4, seed=1)
    s = open_store(path, clock, header=header, dram_blocks=4, nvme_blocks=16, nvme_ttl=100.0)
    try:
        put(s, keys[:4])
        assert records(s) == {(STORED, "dram", i) for i in range(4)}
        put(s, keys[4:], first=4)  # DRAM holds 4: the first four are demoted (the rest, no slot free: NVMe)
        assert records(s) == {(REMOVED, "dram", i) for i in range(4)} | {(STORED, "nvme", i) for i in range(8)}
        assert records(s) == set()
        clock.advance(101)  # past NVMe's TTL, no lookup: a take starts the sweep (on the I/O pool), it or
        got = records(s)  # a later one reports what it removed
        s.flush()
        assert got | records(s) == {(REMOVED, "nvme", i) for i in range(8)}
        put(s, later, first=20)
        assert records(s) == {(STORED, "dram", i) for i in range(20, 24)}
    finally:
        s.close()  # write-back: DRAM's blocks go down to NVMe, with their metadata
    s = open_store(path, clock, header=header, dram_blocks=4, nvme_blocks=16, nvme_ttl=100.0)
    try:
        found = {m.block_hash[0]: m for st, t, m in s.take_events() if st and t == "nvme"}
        assert set(found) == set(range(20, 24))
        assert all(found[i] == meta(i, i - 1) for i in range(20, 24))
    finally:
        s.close()
    s = open_store(path, clock, header=header, events=False, dram_blocks=4, nvme_blocks=16, nvme_ttl=100.0)
    try:
        assert s.events is None and s.take_events() == [] and s.nvme.scanned_meta is None
    finally:
        s.close()


def test_damaged_files(tmp_path):
    """A bad payload is announced removed when a read finds it; bad metadata is served, not announced."""
    clock = FakeClock()
    path = tmp_path / "c"
    keys = make_keys(3)
    s = open_store(path, clock, dram_blocks=0, nvme_blocks=16)
    try:
        put(s, keys)
        assert records(s) == {(STORED, "nvme", i) for i in range(3)}
        f = s.nvme.path_of(keys[2])
        with open(f, "r+b") as fh:  # a payload byte
            fh.seek(ff.HEADER_BYTES + 10)
            b = fh.read(1)
            fh.seek(-1, os.SEEK_CUR)
            fh.write(bytes([b[0] ^ 0xFF]))
        f = s.nvme.path_of(keys[1])
        with open(f, "r+b") as fh:  # a metadata byte (not the header's)
            fh.seek(ff.META_OFFSET + 20)
            b = fh.read(1)
            fh.seek(-1, os.SEEK_CUR)
            fh.write(bytes([b[0] ^ 0xFF]))
        out = blocks_for(keys) * 0
        assert s.get(keys, out) == 2  # block 2 fails its checksum: a miss
        assert records(s) == {(REMOVED, "nvme", 2)}
    finally:
        s.close()
    s = open_store(path, clock, dram_blocks=0, nvme_blocks=16)
    try:
        assert records(s) == {(STORED, "nvme", 0)}  # block 1: served, its metadata is bad
        assert s.contains_prefix(keys, record=False).num_blocks == 2
    finally:
        s.close()


def test_remote_tier_only_when_asked(tmp_path, redis_single, monkeypatch):  # noqa: F811
    """Redis announces what this engine wrote, and what a read found gone; it is off by default."""
    from kvstore.config import from_dict

    from conftest import dram_gb

    monkeypatch.setenv("KVSTORE_REDIS_PASSWORD", redis_single.password or "")
    keys = make_keys(4, seed=7)

    def store(medium):
        cfg = from_dict({"tiers": {"dram": {"capacity_gb": dram_gb(8), "pin_memory": False},
                                   "nvme": {"capacity_gb": 0},
                                   "remote": {"url": redis_single.url, "timeout_ms": 500}},
                         "events": {"remote": {"medium": medium}}})
        return KVStore(cfg, block_bytes=BLOCK, fingerprint=FP, block_tokens=16, clock=FakeClock(), events=True)

    s = store(None)
    try:
        put(s, keys)
        assert records(s) == {(STORED, "dram", i) for i in range(4)}
    finally:
        s.close()
    s = store("storage")
    try:
        put(s, keys[:2], first=10)  # (already in Redis: written again, announced again)
        assert records(s) == {(STORED, t, i) for t in ("dram", "remote") for i in (10, 11)}
        evs = [(st, t) for st, t, m in s.take_events()]
        assert evs == []
        redis_single.client().delete(s.remote.client.redis_key(keys[1]))
        s.dram.remove(keys[:2])  # DRAM forgets them: the next read goes to Redis
        out = blocks_for(keys) * 0
        assert s.get(keys[:2], out[:2]) == 1
        assert (REMOVED, "remote", 11) in records(s)
    finally:
        s.close()


@pytest.mark.parametrize("announced", ["dram", "dram,nvme"])
def test_metadata_goes_with_the_last_copy_even_from_a_tier_not_announced(tmp_path, announced):
    """A block demoted from DRAM (announced) into NVMe, then evicted there: its metadata must go
    then, announced or not. With NVMe not announced, the NVMe eviction journaled nothing and the
    metadata of every block that ever passed through NVMe stayed (found by an audit of what grows)."""
    from kvstore.config import from_dict, merge

    media = {"dram": {"medium": "CPU"}, "nvme": {"medium": "STORAGE" if "nvme" in announced else None}}
    cfg = from_dict(merge(tiny_config(tmp_path / "c", dram_blocks=4, nvme_blocks=8).to_dict(), {"events": media}))
    s = KVStore(cfg, block_bytes=BLOCK, fingerprint=FP, block_tokens=FP.block_size, clock=FakeClock(), events=True)
    try:
        for r in range(40):  # 160 blocks through 4 + 8 slots
            keys = make_keys(4, seed=100 + r)
            put(s, keys, first=(4 * r) % 200)
            s.take_events()
        for _ in range(3):
            s.take_events()
        held = {k for t in s.events.all for k in t.index.entries}
        assert len(held) <= 12 and set(s.events.meta) <= held, (len(s.events.meta), len(held))
    finally:
        s.close()


def test_metadata_of_a_demotion_that_fails_after_the_check_goes_too(tmp_path):
    """A key still being written down (WRITING) when its removal is checked is looked at again: a
    write that then fails is aborted, which journals nothing."""
    from kvstore.tiers.index import WRITING

    s = open_store(tmp_path / "c", FakeClock(), dram_blocks=4, nvme_blocks=8)
    try:
        keys = make_keys(4, seed=7)
        put(s, keys)
        s.take_events()
        k = keys[0]
        idx = s.nvme.index
        with s.nvme.lock:  # as a demotion in flight: a WRITING entry in NVMe, gone from DRAM
            e, _ = idx.reserve(k, BLOCK, s.clock())
        with s.dram.lock:
            s.dram.index.remove(k)
        for _ in range(3):  # the removal's record, then its check two takes later: k is held only as
            s.take_events()  # WRITING, so it is kept in view
        assert k in s.events.meta and idx.entries[k].state == WRITING
        with s.nvme.lock:
            idx.abort(e)  # the write failed
        for _ in range(3):
            s.take_events()
        assert k not in s.events.meta
    finally:
        s.close()
