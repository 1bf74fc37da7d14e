"""A read-only file system under the NVMe tier (issue 29): a real tmpfs remounted read-only (a
folder made read-only by permissions is not the same: root writes through it). The tier's
capacity drops to what it holds with ONE warning, stores are skipped (never an eviction that
cannot delete, never a warning per block), reads go on; after PROBE_AFTER_S of the tier's clock it
probes again and grows back once the file system is writable. A full disk (a real small tmpfs)
uses the same mechanism and grows back by the space the file system reports. Skipped where
mount is refused."""

from __future__ import annotations

import logging
import subprocess
from pathlib import Path

import numpy as np
import pytest

from kvstore.tiers.nvme import NvmeTier
from kvstore.tiers.nvme.tier import PROBE_AFTER_S

from conftest import BLOCK, blocks_for, check_store, check_tier, make_keys, nvme_files
from test_nvme_files import nvme_only, read_n


def _mount(*args: str) -> None:
    try:
        r = subprocess.run(["mount", *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        pytest.skip(f"mount failed: {e}")
    if r.returncode != 0:
        pytest.skip(f"mount {' '.join(args)} refused here: {r.stderr.strip() or r.returncode}")


class Mount:
    def __init__(self, where: Path):
        self.where = where

    def ro(self) -> None:
        _mount("-o", "remount,ro", str(self.where))

    def rw(self) -> None:
        _mount("-o", "remount,rw", str(self.where))


@pytest.fixture
def mnt(tmp_path):
    where = tmp_path / "mnt"
    where.mkdir()
    _mount("-t", "tmpfs", "-o", "size=16m,mode=0700", "kvstore-test", str(where))
    yield Mount(where)
    subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=30)


def warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_read_only_file_system_through_the_store(make_store, mnt, clock, caplog):
    s = nvme_only(make_store, path=mnt.where / "cache", nvme_blocks=32)
    cfg = s.nvme.capacity_bytes
    held, later = make_keys(4, seed=1), make_keys(24, seed=2)
    assert s.put(held, blocks_for(held)) == 4
    mnt.ro()
    with caplog.at_level(logging.WARNING, logger="kvstore"):
        stored = sum(s.put(later[i:i + 4], blocks_for(later[i:i + 4])) for i in range(0, 24, 4))
        assert stored == 0
        assert read_n(s, held) == 4  # what it holds is still served
        clock.advance(PROBE_AFTER_S + 1)  # probed again: still read-only, nothing more to say
        assert s.put(later[:4], blocks_for(later[:4])) == 0 and read_n(s, held) == 4
    w = warnings(caplog)
    assert len(w) == 1 and "read-only" in w[0], w  # ONE warning, not one per block
    assert s.nvme.capacity_bytes == 4 * s.nvme.entry_bytes < cfg and len(s.nvme) == 4
    assert s.stats()["tiers"]["nvme"]["capacity_bytes"] == 4 * s.nvme.entry_bytes
    assert s.metrics.value("kvstore_tier_capacity_bytes", tier="nvme") == 4 * s.nvme.entry_bytes
    assert s.contains_prefix(later).num_blocks == 0  # a counted miss, never a wrong block
    mnt.rw()
    assert s.put(later[:4], blocks_for(later[:4])) == 0  # not yet: the next probe is a minute away
    clock.advance(PROBE_AFTER_S + 1)
    assert s.put(later, blocks_for(later)) == 24  # probed: writable, the capacity is back
    assert s.nvme.capacity_bytes == cfg and s.nvme.fault is None
    assert read_n(s, held + later) == 28
    check_store(s)


def test_read_only_under_dram_demotions(make_store, mnt, clock, caplog):
    """DRAM victims demoted to a read-only NVMe tier: skipped, not a warning each; DRAM serves."""
    s = make_store(path=mnt.where / "cache", dram_blocks=4, nvme_blocks=32)
    first = make_keys(8, seed=3)
    s.put(first, blocks_for(first))
    s.flush()
    on_nvme = len(s.nvme)
    mnt.ro()
    with caplog.at_level(logging.WARNING, logger="kvstore"):
        served = []
        for i in range(6):
            ks = make_keys(4, seed=10 + i)
            s.put(ks, blocks_for(ks))
            s.flush()
            served.append(read_n(s, ks))
    # the first put meets the fault: its DRAM slots were held by the demotions that failed, so its
    # blocks went straight to NVMe and failed too (counted); from then on DRAM serves every put
    assert served[1:] == [4] * 5, served
    assert len(warnings(caplog)) == 1 and len(s.nvme) == on_nvme
    assert s.nvme.stats["skipped_read_only"] >= 4 * 4  # the later victims: not written, not warned
    mnt.rw()
    clock.advance(PROBE_AFTER_S + 1)
    ks = make_keys(8, seed=30)
    s.put(ks, blocks_for(ks))
    s.persist()
    s.flush()
    assert s.nvme.capacity_bytes == s.nvme.configured_capacity and all(s.nvme.contains(k) for k in ks)
    check_store(s)


def test_read_only_through_the_tier_and_removals_wait_for_writable(mnt, clock, caplog):
    def tier():
        return NvmeTier(path=mnt.where / "t", namespace=b"r" * 16, capacity_bytes=16 * 12288, ttl_s=None,
                        policy="lru", block_bytes=BLOCK, clock=clock, header="inline")

    t = tier()
    keys = make_keys(6, seed=4)
    out = np.zeros((6, BLOCK), np.uint8)
    assert t.put(keys[:3], blocks_for(keys[:3])) == 3
    mnt.ro()
    with caplog.at_level(logging.WARNING, logger="kvstore"):
        assert t.put(keys[3:], blocks_for(keys[3:])) == 0  # the writes in flight fail: one warning
        assert t.put(keys[3:], blocks_for(keys[3:])) == 0  # then nothing is even reserved
        assert t.capacity_bytes == 3 * t.entry_bytes  # what it holds
        assert t.remove(keys[:1]) == 1  # its file cannot go yet: kept for later, no warning
    assert len(warnings(caplog)) == 1 and t.stats["skipped_read_only"] == 3
    assert t.stats["write_failed"] == 3 and t.capacity_bytes == 2 * t.entry_bytes
    assert t.get(keys[1:3], out[:2]) == [True, True]
    mnt.rw()
    clock.advance(PROBE_AFTER_S + 1)
    assert t.put(keys[3:], blocks_for(keys[3:])) == 3
    assert len(nvme_files(t)) == 5  # the removed block's file went at the probe
    assert t.get(keys[1:], out[:5]) == [True] * 5 and np.array_equal(out[:5], blocks_for(keys[1:]))
    check_tier(t)
    t.close()


def test_a_full_disk_grows_back_when_space_returns(make_store, tmp_path, clock, caplog):
    """The same mechanism on a real full disk (a 2 MiB tmpfs, 1.5 MiB of it taken by another
    file): one warning, capacity = what it holds; the probe grows it back only by the space the
    file system reports (90 % of it), so a disk still full stays small and quiet."""
    where = tmp_path / "small"
    where.mkdir()
    _mount("-t", "tmpfs", "-o", "size=2m,mode=0700", "kvstore-test", str(where))
    try:
        ballast = where / "ballast"
        ballast.write_bytes(b"\0" * (1536 << 10))
        s = nvme_only(make_store, path=where / "cache", nvme_blocks=256)  # 3 MiB configured
        cfg, eb = s.nvme.capacity_bytes, s.nvme.entry_bytes
        with caplog.at_level(logging.WARNING, logger="kvstore"):
            keys = make_keys(96, seed=5)
            for i in range(0, 96, 8):
                s.put(keys[i:i + 8], blocks_for(keys[i:i + 8]))
            lowered = s.nvme.capacity_bytes
            assert s.nvme.fault == "disk_full" and lowered < 48 * eb and s.nvme.used_bytes <= lowered
            clock.advance(PROBE_AFTER_S + 1)  # still full: the probe finds less than one block of room
            more = make_keys(16, seed=6)
            s.put(more, blocks_for(more))
            assert s.nvme.capacity_bytes < lowered + eb
        assert len(warnings(caplog)) == 1, warnings(caplog)
        ballast.unlink()
        clock.advance(PROBE_AFTER_S + 1)
        later = make_keys(64, seed=7)
        assert s.put(later, blocks_for(later)) == 64  # room again: nothing of these evicted or failed
        assert lowered + 64 * eb <= s.nvme.capacity_bytes < cfg and read_n(s, later) == 64
        check_store(s)
        s.close()
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=30)



