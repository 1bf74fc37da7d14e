"""The shared file-system tier (issue 48): one folder many hosts mount, many writers at once.

Hosts are processes here (each its own writer id and sweeper) on one folder. What they must
hold together: no wrong bytes, a capacity and an idle TTL kept within a sweep period, one sweeper
at a time whose lease a dead holder gives up; and what one reader must: a torn, foreign, planted
or vanished file is a counted miss, never served, never a crash. The contract every medium keeps
is tests/test_every_tier.py's (this one included)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import BLOCK, FakeClock, block_for, blocks_for, dram_gb, nvme_gb, one_key
from kvstore.config import ConfigError, from_dict
from kvstore.store import KVStore
from kvstore.store.chain import Plan, TierChain
from kvstore.store.metrics import StoreMetrics
from kvstore.store.transfers import Transfers
from kvstore.tiers import fileformat as ff
from kvstore.tiers.index import CAPACITY
from kvstore.tiers.sharedfs import SharedFsTier
from kvstore.tiers.sharedfs.sweeper import LEASE, SKEW_S

NS = bytes(range(16))
ROOT = Path(__file__).resolve().parent.parent


def tier(folder, clock=None, cap_blocks: int = 1 << 20, ttl=None, **kw) -> SharedFsTier:
    return SharedFsTier(path=str(folder), namespace=NS, block_bytes=BLOCK, capacity_bytes=cap_blocks * (BLOCK + 4096),
                        ttl_s=ttl, clock=clock or time.time, sweep=False, **kw)


def put(t: SharedFsTier, keys) -> list[bool]:
    res = t.begin_reserve(keys)
    oks = [t.write(e, block_for(e.key)) for e in res]
    t.commit(res, oks)
    return oks


def get(t: SharedFsTier, key) -> np.ndarray | None:
    out = np.zeros(BLOCK, np.uint8)
    (e,) = t.acquire([key])
    ok = t.read(e, out)
    t.release([e], [ok])
    return out if ok else None


# -- one reader ---------------------------------------------------------------------------------

def test_another_hosts_blocks_are_found_and_read_right(tmp_path):
    a, b = tier(tmp_path), tier(tmp_path)
    try:
        keys = [one_key(i) for i in range(4)]
        assert put(a, keys) == [True] * 4
        assert b.leading(keys + [one_key(99)]) == 4  # the files are the truth: no index of a's
        assert all(np.array_equal(get(b, k), block_for(k)) for k in keys)
        assert oct(os.stat(a.path_of(keys[0])).st_mode & 0o777) == "0o600"
        assert oct(os.stat(a.folder).st_mode & 0o777) == "0o700"
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("damage, reason", [
    ("truncate", "truncated"), ("flip", "bad_checksum"), ("foreign", "foreign"), ("header", "bad_header"),
    ("symlink", "not_a_file"), ("mode", "loose_mode")])
def test_a_bad_file_is_a_counted_miss_removed_and_storable_again(tmp_path, damage, reason):
    t = tier(tmp_path / "sfs")
    try:
        k = one_key(1)
        put(t, [k])
        p = t.path_of(k)
        if damage == "truncate":
            os.truncate(p, os.path.getsize(p) - 100)
        elif damage == "flip":
            with open(p, "r+b") as f:
                f.seek(-1, 2)
                b = f.read(1)
                f.seek(-1, 2)
                f.write(bytes([b[0] ^ 1]))
        elif damage == "foreign":  # another namespace's file under this key's name
            other = SharedFsTier(path=str(tmp_path / "other"), namespace=bytes(16), block_bytes=BLOCK,
                                 capacity_bytes=1 << 30, ttl_s=None, sweep=False)
            put(other, [k])
            os.replace(other.path_of(k), p)
            other.close()
        elif damage == "header":
            with open(p, "r+b") as f:
                f.seek(20)
                f.write(b"\xff")
        elif damage == "symlink":
            secret = tmp_path / "secret"
            secret.write_bytes(b"x" * 100)
            os.unlink(p)
            os.symlink(secret, p)
        elif damage == "mode":
            os.chmod(p, 0o666)
        assert get(t, k) is None  # never served
        assert t.corrupt_reasons.get(reason) == 1, t.corrupt_reasons
        assert not os.path.lexists(p)  # removed (a link unlinked, never followed)
        if damage == "symlink":
            assert (tmp_path / "secret").read_bytes() == b"x" * 100
        assert t.leading([k]) == 0 and put(t, [k]) == [True] and np.array_equal(get(t, k), block_for(k))
    finally:
        t.close()


def test_a_file_gone_between_the_lookup_and_the_read_is_a_miss(tmp_path):
    a, b = tier(tmp_path), tier(tmp_path)
    try:
        k = one_key(3)
        put(a, [k])
        assert b.leading([k]) == 1
        os.unlink(a.path_of(k))  # another host's sweeper
        assert get(b, k) is None and b.stats["missing"] == 1 and not b.corrupt_reasons
    finally:
        a.close()
        b.close()


def test_a_file_past_its_ttl_is_not_served_and_a_hit_refreshes_it(tmp_path):
    clock = FakeClock(time.time())
    t = tier(tmp_path, clock=clock, ttl=60)
    try:
        k, j = one_key(4), one_key(5)
        put(t, [k, j])
        clock.advance(40)
        assert get(t, k) is not None  # a hit at +40 s: its file's time is now
        os.utime(t.path_of(k), (clock(), clock()))  # (the file system's clock is the real one: set it to ours)
        clock.advance(40)
        assert t.holds([k, j]) == [True, False]  # j idle 80 s > 60: not served, though still there
        assert get(t, j) is None and t.is_expired(j)
        assert t.sweeper.round() == 1 and not os.path.exists(t.path_of(j))  # the sweeper's
    finally:
        t.close()


def test_the_folder_is_checked_and_its_key_named(tmp_path):
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o777)
    os.chmod(loose, 0o777)
    with pytest.raises(ConfigError, match=r"tiers\.sharedfs\.path"):
        tier(loose)
    # and before any model loads (kvstore config, the vLLM plugin): creating nothing
    from kvstore.store.machine import config_errors

    _, errors = config_errors(overrides={"tiers": {"sharedfs": {"path": str(loose)}}}, ports=False)
    assert [e.key for e in errors] == ["tiers.sharedfs.path"]
    _, errors = config_errors(overrides={"tiers": {"sharedfs": {"path": str(tmp_path / "new" / "sfs")}}}, ports=False)
    assert errors == [] and not (tmp_path / "new").exists()


def test_a_stalled_mount_costs_a_call_its_deadline_then_the_tier_is_skipped_and_a_late_read_lands_nowhere(tmp_path):
    """A file system that stops answering (a hard NFS mount whose server is gone): a lookup, a
    read and a write each return within the deadline as misses; then the tier is skipped (no
    call waits) until its backoff ends; the stalled read, let go later, never writes the caller's
    buffer; once the mount answers again, everything does, and nothing wrong was stored."""
    from kvstore import failpoints
    from kvstore.tiers.sharedfs import tier as sfs

    t = tier(tmp_path, timeout_ms=200)
    keys = [one_key(60 + i) for i in range(3)]
    assert put(t, keys[:2]) == [True, True]
    try:
        failpoints.close_gate()
        failpoints.arm("sharedfs.io=hold")
        out = np.full(BLOCK, 7, np.uint8)
        (e,) = t.acquire([keys[0]])
        t0 = time.monotonic()
        assert t.read(e, out) is False  # the stalled read: a miss within its deadline
        assert time.monotonic() - t0 < 1.0 and t.stats["timeouts"] == 1 and not t.up
        t0 = time.monotonic()
        assert t.leading(keys) == 0 and put(t, keys[2:]) == [False]  # skipped: no wait at all
        assert time.monotonic() - t0 < 0.1 and t.stats["skipped_down"] >= 2
        failpoints.clear()  # the mount answers again: the stalled calls end now
        time.sleep(0.3)
        assert (out == 7).all()  # the late read landed in its own buffer, never the caller's
        t._down_until = 0.0  # (the backoff, BACKOFF_S, over)
        assert t.up and t.leading(keys) == 2 and np.array_equal(get(t, keys[0]), block_for(keys[0]))
        assert put(t, keys[2:]) == [True] and np.array_equal(get(t, keys[2]), block_for(keys[2]))
        assert sfs.BACKOFF_S >= 1
    finally:
        failpoints.clear()
        t.close()


# -- the sweeper -------------------------------------------------------------------------------------

def test_capacity_keeps_the_most_recent_files(tmp_path):
    clock = FakeClock(time.time())
    t = tier(tmp_path, clock=clock, cap_blocks=4)
    try:
        keys = [one_key(10 + i) for i in range(8)]
        for i, k in enumerate(keys):
            put(t, [k])
            os.utime(t.path_of(k), (1000 + i, 1000 + i))  # written in order
        os.utime(t.path_of(keys[0]), (2000, 2000))  # ... and keys[0] hit since
        assert t.sweeper.round() == 4
        assert t.holds(keys) == [True, False, False, False, False, True, True, True]
        assert len(t) == 4 and t.used_bytes == 4 * (BLOCK + 4096) and t.stats["evicted"] == 4
    finally:
        t.close()


def test_one_sweeper_at_a_time_and_a_dead_ones_lease_is_taken_over(tmp_path):
    clock = FakeClock(time.time())
    a, b = tier(tmp_path, clock=clock, sweep_s=1, lease_s=10), tier(tmp_path, clock=clock, sweep_s=1, lease_s=10)
    try:
        assert a.sweeper.round() == 0 and b.sweeper.round() is None  # a holds it
        clock.advance(5)
        assert a.sweeper.round() == 0  # renewed: until +15
        clock.advance(14)
        assert b.sweeper.round() is None  # a's lease still runs (and the skew after it)
        # a stops renewing (dies): b takes over once the lease and the skew are past
        clock.advance(1 + SKEW_S + 1)
        assert b.sweeper.round() == 0 and b.stats["leases_taken"] == 1
        assert a.sweeper.round() is None  # a, back: not the holder any more
        lease = (a.folder / LEASE).read_text().split()
        assert lease[0] == b.id
    finally:
        a.close()
        b.close()


def test_a_closed_sweeper_hands_the_lease_on_at_once(tmp_path):
    a, b = tier(tmp_path), tier(tmp_path)
    try:
        assert a.sweeper.round() == 0 and b.sweeper.round() is None
        a.close()
        assert b.sweeper.round() == 0 and b.stats["leases_taken"] == 0  # nothing to take over
    finally:
        b.close()


HOST = '''
import json, os, sys, time
import numpy as np
sys.path.insert(0, {tests!r})
from conftest import BLOCK, block_for, one_key
from kvstore.tiers.sharedfs import SharedFsTier
t = SharedFsTier(path={folder!r}, namespace=bytes(range(16)), block_bytes=BLOCK, capacity_bytes={cap},
                 ttl_s=None, sweep_s=0.2, lease_s=1.0, sweep={sweep})
me = int(sys.argv[1])
wrong = read = 0
for r in range({rounds}):
    keys = [one_key(1000 * (me + 1) + r), one_key(r)]  # its own block, and one every host writes
    res = t.begin_reserve(keys)
    t.commit(res, [e is not None and t.write(e, block_for(e.key)) for e in res])
    for k in [one_key(r), one_key(1000 * ((me + 1) % {hosts} + 1) + r)]:
        out = np.zeros(BLOCK, np.uint8)
        (e,) = t.acquire([k])
        if t.read(e, out):
            read += 1
            wrong += not np.array_equal(out, block_for(k))
        t.release([e], None)
print(json.dumps({{"wrong": wrong, "read": read, "corrupt": t.corrupt_reasons, "id": t.id}}), flush=True)
if {hold}:
    time.sleep(60)
t.close()
'''


def _host(folder, me: int, *, hosts: int = 4, rounds: int = 60, cap: int = 1 << 30, sweep: bool = True,
          hold: bool = False) -> subprocess.Popen:
    code = HOST.format(tests=str(ROOT / "tests"), folder=str(folder), cap=cap, sweep=sweep, rounds=rounds, hosts=hosts,
                       hold=hold)
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), str(me)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_four_hosts_on_one_folder_read_no_wrong_byte_and_hold_the_capacity(tmp_path):
    cap_blocks = 40  # far less than the 4 x 60 + 60 blocks they write
    cap = cap_blocks * (BLOCK + 4096)
    procs = [_host(tmp_path, i, cap=cap) for i in range(4)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-3000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    assert sum(o["wrong"] for o in outs) == 0 and sum(o["read"] for o in outs) > 0
    assert all(not o["corrupt"] for o in outs)  # a file replaced as it was read is a whole one
    # one sweep period after the writers stop, the folder is within the capacity
    t = tier(tmp_path, cap_blocks=cap_blocks)
    try:
        deadline = time.monotonic() + 10
        while True:
            total = sum(f.stat().st_size for f in t.folder.rglob("*" + ff.SUFFIX))
            if total <= cap or time.monotonic() > deadline:
                break
            t.sweeper.round()  # (the hosts are gone: this process sweeps, as the next host would)
            time.sleep(0.2)
        assert total <= cap, (total, cap)
        assert not list((t.folder / "tmp").iterdir())  # every write renamed into place or removed
    finally:
        t.close()


def test_a_sweeper_killed_9_is_replaced_after_its_lease(tmp_path):
    p = _host(tmp_path, 0, rounds=2, hold=True)
    lease = tmp_path / f"kvstore-{NS.hex()[:16]}" / LEASE
    try:
        deadline = time.monotonic() + 30
        while not lease.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        holder = lease.read_text().split()[0]
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=10)
        t = tier(tmp_path, clock=lambda: time.time() + SKEW_S + 2, sweep_s=0.2, lease_s=1.0)  # past it
        try:
            assert t.sweeper.round() is not None and t.stats["leases_taken"] == 1
            assert lease.read_text().split()[0] == t.id != holder
        finally:
            t.close()
    finally:
        if p.poll() is None:
            p.kill()


# -- through the store --------------------------------------------------------------------------------

def test_a_store_on_another_host_hits_in_the_shared_folder(tmp_path):
    cfg = from_dict({"tiers": {"dram": {"capacity_gb": 16 * BLOCK / 2**30, "pin_memory": False},
                               "nvme": {"capacity_gb": 0}, "sharedfs": {"path": str(tmp_path / "shared")}}})
    a = KVStore(cfg, block_bytes=BLOCK, fingerprint=bytes([1]) * 16)
    b = KVStore(cfg, block_bytes=BLOCK, fingerprint=bytes([1]) * 16)
    other = KVStore(cfg, block_bytes=BLOCK, fingerprint=bytes([2]) * 16)
    try:
        keys = [one_key(50 + i) for i in range(6)]
        assert a.put(keys, np.stack([block_for(k) for k in keys])) == 6
        a.flush()  # the write-through copies
        m = b.contains_prefix(keys, record=False)
        assert m.num_blocks == 6 and set(m.tiers) == {"sharedfs"}
        out = np.zeros((6, BLOCK), np.uint8)
        assert b.get(keys, out) == 6 and all(np.array_equal(o, block_for(k)) for o, k in zip(out, keys))
        assert other.contains_prefix(keys, record=False).num_blocks == 0  # another model: another namespace
    finally:
        a.close()
        b.close()
        other.close()


def test_kvstore_inspect_reads_a_shared_folder(tmp_path):
    """``kvstore inspect PATH`` counts a shared folder's blocks as an NVMe folder's; the sweeper's
    lease beside them is the tier's own bookkeeping, not a bad file."""
    from kvstore.ops.inspect import inspect_folder, render_folder

    t = tier(tmp_path)
    try:
        keys = [one_key(40 + i) for i in range(3)]
        assert put(t, keys) == [True] * 3
        assert t.sweeper.round() == 0 and (t.folder / LEASE).exists()  # held while the store runs
        info = inspect_folder(str(tmp_path))
    finally:
        t.close()
    assert (info["blocks"], info["bad_files"], info["temp_files"]) == (3, 0, 0), info
    assert list(info["namespaces"]) == [t.folder.name]
    assert "3 blocks" in render_folder(info)


