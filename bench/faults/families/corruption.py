"""Fault family 2, ``corruption``: byte flips, truncation, zero length, wrong header fields, files
that are not ours, symlinks, folders and FIFOs where files should be; at read time and at the
start-up scan, inline and xattr headers. Every case must be a counted miss."""

from __future__ import annotations

import errno
import os
import random
import shutil
import time
import traceback
from pathlib import Path
from typing import Callable

import numpy as np
import xxhash

from kvstore.bench.faults.families.common import Hang, alarm, block_of, corrupt_total, key_of, open_store, read_check
from kvstore.tiers import fileformat as ff

_HFMT = "<8sIIIIQQd16s16s"


def craft_header(*, magic=ff.MAGIC, version=ff.VERSION, hlen=ff.HEADER_BYTES, codec=0, flags=0, plen=0, chk=0,
                 created=0.0, fp=b"\0" * 16, key=b"\0" * 16, fix_checksum: bool = True) -> bytes:
    """HEADER_CORE bytes of a header with any field values (a valid header checksum by default)."""
    import struct

    body = struct.pack(_HFMT, magic, version, hlen, codec, flags, plen, chk, created, fp, key)
    hc = xxhash.xxh3_64_intdigest(body) if fix_checksum else xxhash.xxh3_64_intdigest(body) ^ 1
    return body + struct.pack("<Q", hc)


def get_header(tier, path: Path) -> bytes:
    if tier.header == "xattr":
        try:
            return os.getxattr(path, ff.XATTR, follow_symlinks=False)
        except OSError as e:
            if e.errno != errno.ENODATA:
                raise
            return b""
    with open(path, "rb") as f:
        return f.read(ff.HEADER_CORE)


def set_header(tier, path: Path, raw: bytes) -> None:
    if tier.header == "xattr":
        os.setxattr(path, ff.XATTR, raw, follow_symlinks=False)
    else:
        with open(path, "r+b") as f:
            f.write(raw)


def _fields(tier, path: Path) -> dict:
    h = ff.unpack_header(get_header(tier, path))
    return {"codec": h.codec_id, "plen": h.payload_len, "chk": h.checksum, "created": h.created,
            "fp": h.fingerprint, "key": h.key}


def _rewrite(tier, path: Path, **change) -> None:
    f = _fields(tier, path)
    f.update(change)
    set_header(tier, path, craft_header(**f))


def _flip(path: Path, lo: int, hi: int, rng: random.Random, n: int = 3) -> None:
    with open(path, "r+b") as f:
        for _ in range(rng.randint(1, n)):
            off = rng.randrange(lo, hi)
            f.seek(off)
            b = f.read(1)
            f.seek(off)
            f.write(bytes([b[0] ^ rng.randrange(1, 256)]))


def _flip_header(tier, path: Path, rng: random.Random) -> None:
    raw = bytearray(get_header(tier, path))
    for _ in range(rng.randint(1, 3)):
        raw[rng.randrange(len(raw))] ^= rng.randrange(1, 256)
    set_header(tier, path, bytes(raw))


def _payload_range(tier, path: Path) -> tuple[int, int]:
    off = 0 if tier.header == "xattr" else ff.HEADER_BYTES
    return off, off + tier.block_bytes


def _replace(path: Path, make: Callable[[Path], None]) -> None:
    os.unlink(path)
    make(path)


def _valid_copy(path: Path, outside: Path) -> Path:
    outside.mkdir(exist_ok=True)
    dst = outside / f"copy-{path.name}-{time.monotonic_ns()}"
    shutil.copy2(path, dst)
    try:
        os.setxattr(dst, ff.XATTR, os.getxattr(path, ff.XATTR))
    except OSError:
        pass
    return dst


