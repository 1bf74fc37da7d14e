"""``kvstore bench faults``: the fault suite, long form (the short form runs in CI: tests/test_faults.py).

One function per fault family; each returns a dict of figures:

1. ``crash``       — a writer process (puts with evictions, DRAM demotions, reads) killed with
   SIGKILL at random points, over and over; after each restart every indexed block reads back
   byte-identical, no temporary or orphan file is left, the index matches the folder.
2. ``corruption``  — byte flips, truncation, zero length, wrong magic/version/fingerprint/key/
   codec, a huge declared length, files that are not ours, symlinks, folders and FIFOs where
   files should be; at read time and at the start-up scan, inline and xattr headers. Every
   case must be a counted miss: nothing served, no exception, no hang.
3. ``fuzz``        — the file-header parser (and the tier's checks behind it) on random and
   mutated headers; then fuzzed headers written into real block files, read and scanned.
4. ``disk_full``   — the NVMe tier on a small tmpfs (``mount -t tmpfs -o size=``, needs root)
   filled far past capacity: writes fail soft, the tier shrinks, the store keeps serving.
5. ``sharing``     — two processes on one NVMe folder at once (one deletes what the other
   reads, both write, both reopen to see the other's files): no wrong read, no lost write.
6. ``churn``       — a long put/get/prefetch/evict/expire/reopen run; RSS, open files and
   threads sampled (drift = last sample minus the sample after warm-up).
7. ``bad_input``   — bad configs, wrong types, negative sizes, unusable or unsafe folders,
   malformed traces: each must be refused with a clear error (ConfigError/ValueError/TraceError).
8. ``permissions`` — the folders the other families left: files 0600, folders 0700, no
   symlink; bad keys refused; no pickling in the core.
9. ``engine``      — real vLLM engines (bench/faults_engine.py): every way a load can fail,
   injected after the store is filled and followed through the requests after it; DRAM tier
   off and on, in-process and (long run) multiprocess. ``corrupt_served`` (follow-ups whose
   output differs from vLLM's own prefix cache) and ``poisoned_stores`` (blocks left in the
   store whose KV differs from a clean run's under the same key) must both be 0.

``--quick`` runs the CI-sized version. ``--json PATH`` writes every figure (the headline ones
at the top level: crash_cycles, corrupt_reads_served, fuzz_inputs, fuzz_crashes,
disk_full_engine_errors, shared_wrong_reads, rss_drift_mb, fd_drift).
"""

from __future__ import annotations

import argparse
import errno
import json
import math
import os
import random
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Callable

import numpy as np
import xxhash

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from bench.report import markdown_table, progress, write_json  # noqa: E402
from kvstore import fileformat as ff  # noqa: E402
from kvstore.config import GiB, ConfigError, from_dict  # noqa: E402
from kvstore.keys import ModelFingerprint  # noqa: E402

FP = ModelFingerprint(model="faults", dtype="float16", block_size=16, num_layers=2, num_kv_heads=2, head_size=8)
FP_ARGS = {"model": FP.model, "dtype": FP.dtype, "block_size": FP.block_size, "num_layers": FP.num_layers,
           "num_kv_heads": FP.num_kv_heads, "head_size": FP.head_size}

SIZES = {
    "quick": {"crash_cycles": 12, "corruption_rounds": 1, "fuzz_inputs": 20_000, "fuzz_files": 300,
              "disk_full_mb": 3, "sharing_ops": 400, "churn_ops": 1_500},
    "long": {"crash_cycles": 220, "corruption_rounds": 6, "fuzz_inputs": 300_000, "fuzz_files": 3_000,
             "disk_full_mb": 8, "sharing_ops": 4_000, "churn_ops": 15_000},
}
HEADLINE = ("crash_cycles", "corrupt_reads_served", "fuzz_inputs", "fuzz_crashes", "disk_full_engine_errors",
            "shared_wrong_reads", "rss_drift_mb", "fd_drift", "corrupt_served", "poisoned_stores")


# -- shared helpers --------------------------------------------------------------------------------


def key_of(tag: str, i: int) -> bytes:
    return xxhash.xxh3_128_digest(f"{tag}-{i}".encode())


def block_of(key: bytes, nbytes: int) -> np.ndarray:
    """The content stored under ``key`` (derived from it: any process can check any block)."""
    return np.random.default_rng(int.from_bytes(key[:8], "little")).integers(0, 256, nbytes, dtype=np.uint8)


def make_config(path, *, block_bytes: int, dram_blocks: int = 0, nvme_blocks: int = 64, header: str = "auto",
                dram_ttl=None, nvme_ttl=None, io_threads: int = 2, nvme_gb: float | None = None):
    return from_dict({"tiers": {
        "dram": {"capacity_gb": dram_blocks * ff.round_up(block_bytes) / GiB, "ttl_s": dram_ttl, "pin_memory": False},
        "nvme": {"path": None if path is None else str(path), "ttl_s": nvme_ttl, "io_threads": io_threads,
                 "capacity_gb": nvme_gb if nvme_gb is not None else nvme_blocks * ff.file_bytes(block_bytes) / GiB,
                 "header": header}}})


def open_store(path, *, block_bytes: int, clock: Callable[[], float] = time.time, **kw):
    from kvstore.store import KVStore

    return KVStore(make_config(path, block_bytes=block_bytes, **kw), block_bytes=block_bytes, fingerprint=FP,
                   block_tokens=FP.block_size, clock=clock)


def read_check(store, keys: list[bytes], out: np.ndarray | None = None) -> tuple[int, int]:
    """get ``keys``; (blocks served, blocks served with wrong bytes)."""
    bb = store.block_bytes
    if out is None or out.shape[0] < len(keys):
        out = np.zeros((len(keys), bb), np.uint8)
    n = store.get(keys, out[: len(keys)])
    wrong = sum(1 for i in range(n) if not np.array_equal(out[i], block_of(keys[i], bb)))
    return n, wrong


def corrupt_total(tier) -> int:
    with tier.lock:
        return sum(tier.corrupt_reasons.values()) + tier.stats.get("missing", 0)


def walk_cache(base) -> dict:
    """Everything under a tier's base folder, without following a symlink: modes and oddities."""
    out = {"files": 0, "dirs": 0, "bad_file_mode": [], "bad_dir_mode": [], "symlinks": [], "other": []}
    for dirpath, dirnames, filenames in os.walk(base, followlinks=False):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            if stat.S_ISLNK(st.st_mode):
                out["symlinks"].append(p)
            elif stat.S_ISDIR(st.st_mode):
                out["dirs"] += 1
                if stat.S_IMODE(st.st_mode) != 0o700:
                    out["bad_dir_mode"].append(p)
            elif stat.S_ISREG(st.st_mode):
                out["files"] += 1
                if stat.S_IMODE(st.st_mode) != 0o600:
                    out["bad_file_mode"].append(p)
            else:
                out["other"].append(p)
    return out


def tier_vs_folder(tier) -> dict:
    """Compare a tier's index with its namespace folder (quiescent): orphans, missing, tmp files."""
    root = Path(tier.root)
    indexed = {tier.path_of(k) for k in tier.index.entries}
    orphans, tmp_left, seen = [], [], set()
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        d = Path(dirpath)
        for name in filenames + [n for n in dirnames if os.path.islink(d / n)]:
            p = d / name
            if d == Path(tier.tmp):
                tmp_left.append(str(p))
            elif p in indexed and os.path.isfile(p) and not os.path.islink(p):
                seen.add(p)
            else:
                orphans.append(str(p))
    return {"orphans": orphans, "tmp_left": tmp_left, "missing": [str(p) for p in indexed - seen]}


