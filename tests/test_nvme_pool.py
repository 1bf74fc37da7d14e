"""Recycled block files (kvstore/tiers/nvme/pool.py): an evicted file goes into a bounded pool in
``tmp/`` and a later write overwrites it in place, then renames it into place. A pooled file is
never served, a crash mid-recycle leaves nothing half-read, the pool is bounded, the scan removes
what a dead process pooled, and a pooled file that is not a fit is removed, never written through
(the tier's own write and the native engine's alike)."""

from __future__ import annotations

import os
import random
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import xxhash

from kvstore import failpoints
from kvstore.tiers import fileformat as ff
from kvstore.tiers.memory import alloc_aligned
from kvstore.tiers.nvme import NvmeTier, blockio
from kvstore.tiers.nvme.folder import probe_xattr
from kvstore.tiers.nvme.pool import FilePool, default_max_files

from conftest import FP, ROOT, block_for, check_store

BLOCK = 64 << 10
NS = b"P" * 16
HEADERS = ["inline"] + (["xattr"] if probe_xattr(os.environ.get("TMPDIR", "/tmp")) else [])
ENGINES = [None] + (["threads"] if blockio.available() else [])


class Clock:
    t = 1_700_000_000.0

    def __call__(self):
        return self.t


def tier(path, header="inline", blocks=4, pool_files=None, ns=NS, **kw):
    t = NvmeTier(path=path, namespace=ns, capacity_bytes=blocks * (BLOCK + ff.HEADER_BYTES), ttl_s=None,
                 policy="lru", block_bytes=BLOCK, header=header, clock=Clock(), pool_files=pool_files, **kw)
    return t


def rows(n, seed=0):
    mm, flat = alloc_aligned(n * BLOCK)
    r = flat.reshape(n, BLOCK)
    r[:] = np.random.default_rng(seed).integers(0, 256, r.shape, dtype=np.uint8)
    return mm, r


def keys(n, seed=0):
    rng = np.random.default_rng(seed + 500)
    return [rng.integers(0, 256, 16, dtype=np.uint8).tobytes() for _ in range(n)]


def put(t, ks, src, bio=None):
    es = t.reserve(ks)
    oks = bio.write(t, es, list(src)) if bio is not None else [t.write(e, s) for e, s in zip(es, src)]
    t.commit(es, oks)
    return oks


def get(t, ks, out):
    es = t.acquire(ks)
    oks = [e is not None and t.read(e, o) for e, o in zip(es, out)]
    t.release(es, oks)
    return oks


def inodes(t, ks):
    return {os.stat(t.path_of(k)).st_ino for k in ks}


def pooled(t):
    return sorted(n for n in os.listdir(t.tmp) if n.startswith("pool."))


@pytest.fixture(params=ENGINES)
def bio(request):
    if request.param is None:
        yield None
        return
    b = blockio.BlockIO(request.param, depth=4)
    yield b
    b.close()


@pytest.mark.parametrize("header", HEADERS)
def test_an_evicted_file_is_overwritten_in_place_by_a_later_write(tmp_path, header, bio):
    t = tier(tmp_path, header)
    old, new = keys(4), keys(4, seed=1)
    mm, src = rows(4)
    mn, src2 = rows(4, seed=1)
    assert put(t, old, src, bio) == [True] * 4
    before = inodes(t, old)
    assert put(t, new, src2, bio) == [True] * 4  # each reservation evicts one old block first
    assert inodes(t, new) == before  # the same files, renamed into place
    assert t.pool.stats["reused"] == 4 and t.pool.stats["pooled"] == 4 and not os.listdir(t.tmp)
    if bio is not None:
        assert bio.stats["engine_writes"] == 8
    mo, out = rows(4, seed=9)
    assert get(t, new, out) == [True] * 4 and np.array_equal(out, src2)
    assert get(t, old, out) == [False] * 4 and t.stats["corrupt"] == 0
    for k in new:
        assert stat.S_IMODE(os.stat(t.path_of(k)).st_mode) == 0o600
        if header == "xattr":
            assert ff.unpack_header(os.getxattr(t.path_of(k), ff.XATTR)).key == k
    t.close()
    again = tier(tmp_path, header)  # the restart scan takes the recycled files as any others
    assert sorted(again.index.entries) == sorted(new) and again.stats["corrupt"] == 0
    again.close()