# -- victims: what a host lets go, and the folder's own ---------------------------------------------

def _engine(tmp_path, mode: str, dram: int, nvme: int = 0, **kw) -> KVStore:
    n = {"path": str(tmp_path / "nvme"), "capacity_gb": nvme_gb(nvme), "io_threads": 2, "header": "inline"} \
        if nvme else {"capacity_gb": 0}
    # headroom: a step's victims leave their slots only once written down; as many slots again
    # keep every store in DRAM (none written straight below for want of a slot)
    cfg = from_dict({"tiers": {"dram": {"capacity_gb": dram_gb(2 * dram), "headroom_blocks": dram, "pin_memory": False},
                               "nvme": n, "sharedfs": {"path": str(tmp_path / "shared"), "write_mode": mode}}})
    return KVStore(cfg, block_bytes=BLOCK, fingerprint=bytes([1]) * 16, **kw)


def _nvme_files(s: KVStore) -> int:
    return sum(1 for p in s.nvme.root.rglob("*.kvb") if "tmp" not in p.relative_to(s.nvme.root).parts)


@pytest.mark.parametrize("nvme", [0, 4])
def test_write_back_takes_only_what_the_host_lets_go_and_another_host_reads_it(tmp_path, nvme):
    """``write_mode: write_back``: the folder gets the victims of the host's last local tier (DRAM
    alone, or NVMe under it: read back from its file first), nothing else; each block is then
    served right by this host and by another."""
    a = _engine(tmp_path, "write_back", dram=2, nvme=nvme)
    b = _engine(tmp_path, "write_through", dram=2)
    try:
        keys = [one_key(70 + i) for i in range(10)]
        for i in range(0, 10, 2):  # two at a time: each pair pushes the least recent pair down
            assert a.put(keys[i:i + 2], blocks_for(keys[i:i + 2])) == 2
            a.flush()
        held = a.sharedfs.holds(keys)
        let_go = 10 - 2 - nvme  # what DRAM (and NVMe) could not keep
        assert held == [True] * let_go + [False] * (10 - let_go), held
        if nvme:
            assert a.nvme.holds(keys) == [False] * let_go + [True] * nvme + [False] * 2
        # DRAM's 8 victims written down (to the folder, or to NVMe and then 4 of them on to the folder)
        assert a.metrics.value("kvstore_demoted_blocks_total") == 8 + (let_go if nvme else 0)
        m = b.contains_prefix(keys, record=False)  # another host: the folder's share, then nothing
        assert m.num_blocks == let_go and set(m.tiers) == {"sharedfs"}
        out = np.zeros((1, BLOCK), np.uint8)
        for k in keys[:let_go]:
            assert b.get([k], out) == 1 and np.array_equal(out[0], block_for(k)), k
        for k in keys:  # (one-block chains: each its own prompt; a hit below is promoted, its victims go down:
            out[:] = 0  # a file's victim is not served on its way, so each get waits for the last one's moves)
            assert a.get([k], out) == 1 and np.array_equal(out[0], block_for(k)), k
            a.flush()
    finally:
        a.close()
        b.close()


