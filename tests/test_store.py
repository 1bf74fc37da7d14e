"""KVStore: tiers working together (demotion, promotion, write modes), miss reasons, the API."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from kvstore.store import KVStore, PrefixMatch

from conftest import (BLOCK, FP, ODD_BLOCK, ROOT, block_for, blocks_for, check_store, make_keys, nvme_files,
                      one_key, tiny_config)


def M(store, name, **labels):
    return store.metrics.value(name, **labels)


def read_all(store, keys, bb=BLOCK):
    out = np.zeros((len(keys), bb), np.uint8)
    n = store.get(keys, out)
    return n, out


def assert_blocks(store, keys, bb=BLOCK):
    n, out = read_all(store, keys, bb)
    assert n == len(keys)
    for k, row in zip(keys, out):
        assert np.array_equal(row, block_for(k, bb))


# -- basics -------------------------------------------------------------------------------------


def test_put_get_contains(make_store):
    s = make_store(dram_blocks=4, nvme_blocks=16)
    keys = make_keys(3)
    assert s.contains_prefix(keys) == PrefixMatch(0, (), "never_stored")
    assert s.put(keys, blocks_for(keys)) == 3
    assert s.put(keys, blocks_for(keys)) == 0  # present: skipped
    assert s.contains_prefix(keys) == PrefixMatch(3, ("dram",) * 3, None)
    assert_blocks(s, keys)
    assert s.get([], np.zeros((0, BLOCK), np.uint8)) == 0
    check_store(s)


def test_get_stops_at_the_first_missing_block(make_store):
    s = make_store()
    keys = make_keys(4)
    s.put([keys[0], keys[1], keys[3]], blocks_for([keys[0], keys[1], keys[3]]))
    n, out = read_all(s, keys)
    assert n == 2 and np.array_equal(out[1], block_for(keys[1]))
    assert s.contains_prefix(keys).num_blocks == 2
    check_store(s)


@pytest.mark.parametrize("bb", [ODD_BLOCK, 4096 * 3 + 17])
def test_unaligned_block_sizes(make_store, bb):
    s = make_store(block_bytes=bb, dram_blocks=2, nvme_blocks=8)
    keys = make_keys(5)
    assert s.put(keys, blocks_for(keys, bb)) == 5
    assert s.contains_prefix(keys).tiers.count("nvme") == 3
    assert_blocks(s, keys, bb)
    check_store(s)


def test_buffers_lists_and_wide_rows(make_store):
    s = make_store()
    keys = make_keys(2)
    wide = np.zeros((2, BLOCK + 100), np.uint8)
    wide[:, :BLOCK] = blocks_for(keys)
    wide[:, BLOCK:] = 9
    assert s.put(keys, wide) == 2  # extra bytes per row are ignored
    out = np.full((2, BLOCK + 100), 5, np.uint8)
    assert s.get(keys, out) == 2
    assert np.array_equal(out[:, :BLOCK], blocks_for(keys)) and (out[:, BLOCK:] == 5).all()
    outs = [np.zeros(BLOCK, np.uint8) for _ in keys]
    assert s.get(keys, outs) == 2 and all(np.array_equal(o, block_for(k)) for o, k in zip(outs, keys))
    # another dtype with the right byte size is fine as a list item (bytes are bytes)
    outs16 = [np.zeros(BLOCK // 2, np.float16) for _ in keys]
    assert s.get(keys, [o.view(np.uint8) for o in outs16]) == 2


def test_bad_arguments(make_store):
    s = make_store()
    keys = make_keys(2)
    with pytest.raises(ValueError):
        s.put([b"short"], np.zeros((1, BLOCK), np.uint8))
    with pytest.raises(ValueError):
        s.put(keys, np.zeros((1, BLOCK), np.uint8))  # too few rows
    with pytest.raises(ValueError):
        s.put(keys, np.zeros((2, BLOCK - 1), np.uint8))  # rows too short
    with pytest.raises(ValueError):
        s.put(keys, np.zeros((2, BLOCK), np.float32))
    ro = np.zeros((2, BLOCK), np.uint8)
    ro.flags.writeable = False
    with pytest.raises(ValueError):
        s.get(keys, ro)
    with pytest.raises(ValueError):
        s.get(keys, np.zeros((2, 2 * BLOCK), np.uint8)[:, ::2])
    with pytest.raises(ValueError):
        KVStore(tiny_config(None), block_bytes=0, fingerprint=FP)
    check_store(s)


def test_closed_store_refuses_work(make_store):
    s = make_store()
    s.close()
    s.close()  # idempotent
    for call in (lambda: s.put(make_keys(1), np.zeros((1, BLOCK), np.uint8)),
                 lambda: s.get(make_keys(1), np.zeros((1, BLOCK), np.uint8)),
                 lambda: s.contains_prefix(make_keys(1)), lambda: s.prefetch(make_keys(1)),
                 lambda: s.begin_store(make_keys(1)), lambda: s.begin_load(make_keys(1))):
        with pytest.raises(RuntimeError):
            call()


def test_stats_shape(make_store):
    s = make_store()
    keys = make_keys(2)
    s.put(keys, blocks_for(keys))
    st = s.stats()
    assert st["tiers"]["dram"]["blocks"] == 2 and st["tiers"]["nvme"]["blocks"] == 0
    assert st["tiers"]["dram"]["capacity_bytes"] == 4 * BLOCK
    assert st["metrics"]["kvstore_tier_blocks{tier=dram}"] == 2
    assert "kvstore_corrupt_files_total" in s.metrics.text() or "kvstore_corrupt_files" in s.metrics.text()


# -- tiers together -------------------------------------------------------------------------------


def test_dram_eviction_demotes_to_nvme_write_back(make_store, clock):
    s = make_store(dram_blocks=2, nvme_blocks=8)
    a, b, c = (one_key(i) for i in range(3))
    for k in (a, b):
        clock.advance(1)
        s.put([k], block_for(k)[None])
    assert nvme_files(s) == []  # write-back: nothing on NVMe yet
    clock.advance(1)
    s.put([c], block_for(c)[None])  # a goes down in the background; c finds no free slot: NVMe
    s.flush()
    assert s.contains_prefix([a]).tiers == ("nvme",) and s.nvme.path_of(a).exists()
    assert s.contains_prefix([b]).tiers == ("dram",) and not s.nvme.path_of(b).exists()
    assert M(s, "kvstore_demoted_blocks_total") == 1 and M(s, "kvstore_tier_evicted_blocks_total", tier="dram") == 1
    assert s.nvme.index.entries[a].last_access == clock() - 2  # keeps its DRAM recency
    n, out = read_all(s, [a])
    assert n == 1 and np.array_equal(out[0], block_for(a))
    check_store(s)


def test_nvme_hit_promotes_to_dram(make_store, clock):
    s = make_store(dram_blocks=2, nvme_blocks=8)
    keys = [one_key(i) for i in range(3)]
    for k in keys:
        clock.advance(1)
        s.put([k], block_for(k)[None])
        s.flush()
    a = keys[0]
    # the third put evicted a (demoted in the background, its slot held meanwhile), so its own
    # block found no free slot: put wrote it to NVMe
    assert s.contains_prefix(keys).tiers == ("nvme", "dram", "nvme")
    assert M(s, "kvstore_tier_skipped_blocks_total", tier="dram", reason="no_slot") == 1
    assert_blocks(s, [a])
    assert s.contains_prefix([a]).tiers == ("dram",)
    assert M(s, "kvstore_promoted_blocks_total") == 1
    assert s.nvme.contains(a)  # a copy stays on NVMe (it is clean)
    assert_blocks(s, [keys[2]])  # DRAM full: b (the LRU) goes down to NVMe, c read from NVMe
    s.flush()
    assert s.contains_prefix([keys[1]]).tiers == ("nvme",)
    check_store(s)


def test_write_through_writes_nvme_at_put_time(make_store):
    s = make_store(dram_blocks=4, nvme_blocks=8, write_mode="write_through")
    keys = make_keys(3)
    assert s.put(keys, blocks_for(keys)) == 3
    s.flush()  # the NVMe copies are written in the background
    assert all(s.nvme.contains(k) and s.nvme.path_of(k).exists() for k in keys)
    assert s.contains_prefix(keys).tiers == ("dram",) * 3
    assert M(s, "kvstore_tier_written_bytes_total", tier="nvme") == 3 * BLOCK
    check_store(s)
    # a later DRAM eviction need not write again
    more = make_keys(4, seed=1)
    s.put(more, blocks_for(more))
    s.flush()
    assert M(s, "kvstore_demoted_blocks_total") == 0
    assert_blocks(s, keys)
    check_store(s)


def test_write_through_many_puts_through_a_tiny_dram(make_store):
    s = make_store(dram_blocks=2, nvme_blocks=40, write_mode="write_through")
    keys = make_keys(30)
    for i in range(0, 30, 3):
        assert s.put(keys[i:i + 3], blocks_for(keys[i:i + 3])) == 3
    s.flush()
    assert all(s.nvme.contains(k) for k in keys)
    assert_blocks(s, keys)
    check_store(s)


def test_batch_larger_than_dram_goes_through(make_store):
    s = make_store(dram_blocks=4, nvme_blocks=32)
    keys = make_keys(20)
    assert s.put(keys, blocks_for(keys)) == 20
    m = s.contains_prefix(keys)
    assert m.num_blocks == 20 and m.tiers.count("dram") == 4
    assert_blocks(s, keys)
    check_store(s)


def test_put_skips_keys_already_on_nvme(make_store):
    s = make_store(dram_blocks=2, nvme_blocks=8)
    keys = make_keys(4)
    s.put(keys, blocks_for(keys))
    on_nvme = [k for k, t in zip(keys, s.contains_prefix(keys).tiers) if t == "nvme"]
    assert on_nvme
    assert s.put(on_nvme, blocks_for(on_nvme)) == 0
    check_store(s)


def test_dram_full_of_pinned_blocks_falls_back_to_nvme(make_store):
    s = make_store(dram_blocks=2, nvme_blocks=8)
    keys = make_keys(2)
    s.put(keys, blocks_for(keys))
    h = s.begin_load(keys)  # both DRAM slots pinned
    c = one_key(50)
    assert s.put([c], block_for(c)[None]) == 1
    assert s.contains_prefix([c]).tiers == ("nvme",)
    assert M(s, "kvstore_tier_skipped_blocks_total", tier="dram", reason="no_slot") == 0  # no room, not no slot
    s.end_load(h)
    assert_blocks(s, [c])
    s.flush()
    check_store(s)


def test_dram_expiry_demotes_when_nvme_keeps_longer(make_store, clock):
    s = make_store(dram_blocks=4, nvme_blocks=8, dram_ttl=5, nvme_ttl=100)
    keys = make_keys(2)
    s.put(keys, blocks_for(keys))
    clock.advance(6)
    assert s.sweep() == 2
    s.flush()  # demoted in the background
    assert s.contains_prefix(keys).tiers == ("nvme", "nvme")
    assert M(s, "kvstore_tier_expired_blocks_total", tier="dram") == 2
    clock.advance(90)  # NVMe idle TTL counts from the last access (in DRAM): 96 s so far
    assert_blocks(s, keys)
    clock.advance(101)
    assert s.contains_prefix(keys).miss_reason == "expired"
    check_store(s)


def test_dram_only_and_nvme_only_stores(make_store, tmp_path):
    d = make_store(dram_blocks=3, nvme_blocks=0)
    assert d.nvme is None
    keys = make_keys(5)
    assert d.put(keys, blocks_for(keys)) == 3  # one reservation: the head fits, the tail finds no room
    m = d.contains_prefix(keys)
    assert m.num_blocks == 3 and m.miss_reason == "diverged"
    d.close()
    n = make_store(dram_blocks=0, nvme_blocks=8, path=tmp_path / "n")
    assert n.dram is None
    assert n.put(keys, blocks_for(keys)) == 5
    assert n.contains_prefix(keys).tiers == ("nvme",) * 5
    assert_blocks(n, keys)
    check_store(n)
    h = n.begin_store(make_keys(2, seed=3))
    for v, k in zip(h.views, h.keys):
        v[:] = block_for(k)
    assert n.end_store(h) == 2
    assert_blocks(n, h.keys)


def test_temporary_nvme_folder_is_removed_at_close(clock):
    s = KVStore(tiny_config(None), block_bytes=BLOCK, fingerprint=FP, clock=clock)
    keys = make_keys(6)
    s.put(keys, blocks_for(keys))
    folder = s.nvme.root.parent  # a temporary folder, made for this store
    assert folder.exists()
    s.close()
    assert not folder.exists()


def test_a_close_says_what_it_wrote_down(make_store, caplog):
    """A restart that finds its disk tier empty is explained by what the close said (issue 49:
    vLLM's default stop kills the engine before the close; a graceful one logs this line)."""
    s = make_store(dram_blocks=8, nvme_blocks=16)
    keys = make_keys(3)
    s.put(keys, blocks_for(keys))
    assert s.nvme.present_or_writing(keys[0]) is False  # only DRAM holds them
    with caplog.at_level("INFO", logger="kvstore.store.store"):
        s.close()
    assert "closing: wrote 3 blocks only dram held down to nvme" in caplog.text


# -- two-phase API --------------------------------------------------------------------------------


def test_begin_end_store(make_store):
    s = make_store(dram_blocks=4, nvme_blocks=8)
    keys = make_keys(3)
    s.put(keys[:1], blocks_for(keys[:1]))
    h = s.begin_store(keys)
    assert h.views[0] is None and h.views[1] is not None  # present: skip
    assert not s.contains_prefix(keys[1:2]).num_blocks  # WRITING: invisible
    for v, k in zip(h.views, keys):
        if v is not None:
            v[:] = block_for(k)
    assert s.end_store(h, [True, True, False]) == 1
    assert s.contains_prefix(keys) == PrefixMatch(2, ("dram", "dram"), "diverged")
    with pytest.raises(RuntimeError):
        s.end_store(h)
    h2 = s.begin_store(keys[2:])
    with pytest.raises(ValueError):
        s.end_store(h2, [True, True])  # wrong length: nothing stored, nothing leaked
    assert s.contains_prefix(keys).num_blocks == 2
    check_store(s)


def test_begin_end_load_zero_copy_and_pinned(make_store):
    s = make_store(dram_blocks=2, nvme_blocks=8)
    keys = make_keys(4)
    s.put(keys, blocks_for(keys))
    assert s.contains_prefix(keys).tiers == ("dram", "dram", "nvme", "nvme")  # a big put keeps the head
    keys = keys[2:]
    h = s.begin_load(keys)  # DRAM full: the LRU blocks go down in the background, these are read
    assert h.num_blocks == 2 and h.entries == [None, None]  # into private buffers (no free slot yet)
    assert M(s, "kvstore_tier_skipped_blocks_total", tier="dram", reason="no_slot") == 2
    s.end_load(h)
    s.flush()  # the demotions are done: their slots are free
    h = s.begin_load(keys)
    assert h.num_blocks == 2 and h.tier_of == ["nvme", "nvme"]  # promoted into DRAM slots
    assert all(e in s.dram.index.entries.values() for e in h.entries)
    for v, k in zip(h.views, keys):
        assert np.array_equal(v, block_for(k))
    assert all(e.pins >= 1 for e in h.entries)
    # while pinned, nothing evicts them: more puts go around (to NVMe)
    more = make_keys(3, seed=5)
    s.put(more, blocks_for(more))
    for v, k in zip(h.views, keys):
        assert np.array_equal(v, block_for(k))
    s.end_load(h)
    with pytest.raises(RuntimeError):
        s.end_load(h)
    check_store(s)


def test_prefetch_promotes(make_store, store_dir, clock):
    s = make_store(dram_blocks=4, nvme_blocks=8)
    keys = make_keys(3)
    s.put(keys, blocks_for(keys))
    s.close()
    s2 = make_store(dram_blocks=4, nvme_blocks=8)
    assert s2.contains_prefix(keys).tiers == ("nvme",) * 3
    assert s2.prefetch(keys).result(timeout=30) == 3
    assert s2.contains_prefix(keys).tiers == ("dram",) * 3
    assert s2.prefetch(keys).result(timeout=30) == 0
    assert s2.prefetch(make_keys(2, seed=9)).result(timeout=30) == 0
    check_store(s2)



def test_prefetch_without_a_dram_tier_reads_nothing(make_store):
    """No DRAM tier: nothing to promote into, so a prefetch must not read (and discard) every block."""
    # engine off: its reads are counted on the per-block path (the native engine takes a batch's
    # page-aligned buffers: an output array that happened to be aligned read 2 of 3 there, once on CI)
    s = make_store(dram_blocks=0, nvme_blocks=8, engine="off")
    keys = make_keys(3)
    s.put(keys, blocks_for(keys))
    reads = s.nvme.read
    calls = []
    s.nvme.read = lambda *a, **k: calls.append(1) or reads(*a, **k)
    assert s.prefetch(keys).result(timeout=30) == 0
    assert calls == []
    out = np.empty((3, BLOCK), np.uint8)
    assert s.get(keys, out) == 3 and len(calls) == 3  # a real load still reads


# -- miss reasons ---------------------------------------------------------------------------------


def test_miss_reason_never_stored_and_below_min(make_store):
    s = make_store()
    assert s.contains_prefix(make_keys(3)).miss_reason == "never_stored"
    assert s.contains_prefix([], num_tokens=7) == PrefixMatch(0, (), "below_min")
    assert M(s, "kvstore_lookup_miss_tokens_total", reason="below_min") == 7
    assert M(s, "kvstore_lookup_miss_blocks_total", reason="never_stored") == 3


def test_miss_reason_diverged(make_store):
    s = make_store()
    toks = list(range(FP.block_size * 4))
    other = toks[: FP.block_size * 2 + 3] + [999] + toks[FP.block_size * 2 + 4:]
    from kvstore.keys import chain_keys
    a, b = chain_keys(FP, toks, FP.block_size), chain_keys(FP, other, FP.block_size)
    assert a[:2] == b[:2] and a[2] != b[2]
    s.put(a, blocks_for(a))
    m = s.contains_prefix(b)
    assert m == PrefixMatch(2, ("dram", "dram"), "diverged")
    assert M(s, "kvstore_lookup_miss_tokens_total", reason="diverged") == 2 * FP.block_size
    assert M(s, "kvstore_lookup_hit_tokens_total", tier="dram") == 2 * FP.block_size


def test_miss_reason_evicted(make_store, tmp_path):
    s = make_store(dram_blocks=2, nvme_blocks=2)
    keys = make_keys(3)
    s.put(keys, blocks_for(keys))  # 3 blocks, 2 + 2 room: all kept
    assert s.contains_prefix(keys).num_blocks == 3
    more = make_keys(3, seed=1)
    s.put(more, blocks_for(more))
    s.flush()
    m = s.contains_prefix(keys)
    assert m.num_blocks < 3 and m.miss_reason == "evicted"  # 4 places in all for 6 blocks
    # a re-store clears the ghost
    k = keys[m.num_blocks]
    s.put([k], block_for(k)[None])
    s.flush()
    assert s.contains_prefix([k]).num_blocks == 1
    with s.chain.lock:
        assert k not in s.chain._ghosts


def test_miss_reason_expired(make_store, clock):
    s = make_store(dram_ttl=10, nvme_ttl=10)
    keys = make_keys(2)
    s.put(keys, blocks_for(keys))
    clock.advance(11)
    assert s.contains_prefix(keys) == PrefixMatch(0, (), "expired")  # not swept yet
    assert s.sweep() == 2
    assert s.contains_prefix(keys) == PrefixMatch(0, (), "expired")  # remembered after the sweep
    assert s.get(keys, np.zeros((2, BLOCK), np.uint8)) == 0


def test_miss_reason_corrupt(make_store):
    s = make_store(dram_blocks=2, nvme_blocks=8)
    keys = make_keys(4)
    s.put(keys, blocks_for(keys))
    m = s.contains_prefix(keys)
    i = m.tiers.index("nvme")
    p = s.nvme.path_of(keys[i])
    with open(p, "r+b") as f:
        f.seek(4096 + 100)
        b = f.read(1)
        f.seek(4096 + 100)
        f.write(bytes([b[0] ^ 0xFF]))
    n, out = read_all(s, keys)
    assert n == i  # the prefix ends at the corrupt block
    assert s.contains_prefix(keys) == PrefixMatch(i, m.tiers[:i], "corrupt")
    assert M(s, "kvstore_corrupt_files_total", tier="nvme", reason="bad_checksum") == 1


def test_miss_reason_mid_chain_tail_evicted_first(make_store, clock):
    s = make_store(dram_blocks=3, nvme_blocks=0)
    keys = make_keys(3)
    s.put(keys, blocks_for(keys))
    clock.advance(1)
    x = one_key(77)
    s.put([x], block_for(x)[None])
    # the chain lost its tail, not its head
    assert s.contains_prefix(keys) == PrefixMatch(2, ("dram", "dram"), "evicted")


# -- DoD: 2 GiB through a 256 MiB DRAM tier ------------------------------------------------------

_DOD = r"""
import os, re, resource, sys, time
sys.path.insert(0, sys.argv[1])
import numpy as np
from kvstore.config import from_dict
from kvstore.keys import ModelFingerprint, chain_keys
from kvstore.store import KVStore

path = sys.argv[2]
BB = 2 << 20
N = 1024  # 2 GiB
fp = ModelFingerprint(model="dod", block_size=16)
keys = chain_keys(fp, np.arange(N * 16) % 50000, 16)
cfg = from_dict({"tiers": {"dram": {"capacity_gb": 0.25},
                           "nvme": {"path": path, "capacity_gb": 2.5, "ttl_s": None}}})

def content(i, out):
    # deterministic per key, cheap: a uint64 ramp seeded by the key
    seed = int.from_bytes(keys[i][:8], "little") | 1
    v = out.view(np.uint64)
    np.multiply(np.arange(v.size, dtype=np.uint64), np.uint64(seed), out=v)
    v ^= np.uint64(i)

t0 = time.perf_counter()
s = KVStore(cfg, block_bytes=BB, fingerprint=fp)
batch = 8
buf = np.empty((batch, BB), np.uint8)
for i in range(0, N, batch):
    for j in range(batch):
        content(i + j, buf[j])
    assert s.put(keys[i:i + batch], buf) == batch
    s.flush()  # demotions run in the background
t_put = time.perf_counter() - t0
m = s.contains_prefix(keys)
assert m.num_blocks == N, m[:1]
# a put into a full DRAM demotes in the background: its blocks take headroom slots (1/8 of 128
# slots held back), so DRAM holds the last 112 and none was skipped
assert s.dram.headroom == 16 and m.tiers.count("dram") == 112, (m.tiers.count("dram"),)
assert s.metrics.value("kvstore_tier_skipped_blocks_total", tier="dram", reason="no_slot") == 0
exp = np.empty(BB, np.uint8)
t1 = time.perf_counter()
for i in range(0, N, batch):
    assert s.get(keys[i:i + batch], buf) == batch
    for j in range(batch):
        content(i + j, exp)
        if not np.array_equal(buf[j], exp):
            raise SystemExit(f"block {i + j} differs")
t_get = time.perf_counter() - t1
assert "torch" not in sys.modules  # pin_memory: auto must not drag torch in
s.close(persist=False)
# VmHWM is this process's own peak (ru_maxrss would carry the parent's peak across fork+exec)
rss = int(re.search(r"VmHWM:\s+(\d+) kB", open("/proc/self/status").read()).group(1)) * 1024
print(f"RESULT put_s={t_put:.2f} get_s={t_get:.2f} total_s={time.perf_counter() - t0:.2f} peak_rss_mib={rss / 2**20:.1f}")
"""


@pytest.mark.slow
def test_dod_2gib_through_256mib_dram(tmp_path):
    folder = tmp_path / "dod"
    t0 = time.perf_counter()
    try:
        r = subprocess.run([sys.executable, "-c", _DOD, str(ROOT), str(folder)], capture_output=True, text=True,
                           timeout=300)
    finally:
        import shutil
        shutil.rmtree(folder, ignore_errors=True)  # do not leave 2 GiB behind
    assert r.returncode == 0, r.stderr[-3000:]
    line = [x for x in r.stdout.splitlines() if x.startswith("RESULT")][-1]
    vals = dict(kv.split("=") for kv in line.split()[1:])
    print(line, f"wall={time.perf_counter() - t0:.1f}s")
    assert float(vals["peak_rss_mib"]) < 256 + 300, line


# -- lifecycle and metrics -------------------------------------------------------------------------


def test_close_runs_queued_prefetches_and_does_not_raise(make_store):
    s = make_store(dram_blocks=2, nvme_blocks=16)
    keys = make_keys(6)
    s.put(keys, blocks_for(keys))
    futs = [s.prefetch(keys) for _ in range(6)]
    s.close()
    assert all(f.done() and f.exception() is None for f in futs)


def test_failed_start_releases_what_it_took(make_store, store_dir, tmp_path):
    s = make_store(dram_blocks=2, nvme_blocks=4)
    s.close()
    root = Path(s.nvme.root)
    import shutil
    shutil.rmtree(root)
    root.symlink_to(tmp_path)
    with pytest.raises(OSError):
        make_store(dram_blocks=2, nvme_blocks=4)


def test_corrupt_counter_counts_each_file_once(make_store):
    s = make_store(dram_blocks=0, nvme_blocks=16)
    keys = make_keys(3)
    s.put(keys, blocks_for(keys))
    for k in keys[1:]:
        with open(s.nvme.path_of(k), "r+b") as f:
            f.seek(5000)
            f.write(b"\xff\x00\xff")
    out = np.zeros((3, BLOCK), np.uint8)
    assert s.get(keys, out) == 1
    assert s.get(keys[2:], out[:1]) == 0
    for _ in range(3):
        s.stats()
    assert M(s, "kvstore_corrupt_files_total", tier="nvme", reason="bad_checksum") == 2


def test_prometheus_endpoint(make_store):
    import socket
    import urllib.request
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    from kvstore.config import from_dict
    s = make_store(config=from_dict({"tiers": {"dram": {"capacity_gb": 0.0001, "pin_memory": False},
                                               "nvme": {"capacity_gb": 0}}, "metrics": {"port": port}}))
    keys = make_keys(2)
    s.put(keys, blocks_for(keys))
    s.contains_prefix(keys)
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert 'kvstore_lookup_hit_blocks_total{tier="dram"} 2.0' in body
    s.close()


def test_sessions_reach_the_policy_through_get(make_store, clock):
    s = make_store(dram_blocks=3, nvme_blocks=0, policy="lru_shared")
    a, b, c, d, e = (one_key(i) for i in range(5))
    for k in (a, b, c):
        clock.advance(1)
        s.put([k], block_for(k)[None])
    out = np.zeros((1, BLOCK), np.uint8)
    for sess in ("s1", "s2"):
        assert s.get([a], out, session=sess) == 1
    for k in (d, e):
        s.put([k], block_for(k)[None])
    assert s.contains_prefix([a]).num_blocks == 1
    assert [s.contains_prefix([k]).num_blocks for k in (b, c, d, e)] == [0, 0, 1, 1]


def test_default_pinning_does_not_import_torch(tmp_path):
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from kvstore.store import KVStore; "
            "from kvstore.config import from_dict; from kvstore.keys import ModelFingerprint; "
            "s = KVStore(from_dict({'tiers': {'dram': {'capacity_gb': 0.001}, 'nvme': {'path': sys.argv[2]}}}), "
            "block_bytes=4096, fingerprint=ModelFingerprint('m')); "
            "assert s.dram is not None and not s.dram.pool.pinned; s.close(); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code, str(ROOT), str(tmp_path / "c")], check=True, timeout=60)


def test_a_part_that_raises_leaves_no_other_part_running_after_put_returns(tmp_path, monkeypatch):
    """A put into NVMe (DRAM off) is cut into one part per I/O thread. A part that raised made
    every part run again here while the others still ran on the pool: put returned, the caller
    reused its rows, and a late part wrote the new bytes under the old key with a good checksum.
    Now the raising part's blocks fail (counted), and put returns once every part has ended."""
    import threading

    from kvstore.tiers.nvme import NvmeTier

    keys = make_keys(8, seed=61)
    s = KVStore(tiny_config(tmp_path / "c", dram_blocks=0, io_threads=4, engine="off"), block_bytes=BLOCK,
                fingerprint=FP, block_tokens=16)
    real, raised, ended = NvmeTier.write, [], []

    def write(self, e, src):
        if e.key == keys[0] and not raised:
            raised.append(1)
            raise RuntimeError("a part's own error")
        if e.key == keys[1] and threading.current_thread().name.startswith("kvstore-io"):
            time.sleep(0.3)  # a part still running when another raised
            ok = real(self, e, src)
            ended.append(time.monotonic())
            return ok
        return real(self, e, src)

    monkeypatch.setattr(NvmeTier, "write", write)
    try:
        rows = blocks_for(keys)
        n = s.put(keys, rows)
        returned = time.monotonic()
        rows[:] = 0  # the caller reuses its buffer
        time.sleep(0.5)
        assert raised and ended and ended[0] <= returned  # every part ended before put returned
        assert n == 6  # the raising part's two blocks (keys 0 and 4) failed, the rest stored
        for i, k in enumerate(keys):
            out = np.zeros((1, BLOCK), np.uint8)
            if s.get([k], out):
                assert np.array_equal(out[0], block_for(k)), i
            else:
                assert i in (0, 4)
    finally:
        s.close()
