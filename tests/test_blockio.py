"""The batched block-file engine (kvstore/tiers/blockio.py, csrc/blockio/): the files it writes are
the tier's files (same bytes, header, modes, mtime; read back by the tier and by the restart scan),
it reads the tier's files, and every damage is the same counted, removed miss as in the tier's own
read. Both backends (io_uring where the kernel allows it, the thread pool always), both layouts."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys

import numpy as np
import pytest

from kvstore import failpoints
from kvstore.tiers import fileformat as ff
from kvstore.tiers.memory import alloc_aligned
from kvstore.tiers.nvme import blockio
from kvstore.tiers.nvme.folder import probe_xattr
from kvstore.tiers.nvme import NvmeTier

pytestmark = pytest.mark.skipif(not blockio.available(), reason=f"kvstore._blockio not built: {blockio.native_error()}")

BLOCK = 64 << 10
NS = b"N" * 16
BACKENDS = ["threads"] + (["io_uring"] if blockio.available() and blockio._native.HAVE_URING else [])
HEADERS = ["inline"] + (["xattr"] if probe_xattr(os.environ.get("TMPDIR", "/tmp")) else [])


class Clock:
    t = 1_700_000_000.25

    def __call__(self):
        return self.t


def tier(path, header, block=BLOCK, ns=NS, clock=None, blocks=256):
    return NvmeTier(path=path, namespace=ns, capacity_bytes=blocks * (block + 8192), ttl_s=None, policy="lru",
                    block_bytes=block, header=header, clock=clock or Clock())


def rows(n, block=BLOCK, seed=0):
    mm, flat = alloc_aligned(n * ff.round_up(block))
    r = flat.reshape(n, ff.round_up(block))
    r[:] = np.random.default_rng(seed).integers(0, 256, r.shape, dtype=np.uint8)
    return mm, r


def keys(n, seed=0):
    rng = np.random.default_rng(seed + 1000)
    return [rng.integers(0, 256, 16, dtype=np.uint8).tobytes() for _ in range(n)]


def put(t, bio, ks, src):
    es = t.reserve(ks)
    oks = bio.write(t, es, list(src)) if bio is not None else [t.write(e, s) for e, s in zip(es, src)]
    t.commit(es, oks)
    return oks


def get(t, bio, ks, out):
    es = t.acquire(ks)
    oks = bio.read(t, es, list(out)) if bio is not None else [t.read(e, o) for e, o in zip(es, out)]
    t.release(es, oks)
    return oks


# "io_uring x4": three helper threads share each batch (a block is done by whichever thread took it)
ENGINES = BACKENDS + (["io_uring x4"] if "io_uring" in BACKENDS else [])


@pytest.fixture(params=ENGINES)
def bio(request):
    backend, _, threads = request.param.partition(" x")
    b = blockio.BlockIO(backend, depth=4, threads=int(threads or 1))
    assert b.backend == backend and b.threads == int(threads or 1)
    yield b
    b.close()


@pytest.mark.skipif(not blockio.checksum_native(), reason="built without libxxhash: checksums come from Python")
def test_xxh3_is_the_file_formats_checksum():
    rng = np.random.default_rng(1)
    for n in (0, 1, 3, 16, 17, 128, 129, 240, 241, 1000, 4096, 65536 + 7, 2 << 20):
        b = rng.integers(0, 256, n, dtype=np.uint8)
        assert blockio._native.xxh3_64(b) == ff.checksum(b), n


@pytest.mark.parametrize("header", HEADERS)
def test_engine_files_are_the_tiers_files(tmp_path, bio, header):
    """Same key, same bytes, one file by the tier, one by the engine: identical but for the created
    time (and the header checksum over it); the tier reads the engine's, the engine the tier's."""
    a, b = tier(tmp_path / "a", header), tier(tmp_path / "b", header)
    ks = keys(9)  # more than the depth: the engine refills
    mm, src = rows(9)
    assert put(a, None, ks, src) == [True] * 9 and put(b, bio, ks, src) == [True] * 9
    assert bio.stats["engine_writes"] == 9 and bio.stats["tier_writes"] == 0
    for k in ks:
        pa, pb = a.path_of(k), b.path_of(k)
        sa, sb = os.stat(pa), os.stat(pb)
        assert (sa.st_size, stat.S_IMODE(sa.st_mode), sa.st_mtime) == (sb.st_size, 0o600, Clock.t)
        da, db = pa.read_bytes(), pb.read_bytes()
        if header == "xattr":
            da, db = os.getxattr(pa, ff.XATTR) + da, os.getxattr(pb, ff.XATTR) + db
        ha, hb = ff.unpack_header(da), ff.unpack_header(db)
        assert ha.checksum == hb.checksum and ha.key == hb.key == k and ha.payload_len == hb.payload_len
        same = lambda d: d[:40] + d[48:80] + d[88:]  # noqa: E731  (created, header checksum)
        assert same(da) == same(db)
    assert not os.listdir(b.tmp)  # no temp file left
    ma, out_a = rows(9, seed=7)
    mb, out_b = rows(9, seed=8)
    assert get(a, bio, ks, out_a) == [True] * 9 and get(b, None, ks, out_b) == [True] * 9
    assert bio.stats["engine_reads"] == 9 and bio.stats["tier_reads"] == 0
    assert np.array_equal(out_a[:, :BLOCK], src[:, :BLOCK]) and np.array_equal(out_b[:, :BLOCK], src[:, :BLOCK])
    b.close()
    again = tier(tmp_path / "b", header)  # the restart scan takes every file
    assert again.stats["scanned"] == 9 and again.stats["dropped_at_scan"] == 0
    for t in (a, again):
        t.close()


@pytest.mark.parametrize("header", HEADERS)
def test_a_read_touches_the_file_with_the_hit_time(tmp_path, bio, header):
    clock = Clock()
    t = tier(tmp_path, header, clock=clock)
    ks = keys(3)
    mm, src = rows(3)
    put(t, bio, ks, src)
    clock.t = Clock.t + 500.5
    mo, out = rows(3, seed=9)
    assert get(t, bio, ks, out) == [True] * 3
    assert {os.stat(t.path_of(k)).st_mtime for k in ks} == {Clock.t + 500.5}
    t.close()


def _flip(p, off):
    with open(p, "r+b") as f:
        f.seek(off)
        c = f.read(1)
        f.seek(off)
        f.write(bytes([c[0] ^ 0x5A]))


def _foreign(tmp_path, header, key, src, dst):
    other = tier(tmp_path / "foreign", header, ns=b"F" * 16)
    put(other, None, [key], src)
    p = other.path_of(key)
    shutil.copyfile(p, dst)
    if header == "xattr":
        os.setxattr(dst, ff.XATTR, os.getxattr(p, ff.XATTR))
    other.close()


def _damage(kind, header, p, tmp_path, key, src):
    hdr = ff.HEADER_BYTES if header == "inline" else 0
    if kind == "payload":
        _flip(p, hdr + 123)
    elif kind == "truncate":
        os.truncate(p, p.stat().st_size - 4096)
    elif kind == "extend":
        with open(p, "ab") as f:
            f.write(b"\0" * 4096)
    elif kind == "empty":
        os.truncate(p, 0)
    elif kind == "header":
        if header == "inline":
            _flip(p, 30)
        else:
            h = bytearray(os.getxattr(p, ff.XATTR))
            h[30] ^= 0x5A
            os.setxattr(p, ff.XATTR, bytes(h))
    elif kind == "foreign":
        _foreign(tmp_path, header, key, src, p)
    elif kind == "fifo":
        p.unlink()
        os.mkfifo(p, 0o600)
    elif kind == "symlink":
        outside = tmp_path / "outside"
        outside.write_bytes(b"keep")
        p.unlink()
        p.symlink_to(outside)


DAMAGE = {"payload": "bad_checksum", "truncate": "truncated", "extend": "bad_size", "empty": "truncated",
          "header": "bad_header", "foreign": "foreign", "fifo": "not_a_file", "symlink": "open_failed"}


@pytest.mark.parametrize("header", HEADERS)
@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_damage_is_the_tiers_counted_removed_miss(tmp_path, bio, header, kind):
    """The same damage in two folders: the tier's own read and the engine's give the same verdict."""
    verdicts = []
    for who in ("tier", "engine"):
        t = tier(tmp_path / who, header)
        ks = keys(6)
        mm, src = rows(6)
        put(t, bio, ks, src)
        p = t.path_of(ks[2])
        _damage(kind, header, p, tmp_path / who, ks[2], src[2:3])
        mo, out = rows(6, seed=9)  # page aligned: the engine takes every block
        oks = get(t, bio if who == "engine" else None, ks, out)
        assert oks == [True, True, False, True, True, True]
        assert t.stats["corrupt"] == 1
        assert not os.path.lexists(p)  # removed: the name itself, never what a symlink points at
        if kind == "symlink":
            assert (tmp_path / who / "outside").read_bytes() == b"keep"
        good = [0, 1, 3, 4, 5]
        assert np.array_equal(out[good, :BLOCK], src[good, :BLOCK])
        if who == "engine":
            assert bio.stats["engine_reads"] == 5 and bio.stats["tier_reads"] == 1
        verdicts.append(dict(t.corrupt_reasons))
        t.close()
    expect = DAMAGE[kind]
    if kind == "fifo" and verdicts[0] == {"open_failed": 1}:
        expect = "open_failed"  # O_DIRECT: opening a FIFO is EINVAL before fstat could say what it is
    assert verdicts == [{expect: 1}, {expect: 1}]


def _both(tmp_path, bio, header, n, damage, op):
    """Store ``n`` blocks in two folders, damage both alike, then ``op`` ("get" or "put" of fresh
    keys) through the tier's own path in one and the engine in the other: (oks, stats, reasons) each."""
    seen = []
    for who in ("tier", "engine"):
        t = tier(tmp_path / who, header)
        ks = keys(n)
        mm, src = rows(n)
        if op == "get":
            put(t, bio, ks, src)
        damage(t, ks, tmp_path / who)
        mo, out = rows(n, seed=9)
        b = bio if who == "engine" else None
        oks = get(t, b, ks, out) if op == "get" else put(t, b, ks, src)
        if op == "get":
            good = [i for i, o in enumerate(oks) if o]
            assert np.array_equal(out[good, :BLOCK], src[good, :BLOCK]), "wrong bytes served"
        seen.append((oks, dict(t.stats), dict(t.corrupt_reasons), sorted(os.listdir(t.tmp))))
        t.close()
    assert seen[0] == seen[1]
    assert bio.stats["engine_" + ("reads" if op == "get" else "writes")] > 0  # the engine took the good ones
    return seen[1]


