"""A non-file planted at a block path (issue 29): a folder (empty or not), a FIFO, a symlink or a
socket where a block file belongs is counted once and the key stays storable: through the tier
and through KVStore, while running (before and after the key was stored) and at the start-up
scan. Nothing is followed, nothing outside the cache is touched."""

from __future__ import annotations

import os
import shutil
import socket
from pathlib import Path

import numpy as np
import pytest

from kvstore.bench import faults as F
from kvstore.tiers.nvme import NvmeTier

from conftest import BLOCK, block_for, blocks_for, check_store, check_tier, make_keys, one_key
from test_nvme_files import nvme_only, read_n

KINDS = ["empty_folder", "folder", "fifo", "symlink", "socket"]


@pytest.fixture
def outside(tmp_path):
    d = tmp_path / "outside"
    d.mkdir()
    (d / "precious").write_bytes(b"keep me")
    return d


def plant(p: Path, kind: str, outside: Path) -> None:
    """Put a ``kind`` non-file at ``p`` (whatever was there is removed first)."""
    if p.is_symlink() or p.is_file():
        p.unlink()
    p.parent.mkdir(parents=True, exist_ok=True)
    if kind == "empty_folder":
        p.mkdir()
    elif kind == "folder":
        p.mkdir()
        (p / "inside").write_bytes(b"x")
        (p / "link").symlink_to(outside / "precious")  # removing the folder must not follow it
    elif kind == "fifo":
        os.mkfifo(p, 0o600)
    elif kind == "symlink":
        p.symlink_to(outside / "precious")
    elif kind == "socket":
        s, cwd = socket.socket(socket.AF_UNIX), os.getcwd()
        try:
            os.chdir(p.parent)  # a relative name: the full path is longer than a socket address takes
            s.bind(p.name)
        finally:
            os.chdir(cwd)
            s.close()


def untouched(outside: Path) -> bool:
    return (outside / "precious").read_bytes() == b"keep me" and sorted(os.listdir(outside)) == ["precious"]


@pytest.mark.parametrize("kind", KINDS)
def test_planted_after_the_key_was_stored(make_store, outside, kind):
    """The block read finds the non-file: a counted miss; the next store of the key succeeds."""
    s = nvme_only(make_store)
    keys = make_keys(3)
    s.put(keys, blocks_for(keys))
    plant(s.nvme.path_of(keys[1]), kind, outside)
    with F.alarm(10):  # a FIFO must not block
        assert read_n(s, keys) == 1
    assert s.nvme.stats["corrupt"] == 1
    assert s.contains_prefix(keys).num_blocks == 1  # the index dropped it: a miss, not a hang
    assert s.put(keys, blocks_for(keys)) == 1  # stored again
    assert read_n(s, keys) == 3 and s.nvme.stats["corrupt"] == 1 and s.nvme.stats["write_failed"] == 0
    assert untouched(outside)
    check_store(s)


@pytest.mark.parametrize("kind", KINDS)
def test_planted_before_the_key_is_stored(make_store, outside, kind):
    """The writer finds the non-file at its path: replaced (a folder is moved aside, counted)."""
    s = nvme_only(make_store)
    keys = make_keys(2)
    s.put(keys[:1], blocks_for(keys[:1]))
    p = s.nvme.path_of(keys[1])
    plant(p, kind, outside)
    for _ in range(3):  # never blocked: the first store succeeds, and the later ones find it stored
        s.put(keys, blocks_for(keys))
    assert read_n(s, keys) == 2 and s.nvme.stats["write_failed"] == 0
    # a folder cannot be renamed over: counted, removed or moved aside; a FIFO, link or socket is
    # replaced by the rename itself (never opened, never followed: nothing to count)
    assert s.nvme.stats["corrupt"] == (1 if "folder" in kind else 0)
    assert untouched(outside) and p.is_file() and not p.is_symlink()
    check_store(s)
    s.close()
    s2 = nvme_only(make_store)  # what was moved aside is removed by the scan, not counted again
    assert not [q for q in p.parent.iterdir() if q.name.startswith(".discard.")]
    assert s2.nvme.stats["corrupt"] == 0 and read_n(s2, keys) == 2
    assert untouched(outside)


@pytest.mark.parametrize("kind", KINDS)
def test_planted_while_closed_is_counted_once_at_the_scan(make_store, outside, kind):
    s = nvme_only(make_store)
    keys = make_keys(3)
    s.put(keys, blocks_for(keys))
    s.close()
    p = s.nvme.path_of(keys[1])
    plant(p, kind, outside)
    with F.alarm(10):
        s2 = nvme_only(make_store)
    assert s2.nvme.stats["corrupt"] == 1 and not os.path.lexists(p)  # counted, removed, never followed
    assert len(s2.nvme) == 2 and read_n(s2, keys) == 1  # a miss from block 1 on
    assert s2.put(keys, blocks_for(keys)) == 1 and read_n(s2, keys) == 3
    check_store(s2)
    s2.close()
    s3 = nvme_only(make_store)
    assert s3.nvme.stats["corrupt"] == 0 and read_n(s3, keys) == 3  # counted once, not at every start
    assert untouched(outside)


@pytest.mark.parametrize("kind", ["file", "symlink", "fifo"])
def test_a_non_folder_at_a_fan_out_path_does_not_block_its_keys(make_store, outside, kind):
    s = nvme_only(make_store)
    k = one_key(7)
    top = s.nvme.path_of(k).parent  # the key's fan-out folder (made at start: replaced while running)
    top.rmdir()
    if kind == "file":
        top.write_bytes(b"junk")
    else:
        plant(top, kind, outside)
    assert s.put([k], block_for(k)[None]) == 1 and read_n(s, [k]) == 1
    assert top.is_dir() and not top.is_symlink() and s.nvme.stats["corrupt"] == 1
    assert untouched(outside)
    check_store(s)


def test_through_the_tier_alone(tmp_path, outside, clock):
    """The tier's own put/get (no KVStore): a folder planted at a stored key's path, then at a key
    never stored; both keys storable again; the scan of a new tier removes what was moved aside."""
    def tier():
        return NvmeTier(path=tmp_path / "t", namespace=b"n" * 16, capacity_bytes=1 << 20, ttl_s=None,
                        policy="lru", block_bytes=BLOCK, clock=clock, header="inline")

    t = tier()
    keys = make_keys(2)
    out = np.zeros((2, BLOCK), np.uint8)
    assert t.put(keys[:1], blocks_for(keys[:1])) == 1
    plant(t.path_of(keys[0]), "folder", outside)
    plant(t.path_of(keys[1]), "folder", outside)
    assert t.get(keys[:1], out[:1]) == [False] and t.stats["corrupt"] == 1
    assert t.put(keys, blocks_for(keys)) == 2 and t.stats["corrupt"] == 2 and t.stats["write_failed"] == 0
    assert t.get(keys, out) == [True, True] and np.array_equal(out, blocks_for(keys))
    check_tier(t)
    t.close()
    t2 = tier()
    assert t2.stats["corrupt"] == 0 and len(t2) == 2
    assert not [q for q in Path(t2.root).rglob(".discard.*")] and untouched(outside)
    t2.close()
    shutil.rmtree(tmp_path / "t")