def test_write_through_still_takes_every_block_at_once(tmp_path):
    a = _engine(tmp_path, "write_through", dram=4)
    try:
        keys = [one_key(90 + i) for i in range(3)]
        assert a.put(keys, blocks_for(keys)) == 3
        a.flush()
        assert a.sharedfs.holds(keys) == [True] * 3  # nothing evicted, all there
    finally:
        a.close()


def test_a_shared_folders_victims_go_to_the_tier_below_it(tmp_path):
    """A shared tier with a capacity has victims: its sweeper sets them aside (out of readers'
    sight), the chain writes them down to the shared tier below that takes victims, then they are
    removed; without a tier below, the sweeper removes them as before."""
    clock = FakeClock(time.time())
    upper = tier(tmp_path / "fast", clock=clock, cap_blocks=2)
    lower = tier(tmp_path / "archive", clock=clock, write_through=False)
    lower.name = "archive"
    chain = TierChain([upper, lower], clock=clock)
    moves = Transfers(chain, StoreMetrics(), block_bytes=BLOCK, io_threads=2)
    try:
        assert upper.keeps_victims and not lower.keeps_victims
        keys = [one_key(110 + i) for i in range(5)]
        for i, k in enumerate(keys):
            put(upper, [k])
            os.utime(upper.path_of(k), (clock() - 100 + i,) * 2)  # written in order
        bad = keys[1]  # one victim's file damaged while it waits: not written down
        assert upper.sweeper.round() == 3 and upper.stats["set_aside"] == 3
        assert upper.holds(keys) == [False, False, False, True, True]  # out of sight at once
        aside = sorted(p.name for p in (upper.folder / "tmp").iterdir())
        assert aside == sorted(f"{k.hex()}.{upper.id}.victim" for k in keys[:3])
        with open(upper.folder / "tmp" / f"{bad.hex()}.{upper.id}.victim", "r+b") as f:
            f.seek(ff.HEADER_BYTES + 5)
            f.write(b"\xff\x00\xff")
        plan = Plan()
        assert chain.expire(plan) == 3 and ("evicted", "sharedfs", 3) in plan.counts
        moves.run(plan)
        moves.flush()
        assert lower.holds(keys) == [True, False, True, False, False]
        assert all(np.array_equal(get(lower, k), block_for(k)) for k in (keys[0], keys[2]))
        assert upper.stats["corrupt"] == 1 and not list((upper.folder / "tmp").iterdir())  # all removed
        assert chain.expire(Plan()) == 0
        # no tier below: removed, nothing set aside
        alone = tier(tmp_path / "alone", clock=clock, cap_blocks=1)
        TierChain([alone], clock=clock)
        try:
            put(alone, keys[:2])
            assert alone.sweeper.round() == 1 and alone.stats["set_aside"] == 0
            assert not list((alone.folder / "tmp").iterdir())
        finally:
            alone.close()
    finally:
        moves.shutdown()
        upper.close()
        lower.close()