def test_a_pooled_file_is_never_served(tmp_path):
    """A pooled file still holds a whole, valid block of its old key; no lookup ever reaches it:
    not a get, not the restart scan (it removes it, with what a killed writer left)."""
    t = tier(tmp_path, pool_files=8)
    ks = keys(3)
    mm, src = rows(3)
    put(t, ks, src)
    assert t.remove(ks[:2]) == 2
    names = pooled(t)
    assert len(names) == 2 and not t.path_of(ks[0]).exists()
    body = (Path(t.tmp) / names[0]).read_bytes()
    assert ff.unpack_header(body).key in ks[:2]  # a valid block file, in the pool
    mo, out = rows(3, seed=9)
    assert get(t, ks, out) == [False, False, True] and t.stats["corrupt"] == 0
    dead = 2 ** 22 + 17  # above any pid_max: no such process
    os.rename(Path(t.tmp) / names[0], Path(t.tmp) / f"pool.{dead}.0")  # as a killed process leaves it
    t.close()  # a close empties its own pool (the other file)
    assert os.listdir(t.tmp) == [f"pool.{dead}.0"]
    again = tier(tmp_path, pool_files=8)
    assert sorted(again.index.entries) == [ks[2]] and again.stats["tmp_removed"] == 1 and not os.listdir(again.tmp)
    again.close()


def test_the_pool_is_bounded(tmp_path):
    t = tier(tmp_path, blocks=10, pool_files=3)
    ks = keys(10)
    mm, src = rows(10)
    put(t, ks, src)
    assert t.remove(ks) == 10
    assert len(pooled(t)) == 3 and t.pool.stats["full"] == 7  # the rest removed, as before recycling
    assert not any(t.path_of(k).exists() for k in ks)
    t.close()
    assert default_max_files(2 << 20, 100 << 30) == 256  # 256 files at most ...
    assert default_max_files(32 << 20, 100 << 30) == 32  # ... and 1 GiB ...
    assert default_max_files(2 << 20, 5 << 20) == 2  # ... and never more than the capacity


def test_a_close_and_a_full_disk_empty_the_pool(tmp_path):
    t = tier(tmp_path, blocks=8, pool_files=8)
    ks = keys(8)
    mm, src = rows(8)
    put(t, ks[:6], src[:6])
    t.remove(ks[:4])
    assert len(pooled(t)) == 4
    failpoints.arm("nvme.write=enospc*1")
    try:
        assert put(t, ks[6:7], src[6:7]) == [False]
    finally:
        failpoints.clear()
    assert t.stats["disk_full"] == 1 and pooled(t) == []  # their space goes back to the file system
    t.remove(ks[4:5])
    assert len(pooled(t)) == 1
    t.close()
    assert not os.listdir(t.tmp)


def test_variable_size_files_are_not_pooled(tmp_path):
    from kvstore.codecs import Geometry, make_codec

    codec = make_codec("zstd", Geometry(BLOCK, "float16", 128), 1)
    t = tier(tmp_path, codec=codec, pool_files=8)
    assert t.pool.max_files == 0
    ks = keys(2)
    mm, src = rows(2)
    src[:, 1000:] = 0  # compresses: files of different sizes
    put(t, ks, src)
    t.remove(ks)
    assert not os.listdir(t.tmp) and t.pool.stats["full"] == 2
    t.close()


def _plant(t, how, outside: Path) -> str:
    """Something in the pool that is not a fit for a block file; returns its pool name."""
    name = "pool.%d.%d" % (os.getpid(), 10_000 + len(t.pool))
    p = Path(t.tmp) / name
    good = bytes(t.file_bytes)
    if how == "symlink":  # to a file that would pass every other check
        outside.write_bytes(good)
        os.chmod(outside, 0o600)
        p.symlink_to(outside)
    elif how == "fifo":
        os.mkfifo(p, 0o600)
    elif how == "folder":
        p.mkdir(mode=0o700)
        (p / "inside").write_bytes(b"x")
    elif how == "size":
        p.write_bytes(good[:-4096])
        os.chmod(p, 0o600)
    elif how == "mode":
        p.write_bytes(good)
        os.chmod(p, 0o644)
    elif how == "hardlink":
        outside.write_bytes(good)
        os.chmod(outside, 0o600)
        os.link(outside, p)
    elif how == "foreign":
        p.write_bytes(good)
        os.chmod(p, 0o600)
        os.chown(p, 65534, 65534)
    with t.pool._lock:
        t.pool._names.append(name)
    return name


UNFIT = ["symlink", "fifo", "folder", "size", "mode", "hardlink"] + (["foreign"] if os.geteuid() == 0 else [])


@pytest.mark.parametrize("how", UNFIT)
def test_a_pooled_file_that_is_not_a_fit_is_removed_never_written_through(tmp_path, how, bio):
    t = tier(tmp_path / "t", pool_files=8)
    outside = tmp_path / "outside"
    name = _plant(t, how, outside)
    ks = keys(2)
    mm, src = rows(2)
    assert put(t, ks, src, bio) == [True, True]  # written to a new file instead
    assert t.pool.stats["unfit"] == 1 and t.pool.stats["reused"] == 0
    assert not os.path.lexists(Path(t.tmp) / name) and not os.listdir(t.tmp)
    if how in ("symlink", "hardlink"):
        assert outside.read_bytes() == bytes(t.file_bytes)  # never written through
    mo, out = rows(2, seed=9)
    assert get(t, ks, out) == [True, True] and np.array_equal(out, src)
    t.close()