def test_a_start_where_not_every_folder_can_be_made(tmp_path, clock):
    """The fan-out folders are made at start; where the file system runs out (of inodes, here)
    the tier starts anyway: its writes are stored or counted as a full disk, never raised, and
    what it stores reads back right."""
    where = tmp_path / "few"
    where.mkdir()
    _mount("-t", "tmpfs", "-o", "size=16m,nr_inodes=64,mode=0700", "kvstore-test", str(where))
    try:
        t = NvmeTier(path=where / "t", namespace=b"f" * 16, capacity_bytes=16 * 12288, ttl_s=None,
                     policy="lru", block_bytes=BLOCK, clock=clock, header="inline")
        assert 0 < sum(1 for d in t.root.iterdir() if d.name != "tmp") < 256
        keys = make_keys(12, seed=5)
        stored = t.put(keys, blocks_for(keys))
        out = np.zeros((12, BLOCK), np.uint8)
        got = t.get(keys, out)
        assert sum(got) == stored and t.stats["write_failed"] == 12 - stored  # (here every inode went to folders)
        assert t.stats["disk_full"] >= 12 - stored  # the full-disk path: capacity lowered, probed again later
        assert all(np.array_equal(o, b) for o, b, g in zip(out, blocks_for(keys), got) if g)
        t.close()
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=30)
