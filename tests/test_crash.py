"""kill -9 of a writer in the middle of its write loop: what survives is whole and right."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import xxhash

from kvstore.tiers import fileformat as ff
from kvstore.config import from_dict
from kvstore.store import KVStore

from conftest import FP, ROOT, block_for, check_store, nvme_gb, dram_gb

BB = 64 * 1024 + 100  # not 4 KiB aligned: exercises the padded tail too

_WRITER = r"""
import sys
sys.path.insert(0, sys.argv[1])
import numpy as np, xxhash
from kvstore.config import from_dict
from kvstore.keys import ModelFingerprint
from kvstore.store import KVStore

path, mode, start, bb = sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
fp = ModelFingerprint(**eval(sys.argv[6]))
dram = float(sys.argv[7]) if mode == "small_dram" else 0
cfg = from_dict({"tiers": {"dram": {"capacity_gb": dram, "pin_memory": False},
                           "nvme": {"path": path, "capacity_gb": float(sys.argv[8]), "ttl_s": None,
                                    "io_threads": 2}}})
s = KVStore(cfg, block_bytes=bb, fingerprint=fp)

def key(i):
    return xxhash.xxh3_128_digest(b"crash-%d" % i)

def block(k):
    return np.random.default_rng(int.from_bytes(k[:8], "little")).integers(0, 256, bb, dtype=np.uint8)

print("ready", flush=True)
i = start
while True:
    ks = [key(i + j) for j in range(3)]
    s.put(ks, np.stack([block(k) for k in ks]))
    i += 3
"""


def _key(i: int) -> bytes:
    return xxhash.xxh3_128_digest(b"crash-%d" % i)


def _count_files(root: Path) -> int:
    return sum(1 for _ in root.rglob("*" + ff.SUFFIX)) if root.exists() else 0


def _fp_repr() -> str:
    return repr({"model": FP.model, "dtype": FP.dtype, "block_size": FP.block_size, "num_layers": FP.num_layers,
                 "num_kv_heads": FP.num_kv_heads, "head_size": FP.head_size})


@pytest.mark.parametrize("mode", ["nvme_only", "small_dram"])
def test_kill_9_mid_write_loop(tmp_path, mode):
    folder = tmp_path / "cache"
    rnd = random.Random(1234)
    nvme_cap = nvme_gb(4000, BB)
    start = 0
    total_checked = 0
    for rnd_i in range(3):
        before = _count_files(folder)
        p = subprocess.Popen([sys.executable, "-c", _WRITER, str(ROOT), str(folder), mode, str(start), str(BB),
                              _fp_repr(), str(dram_gb(4, BB)), str(nvme_cap)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert p.stdout.readline().strip() == "ready", p.stderr.read()
            deadline = time.monotonic() + 30
            while _count_files(folder) < before + 12 and time.monotonic() < deadline:
                assert p.poll() is None, p.stderr.read()
                time.sleep(0.005)
            time.sleep(rnd.uniform(0, 0.05))
        finally:
            os.kill(p.pid, signal.SIGKILL)
            p.wait(timeout=30)
            p.stdout.close()
            p.stderr.close()
        assert p.returncode == -signal.SIGKILL
        start += 3000  # the next writer continues with new keys (and leaves these alone)

        cfg = from_dict({"tiers": {"dram": {"capacity_gb": 0},
                                   "nvme": {"path": str(folder), "capacity_gb": nvme_cap, "ttl_s": None}}})
        s = KVStore(cfg, block_bytes=BB, fingerprint=FP)
        try:
            assert list(Path(s.nvme.tmp).iterdir()) == [], "temporary files survived the restart"
            held = list(s.nvme.index.entries)
            assert len(held) >= 12
            ids = {_key(i): i for r in range(rnd_i + 1) for i in range(r * 3000, r * 3000 + 3000)}
            out = np.zeros((1, BB), np.uint8)
            for k in held:
                assert k in ids, "a block under a key that was never written"
                if s.get([k], out) == 1:
                    assert np.array_equal(out[0], block_for(k, BB)), f"wrong bytes for block {ids[k]}"
                    total_checked += 1
            assert s.nvme.stats["corrupt"] == 0  # a rename is atomic: no torn files
            check_store(s)
        finally:
            s.close()
    assert total_checked >= 36