def test_a_pooled_name_is_taken_only_once_its_file_is_there(tmp_path):
    """Evictions pool files while writers take them: a writer never gets a name whose rename into
    the pool has not happened yet (it would find nothing and count the file unfit)."""
    t = tier(tmp_path, blocks=64, pool_files=64)
    d = tmp_path / "src"
    d.mkdir()
    dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    stop = threading.Event()
    n = [0]
    errors = []

    def evictor(tag):
        i = 0
        while not stop.is_set():
            nm = f"{tag}{i}"
            with open(d / nm, "wb") as f:
                f.write(bytes(t.file_bytes))
            os.chmod(d / nm, 0o600)
            if not t.pool.put(dfd, nm):
                os.unlink(d / nm)
            i += 1

    def taker():
        while not stop.is_set():
            nm = t.pool.take()
            if nm is None:
                continue
            fd = t.pool.open(nm, 0)
            if fd >= 0:
                os.close(fd)
                os.unlink(nm, dir_fd=t.pool.tmp_fd)
                n[0] += 1

    def guarded(fn, *a):
        try:
            fn(*a)
        except Exception as e:  # noqa: BLE001  (fails the test below)
            errors.append(e)
            stop.set()

    ths = [threading.Thread(target=guarded, args=a) for a in ((evictor, "a"), (evictor, "b"), (taker,), (taker,))]
    for th in ths:
        th.start()
    deadline = time.monotonic() + 30
    while n[0] < 1000 and time.monotonic() < deadline:
        time.sleep(0.01)
    stop.set()
    for th in ths:
        th.join()
    os.close(dfd)
    assert not errors and n[0] >= 1000 and t.pool.stats["unfit"] == 0
    t.close()


def test_a_read_racing_another_process_reusing_the_file_is_a_miss_never_a_removal(tmp_path):
    """Two tiers on one folder (as two processes): A opens K's file; meanwhile B evicts K and
    overwrites that very file with K2's block. A's checks fail on bytes that are not K's: a miss,
    and A removes nothing (the name is no longer that file's; K2's file is B's, whole)."""
    a = tier(tmp_path, blocks=8, pool_files=8)
    k, k2 = keys(2)
    mm, src = rows(2)
    put(a, [k], src[:1])
    b = tier(tmp_path, blocks=8, pool_files=8)  # its scan finds K
    assert b.contains(k)
    failpoints.arm("nvme.read=hold*1")
    failpoints.close_gate()
    got = []
    mo, out = rows(1, seed=9)
    reader = threading.Thread(target=lambda: got.append(get(a, [k], out)))
    try:
        reader.start()
        deadline = time.monotonic() + 10
        while reader.ident not in failpoints.holding() and time.monotonic() < deadline:
            time.sleep(0.005)
        assert b.remove([k]) == 1 and len(b.pool) == 1  # K's file, open in A, now in B's pool
        assert put(b, [k2], src[1:]) == [True] and b.pool.stats["reused"] == 1  # overwritten in place
    finally:
        failpoints.open_gate()
        reader.join(30)
        failpoints.clear()
    assert got == [[False]]
    assert a.stats["corrupt"] == 0 and a.stats["missing"] == 1
    assert b.path_of(k2).exists()
    mo2, out2 = rows(1, seed=10)
    assert get(b, [k2], out2) == [True] and np.array_equal(out2[0], src[1])
    a.close()
    b.close()


_WRITER = r"""
import sys
sys.path.insert(0, sys.argv[1])
import numpy as np, xxhash
from kvstore.config import from_dict
from kvstore.keys import ModelFingerprint
from kvstore.store import KVStore

path, start, bb, nvme_gb, engine = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5]), sys.argv[6]
fp = ModelFingerprint(**eval(sys.argv[7]))
cfg = from_dict({"tiers": {"dram": {"capacity_gb": 0}, "nvme": {"path": path, "capacity_gb": nvme_gb, "ttl_s": None,
                                                                 "io_threads": 2, "engine": engine}}})
s = KVStore(cfg, block_bytes=bb, fingerprint=fp)

def key(i):
    return xxhash.xxh3_128_digest(b"recycle-%d" % i)

def block(k):
    return np.random.default_rng(int.from_bytes(k[:8], "little")).integers(0, 256, bb, dtype=np.uint8)

print("ready", flush=True)
i = start
while True:
    ks = [key(i + j) for j in range(4)]
    s.put(ks, np.stack([block(k) for k in ks]))
    i += 4
    if i - start >= 48:
        print("recycling", s.nvme.pool.stats["reused"], flush=True)
        start = 1 << 40
"""


