"""SSD admission: ``tiers.nvme.admit_after`` = N writes a block to NVMe only once N requests asked
for it (the one that stored it, each hit, each later store after it was turned away). Real
stores on temporary folders, step by step; then the simulator against the real store on a
mixed trace (they must agree exactly, NVMe bytes written included)."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore import failpoints
from kvstore.store import placement
from kvstore.config import from_dict, merge
from kvstore.tune import Simulator
from store_replay import replay_store

from conftest import BLOCK, block_for, check_store, one_key, tiny_config
from test_tune import BB, cfg_blocks, mixed_trace  # noqa: F401 (a fixture)

NOT_ADMITTED = {"tier": "nvme", "reason": "not_admitted"}


def M(s, name, **labels):
    return s.metrics.value(name, **labels)


def cfg(path, admit, **kw):
    return from_dict(merge(tiny_config(path, **kw).to_dict(), {"tiers": {"nvme": {"admit_after": admit}}}))


@pytest.fixture(autouse=True)
def _clean_failpoints():
    failpoints.clear()
    yield
    failpoints.clear()


@pytest.fixture
def store(make_store, store_dir, clock):
    """``store(admit_after, **tiny_config kwargs)``: 2 blocks in DRAM over 8 NVMe files, plus a
    headroom slot by default (a store next to a victim being written down always finds one)."""
    def make(admit, **kw):
        kw = {"dram_blocks": 2, "nvme_blocks": 8, "headroom": 1, **kw}
        return make_store(config=cfg(store_dir, admit, **kw))
    return make


def put(s, clock, *keys):
    n = 0
    for k in keys:
        clock.advance(1)
        n += s.put([k], block_for(k)[None])
    s.flush()
    return n


def hit(s, clock, k):
    clock.advance(1)
    out = np.zeros((1, BLOCK), np.uint8)
    assert s.get([k], out, session="other") == 1 and np.array_equal(out[0], block_for(k))


def on_nvme(s, k):
    return s.nvme.contains(k) and s.nvme.path_of(k).exists()


# -- the rules -----------------------------------------------------------------------------------


def test_the_rule_in_placement():
    adm = placement.Admission(2, capacity=2)
    assert adm.active and not adm.admits(1) and adm.admits(2)
    assert not placement.Admission(0).active and not placement.Admission(1).active  # a store is an ask
    adm.turn_away(b"a", 1)
    assert adm.recall(b"a") == 1 and adm.recall(b"a") == 0  # taken by the block's next entry
    for k in (b"a", b"b", b"c"):
        adm.turn_away(k, 1)
    assert len(adm) == 2 and adm.recall(b"a") == 0  # bounded: the oldest forgotten first
    # stale (past NVMe's TTL) and already-lower come first; then admission; then the write
    kw = {"has_lower": True, "lower_holds": False, "lower_ttl": None}
    assert placement.demote_action(0.0, 1.0, **kw, admitted=False) == placement.NOT_ADMITTED
    assert placement.demote_action(0.0, 1.0, **kw) == placement.DEMOTE
    assert placement.demote_action(0.0, 1.0, **{**kw, "lower_holds": True}, admitted=False) == placement.ALREADY_LOWER
    assert placement.demote_action(0.0, 9.0, **{**kw, "lower_ttl": 5.0}, admitted=False) == placement.STALE
    assert placement.gone_reason("not_admitted") == "not_admitted" and "not_admitted" in placement.MISS_REASONS


# -- DRAM over NVMe, write-back ------------------------------------------------------------------


def test_a_block_stored_once_and_never_hit_is_dropped_not_written(store, clock):
    s = store(2)
    a, b, c = (one_key(i) for i in range(3))
    put(s, clock, a, b, c)  # c evicts a (LRU): a has 1 ask (its store) of 2
    assert not on_nvme(s, a) and not s.dram.contains(a)
    assert M(s, "kvstore_tier_skipped_blocks_total", **NOT_ADMITTED) == 1
    assert M(s, "kvstore_demoted_blocks_total") == 0 and M(s, "kvstore_tier_written_bytes_total", tier="nvme") == 0
    m = s.contains_prefix([a])
    assert m.num_blocks == 0 and m.miss_reason == "not_admitted"
    assert M(s, "kvstore_lookup_miss_blocks_total", reason="not_admitted") == 1
    check_store(s)


def test_a_block_stored_again_by_a_later_request_is_written_at_its_next_eviction(store, clock):
    s = store(2)
    a, b, c, d, e = (one_key(i) for i in range(5))
    put(s, clock, a, b, c)  # a turned away (1 ask)
    put(s, clock, a)  # computed again after that miss: 2 asks; b turned away
    put(s, clock, d)  # c turned away
    assert not on_nvme(s, a) and M(s, "kvstore_tier_skipped_blocks_total", **NOT_ADMITTED) == 3
    put(s, clock, e)  # a is the LRU victim now: demoted
    assert on_nvme(s, a) and s.contains_prefix([a]).tiers == ("nvme",)
    assert M(s, "kvstore_demoted_blocks_total") == 1
    assert M(s, "kvstore_tier_written_bytes_total", tier="nvme") == BLOCK
    assert M(s, "kvstore_tier_skipped_blocks_total", **NOT_ADMITTED) == 3
    check_store(s)


def test_a_block_hit_once_is_written(store, clock):
    s = store(2)
    a, b, c = (one_key(i) for i in range(3))
    put(s, clock, a)
    hit(s, clock, a)  # 2 asks: its store and this hit
    put(s, clock, b, c)  # c evicts a
    assert on_nvme(s, a) and M(s, "kvstore_tier_skipped_blocks_total", **NOT_ADMITTED) == 0
    check_store(s)


def test_admit_after_3_carries_the_asks_of_a_turned_away_block(store, clock):
    s = store(3)
    a, b, c, d, e = (one_key(i) for i in range(5))
    put(s, clock, a)
    hit(s, clock, a)  # 2 asks of 3
    put(s, clock, b, c)  # a turned away with its 2 asks
    assert not on_nvme(s, a) and s.contains_prefix([a]).miss_reason == "not_admitted"
    put(s, clock, a, d)  # stored again: 3 asks (2 remembered + this store); b and c turned away
    assert not on_nvme(s, a) and M(s, "kvstore_tier_skipped_blocks_total", **NOT_ADMITTED) == 3
    put(s, clock, e)  # evicts a: written
    assert on_nvme(s, a)
    check_store(s)


@pytest.mark.parametrize("admit", [0, 1])
def test_admit_after_0_and_1_write_every_block(store, clock, admit):
    s = store(admit)
    a, b, c = (one_key(i) for i in range(3))
    put(s, clock, a, b, c)
    assert on_nvme(s, a) and M(s, "kvstore_demoted_blocks_total") == 1
    assert M(s, "kvstore_tier_skipped_blocks_total", **NOT_ADMITTED) == 0


def test_a_copy_promoted_from_nvme_counts_as_admitted(store, clock):
    """A block read up from NVMe was admitted: if NVMe loses its file meanwhile, the DRAM copy is
    written down again at eviction (its own asks, 1 since the promotion, would not do)."""
    s = store(2)
    a, b, c = (one_key(i) for i in range(3))
    put(s, clock, a)
    hit(s, clock, a)
    put(s, clock, b, c)  # a demoted
    put(s, clock, one_key(7), one_key(8))  # DRAM holds neither a nor b now
    assert on_nvme(s, a) and not s.dram.contains(a)
    hit(s, clock, a)  # promoted into DRAM
    assert s.dram.contains(a) and s.nvme.remove([a]) == 1 and not on_nvme(s, a)
    put(s, clock, one_key(10), one_key(11))  # a evicted from DRAM
    assert on_nvme(s, a)
    check_store(s)


# -- other modes -----------------------------------------------------------------------------------


def test_nvme_only_store_writes_a_block_at_its_second_store(store, clock):
    s = store(2, dram_blocks=0, headroom=0)
    assert s.dram is None
    a = one_key(0)
    assert put(s, clock, a) == 0  # the first store of a block is not written
    assert not on_nvme(s, a) and s.contains_prefix([a]).miss_reason == "not_admitted"
    assert M(s, "kvstore_tier_skipped_blocks_total", **NOT_ADMITTED) == 1
    assert put(s, clock, a) == 1  # the second one is
    assert on_nvme(s, a) and s.contains_prefix([a]).tiers == ("nvme",)
    hit(s, clock, a)
    # begin_store/end_store (the connector's two phases) pass the same gate
    b = one_key(1)
    h = s.begin_store([b])
    assert h.views == [None] and s.end_store(h) == 0 and not on_nvme(s, b)
    h = s.begin_store([b])
    h.views[0][:] = block_for(b)
    assert s.end_store(h) == 1 and on_nvme(s, b)
    assert M(s, "kvstore_tier_skipped_blocks_total", **NOT_ADMITTED) == 2
    check_store(s)


def test_write_through_copies_only_admitted_blocks_at_store(store, clock):
    s = store(2, write_mode="write_through")
    a, b, c = (one_key(i) for i in range(3))
    put(s, clock, a)
    assert not on_nvme(s, a)  # 1 ask: not copied when stored
    hit(s, clock, a)
    assert not on_nvme(s, a)  # admitted now, but write-through copies at store time only
    put(s, clock, b, c)  # c evicts a: written then (write-back for the blocks admitted later)
    assert on_nvme(s, a) and M(s, "kvstore_demoted_blocks_total") == 1
    put(s, clock, one_key(5))  # b (1 ask) turned away
    assert not on_nvme(s, b) and M(s, "kvstore_tier_skipped_blocks_total", **NOT_ADMITTED) == 1
    put(s, clock, b)  # stored again (c turned away): 2 asks, copied through at once
    assert on_nvme(s, b) and s.contains_prefix([b]).tiers == ("dram",)
    assert M(s, "kvstore_tier_skipped_blocks_total", **NOT_ADMITTED) == 2
    check_store(s)


def test_a_put_with_no_free_dram_slot_is_gated_on_its_way_to_nvme(store, clock):
    """put writes a block that found no DRAM slot straight to NVMe: a store, so an ask."""
    s = store(2, headroom=0)
    a, b, c = (one_key(i) for i in range(3))
    put(s, clock, a)
    hit(s, clock, a)
    put(s, clock, b)
    failpoints.close_gate()
    failpoints.arm("demote.write=hold")  # a's demotion holds its slot: c finds none
    clock.advance(1)
    assert s.put([c], block_for(c)[None]) == 0  # 1 ask: not written either
    assert M(s, "kvstore_tier_skipped_blocks_total", tier="dram", reason="no_slot") == 1
    assert M(s, "kvstore_tier_skipped_blocks_total", **NOT_ADMITTED) == 1
    assert s.contains_prefix([c]).miss_reason == "not_admitted"
    clock.advance(1)
    assert s.put([c], block_for(c)[None]) == 1  # the second store: written to NVMe by put
    assert on_nvme(s, c)
    failpoints.open_gate()
    s.flush()
    assert on_nvme(s, a)
    check_store(s)


def test_close_does_not_persist_blocks_short_of_their_asks(make_store, store_dir, clock):
    s = make_store(config=cfg(store_dir, 2, dram_blocks=4, nvme_blocks=8))
    a, b = one_key(0), one_key(1)
    put(s, clock, a, b)
    hit(s, clock, a)
    assert s.persist() == 1 and on_nvme(s, a) and not on_nvme(s, b)


# -- the simulator is the store ---------------------------------------------------------------------

def simulated(trace, c):
    sim = Simulator.from_config(c, BB)
    for r in trace.requests():
        sim.request(*r)
    return sim.result()


# measured on this trace (admit 0 -> admit 2): 48/60/200/600 write-back: hit rate 71.5% -> 66.3%,
# NVMe writes 1321 -> 941 blocks; NVMe only: 68.6% -> 51.9%, 1519 -> 1062 blocks
@pytest.mark.parametrize("dram,dttl,nvme,nttl,policy,shared,mode,admit", [
    (48, 60, 200, 600, "lru", None, "write_back", 2),
    (16, None, 64, 900, "fifo", None, "write_through", 2),
    (0, None, 150, 120, "lru", None, "write_back", 2),  # NVMe only
    (40, 120, 120, 300, "lru_shared", 1200, "write_back", 3),
])
def test_simulator_and_store_agree_with_admission(mixed_trace, tmp_path, dram, dttl, nvme, nttl, policy, shared,
                                                  mode, admit):
    c = cfg_blocks(dram, dttl, nvme, nttl, policy, shared, mode, admit_after=admit)
    a = simulated(mixed_trace, c)
    b = replay_store(mixed_trace, c, BB, nvme_path=str(tmp_path))
    assert a["hit_rate"] == b["hit_rate"] and a["hit_rate_by_tier"] == b["hit_rate_by_tier"]
    assert {k: v for k, v in a["misses_by_reason"].items() if v} == b["misses_by_reason"]
    assert a["nvme_written_bytes"] == b["nvme_written_bytes"] and a["nvme_not_admitted"] == b["nvme_not_admitted"]
    assert b["misses_by_reason"]["not_admitted"] > 0 and b["nvme_not_admitted"] > 0  # the filter did something
    off = simulated(mixed_trace, cfg_blocks(dram, dttl, nvme, nttl, policy, shared, mode))
    assert off["nvme_not_admitted"] == 0 and "not_admitted" not in {k for k, v in off["misses_by_reason"].items() if v}
    assert a["nvme_written_bytes"] < 0.8 * off["nvme_written_bytes"]  # fewer SSD writes ...
    assert a["hit_rate"] < off["hit_rate"]  # ... for fewer hits on this trace
    assert a["nvme_written_bytes_per_hour"] == pytest.approx(a["nvme_written_bytes"] * 3600 / a["duration_s"])