class Hang(Exception):
    pass


class alarm:
    """Raise :class:`Hang` in the main thread after ``seconds`` (a blocking open/read is interrupted)."""

    def __init__(self, seconds: int):
        self.seconds = seconds
        self.armed = threading.current_thread() is threading.main_thread()

    def __enter__(self):
        if self.armed:
            def on_alarm(*_):
                raise Hang(f"no answer within {self.seconds} s")
            self.old = signal.signal(signal.SIGALRM, on_alarm)
            signal.alarm(self.seconds)
        return self

    def __exit__(self, *exc):
        if self.armed:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, self.old)
        return False


def _child_cmd(job: dict) -> list[str]:
    code = f"import sys; sys.path.insert(0, {REPO!r}); from bench.faults import child_main; child_main(sys.argv[1])"
    return [sys.executable, "-c", code, json.dumps(job)]


def child_main(arg: str) -> None:
    """Entry point of the writer/sharer child processes."""
    job = json.loads(arg)
    {"crash_writer": _crash_writer, "sharer": _sharer}[job["role"]](job)


# -- 1. crashes ------------------------------------------------------------------------------------

CRASH_VARIANTS = [  # (DRAM blocks, header layout): write-back demotions and both file layouts
    (0, "inline"), (4, "inline"), (0, "xattr"), (4, "xattr")]


def _crash_writer(job: dict) -> None:
    bb, start = job["block_bytes"], job["start"]
    s = open_store(job["path"], block_bytes=bb, dram_blocks=job["dram_blocks"], nvme_blocks=job["nvme_blocks"],
                   header=job["header"])
    rng = random.Random(start)
    print("ready", flush=True)
    out = np.zeros((3, bb), np.uint8)
    i = start
    while True:
        ks = [key_of("crash", i + j) for j in range(3)]
        s.put(ks, np.stack([block_of(k, bb) for k in ks]))
        i += 3
        if rng.random() < 0.3:  # reads too: utime on hits, promotions into DRAM
            j = rng.randrange(start, i - 2)
            s.get([key_of("crash", j + t) for t in range(3)], out)
        if rng.random() < 0.05:
            s.sweep()


def verify_recovery(path, *, block_bytes: int, dram_blocks: int, nvme_blocks: int, header: str) -> dict:
    """Open a store on a folder a killed writer left; check the folder and every block."""
    s = open_store(path, block_bytes=block_bytes, dram_blocks=0, nvme_blocks=nvme_blocks, header=header)
    try:
        nv = s.nvme
        scan_corrupt = nv.stats["corrupt"]
        f = tier_vs_folder(nv)
        keys = list(nv.index.entries)
        served = wrong = failed = 0
        out = np.zeros((1, block_bytes), np.uint8)
        for k in keys:
            n, w = read_check(s, [k], out)
            served += n
            wrong += w
            failed += 1 - n
        return {"blocks": len(keys), "served": served, "wrong": wrong, "failed_reads": failed,
                "scan_corrupt": scan_corrupt, "tmp_removed": nv.stats["tmp_removed"], "orphans": len(f["orphans"]),
                "tmp_left": len(f["tmp_left"]), "missing": len(f["missing"]), "header": nv.header,
                "examples": (f["orphans"] + f["tmp_left"] + f["missing"])[:3]}
    finally:
        s.close()