def test_an_nvme_victim_on_its_way_down_is_a_miss_not_a_leak_and_the_backlog_is_bounded(tmp_path, monkeypatch):
    """NVMe's victims hold only their files until written to the folder (they left NVMe's index
    and its capacity): a lookup meanwhile is a miss (a load's pin of such a file, released by its
    tier, once kept it and its file for good), and past ``DOWN_MAX_BYTES`` in flight a move is
    dropped, its files removed, counted as backlog. The background moves run when the test says
    (the tuner's executor)."""
    from kvstore.store import transfers
    from kvstore.tune.deferred import Deferred

    io = Deferred()
    monkeypatch.setattr(transfers, "DOWN_MAX_BYTES", BLOCK)  # one move at a time (a bigger one when alone)
    a = _engine(tmp_path, "write_back", dram=2, nvme=2, io_executor=io)
    try:
        k = [one_key(130 + i) for i in range(8)]
        for i in (0, 2):
            a.put(k[i:i + 2], blocks_for(k[i:i + 2]))
            io.run()
        assert a.nvme.holds(k[:2]) == [True, True] and a.dram.holds(k[2:4]) == [True, True]
        a.put(k[4:6], blocks_for(k[4:6]))  # DRAM lets k2,k3 go to NVMe, which lets k0,k1 go to the folder
        assert a.nvme.holds(k[:4]) == [False, False, True, True]  # (reserved there, being written)
        out = np.zeros((1, BLOCK), np.uint8)
        assert a.get([k[0]], out) == 0  # on its way down: a miss, nothing pinned
        io.run()
        assert a.get([k[0]], out) == 1 and np.array_equal(out[0], block_for(k[0]))  # from the folder
        io.run()  # (the promotion's own victim, written down)
        assert not a.chain.demotions.held and _nvme_files(a) == len(a.nvme) == 2  # no file left behind
        # NVMe's two blocks let go as two moves at once (as two stores' reservations would): the
        # first fills the budget, the second is dropped
        victims = [a.nvme.index.remove(key, CAPACITY) for key in list(a.nvme.index.entries)]
        assert len(victims) == 2 and None not in victims
        below = a.chain.below(a.nvme)
        for e in victims:
            plan = Plan()
            a.chain.victims(a.nvme, [e], plan)
            a.transfers.run(plan)
        assert a.metrics.value("kvstore_tier_skipped_blocks_total", tier="sharedfs", reason="backlog") == 1
        io.run()
        assert below.holds([e.key for e in victims]) == [True, False]
        assert _nvme_files(a) == 0  # both files gone: one written down, one dropped
        assert a.contains_prefix([victims[1].key], record=False).miss_reason == "evicted"
    finally:
        a.close()
