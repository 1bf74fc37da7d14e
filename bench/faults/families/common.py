"""What every fault family shares: the store it opens, the blocks it writes and checks, the
folder checks, a timeout for a blocking call, a size-limited tmpfs, and the child processes."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import numpy as np
import xxhash

from kvstore.bench.common.stores import capacity_gb
from kvstore.bench.common.stores import open_store as _open
from kvstore.config import from_dict
from kvstore.keys import ModelFingerprint

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))  # the checkout

FP = ModelFingerprint(model="faults", dtype="float16", block_size=16, num_layers=2, num_kv_heads=2, head_size=8)


def key_of(tag: str, i: int) -> bytes:
    return xxhash.xxh3_128_digest(f"{tag}-{i}".encode())


def block_of(key: bytes, nbytes: int) -> np.ndarray:
    """The content stored under ``key`` (derived from it: any process can check any block)."""
    return np.random.default_rng(int.from_bytes(key[:8], "little")).integers(0, 256, nbytes, dtype=np.uint8)


def make_config(path, *, block_bytes: int, dram_blocks: int = 0, nvme_blocks: int = 64, header: str = "auto",
                dram_ttl=None, nvme_ttl=None, io_threads: int = 2, nvme_gb: float | None = None,
                nvme_codec: str = "none"):
    """``dram_blocks`` DRAM slots; NVMe room for ``nvme_blocks`` files with inline headers (or ``nvme_gb``)."""
    return from_dict({"tiers": {
        "dram": {"capacity_gb": capacity_gb(dram_blocks, block_bytes, "dram"), "ttl_s": dram_ttl, "pin_memory": False},
        "nvme": {"path": None if path is None else str(path), "ttl_s": nvme_ttl, "io_threads": io_threads,
                 "capacity_gb": nvme_gb if nvme_gb is not None else capacity_gb(nvme_blocks, block_bytes, "nvme"),
                 "header": header, "codec": nvme_codec}}})


def open_store(path, *, block_bytes: int, clock: Callable[[], float] = time.time, **kw):
    return _open(make_config(path, block_bytes=block_bytes, **kw), block_bytes=block_bytes, fingerprint=FP,
                 block_tokens=FP.block_size, clock=clock, ready=False)


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
    code = (f"import sys; sys.path.insert(0, {REPO!r}); from kvstore.bench.faults.families.common import child_main; "
            "child_main(sys.argv[1])")
    return [sys.executable, "-c", code, json.dumps(job)]


def child_main(arg: str) -> None:
    """Entry point of the writer/sharer child processes."""
    from kvstore.bench.faults.families.crash import _crash_writer
    from kvstore.bench.faults.families.sharing import _sharer

    job = json.loads(arg)
    {"crash_writer": _crash_writer, "sharer": _sharer}[job["role"]](job)


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