@pytest.mark.parametrize("engine,bb", [("auto", 64 << 10), ("off", (64 << 10) + 100)])
def test_kill_9_mid_recycle_leaves_nothing_half_read(tmp_path, engine, bb):
    """A writer that recycles a file for nearly every block (a cache of 16 files), killed at random
    points: after each restart every block the scan finds reads back whole and right, none is
    corrupt, and ``tmp/`` is empty (the pooled and half-overwritten files removed)."""
    from kvstore.config import from_dict
    from kvstore.store import KVStore

    folder = tmp_path / "cache"
    blocks = 16
    gb = blocks * ff.file_bytes(bb) / (1 << 30)
    fp = repr({"model": FP.model, "dtype": FP.dtype, "block_size": FP.block_size, "num_layers": FP.num_layers,
               "num_kv_heads": FP.num_kv_heads, "head_size": FP.head_size})
    rnd = random.Random(34)
    start, checked = 0, 0
    for cycle in range(4):
        p = subprocess.Popen([sys.executable, "-c", _WRITER, str(ROOT), str(folder), str(start), str(bb), str(gb),
                              engine, fp], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert p.stdout.readline().strip() == "ready", p.stderr.read()
            line = p.stdout.readline().split()
            assert line[:1] == ["recycling"] and int(line[1]) > 0, p.stderr.read()  # files are being reused
            time.sleep(rnd.uniform(0, 0.05))
        finally:
            os.kill(p.pid, signal.SIGKILL)
            p.wait(timeout=30)
            p.stdout.close()
            p.stderr.close()
        start += 10_000
        cfg = from_dict({"tiers": {"dram": {"capacity_gb": 0},
                                   "nvme": {"path": str(folder), "capacity_gb": gb, "ttl_s": None}}})
        s = KVStore(cfg, block_bytes=bb, fingerprint=FP)
        try:
            assert list(Path(s.nvme.tmp).iterdir()) == [], "pooled or temporary files survived the restart"
            held = list(s.nvme.index.entries)
            assert len(held) >= 8
            ids = {xxhash.xxh3_128_digest(b"recycle-%d" % i): i for c in range(cycle + 1)
                   for i in range(c * 10_000, c * 10_000 + 10_000)}
            out = np.zeros((1, bb), np.uint8)
            for k in held:
                assert k in ids, "a block under a key that was never written"
                assert s.get([k], out) == 1, "a block the scan took does not read back"
                assert np.array_equal(out[0], block_for(k, bb)), f"wrong bytes for block {ids[k]}"
                checked += 1
            assert s.nvme.stats["corrupt"] == 0
            check_store(s)
        finally:
            s.close()
    assert checked >= 32


@pytest.mark.parametrize("header", HEADERS)
def test_a_recycled_file_renamed_before_its_bytes_landed_is_a_counted_miss(tmp_path, header):
    """No fsync, as before: after a power loss a recycled file may be in place with its old bytes
    under the new header (or the other way round). Its checksum or its key fails: a counted miss,
    removed, never the old block's bytes served as the new key's."""
    t = tier(tmp_path, header, blocks=4)
    old, new = keys(4), keys(4, seed=1)
    mm, src = rows(4)
    mn, src2 = rows(4, seed=1)
    put(t, old, src)
    saved = {}
    for k in old:
        p = t.path_of(k)
        saved[os.stat(p).st_ino] = (p.read_bytes(), os.getxattr(p, ff.XATTR) if header == "xattr" else None)
    put(t, new, src2)  # every file recycled
    hdr = ff.HEADER_BYTES if header == "inline" else 0
    for i, k in enumerate(new[:2]):  # the payload as it was before the overwrite
        p = t.path_of(k)
        body, _x = saved[os.stat(p).st_ino]
        with open(p, "r+b") as f:
            f.seek(hdr)
            f.write(body[hdr:])
    k3 = new[2]  # the old header (xattr: the attribute; inline: the first 4 KiB), the new payload
    body, x = saved[os.stat(t.path_of(k3)).st_ino]
    if header == "xattr":
        os.setxattr(t.path_of(k3), ff.XATTR, x)
    else:
        with open(t.path_of(k3), "r+b") as f:
            f.write(body[:hdr])
    mo, out = rows(4, seed=9)
    assert get(t, new, out) == [False, False, False, True]
    assert t.corrupt_reasons.get("bad_checksum", 0) == 2 and t.corrupt_reasons.get("wrong_key", 0) == 1
    assert not t.path_of(new[0]).exists() and np.array_equal(out[3], src2[3])
    t.close()