def _planted_leaf_symlink(t, ks, where):
    leaf = t.path_of(ks[1]).parent
    shutil.move(leaf, where / "moved")
    leaf.symlink_to(where / "moved")  # a fan-out folder swapped for a symlink to a valid one


def test_a_file_gone_is_a_miss_and_a_planted_leaf_symlink_is_never_followed(tmp_path, bio):
    def damage(t, ks, where):
        t.path_of(ks[0]).unlink()
        _planted_leaf_symlink(t, ks, where)

    oks, stats, reasons, _ = _both(tmp_path, bio, "inline", 3, damage, "get")
    assert oks == [False, False, True] and stats["missing"] >= 1
    for who in ("tier", "engine"):
        assert (tmp_path / who / "moved").is_dir()  # not followed into, not removed


def _loose_modes(t, ks, where):
    os.chmod(t.path_of(ks[0]), 0o644)  # ours, readable by others: the tier fixes it
    os.chmod(t.path_of(ks[1]), 0o666)  # writable by others: never served
    os.chmod(t.path_of(ks[2]).parent, 0o755)


def test_loose_modes_get_the_tiers_verdict(tmp_path, bio):
    oks, stats, reasons, _ = _both(tmp_path, bio, "inline", 4, _loose_modes, "get")
    assert oks[1] is False and oks[3] is True