def crash(folder, *, cycles: int, seed: int = 0, block_bytes: int = 48 * 1024 + 100, nvme_blocks: int = 48,
          advance: Callable[[], None] | None = None) -> dict:
    """SIGKILL a writer ``cycles`` times at random points; verify after every restart."""
    rnd = random.Random(seed)
    folder = Path(folder)
    tot = {"crash_cycles": 0, "crash_killed_before_ready": 0, "crash_tmp_at_kill": 0, "crash_blocks_verified": 0,
           "crash_wrong_reads": 0, "crash_failed_reads": 0, "crash_scan_corrupt": 0, "crash_orphans": 0,
           "crash_tmp_after_recovery": 0, "crash_index_missing_files": 0, "crash_writer_errors": 0,
           "crash_perm_violations": 0}
    examples: list = []
    start = 0
    for c in range(cycles):
        dram_blocks, header = CRASH_VARIANTS[c % len(CRASH_VARIANTS)]
        job = {"role": "crash_writer", "path": str(folder), "block_bytes": block_bytes, "dram_blocks": dram_blocks,
               "nvme_blocks": nvme_blocks, "header": header, "start": start}
        start += 1_000_000
        p = subprocess.Popen(_child_cmd(job), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            if rnd.random() < 0.15:  # during start-up: the scan, stale-file cleanup, probes
                time.sleep(rnd.uniform(0.0, 0.4))
                tot["crash_killed_before_ready"] += 1
            else:
                line = p.stdout.readline().strip()
                if line != "ready":
                    tot["crash_writer_errors"] += 1
                    examples.append(p.stderr.read()[-2000:])
                time.sleep(rnd.uniform(0.0, 0.25))
        finally:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
            p.wait(timeout=60)
            p.stdout.close()
            err = p.stderr.read()
            p.stderr.close()
        if p.returncode != -signal.SIGKILL:
            tot["crash_writer_errors"] += 1
            examples.append(err[-2000:])
        for d in folder.glob("kvstore-*/tmp") if folder.exists() else []:
            tot["crash_tmp_at_kill"] += sum(1 for _ in d.iterdir())
        r = verify_recovery(folder, block_bytes=block_bytes, dram_blocks=dram_blocks, nvme_blocks=nvme_blocks,
                            header=header)
        w = walk_cache(folder)
        perm = len(w["bad_file_mode"]) + len(w["bad_dir_mode"]) + len(w["symlinks"]) + len(w["other"])
        tot["crash_cycles"] += 1
        tot["crash_blocks_verified"] += r["served"]
        tot["crash_wrong_reads"] += r["wrong"]
        tot["crash_failed_reads"] += r["failed_reads"]
        tot["crash_scan_corrupt"] += r["scan_corrupt"]
        tot["crash_orphans"] += r["orphans"]
        tot["crash_tmp_after_recovery"] += r["tmp_left"]
        tot["crash_index_missing_files"] += r["missing"]
        tot["crash_perm_violations"] += perm
        if r["examples"]:
            examples.extend(r["examples"])
        if advance:
            advance()
    tot["crash_examples"] = examples[:5]
    return tot


# -- 2. corruption and bad files ---------------------------------------------------------------------

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
    from kvstore.tiers.folder import probe_xattr

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
    if counted == 0 and not (phase == "scan" and not s.nvme.holds(k) and scan_counted > 0):
        res["corrupt_uncounted_cases"].append(f"{phase}:{name}")


def _plant_junk(root: Path, rng: random.Random) -> int:
    """Files that are not ours, where the scan looks: top level, fan-out folders, bad names, a FIFO."""
    n = 0
    leafs = [d for d in root.glob("??/??") if d.is_dir() and not d.is_symlink()]
    spots = [root / "notes.txt", root / "zz", root / "ab" / "zz.kvb"]
    for d in leafs[:4]:
        spots += [d / "README", d / ("0" * 32 + ".kvb"), d / (d.parent.name + d.name + "x" * 28 + ".kvb"),
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


# -- 3. fuzzing ------------------------------------------------------------------------------------


def _fuzz_header(rng: random.Random, valid: bytes) -> bytes:
    r = rng.random()
    if r < 0.15:
        return rng.randbytes(rng.choice([0, 1, 7, 8, 40, 87, 88, 89, 200, 4096]))
    if r < 0.35:  # flips, checksum left broken
        b = bytearray(valid)
        for _ in range(rng.randint(1, 6)):
            b[rng.randrange(len(b))] ^= rng.randrange(1, 256)
        return bytes(b)
    if r < 0.45:
        return valid[: rng.randrange(len(valid))]
    if r < 0.55:
        return valid + rng.randbytes(rng.randint(1, 64))
    # structured: any field values, with a valid header checksum (reaches every later check)
    body = bytearray(valid[:80])
    for _ in range(rng.randint(1, 4)):
        off = rng.randrange(80)
        body[off:off + 8] = rng.randbytes(8)[: len(body[off:off + 8])]
    if rng.random() < 0.5:
        body[:8] = ff.MAGIC
    return bytes(body[:80]) + xxhash.xxh3_64_intdigest(bytes(body[:80])).to_bytes(8, "little")


def _meaning(raw: bytes):
    """What a reader acts on in a header (not ``created``, not padding); None if it is refused."""
    try:
        h = ff.unpack_header(raw)
    except ff.BadBlockFile:
        return None
    return h.codec_id, h.payload_len, h.checksum, h.fingerprint, h.key


def fuzz(folder, *, inputs: int, files: int, seed: int = 0, block_bytes: int = 8192,
         advance: Callable[[int], None] | None = None) -> dict:
    """Header parser + tier checks on ``inputs`` fuzzed headers; ``files`` fuzzed real files."""
    from kvstore.tiers.folder import probe_xattr

    rng = random.Random(seed)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    res = {"fuzz_inputs": 0, "fuzz_parser_inputs": 0, "fuzz_file_inputs": 0, "fuzz_accepted_headers": 0,
           "fuzz_crashes": 0, "fuzz_hangs": 0, "fuzz_served": 0, "fuzz_wrong_reads": 0, "fuzz_examples": []}
    s = open_store(folder / "parser", block_bytes=block_bytes, nvme_blocks=8, header="inline")
    tier = s.nvme
    k0 = key_of("fuzz", 0)
    valid = craft_header(plen=block_bytes, chk=123, created=1.0, fp=s.namespace, key=k0)
    step = max(1, inputs // 100)
    try:
        for i in range(inputs):
            data = _fuzz_header(rng, valid)
            try:
                h = ff.unpack_header(data)
                res["fuzz_accepted_headers"] += 1
                tier._check(h, k0)  # what a read/scan checks next
            except ff.BadBlockFile:
                pass
            except Exception:
                res["fuzz_crashes"] += 1
                res["fuzz_examples"].append(f"{data.hex()}: {traceback.format_exc()[-800:]}")
            res["fuzz_parser_inputs"] += 1
            if advance and (i + 1) % step == 0:
                advance(step)
    finally:
        s.close()
    layouts = ["inline"] + (["xattr"] if probe_xattr(folder) else [])
    per = max(1, files // len(layouts))
    for layout in layouts:
        path = folder / f"files-{layout}"
        s = open_store(path, block_bytes=block_bytes, nvme_blocks=64, header=layout)
        planted = []
        try:
            keys = [key_of(f"fuzzfile-{layout}", i) for i in range(16)]
            s.put(keys, np.stack([block_of(k, block_bytes) for k in keys]))
            valid = {k: get_header(s.nvme, s.nvme.path_of(k)) for k in keys}
            for i in range(per):
                k = keys[i % len(keys)]
                p = s.nvme.path_of(k)
                data = _fuzz_header(rng, valid[k])
                try:
                    if s.nvme.header == "xattr":
                        if data:
                            os.setxattr(p, ff.XATTR, data[:1024])  # file systems cap attribute sizes
                        elif get_header(s.nvme, p):
                            os.removexattr(p, ff.XATTR)
                    else:
                        with open(p, "r+b") as f:
                            f.write(data[: ff.HEADER_BYTES])
                            if len(data) > ff.HEADER_CORE and rng.random() < 0.3:
                                f.truncate(rng.randrange(len(data) // 2, ff.file_bytes(block_bytes) + 1))
                    same = _meaning(get_header(s.nvme, p)) == _meaning(valid[k]) and os.path.getsize(p) == s.nvme.file_bytes
                    with alarm(20):
                        n, wrong = read_check(s, [k])
                    res["fuzz_wrong_reads"] += wrong
                    if n and not same:
                        res["fuzz_served"] += 1
                    if not n:  # gone (counted): write it back for the next input
                        s.put([k], block_of(k, block_bytes)[None])
                except Hang:
                    res["fuzz_hangs"] += 1
                except Exception:
                    res["fuzz_crashes"] += 1
                    res["fuzz_examples"].append(f"file {layout}: {traceback.format_exc()[-800:]}")
                res["fuzz_file_inputs"] += 1
                if advance and (i + 1) % max(1, per // 20) == 0:
                    advance(0)
            # the start-up scan on fuzzed headers
            for i, k in enumerate(keys):
                planted.append(k)
                p = s.nvme.path_of(k)
                data = _fuzz_header(rng, valid[k])
                if s.nvme.header == "xattr":
                    if data:
                        os.setxattr(p, ff.XATTR, data[:1024])
                else:
                    with open(p, "r+b") as f:
                        f.write(data[: ff.HEADER_BYTES])
                res["fuzz_file_inputs"] += 1
        finally:
            s.close()
        try:
            with alarm(20):
                s2 = open_store(path, block_bytes=block_bytes, nvme_blocks=64, header=layout)
            try:
                for k in planted:
                    n, wrong = read_check(s2, [k])
                    res["fuzz_wrong_reads"] += wrong
            finally:
                s2.close()
        except Hang:
            res["fuzz_hangs"] += 1
        except Exception:
            res["fuzz_crashes"] += 1
            res["fuzz_examples"].append(f"scan {layout}: {traceback.format_exc()[-800:]}")
    res["fuzz_inputs"] = res["fuzz_parser_inputs"] + res["fuzz_file_inputs"]
    res["fuzz_examples"] = res["fuzz_examples"][:5]
    return res


# -- 4. disk full ----------------------------------------------------------------------------------


class MountError(Exception):
    pass


class tmpfs:
    """``mount -t tmpfs -o size=N`` on a fresh folder (root only); unmounted on exit."""

    def __init__(self, where, size_mb: int, options: str = ""):
        self.where = Path(where)
        self.size_mb = size_mb
        self.options = options

    def __enter__(self) -> Path:
        self.where.mkdir(parents=True, exist_ok=True)
        opts = f"size={self.size_mb}m,mode=0700" + (f",{self.options}" if self.options else "")
        try:
            r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "kvstore-faults", str(self.where)],
                               capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.SubprocessError) as e:
            raise MountError(f"mount failed: {e}") from None
        if r.returncode != 0:
            raise MountError(f"mount -t tmpfs not permitted here: {r.stderr.strip() or r.returncode}")
        return self.where

    def __exit__(self, *exc) -> None:
        subprocess.run(["umount", "-l", str(self.where)], capture_output=True, timeout=30)


def disk_full(folder, *, size_mb: int = 3, seed: int = 0, block_bytes: int = 64 * 1024, rounds: int | None = None,
              advance: Callable[[], None] | None = None) -> dict:
    """Fill an NVMe tier on a ``size_mb`` tmpfs far past its size; the store keeps serving."""
    from kvstore.store import KVStore  # noqa: F401

    folder = Path(folder)
    fb = ff.file_bytes(block_bytes)
    rounds = rounds or max(40, 6 * size_mb * (1 << 20) // fb // 4)
    res = {"disk_full_mb": size_mb, "disk_full_engine_errors": 0, "disk_full_events": 0, "disk_full_rounds": 0,
           "disk_full_write_failures_metric": 0.0, "disk_full_nvme_capacity_configured": 0,
           "disk_full_nvme_capacity_after": 0, "disk_full_capacity_gauge": 0.0, "disk_full_chains_served": 0,
           "disk_full_chains_served_after_full": 0, "disk_full_rounds_after_full": 0, "disk_full_wrong_reads": 0,
           "disk_full_stored_after_full": 0, "disk_full_nvme_blocks_served_after_full": 0, "disk_full_tmp_left": 0, "disk_full_examples": []}
    try:
        with tmpfs(folder / "mnt", size_mb) as mnt:
            s = open_store(mnt / "cache", block_bytes=block_bytes, dram_blocks=8, nvme_gb=1.0, header="auto")
            try:
                res["disk_full_nvme_capacity_configured"] = s.nvme.capacity_bytes
                out = np.zeros((4, block_bytes), np.uint8)
                for r in range(rounds):
                    keys = [key_of(f"full-{seed}", 4 * r + j) for j in range(4)]
                    full_before = s.nvme.stats.get("disk_full", 0) > 0
                    try:
                        stored = s.put(keys, np.stack([block_of(k, block_bytes) for k in keys]))
                        n, wrong = read_check(s, keys, out)
                        s.persist()  # write DRAM down now: the disk fills on every round
                    except Exception:
                        res["disk_full_engine_errors"] += 1
                        res["disk_full_examples"].append(traceback.format_exc()[-1500:])
                        continue
                    res["disk_full_rounds"] += 1
                    res["disk_full_wrong_reads"] += wrong
                    res["disk_full_chains_served"] += n == 4
                    if full_before and r >= 2:  # an older chain: its blocks come from NVMe, if held
                        old = [key_of(f"full-{seed}", 4 * (r - 2) + j) for j in range(4)]
                        m = s.contains_prefix(old, record=False)
                        n_old, w_old = read_check(s, old, out)
                        res["disk_full_wrong_reads"] += w_old
                        res["disk_full_nvme_blocks_served_after_full"] += min(n_old, m.tiers.count("nvme"))
                    if full_before:
                        res["disk_full_rounds_after_full"] += 1
                        res["disk_full_chains_served_after_full"] += n == 4
                        res["disk_full_stored_after_full"] += stored
                    if advance:
                        advance()
                s.flush()
                res["disk_full_events"] = s.nvme.stats.get("disk_full", 0)
                res["disk_full_write_failures_metric"] = s.metrics.value("kvstore_tier_errors_total", tier="nvme",
                                                                         op="write")
                res["disk_full_nvme_capacity_after"] = s.nvme.capacity_bytes
                res["disk_full_nvme_blocks_held"] = len(s.nvme)
                s.stats()
                res["disk_full_capacity_gauge"] = s.metrics.value("kvstore_tier_capacity_bytes", tier="nvme")
                res["disk_full_tmp_left"] = sum(1 for _ in Path(s.nvme.tmp).iterdir())
                res["disk_full_fs_bytes"] = shutil.disk_usage(mnt).total
            finally:
                try:
                    s.close()
                except Exception:
                    res["disk_full_engine_errors"] += 1
                    res["disk_full_examples"].append(traceback.format_exc()[-1500:])
    except MountError as e:
        res["skipped"] = str(e)
    res["disk_full_examples"] = res["disk_full_examples"][:3]
    return res


# -- 5. sharing ------------------------------------------------------------------------------------


def _sharer(job: dict) -> None:
    me, other, bb, ops = job["id"], 1 - job["id"], job["block_bytes"], job["ops"]
    rng = random.Random(job["seed"] * 7 + me)
    kw = dict(block_bytes=bb, dram_blocks=job["dram_blocks"], nvme_blocks=job["nvme_blocks"], header=job["header"])
    pre = [key_of("pre", i) for i in range(job["pre"])]
    pre_set = set(pre)
    r = {"reads_ok": 0, "wrong": 0, "misses": 0, "errors": 0, "deleted": 0, "reopens": 0, "other_reads_ok": 0,
         "common_writes": 0, "rewritten": 0, "written": [], "examples": []}
    out = np.zeros((4, bb), np.uint8)
    s = open_store(job["path"], **kw)
    n_own = 0
    try:
        for op in range(ops):
            x = rng.random()
            try:
                if x < 0.3:  # own new blocks (never deleted by anyone: must all be there at the end)
                    ks = [key_of(f"own{me}", n_own + j) for j in range(2)]
                    n_own += 2
                    s.put(ks, np.stack([block_of(k, bb) for k in ks]))
                    r["written"] += [k.hex() for k in ks]
                elif x < 0.4:  # the same keys from both processes at once
                    ks = [key_of("common", rng.randrange(64))]
                    r["common_writes"] += s.put(ks, np.stack([block_of(k, bb) for k in ks]))
                elif x < 0.8:  # reads of shared blocks (which the other process may be deleting)
                    ks = [pre[rng.randrange(len(pre))] for _ in range(rng.randint(1, 4))]
                    n, w = read_check(s, ks, out)
                    r["reads_ok"] += n
                    r["wrong"] += w
                    r["misses"] += len(ks) - n
                elif x < 0.92:
                    ks = [pre[rng.randrange(len(pre))] for _ in range(3)]
                    if me == 0:  # delete what the other reads ...
                        r["deleted"] += s.nvme.remove(ks)
                    else:  # ... while the other writes it again
                        r["rewritten"] += s.put(ks, np.stack([block_of(k, bb) for k in ks]))
                else:  # reopen: the scan sees the other's files; read some of them
                    s.close()
                    s = open_store(job["path"], **kw)
                    r["reopens"] += 1
                    theirs = [k for k in s.nvme.index.entries if k not in pre_set][:16]
                    for k in theirs:
                        n, w = read_check(s, [k], out)
                        r["other_reads_ok"] += n
                        r["wrong"] += w
            except Exception:
                r["errors"] += 1
                if len(r["examples"]) < 3:
                    r["examples"].append(traceback.format_exc()[-1500:])
    finally:
        s.close()
    print("RESULT " + json.dumps(r), flush=True)


def sharing(folder, *, ops: int, seed: int = 0, block_bytes: int = 16384, pre: int = 96,
            advance: Callable[[], None] | None = None) -> dict:
    """Two processes on one NVMe folder at the same time."""
    folder = Path(folder)
    big = 8 * ops + 4 * pre + 256  # no capacity evictions: every own write must survive
    s = open_store(folder, block_bytes=block_bytes, nvme_blocks=big, header="auto")
    pk = [key_of("pre", i) for i in range(pre)]
    s.put(pk, np.stack([block_of(k, block_bytes) for k in pk]))
    header = s.nvme.header
    s.close()
    procs = []
    for me in (0, 1):
        job = {"role": "sharer", "id": me, "path": str(folder), "block_bytes": block_bytes, "ops": ops,
               "seed": seed, "pre": pre, "dram_blocks": 8 if me else 0, "nvme_blocks": big, "header": header}
        procs.append(subprocess.Popen(_child_cmd(job), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results, errors, examples = [], 0, []
    for p in procs:
        out, err = p.communicate(timeout=1800)
        line = next((ln for ln in out.splitlines() if ln.startswith("RESULT ")), None)
        if p.returncode != 0 or line is None:
            errors += 1
            examples.append(err[-2000:])
            continue
        results.append(json.loads(line[7:]))
    if advance:
        advance()
    res = {"shared_processes": 2, "shared_ops": 2 * ops, "shared_wrong_reads": sum(r["wrong"] for r in results),
           "shared_reads_ok": sum(r["reads_ok"] + r["other_reads_ok"] for r in results),
           "shared_reads_of_other_process": sum(r["other_reads_ok"] for r in results),
           "shared_misses": sum(r["misses"] for r in results), "shared_deleted": sum(r["deleted"] for r in results),
           "shared_rewritten": sum(r["rewritten"] for r in results),
           "shared_reopens": sum(r["reopens"] for r in results),
           "shared_errors": errors + sum(r["errors"] for r in results),
           "shared_examples": (examples + [e for r in results for e in r["examples"]])[:3]}
    # no lost writes: a fresh store finds every block each process wrote, byte-identical
    written = [bytes.fromhex(h) for r in results for h in r["written"]]
    s = open_store(folder, block_bytes=block_bytes, nvme_blocks=big, header=header)
    try:
        lost = wrong = 0
        out = np.zeros((1, block_bytes), np.uint8)
        for k in written:
            n, w = read_check(s, [k], out)
            lost += 1 - n
            wrong += w
        commons = [key_of("common", i) for i in range(64)]
        res["shared_common_present"] = sum(s.nvme.contains(k) for k in commons)
        f = tier_vs_folder(s.nvme)
    finally:
        s.close()
    res.update({"shared_writes": len(written), "shared_lost_writes": lost, "shared_wrong_reads": res[
        "shared_wrong_reads"] + wrong, "shared_orphans": len(f["orphans"]), "shared_tmp_left": len(f["tmp_left"])})
    return res


# -- 6. churn --------------------------------------------------------------------------------------


def proc_sample() -> dict:
    rss = 0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
    return {"rss_mb": rss / (1 << 20), "fds": len(os.listdir("/proc/self/fd")),
            "threads": len(os.listdir("/proc/self/task"))}


def churn(folder, *, ops: int, seed: int = 0, block_bytes: int = 16384, samples: int = 40,
          advance: Callable[[int], None] | None = None) -> dict:
    """put/get/prefetch/evict/expire/remove/reopen for ``ops`` operations on a fake clock."""
    import gc

    rng = random.Random(seed)
    t = [1_700_000_000.0]
    clock = lambda: t[0]  # noqa: E731
    kw = dict(block_bytes=block_bytes, dram_blocks=16, nvme_blocks=96, header="auto", dram_ttl=20.0, nvme_ttl=120.0)
    s = open_store(folder, clock=clock, **kw)
    sessions: dict[int, list[bytes]] = {}
    out = np.zeros((12, block_bytes), np.uint8)
    res = {"churn_ops": 0, "churn_wrong_reads": 0, "churn_hits": 0, "churn_reopens": 0, "churn_errors": 0,
           "churn_examples": []}
    trail = []
    every = max(1, ops // samples)
    reopen_every = max(50, ops // 12)
    try:
        for op in range(ops):
            try:
                sid = rng.randrange(40)
                chain = sessions.setdefault(sid, [])
                x = rng.random()
                if x < 0.45 or not chain:  # a turn: the prompt grows; store the new blocks
                    if len(chain) >= 12:
                        chain.clear()
                        sid_gen = rng.getrandbits(32)
                        chain.append(key_of("churn-root", sid_gen % 4))  # a few shared system prompts
                    new = [xxhash.xxh3_128_digest((chain[-1] if chain else b"") + rng.randbytes(8))
                           for _ in range(rng.randint(1, 3))]
                    chain += new
                    ks = chain[-12:]
                    s.put(ks, np.stack([block_of(k, block_bytes) for k in ks]))
                elif x < 0.85:
                    ks = chain[-12:]
                    n, w = read_check(s, ks, out)
                    res["churn_hits"] += n
                    res["churn_wrong_reads"] += w
                elif x < 0.9:
                    s.prefetch(chain[-12:]).result()
                elif x < 0.95:
                    s.sweep()
                else:
                    s.nvme.remove(chain[-2:])
                t[0] += rng.expovariate(1 / 1.5)
                if op % reopen_every == reopen_every - 1:
                    s.close()
                    s = open_store(folder, clock=clock, **kw)
                    res["churn_reopens"] += 1
            except Exception:
                res["churn_errors"] += 1
                if len(res["churn_examples"]) < 3:
                    res["churn_examples"].append(traceback.format_exc()[-1500:])
            res["churn_ops"] += 1
            if op % every == 0 or op == ops - 1:
                gc.collect()
                trail.append({"op": op, **proc_sample()})
                if advance:
                    advance(every)
    finally:
        s.close()
    gc.collect()
    after = proc_sample()
    warm = trail[max(1, len(trail) // 5)] if len(trail) > 2 else trail[0]
    last = trail[-1]
    res.update({
        "rss_start_mb": round(trail[0]["rss_mb"], 1), "rss_after_warmup_mb": round(warm["rss_mb"], 1),
        "rss_end_mb": round(last["rss_mb"], 1), "rss_max_mb": round(max(x["rss_mb"] for x in trail), 1),
        "rss_drift_mb": round(last["rss_mb"] - warm["rss_mb"], 2),
        "fd_after_warmup": warm["fds"], "fd_end": last["fds"], "fd_drift": last["fds"] - warm["fds"],
        "fd_max": max(x["fds"] for x in trail), "fd_after_close": after["fds"],
        "threads_after_warmup": warm["threads"], "threads_end": last["threads"],
        "thread_drift": last["threads"] - warm["threads"], "threads_max": max(x["threads"] for x in trail),
        "threads_after_close": after["threads"], "churn_samples": trail,
    })
    return res


# -- 7. bad input ----------------------------------------------------------------------------------


def _expect(cases: list, name: str, fn: Callable[[], object], exc, must: tuple[str, ...] = ()) -> None:
    """Run one bad input; record whether it was refused with ``exc`` and a message naming ``must``."""
    try:
        fn()
    except exc as e:
        msg = str(e)
        ok = all(m in msg for m in must)
        cases.append({"case": name, "ok": ok, "error": f"{type(e).__name__}: {msg}"[:300]})
        return
    except Exception as e:
        cases.append({"case": name, "ok": False, "error": f"UNEXPECTED {type(e).__name__}: {e}"[:300]})
        return
    cases.append({"case": name, "ok": False, "error": "accepted"})


BAD_CONFIGS = {
    "negative capacity": ({"tiers": {"dram": {"capacity_gb": -1}}}, "tiers.dram.capacity_gb"),
    "capacity as text": ({"tiers": {"nvme": {"capacity_gb": "10GB"}}}, "tiers.nvme.capacity_gb"),
    "capacity as list": ({"tiers": {"nvme": {"capacity_gb": [1]}}}, "tiers.nvme.capacity_gb"),
    "capacity inf": ({"tiers": {"nvme": {"capacity_gb": float("inf")}}}, "tiers.nvme.capacity_gb"),
    "capacity bool": ({"tiers": {"dram": {"capacity_gb": True}}}, "tiers.dram.capacity_gb"),
    "negative ttl": ({"tiers": {"nvme": {"ttl_s": -5}}}, "tiers.nvme.ttl_s"),
    "ttl as text": ({"tiers": {"dram": {"ttl_s": "1h"}}}, "tiers.dram.ttl_s"),
    "unknown policy": ({"tiers": {"dram": {"policy": "mru"}}}, "tiers.dram.policy"),
    "unknown codec": ({"tiers": {"nvme": {"codec": "gzip"}}}, "tiers.nvme.codec"),
    "io_threads 0": ({"tiers": {"nvme": {"io_threads": 0}}}, "tiers.nvme.io_threads"),
    "io_threads float": ({"tiers": {"nvme": {"io_threads": 2.5}}}, "tiers.nvme.io_threads"),
    "zstd level 99": ({"tiers": {"nvme": {"zstd_level": 99}}}, "tiers.nvme.zstd_level"),
    "path as int": ({"tiers": {"nvme": {"path": 5}}}, "tiers.nvme.path"),
    "path empty": ({"tiers": {"nvme": {"path": "  "}}}, "tiers.nvme.path"),
    "o_direct maybe": ({"tiers": {"nvme": {"o_direct": "maybe"}}}, "tiers.nvme.o_direct"),
    "port too big": ({"metrics": {"port": 70000}}, "metrics.port"),
    "port text": ({"metrics": {"port": "http"}}, "metrics.port"),
    "tiers not a mapping": ({"tiers": [1, 2]}, "tiers"),
    "dram not a mapping": ({"tiers": {"dram": 4}}, "tiers.dram"),
    "unknown top key": ({"tier": {}}, "tier"),
    "unknown nvme key": ({"tiers": {"nvme": {"size": 1}}}, "tiers.nvme.size"),
    "root not a mapping": (["tiers"], "<root>"),
    "trace_path int": ({"trace_path": 3}, "trace_path"),
}

BAD_TRACE_LINES = {
    "not json": "{t: 1",
    "binary": "\x00\xff\xfe",
    "array": "[1, 2, 3]",
    "string": '"hello"',
    "missing keys": '{"t": 1}',
    "blocks not a list": '{"t":1,"session":"s","blocks":"abcd","block_tokens":16,"prompt_tokens":1}',
    "blocks of lists": '{"t":1,"session":"s","blocks":[[1]],"block_tokens":16,"prompt_tokens":1}',
    "blocks of objects": '{"t":1,"session":"s","blocks":[{"a":1}],"block_tokens":16,"prompt_tokens":1}',
    "blocks not hex": '{"t":1,"session":"s","blocks":["zz"],"block_tokens":16,"prompt_tokens":1}',
    "blocks ints": '{"t":1,"session":"s","blocks":[1,2],"block_tokens":16,"prompt_tokens":1}',
    "t text": '{"t":"soon","session":"s","blocks":[],"block_tokens":16,"prompt_tokens":1}',
    "t nan": '{"t":"nan","session":"s","blocks":[],"block_tokens":16,"prompt_tokens":1}',
    "t infinite": '{"t":1e400,"session":"s","blocks":[],"block_tokens":16,"prompt_tokens":1}',
    "block_tokens 0": '{"t":1,"session":"s","blocks":[],"block_tokens":0,"prompt_tokens":1}',
    "prompt_tokens negative": '{"t":1,"session":"s","blocks":[],"block_tokens":16,"prompt_tokens":-4}',
    "prompt_tokens text": '{"t":1,"session":"s","blocks":[],"block_tokens":16,"prompt_tokens":"many"}',
}


def bad_input(folder, *, advance: Callable[[], None] | None = None) -> dict:
    """Bad configs, wrong types, negative sizes, unusable/unsafe folders, malformed traces."""
    from kvstore.config import load_config
    from kvstore.store import KVStore
    from kvstore.trace import TraceError, parse_line
    from kvstore.tune.cli import main as tune_main
    from kvstore.tune.traces import load_trace

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    cases: list[dict] = []
    for name, (data, key) in BAD_CONFIGS.items():
        _expect(cases, f"config: {name}", lambda d=data: from_dict(d), ConfigError, (key,))
    # files
    files = {"yaml list": "- a\n- b\n", "yaml syntax": "tiers: {dram: [\n", "binary": "\x00\x01\x02"}
    for name, text in files.items():
        p = folder / f"bad-{name.replace(' ', '_')}.yaml"
        p.write_text(text)
        _expect(cases, f"config file: {name}", lambda p=p: load_config(p, environ={}), ConfigError, ("config",))
    _expect(cases, "config file: missing", lambda: load_config(folder / "nope.yaml", environ={}), ConfigError,
            ("nope.yaml",))
    _expect(cases, "env: bad value", lambda: load_config(None, environ={"KVSTORE__TIERS__DRAM__CAPACITY_GB": "-3"}),
            ConfigError, ("tiers.dram.capacity_gb",))
    # the store's own arguments
    cfg = make_config(None, block_bytes=4096, dram_blocks=4, nvme_blocks=8)
    _expect(cases, "store: negative block_bytes", lambda: KVStore(cfg, block_bytes=-1, fingerprint=FP), ValueError,
            ("block_bytes",))
    _expect(cases, "store: zero block_bytes", lambda: KVStore(cfg, block_bytes=0, fingerprint=FP), ValueError,
            ("block_bytes",))
    s = KVStore(cfg, block_bytes=4096, fingerprint=FP)
    try:
        good = [key_of("bad", 0)]
        blk = np.zeros((1, 4096), np.uint8)
        _expect(cases, "keys: too short", lambda: s.put([b"short"], blk), ValueError, ("16-byte",))
        _expect(cases, "keys: a path", lambda: s.put([b"../../../etc/passwd"], blk), ValueError, ("16-byte",))
        _expect(cases, "keys: text", lambda: s.get(["0" * 32], blk), ValueError, ("16-byte",))
        _expect(cases, "keys: int", lambda: s.contains_prefix([12345]), ValueError, ("16-byte",))
        _expect(cases, "blocks: float32", lambda: s.put(good, np.zeros((1, 1024), np.float32)), ValueError,
                ("blocks",))
        _expect(cases, "blocks: too small", lambda: s.put(good, np.zeros((1, 100), np.uint8)), ValueError,
                ("blocks",))
        _expect(cases, "blocks: too few", lambda: s.put(good * 2, blk), ValueError, ("blocks",))
        ro = np.zeros((1, 4096), np.uint8)
        ro.flags.writeable = False
        _expect(cases, "out: read-only", lambda: s.get(good, ro), ValueError, ("read-only",))
        _expect(cases, "out: 1-D", lambda: s.get(good, np.zeros(4096, np.uint8)), ValueError, ("out",))
    finally:
        s.close()
    # folders: unusable or unsafe
    nv = "tiers.nvme.path"

    def store_at(p):
        st = open_store(p, block_bytes=4096, nvme_blocks=4)
        st.close()

    a_file = folder / "a-file"
    a_file.write_bytes(b"x")
    _expect(cases, "folder: is a file", lambda: store_at(a_file), ConfigError, (nv,))
    _expect(cases, "folder: under a file", lambda: store_at(a_file / "sub"), ConfigError, (nv,))
    other = folder / "owned-by-nobody"
    other.mkdir(mode=0o700, exist_ok=True)
    try:
        os.chown(other, 65534, 65534)
        _expect(cases, "folder: owned by another user", lambda: store_at(other), ConfigError, (nv, "owned"))
    except PermissionError:
        cases.append({"case": "folder: owned by another user", "ok": None, "error": "skipped: needs root"})
    ww = folder / "world-writable"
    ww.mkdir(exist_ok=True)
    os.chmod(ww, 0o777)
    _expect(cases, "folder: world-writable", lambda: store_at(ww), ConfigError, (nv, "world-writable"))
    sticky = folder / "sticky-tmp-like"
    sticky.mkdir(exist_ok=True)
    os.chmod(sticky, 0o1777)
    _expect(cases, "folder: world-writable sticky (like /tmp)", lambda: store_at(sticky), ConfigError, (nv,))
    try:
        with tmpfs(folder / "ro-mnt", 1, "ro"):
            _expect(cases, "folder: read-only file system", lambda: store_at(folder / "ro-mnt"), ConfigError,
                    (nv, "writable"))
            _expect(cases, "folder: missing under a read-only fs", lambda: store_at(folder / "ro-mnt" / "x"),
                    ConfigError, (nv,))
    except MountError as e:
        cases.append({"case": "folder: read-only file system", "ok": None, "error": f"skipped: {e}"})
    # malformed traces: the tuner's loader and the trace reader
    for name, line in BAD_TRACE_LINES.items():
        p = folder / "bad-trace.jsonl"
        good = '{"t":0,"session":"a","blocks":["' + "ab" * 16 + '"],"block_tokens":16,"prompt_tokens":20}'
        p.write_text(good + "\n" + line + "\n")
        _expect(cases, f"trace (tuner): {name}", lambda p=p: load_trace(p), TraceError, ("line 2",))
        _expect(cases, f"trace (reader): {name}", lambda line=line: parse_line(line, 2), TraceError, ("line 2",))
    p = folder / "bad-trace.jsonl"
    p.write_text(BAD_TRACE_LINES["blocks of lists"] + "\n")
    import contextlib
    import io

    with contextlib.redirect_stderr(io.StringIO()) as err, contextlib.redirect_stdout(io.StringIO()):
        try:
            rc = tune_main(["--trace", str(p), "--quiet", "--out", str(folder / "tune-out")])
        except SystemExit as e:
            rc = e.code
        except Exception as e:
            rc = f"crash {e!r}"
    cases.append({"case": "kvstore tune on a malformed trace", "ok": rc not in (0, None) and isinstance(rc, int)
                  and "Traceback" not in err.getvalue(), "error": f"exit {rc}: {err.getvalue().strip()[:200]}"})
    # random nested data: only ConfigError, never anything else
    rng = random.Random(1)
    fuzz_bad = 0
    for i in range(2000):
        d = _random_config(rng)
        try:
            from_dict(d)
        except ConfigError:
            pass
        except Exception as e:
            fuzz_bad += 1
            cases.append({"case": f"config fuzz #{i}", "ok": False, "error": f"{type(e).__name__}: {e}; {d!r}"[:300]})
    if advance:
        advance()
    checked = [c for c in cases if c["ok"] is not None]
    return {"bad_input_cases": len(checked), "bad_input_refused_clearly": sum(1 for c in checked if c["ok"]),
            "bad_input_unclear": [c for c in checked if not c["ok"]], "bad_input_config_fuzz": 2000,
            "bad_input_skipped": [c for c in cases if c["ok"] is None], "bad_input_detail": cases}


_SCALARS = [None, True, 0, -1, 1, 2.5, float("nan"), float("inf"), "", "x", "auto", "lru", "none", "/tmp/x", [],
            [1], {}, 10**30, -10**30, "true", b"bytes"]
_KEYS = ["tiers", "dram", "nvme", "metrics", "port", "trace_path", "capacity_gb", "ttl_s", "ttl_shared_s", "policy",
         "codec", "path", "io_threads", "o_direct", "header", "write_mode", "zstd_level", "pin_memory", "other", 3]


def _random_config(rng: random.Random, depth: int = 0):
    if depth > 3 or rng.random() < 0.3:
        return rng.choice(_SCALARS)
    if rng.random() < 0.1:
        return [_random_config(rng, depth + 1) for _ in range(rng.randint(0, 2))]
    d = {}
    for _ in range(rng.randint(0, 3)):
        d[rng.choice(_KEYS)] = _random_config(rng, depth + 1)
    if depth == 0 and rng.random() < 0.7:  # mostly well-shaped, so the value checks are reached
        d = {"tiers": {"dram": {rng.choice(_KEYS[6:-2]): rng.choice(_SCALARS)},
                       "nvme": {rng.choice(_KEYS[6:-2]): rng.choice(_SCALARS)}},
             "metrics": {"port": rng.choice(_SCALARS)}}
    return d


# -- 8. permissions --------------------------------------------------------------------------------

_BANNED = re.compile(r"\b(pickle|cPickle|marshal|shelve|dill|cloudpickle|joblib)\b|allow_pickle|np\.load\(|"
                     r"torch\.load\(|numpy\.load\(")


def permissions(folders: list, *, advance: Callable[[], None] | None = None) -> dict:
    """Modes and symlinks of what the other families left; key paths; no unpickling in the core."""
    files = dirs = 0
    bad = []
    for f in folders:
        for d in Path(f).rglob("kvstore-*"):  # every namespace folder (each tier's own files)
            if d.is_symlink() or not d.is_dir():
                continue
            w = walk_cache(d)
            files += w["files"]
            dirs += w["dirs"] + 1
            if stat.S_IMODE(os.lstat(d).st_mode) != 0o700:
                bad.append(str(d))
            bad += w["bad_file_mode"] + w["bad_dir_mode"] + w["symlinks"] + w["other"]
    # every key maps to a path inside the namespace folder, from its hex digits only
    from kvstore.tiers.nvme import NvmeTier

    escapes = 0
    root = Path("/x/kvstore-0")
    tier = NvmeTier.__new__(NvmeTier)
    tier.root = root
    rng = random.Random(0)
    for i in range(10000):
        k = b"../../etc/passwd" if i == 0 else (b"/" * 16 if i == 1 else rng.randbytes(16))
        p = tier.path_of(k)
        if p.parent.parent.parent != root or not re.fullmatch(r"[0-9a-f]{32}\.kvb", p.name) or ".." in p.parts:
            escapes += 1
    core = [p for p in Path(REPO, "kvstore").rglob("*.py")]
    pickles = [f"{p.name}:{i + 1}" for p in core for i, line in enumerate(p.read_text().splitlines())
               if _BANNED.search(line)]
    if advance:
        advance()
    return {"perm_files_checked": files, "perm_dirs_checked": dirs, "perm_violations": len(bad),
            "perm_examples": bad[:5], "perm_key_path_escapes": escapes, "perm_unpickling_sites": pickles}


# -- the runner ------------------------------------------------------------------------------------


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="the CI-sized run (seconds, not minutes)")
    p.add_argument("--json", default=None, metavar="PATH", help="write every figure as JSON")
    p.add_argument("--dir", default=None, help="parent folder for the scratch folders (default: a temp folder)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", default=None, help="comma-separated families (crash,corruption,fuzz,disk_full,"
                   "sharing,churn,bad_input,permissions,engine)")


FAMILIES = ("crash", "corruption", "fuzz", "disk_full", "sharing", "churn", "bad_input", "permissions", "engine")


def run(a: argparse.Namespace) -> dict:
    size = SIZES["quick" if a.quick else "long"]
    only = set(a.only.split(",")) if a.only else set(FAMILIES)
    unknown = only - set(FAMILIES)
    if unknown:
        raise SystemExit(f"unknown families: {', '.join(sorted(unknown))}")
    figures: dict = {}
    families: dict = {}
    timings: dict = {}
    work = tempfile.mkdtemp(prefix="kvstore-faults-", dir=a.dir)
    os.chmod(work, 0o700)
    steps = {"crash": size["crash_cycles"], "corruption": 2 * size["corruption_rounds"], "fuzz": 100,
             "disk_full": 1, "sharing": 1, "churn": size["churn_ops"], "bad_input": 1, "permissions": 1,
             "engine": 3 if a.quick else 5}
    total = sum(v for k, v in steps.items() if k in only)
    bar, task = progress(total, "bench faults")
    import logging

    kvlog = logging.getLogger("kvstore")
    old_level = kvlog.level
    kvlog.setLevel(logging.ERROR)  # every fault is logged as a warning: thousands of them
    try:
        with bar:
            def adv(n: int = 1) -> None:
                bar.advance(task, n)

            def go(name: str, fn: Callable[[], dict]) -> None:
                if name not in only:
                    return
                bar.update(task, description=f"bench faults: {name}")
                t0 = time.perf_counter()
                families[name] = fn()
                timings[name] = round(time.perf_counter() - t0, 1)

            go("crash", lambda: crash(Path(work, "crash"), cycles=size["crash_cycles"], seed=a.seed, advance=adv))
            go("corruption", lambda: corruption(Path(work, "corruption"), rounds=size["corruption_rounds"],
                                                seed=a.seed, advance=adv))
            go("fuzz", lambda: fuzz(Path(work, "fuzz"), inputs=size["fuzz_inputs"], files=size["fuzz_files"],
                                    seed=a.seed, advance=lambda n: adv(n * 100 // max(1, size["fuzz_inputs"]))))
            go("disk_full", lambda: disk_full(Path(work, "disk_full"), size_mb=size["disk_full_mb"], seed=a.seed))
            go("sharing", lambda: sharing(Path(work, "sharing"), ops=size["sharing_ops"], seed=a.seed, advance=adv))
            go("churn", lambda: churn(Path(work, "churn"), ops=size["churn_ops"], seed=a.seed, advance=adv))
            go("bad_input", lambda: bad_input(Path(work, "bad_input"), advance=adv))
            # (not corruption/fuzz: their folders hold the foreign files planted on purpose)
            go("permissions", lambda: permissions([Path(work, f) for f in ("crash", "sharing", "churn")],
                                                  advance=adv))
            from bench import faults_engine

            os.makedirs(Path(work, "engine"), mode=0o700, exist_ok=True)
            go("engine", lambda: faults_engine.family(str(Path(work, "engine")), quick=a.quick, advance=adv))
    finally:
        kvlog.setLevel(old_level)
        shutil.rmtree(work, ignore_errors=True)
    for fam in families.values():
        figures.update({k: v for k, v in fam.items() if isinstance(v, (int, float)) and not isinstance(v, bool)})
    figures["corrupt_reads_served"] = sum(families.get(f, {}).get(k, 0) for f, k in (
        ("crash", "crash_wrong_reads"), ("corruption", "corrupt_reads_served"), ("fuzz", "fuzz_served"),
        ("fuzz", "fuzz_wrong_reads")))
    data = {"mode": "quick" if a.quick else "long", "sizes": size, **{k: figures.get(k) for k in HEADLINE},
            "figures": figures, "families": families, "seconds": timings}
    rows = [{"family": f, "figure": k, "value": v} for f, fam in families.items() for k, v in fam.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)]
    rows += [{"family": "all", "figure": k, "value": figures.get(k)} for k in HEADLINE]
    print(markdown_table(rows, ["family", "figure", "value"]))
    print()
    if families.get("engine", {}).get("rows"):  # per fault, per engine mode
        er = families["engine"]["rows"]
        print(markdown_table(er, list(er[0])))
        print()
    print(markdown_table([{"family": f, "seconds": s} for f, s in timings.items()], ["family", "seconds"]))
    problems = problems_of(data)
    print("\nno problems found" if not problems else "\nPROBLEMS:\n" + "\n".join(f"- {p}" for p in problems))
    data["problems"] = problems
    write_json(a.json, data)
    return data


def problems_of(data: dict) -> list[str]:
    """What a run found that must not happen (empty: all good)."""
    fam = data["families"]
    out = []
    zero = {"crash": ["crash_wrong_reads", "crash_failed_reads", "crash_orphans", "crash_tmp_after_recovery",
                      "crash_index_missing_files", "crash_writer_errors", "crash_perm_violations",
                      "crash_scan_corrupt"],
            "corruption": ["corrupt_reads_served", "corrupt_crashes", "corrupt_hangs"],
            "fuzz": ["fuzz_crashes", "fuzz_hangs", "fuzz_served", "fuzz_wrong_reads"],
            "disk_full": ["disk_full_engine_errors", "disk_full_wrong_reads", "disk_full_tmp_left"],
            "sharing": ["shared_wrong_reads", "shared_lost_writes", "shared_errors", "shared_orphans",
                        "shared_tmp_left"],
            "churn": ["churn_wrong_reads", "churn_errors"],
            "permissions": ["perm_violations", "perm_key_path_escapes"],
            "engine": ["corrupt_served", "poisoned_stores", "engine_not_healed"]}
    for f, keys in zero.items():
        for k in keys:
            if f in fam and fam[f].get(k):
                out.append(f"{f}: {k} = {fam[f][k]}")
    if "corruption" in fam:
        c = fam["corruption"]
        if c["corrupt_uncounted_cases"]:
            out.append(f"corruption: not counted: {c['corrupt_uncounted_cases']}")
        if c["corrupt_misses"] != c["corrupt_cases"] - c["corrupt_crashes"] - c["corrupt_hangs"]:
            out.append("corruption: a damaged block was not a miss")
    if "disk_full" in fam and "skipped" not in fam["disk_full"]:
        d = fam["disk_full"]
        if not d["disk_full_events"] or d["disk_full_nvme_capacity_after"] >= d["disk_full_nvme_capacity_configured"]:
            out.append("disk_full: the tier did not shrink")
    if "bad_input" in fam and fam["bad_input"]["bad_input_unclear"]:
        out.append(f"bad_input: {[c['case'] for c in fam['bad_input']['bad_input_unclear']]}")
    if "permissions" in fam and fam["permissions"]["perm_unpickling_sites"]:
        out.append(f"permissions: unpickling in {fam['permissions']['perm_unpickling_sites']}")
    if "churn" in fam and fam["churn"].get("fd_drift", 0) > 0:
        out.append(f"churn: fd_drift = {fam['churn']['fd_drift']}")
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="kvstore bench faults", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    main()
