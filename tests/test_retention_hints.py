"""Retention hints in the store (issue 17 item 3): a request's ``ttl_s`` is the idle TTL of
the blocks it stores, in DRAM, on NVMe after a demotion, and in Redis; on a hit it lengthens the
TTL of the blocks served (never shortens it); a promoted block keeps it; a bad value is a clear
error. The connector's side (kv_transfer_params, ``store: false``) is tested with vLLM."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.config import from_dict
from kvstore.store import KVStore

from conftest import BLOCK, FP, FakeClock, blocks_for, dram_gb, make_keys, nvme_gb, tiny_config
from redis_servers import redis_single  # noqa: F401


def _store(tmp_path, clock, **kw) -> KVStore:
    cfg = tiny_config(tmp_path / "nvme", dram_ttl=60, nvme_ttl=60, **kw)
    return KVStore(cfg, block_bytes=BLOCK, fingerprint=FP, block_tokens=FP.block_size, clock=clock)


def _held(s: KVStore, keys) -> int:
    return s.contains_prefix(keys, record=False).num_blocks


def test_a_hinted_store_outlives_the_config_ttl(tmp_path):
    clock = FakeClock()
    s = _store(tmp_path, clock, dram_blocks=8)
    try:
        plain, kept = make_keys(2, seed=1), make_keys(2, seed=2)
        s.put(plain, blocks_for(plain))
        s.put(kept, blocks_for(kept), ttl_s=3600)
        clock.advance(120)
        assert _held(s, plain) == 0 and _held(s, kept) == 2
        clock.advance(3600)
        assert _held(s, kept) == 0
        h = s.begin_store(make_keys(1, seed=3), ttl_s=10)  # a shorter hint for a new block: kept 10 s
        h.views[0][:] = blocks_for(h.keys)[0]
        s.end_store(h)
        clock.advance(11)
        assert _held(s, h.keys) == 0
    finally:
        s.close()


def test_the_hint_goes_down_to_nvme_and_back_up(tmp_path):
    clock = FakeClock()
    s = _store(tmp_path, clock, dram_blocks=2, nvme_blocks=16)
    try:
        kept, plain = make_keys(2, seed=4), make_keys(2, seed=5)
        s.put(kept, blocks_for(kept), ttl_s=3600)
        s.put(plain, blocks_for(plain))  # evicts kept to NVMe (LRU)
        s.flush()
        assert not s.dram.contains(kept[0]) and s.nvme.contains(kept[0])
        clock.advance(30)
        filler = make_keys(2, seed=6)
        s.put(filler, blocks_for(filler))  # plain goes down too
        s.flush()
        clock.advance(100)  # past NVMe's 60 s idle TTL: only the hinted blocks remain
        assert _held(s, kept) == 2 and _held(s, plain) == 0
        out = np.zeros((2, BLOCK), np.uint8)
        assert s.get(kept, out) == 2 and np.array_equal(out, blocks_for(kept))  # promoted into DRAM
        assert s.dram.contains(kept[0])
        clock.advance(120)
        assert s.dram.contains(kept[0])  # the DRAM copy kept the hint
    finally:
        s.close()


def test_a_hit_lengthens_never_shortens(tmp_path):
    clock = FakeClock()
    s = _store(tmp_path, clock, dram_blocks=8)
    try:
        keys = make_keys(3, seed=7)
        s.put(keys, blocks_for(keys))
        s.end_load(s.pin_load(keys, ttl_s=3600))  # an agent's next turn asks to keep them
        clock.advance(600)
        assert _held(s, keys) == 3
        s.end_load(s.pin_load(keys, ttl_s=5))  # a shorter hint does not shorten them
        clock.advance(600)
        assert _held(s, keys) == 3
    finally:
        s.close()


@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf"), "3600", True,
                                 10 ** 400])  # past a float (JSON gives it): was an OverflowError
def test_bad_hints_are_clear_errors(tmp_path, bad):
    s = _store(tmp_path, FakeClock())
    try:
        keys = make_keys(1, seed=8)
        with pytest.raises(ValueError, match="ttl_s"):
            s.put(keys, blocks_for(keys), ttl_s=bad)
        with pytest.raises(ValueError, match="ttl_s"):
            s.pin_load(keys, ttl_s=bad)
        assert _held(s, keys) == 0
    finally:
        s.close()


def test_remote_values_get_the_hint(tmp_path, redis_single, monkeypatch):  # noqa: F811
    monkeypatch.setenv("KVSTORE_REDIS_PASSWORD", redis_single.password)
    cfg = from_dict({"tiers": {"dram": {"capacity_gb": dram_gb(8), "pin_memory": False},
                               "nvme": {"path": str(tmp_path / "n"), "capacity_gb": nvme_gb(8)},
                               "remote": {"url": redis_single.url, "ttl_s": 600}}})
    s = KVStore(cfg, block_bytes=BLOCK, fingerprint=FP, block_tokens=FP.block_size)
    try:
        plain, kept = make_keys(1, seed=9), make_keys(1, seed=10)
        s.put(plain, blocks_for(plain))
        s.put(kept, blocks_for(kept), ttl_s=7200)
        s.flush()
        c = redis_single.client()
        assert 0 < c.pttl(s.remote.client.redis_key(plain[0])) <= 600_000
        assert 600_000 < c.pttl(s.remote.client.redis_key(kept[0])) <= 7_200_000
    finally:
        s.close()