@pytest.mark.parametrize("header", HEADERS)
def test_a_write_in_the_way_gets_the_tiers_handling(tmp_path, bio, header):
    def damage(t, ks, where):
        bad = t.path_of(ks[3]).parent
        bad.rmdir()  # (made at start, empty)
        bad.write_bytes(b"not a folder")  # the leaf folder's name is taken by a file
        t.path_of(ks[1]).parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        t.path_of(ks[1]).mkdir(mode=0o700)  # a folder planted at a block path

    oks, stats, reasons, tmp = _both(tmp_path, bio, header, 5, damage, "put")
    assert oks[0] and oks[2] and oks[4] and not tmp  # no temp file left


def test_a_full_disk_shrinks_the_tier_as_the_tiers_own_write(tmp_path, bio):
    t = tier(tmp_path / "t", "inline")
    ks = keys(4)
    mm, src = rows(4)
    put(t, bio, ks[:2], src[:2])
    cap = t.index.capacity
    failpoints.arm("nvme.write=enospc*1")  # armed: every block goes through the tier's own write
    try:
        oks = put(t, bio, ks[2:], src[2:])
    finally:
        failpoints.clear()
    assert oks == [False, True] and t.stats["disk_full"] == 1 and t.index.capacity < cap
    t.close()


# Run in a child: RLIMIT_FSIZE holds for the whole process, and pytest's own files must not hit it.
_EFBIG = r"""
import json, os, resource, signal, sys
from pathlib import Path
sys.path.insert(0, sys.argv[4])
from test_blockio import BLOCK, blockio, keys, put, rows, tier
path, backend, header = sys.argv[1:4]
t, bio = tier(Path(path), header), blockio.BlockIO(backend, depth=4)
ks, (mm, src) = keys(8), rows(8)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead of killing us
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (16 << 10, hard))  # a quarter block: each write stops part-way
bad, during = put(t, bio, ks[:4], src[:4]), dict(bio.stats)
resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
left = sorted(str(p.relative_to(path)) for p in Path(path).rglob("*") if p.is_file())
gone = [e is None for e in t.acquire(ks[:4])]
good = put(t, bio, ks[4:], src[4:])
mo, out = rows(4, seed=9)
es = t.acquire(ks[4:])
got = bio.read(t, es, list(out))
t.release(es, got)
same = all(bytes(out[i][:BLOCK]) == bytes(src[4 + i][:BLOCK]) for i in range(4))
print(json.dumps({"bad": bad, "during": during, "left": left, "gone": gone, "good": good, "got": got,
                  "same": same, "after": bio.stats, "failed": t.stats["write_failed"]}))
bio.close()
t.close()
"""


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("header", HEADERS)
def test_a_real_write_error_in_the_engine_leaves_nothing_and_the_next_writes_work(tmp_path, backend, header):
    """The kernel fails the engine's own writes part-way (EFBIG from a 16 KiB RLIMIT_FSIZE, no
    failpoint: the blocks go through the engine): every block is refused, no half file or temp
    file stays, no key is indexed; the failure is counted; with the limit lifted the next blocks
    go through the engine and read back right."""
    r = subprocess.run([sys.executable, "-c", _EFBIG, str(tmp_path / "t"), backend, header,
                        os.path.dirname(__file__)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    v = json.loads(r.stdout.strip().splitlines()[-1])
    assert v["bad"] == [False] * 4 and v["gone"] == [True] * 4 and v["failed"] == 4
    assert v["left"] == [], f"files left by failed writes: {v['left']}"
    # the engine took them (none served) and handed each failure to the tier, whose retry failed too
    assert v["during"]["engine_writes"] == 0 and v["during"]["tier_writes"] == 4
    assert v["good"] == [True] * 4 and v["got"] == [True] * 4 and v["same"]
    assert v["after"]["engine_writes"] == 4 and v["after"]["engine_reads"] == 4


def test_checksums_from_python_when_the_engine_has_none(tmp_path, bio, monkeypatch):
    """A build without libxxhash: the wrapper hashes, the engine only writes and reads."""
    monkeypatch.setattr(blockio, "checksum_native", lambda: False)
    t = tier(tmp_path / "t", "inline")
    ks = keys(4)
    mm, src = rows(4)
    assert put(t, bio, ks, src) == [True] * 4
    _flip(t.path_of(ks[1]), ff.HEADER_BYTES + 5)
    mo, out = rows(4, seed=9)
    assert get(t, bio, ks, out) == [True, False, True, True] and t.corrupt_reasons == {"bad_checksum": 1}
    assert bio.stats["engine_writes"] == 4 and bio.stats["engine_reads"] == 3
    assert np.array_equal(out[0, :BLOCK], src[0, :BLOCK])
    t.close()


def test_unaligned_or_codec_blocks_take_the_tiers_path(tmp_path, bio):
    t = tier(tmp_path / "t", "inline", block=5000)  # padded to 8 KiB: a 5,000-byte row is too short
    ks = keys(3)
    src = np.random.default_rng(3).integers(0, 256, (3, 5000), dtype=np.uint8)
    assert put(t, bio, ks, src) == [True] * 3
    out = np.zeros_like(src)
    assert get(t, bio, ks, out) == [True] * 3 and np.array_equal(out, src)
    assert bio.stats["engine_writes"] == bio.stats["engine_reads"] == 0
    t.close()


def test_bad_arguments_are_clear_errors():
    with pytest.raises(ValueError, match="auto, io_uring or threads"):
        blockio._native.Engine("fast", 4)
    e = blockio.BlockIO("threads", 2)
    assert e.reason == "threads asked for"
    e.close()
    with pytest.raises(RuntimeError, match="closed"):
        e.write(None, [], [])


# -- the engine in the store (tiers.nvme.engine): moves.py hands it a batch, or each I/O thread's part --
def _store(path, engine, block=BLOCK, dram_blocks=0, nvme_blocks=64, header="inline", depth="auto"):
    from kvstore.config import from_dict
    from kvstore.keys import ModelFingerprint
    from kvstore.store import KVStore

    fp = ModelFingerprint(model="engine-wiring", dtype="uint8", block_size=1, num_layers=1, num_kv_heads=1,
                          head_size=block)
    cfg = from_dict({"tiers": {"dram": {"capacity_gb": dram_blocks * ff.round_up(block) / 2**30, "pin_memory": False},
                               "nvme": {"path": str(path), "capacity_gb": nvme_blocks * ff.file_bytes(block) / 2**30,
                                        "ttl_s": None, "io_threads": 4, "engine": engine, "header": header,
                                        "engine_depth": depth}}})
    return KVStore(cfg, block_bytes=block, fingerprint=fp, clock=Clock())


def test_the_engine_depth_is_the_configs_or_about_16_mib_in_flight(tmp_path):
    """tiers.nvme.engine_depth: a number as given; auto: about 16 MiB in flight over the I/O
    threads, between 2 and 8 a thread (2 for 2 MiB blocks and 4 threads); the thread pool that
    stands in for io_uring keeps its 8 workers. At depth 1 (each block
    opened, read and hashed with nothing else in flight) the blocks still all go through the
    engine and come back right."""
    from kvstore.tiers.nvme.tier import auto_depth

    assert [auto_depth(b, 4) for b in (256 << 10, 1 << 20, 2 << 20, (2 << 20) + 4096, 32 << 20)] == [8, 4, 2, 2, 2]
    assert auto_depth(2 << 20, 1) == 8 and auto_depth(4 << 20, 1) == 4
    auto, one = _store(tmp_path / "auto", "auto"), _store(tmp_path / "one", "auto", depth=1)
    assert auto.nvme.engine.depth == auto_depth(auto.nvme.file_bytes, 4) == 8  # a small block: 8
    assert one.nvme.engine.depth == 1
    pool = _store(tmp_path / "pool", "threads")  # no io_uring: its thread pool, 8 workers shared by every caller
    assert pool.nvme.engine.backend == "threads" and pool.nvme.engine.depth == 8
    pool.close()
    ks = keys(40)
    mm, src = rows(40)
    mo, out = rows(40, seed=5)
    assert one.put(ks, src) == 40 and one.get(ks, out) == 40 and np.array_equal(out, src)
    assert one.nvme.engine.stats["engine_writes"] == 40 and one.nvme.engine.stats["engine_reads"] == 40
    auto.close()
    one.close()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("header", HEADERS)
def test_the_store_moves_blocks_through_the_engine_same_files_as_without(tmp_path, backend, header):
    """A store with the engine on and one with it off, the same blocks: the same files (but for the
    created time), every block through the engine (a batch a call, or a part per I/O thread), read back
    right by both; a full cache recycles files through the engine too."""
    on, off = _store(tmp_path / "on", backend, header=header), _store(tmp_path / "off", "off", header=header)
    assert on.nvme.engine.backend == backend and off.nvme.engine is None
    ks = keys(40)
    mm, src = rows(40)
    assert on.put(ks, src) == 40 and off.put(ks, src) == 40
    e = on.nvme.engine
    assert e.stats["engine_writes"] == 40 and e.stats["tier_writes"] == 0
    for k in ks:
        pa, pb = on.nvme.path_of(k), off.nvme.path_of(k)
        da, db = pa.read_bytes(), pb.read_bytes()
        if header == "xattr":
            da, db = os.getxattr(pa, ff.XATTR) + da, os.getxattr(pb, ff.XATTR) + db
        same = lambda d: d[:40] + d[48:80] + d[88:]  # noqa: E731  (created, header checksum)
        assert same(da) == same(db) and os.stat(pa).st_mtime == os.stat(pb).st_mtime
    mo, out = rows(40, seed=5)
    assert on.get(ks, out) == 40 and np.array_equal(out, src)
    assert e.stats["engine_reads"] == 40 and e.stats["tier_reads"] == 0
    more = keys(40, seed=3)
    assert on.put(more, src) == 40  # a full cache (room for 64): 16 victims' files reused
    on.flush()
    assert on.nvme.pool.stats["reused"] >= 1 and e.stats["engine_writes"] == 80
    assert on.get(more, out) == 40 and np.array_equal(out, src)
    on.close()
    off.close()


def test_the_store_falls_back_to_the_tiers_path_for_anything_unusual(tmp_path):
    """A block size the engine does not take (not 4 KiB aligned: the tier's bounce buffer), or a
    failpoint armed: every block goes through the tier's own write and read, the bytes right."""
    odd = 5000
    s = _store(tmp_path / "odd", "auto", block=odd)
    ks = keys(8)
    src = np.random.default_rng(3).integers(0, 256, (8, odd), dtype=np.uint8)
    assert s.put(ks, src) == 8
    out = np.zeros_like(src)
    assert s.get(ks, out) == 8 and np.array_equal(out, src)
    e = s.nvme.engine
    assert e.stats["engine_writes"] == e.stats["engine_reads"] == 0 and e.stats["tier_writes"] == 8
    s.close()
    s = _store(tmp_path / "fp", "auto")
    mm, src = rows(8)
    failpoints.arm("nvme.read=slow*0")  # armed (never fires): the engine steps aside
    try:
        assert s.put(keys(8), src) == 8
    finally:
        failpoints.clear()
    assert s.nvme.engine.stats["engine_writes"] == 0 and s.nvme.engine.stats["tier_writes"] == 8
    s.close()


def test_demotions_from_dram_go_through_the_engine(tmp_path):
    """DRAM victims are written down from their slots (page aligned, padded): in parts, through the
    engine; every block reads back right from NVMe."""
    s = _store(tmp_path, "auto", dram_blocks=8, nvme_blocks=64)
    ks = keys(40)
    mm, src = rows(40)
    for i in range(0, 40, 8):
        assert s.put(ks[i: i + 8], src[i: i + 8]) == 8
    s.flush()
    # how many victims a demotion batch holds depends on timing (a lone victim takes the tier's
    # path): 24+ of the 32 went through the engine in most runs, 20 once on CI; at least one batch must
    assert s.nvme.engine.stats["engine_writes"] >= 2
    mo, out = rows(40, seed=5)
    assert s.get(ks, out) == 40 and np.array_equal(out, src)
    s.close()


# -- helper threads (io_uring, threads > 1): a batch shared off one cursor --------------------------
def _bio_threads() -> int:
    return sum(1 for t in os.listdir("/proc/self/task")
               if open(f"/proc/self/task/{t}/comm").read().strip() == "kvstore-bio")


@pytest.mark.skipif("io_uring" not in BACKENDS, reason="io_uring refused here: no helper threads")
@pytest.mark.parametrize("header", HEADERS)
def test_helpers_take_blocks_of_a_callers_batch_and_end_with_the_engine(tmp_path, header):
    """threads=4: three helper threads (bounded: the same three for every batch, joined at close)
    take blocks of a caller's batch off its cursor: within a few batches some block is theirs, and
    every block of every batch is written and read back right."""
    before = _bio_threads()
    b = blockio.BlockIO("io_uring", depth=2, threads=4)
    assert b.threads == 4 and _bio_threads() == before + 3
    t = tier(tmp_path, header, blocks=20 * 64)
    n = 64
    mm, src = rows(n)
    mo, out = rows(n, seed=9)
    for attempt in range(20):  # a helper wakes within microseconds; a loaded machine may let the caller finish first
        ks = keys(n, seed=attempt)
        assert put(t, b, ks, src) == [True] * n
        out[:] = 0
        assert get(t, b, ks, out) == [True] * n and np.array_equal(out, src)
        if b.helped:
            break
    assert b.helped > 0 and b.stats["engine_writes"] == b.stats["engine_reads"] == n * (attempt + 1)
    b.close()
    assert _bio_threads() == before
    t.close()
    one = blockio.BlockIO("io_uring", depth=2)  # threads=1: no helpers
    assert one.threads == 1 and _bio_threads() == before
    one.close()


@pytest.mark.skipif("io_uring" not in BACKENDS, reason="io_uring refused here: no helper threads")
def test_many_callers_at_once_share_the_helpers_and_all_come_back_right(tmp_path):
    """Six callers at once on one engine with helpers (more callers than its threads: each caller
    runs its own batch, helpers join whichever is open): every batch is right, none hangs."""
    import threading

    b = blockio.BlockIO("io_uring", depth=2, threads=4)
    t = tier(tmp_path, "inline", blocks=6 * 6 * 8)
    errors: list[str] = []

    def caller(c: int) -> None:
        mm, src = rows(8, seed=c)
        mo, out = rows(8, seed=100 + c)
        for r in range(6):
            ks = keys(8, seed=1000 * c + r)
            if put(t, b, ks, src) != [True] * 8:
                errors.append(f"caller {c} round {r}: a write failed")
            out[:] = 0
            if get(t, b, ks, out) != [True] * 8 or not np.array_equal(out, src):
                errors.append(f"caller {c} round {r}: wrong bytes")

    ths = [threading.Thread(target=caller, args=(c,)) for c in range(6)]
    for th in ths:
        th.start()
    for th in ths:
        th.join(timeout=120)
    assert not any(th.is_alive() for th in ths), "a caller hangs"
    assert errors == [] and b.stats["engine_reads"] == 6 * 6 * 8
    b.close()
    t.close()


def test_a_tier_whose_engine_spreads_gets_one_call_a_batch(tmp_path, monkeypatch):
    """The mover cuts a batch per I/O thread only where the tier does not spread it itself: the
    io_uring engine with helpers (``spreads``) gets one read_many / write_many call a batch; the
    thread pool, a codec (the tier's own path per block) or no engine, a call per I/O thread."""
    calls: list[tuple[str, int]] = []
    for op in ("read_many", "write_many"):
        real = getattr(NvmeTier, op)
        monkeypatch.setattr(NvmeTier, op, lambda self, es, bufs, _r=real, _op=op: calls.append((_op, len(es)))
                            or _r(self, es, bufs))
    cases = [("threads", None), ("off", None), ("auto", "zstd")] + ([("io_uring", None)] if "io_uring" in BACKENDS else [])
    for engine, codec in cases:
        s = _store(tmp_path / f"{engine}-{codec}", engine)
        if codec is not None:
            s.close()
            from kvstore.config import from_dict
            from kvstore.keys import ModelFingerprint
            from kvstore.store import KVStore
            cfg = from_dict({"tiers": {"dram": {"capacity_gb": 0}, "nvme": {
                "path": str(tmp_path / "zstd"), "capacity_gb": 64 * ff.file_bytes(BLOCK) / 2**30, "ttl_s": None,
                "io_threads": 4, "engine": "auto", "codec": "zstd"}}})
            s = KVStore(cfg, block_bytes=BLOCK, fingerprint=ModelFingerprint(
                model="engine-wiring", dtype="uint8", block_size=1, num_layers=1, num_kv_heads=1, head_size=BLOCK),
                clock=Clock())
        spreads = engine == "io_uring"
        assert s.nvme.spreads is spreads, (engine, codec)
        ks = keys(40)
        mm, src = rows(40)
        mo, out = rows(40, seed=5)
        calls.clear()
        assert s.put(ks, src) == 40
        assert s.get(ks, out) == 40 and np.array_equal(out, src)
        want = [40] if spreads else [10, 10, 10, 10]
        assert sorted(n for op, n in calls if op == "write_many") == want, (engine, codec, calls)
        assert sorted(n for op, n in calls if op == "read_many") == want, (engine, codec, calls)
        s.close()


def test_a_load_without_buffers_reads_into_aligned_ones_through_the_engine(tmp_path):
    """No DRAM slot and no caller buffer: the store's private buffers are page aligned and padded,
    so the engine reads every block (an unaligned np.empty row took the tier's bounce buffer, one
    block at a time); each view is the block, right."""
    s = _store(tmp_path, "auto")  # NVMe only
    ks = keys(40)
    mm, src = rows(40)
    assert s.put(ks, src) == 40
    h = s.begin_load(ks)
    try:
        assert h.num_blocks == 40
        for i in range(40):
            assert h.views[i].nbytes == BLOCK and np.array_equal(h.views[i], src[i][:BLOCK])
    finally:
        s.end_load(h)
    e = s.nvme.engine
    assert e.stats["engine_reads"] == 40 and e.stats["tier_reads"] == 0
    s.close()


_FAILED_WAITS = r"""
import json, sys
from pathlib import Path
sys.path.insert(0, sys.argv[2])
from test_blockio import BLOCK, blockio, get, keys, put, rows, tier
t, bio = tier(Path(sys.argv[1]), "inline"), blockio.BlockIO("io_uring", depth=4)
ks, (mm, src) = keys(16), rows(16)
wrote = put(t, bio, ks, src)
mo, out = rows(16, seed=7)
got = get(t, bio, ks, out)
same = [bytes(out[i][:BLOCK]) == bytes(src[i][:BLOCK]) for i in range(16)]
print(json.dumps({"wrote": wrote, "got": got, "same": same, "wait_errors": bio.wait_errors}))
bio.close()
t.close()
"""


@pytest.mark.skipif("io_uring" not in BACKENDS, reason="io_uring refused here")
def test_a_failed_io_uring_wait_keeps_reaping_until_the_io_in_flight_is_done(tmp_path):
    """io_uring_wait_cqe failing with blocks in flight (made to fail by the engine's test hook:
    the kernel gives no way): the engine waits again until every completion is reaped, so no
    buffer goes back to the caller with I/O on it. It used to fail the blocks in flight at once
    and close the ring, while the disk could still DMA into buffers the caller then reused."""
    env = dict(os.environ, KVSTORE_BLOCKIO_FAIL_WAITS="6")
    r = subprocess.run([sys.executable, "-c", _FAILED_WAITS, str(tmp_path / "t"), os.path.dirname(__file__)],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    v = json.loads(r.stdout.strip().splitlines()[-1])
    assert v["wrote"] == [True] * 16 and v["got"] == [True] * 16 and all(v["same"])  # blocks in flight: done
    assert v["wait_errors"] == 6