def damages(outside: Path) -> dict[str, Callable]:
    """name -> damage(tier, key, path, rng); each leaves a file that must never be served."""
    def other_key(k):
        return xxhash.xxh3_128_digest(k + b"other")

    return {
        "flip_header": lambda t, k, p, r: _flip_header(t, p, r),
        "flip_payload": lambda t, k, p, r: _flip(p, *_payload_range(t, p), r),
        "truncate": lambda t, k, p, r: os.truncate(p, r.randrange(1, os.path.getsize(p))),
        "zero_length": lambda t, k, p, r: os.truncate(p, 0),
        "extend": lambda t, k, p, r: open(p, "ab").write(os.urandom(r.randint(1, 8192))),
        "wrong_magic": lambda t, k, p, r: _rewrite(t, p, magic=b"NOTKVST\x01"),
        "wrong_version": lambda t, k, p, r: _rewrite(t, p, version=ff.VERSION + r.randint(1, 1000)),
        "wrong_header_len": lambda t, k, p, r: _rewrite(t, p, hlen=r.choice([0, 512, 8192, 2**32 - 1])),
        "wrong_fingerprint": lambda t, k, p, r: _rewrite(t, p, fp=os.urandom(16)),
        "wrong_key": lambda t, k, p, r: _rewrite(t, p, key=other_key(k)),
        "wrong_codec": lambda t, k, p, r: _rewrite(t, p, codec=r.choice([1, 2, 5, 99, 2**32 - 1])),
        "huge_length": lambda t, k, p, r: _rewrite(t, p, plen=r.choice([2**63 - 1, 2**64 - 1, 1 << 40])),
        "zero_declared_length": lambda t, k, p, r: _rewrite(t, p, plen=0),
        "wrong_checksum_field": lambda t, k, p, r: _rewrite(t, p, chk=r.getrandbits(64)),
        "header_checksum_only": lambda t, k, p, r: set_header(t, p, get_header(t, p)[:-8] + os.urandom(8)),
        "not_ours_random": lambda t, k, p, r: _replace(p, lambda q: q.write_bytes(os.urandom(t.file_bytes))),
        "not_ours_text": lambda t, k, p, r: _replace(p, lambda q: q.write_text("not a block file\n")),
        "symlink_to_valid_copy": lambda t, k, p, r: (lambda dst: _replace(p, lambda q: q.symlink_to(dst)))(
            _valid_copy(p, outside)),
        "symlink_dangling": lambda t, k, p, r: _replace(p, lambda q: q.symlink_to(outside / "nowhere")),
        "folder": lambda t, k, p, r: _replace(p, lambda q: (q.mkdir(), (q / "x").write_bytes(b"x"))),
        "fifo": lambda t, k, p, r: _replace(p, lambda q: os.mkfifo(q, 0o600)),
        "no_header_attr": lambda t, k, p, r: (os.removexattr(p, ff.XATTR) if t.header == "xattr"
                                              else _rewrite(t, p, magic=b"\0" * 8)),
    }


def corruption(folder, *, rounds: int = 1, seed: int = 0, block_bytes: int = 16384,
               advance: Callable[[], None] | None = None) -> dict:
    """Every damage, at read time and at the start-up scan, for each header layout."""
    from kvstore.tiers.nvme.folder import probe_xattr

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    rng = random.Random(seed)
    outside = folder / "outside"
    dmg = damages(outside)
    layouts = ["inline"] + (["xattr"] if probe_xattr(folder) else [])
    res = {"corrupt_cases": 0, "corrupt_misses": 0, "corrupt_counted": 0, "corrupt_uncounted_cases": [],
           "corrupt_reads_served": 0, "corrupt_crashes": 0, "corrupt_hangs": 0, "corrupt_layouts": layouts,
           "corrupt_junk_files": 0, "corrupt_examples": []}
    names = sorted(dmg)
    n_idx = 0
    for layout in layouts:
        path = folder / f"cache-{layout}"
        for rnd_i in range(rounds):
            # read time: damage a file under a running store, then read it
            s = open_store(path, block_bytes=block_bytes, nvme_blocks=4 * len(names), header=layout)
            try:
                keys = [key_of(f"corrupt-{layout}", n_idx + i) for i in range(len(names))]
                n_idx += len(names)
                s.put(keys, np.stack([block_of(k, block_bytes) for k in keys]))
                for name, k in zip(names, keys):
                    _case(res, s, name, k, lambda: dmg[name](s.nvme, k, s.nvme.path_of(k), rng), phase="read")
            finally:
                s.close()
            # start-up scan: damage files of a closed store, reopen (plus junk that is not ours)
            s = open_store(path, block_bytes=block_bytes, nvme_blocks=4 * len(names), header=layout)
            keys = [key_of(f"corrupt-{layout}", n_idx + i) for i in range(len(names))]
            n_idx += len(names)
            s.put(keys, np.stack([block_of(k, block_bytes) for k in keys]))
            tier = s.nvme
            s.close()
            errors = []
            for name, k in zip(names, keys):
                try:
                    dmg[name](tier, k, tier.path_of(k), rng)
                except Exception as e:
                    errors.append(f"{name}: {e!r}")
            res["corrupt_junk_files"] += _plant_junk(Path(tier.root), rng)
            try:
                with alarm(20):
                    s2 = open_store(path, block_bytes=block_bytes, nvme_blocks=4 * len(names), header=layout)
            except Hang:
                res["corrupt_hangs"] += 1
                continue
            except Exception:
                res["corrupt_crashes"] += 1
                res["corrupt_examples"].append(traceback.format_exc()[-1500:])
                continue
            try:
                scan_counted = corrupt_total(s2.nvme)
                res["corrupt_counted"] += scan_counted
                for name, k in zip(names, keys):
                    _case(res, s2, name, k, None, phase="scan", scan_counted=scan_counted)
            finally:
                s2.close()
            res["corrupt_examples"].extend(errors)
            if advance:
                advance()
    res["corrupt_uncounted_cases"] = sorted(set(res["corrupt_uncounted_cases"]))
    res["corrupt_examples"] = res["corrupt_examples"][:5]
    return res


def _case(res: dict, s, name: str, k: bytes, damage, *, phase: str, scan_counted: int = 0) -> None:
    res["corrupt_cases"] += 1
    before = corrupt_total(s.nvme)
    try:
        if damage is not None:
            damage()
        with alarm(20):
            n, wrong = read_check(s, [k])
    except Hang:
        res["corrupt_hangs"] += 1
        return
    except Exception:
        res["corrupt_crashes"] += 1
        res["corrupt_examples"].append(f"{phase} {name}: " + traceback.format_exc()[-1500:])
        return
    counted = corrupt_total(s.nvme) - before
    res["corrupt_counted"] += counted
    if n == 0:
        res["corrupt_misses"] += 1
    else:
        res["corrupt_reads_served"] += 1  # a damaged file was served at all (wrong bytes or not)
        res["corrupt_examples"].append(f"{phase} {name}: served ({wrong} wrong)")
    if counted == 0 and not (phase == "scan" and not s.nvme.present_or_writing(k) and scan_counted > 0):
        res["corrupt_uncounted_cases"].append(f"{phase}:{name}")


def _plant_junk(root: Path, rng: random.Random) -> int:
    """Files that are not ours, where the scan looks: top level, fan-out folders, bad names, a FIFO."""
    n = 0
    leafs = [d for d in root.glob("??") if d.is_dir() and not d.is_symlink()]
    spots = [root / "notes.txt", root / "zz", root / "ab" / "zz.kvb"]
    for d in leafs[:4]:
        spots += [d / "README", d / ("0" * 32 + ".kvb"), d / (d.name + "x" * 30 + ".kvb"),
                  d / ("f" * 32 + ".kvb.tmp")]
    for p in spots:
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
            if p.exists() or p.is_symlink():
                continue
            p.write_bytes(os.urandom(rng.choice([0, 17, 4096, 20480])))
            n += 1
        except OSError:
            pass
    if leafs:
        try:
            os.mkfifo(leafs[0] / ("e" * 32 + ".kvb"), 0o600)
            n += 1
        except OSError:
            pass
    return n
