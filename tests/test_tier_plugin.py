"""A medium from another package, registered only through the ``kvstore.tiers`` entry point
(issue 48): the config takes its section, the store opens it in its chain order, blocks move
through it and come back right, its hits and metrics carry its name; a plug-in that does not load
costs its own medium only.

The plug-in is a real distribution on ``sys.path`` (a package and its ``.dist-info`` with
``entry_points.txt``, as pip would leave it), loaded by a fresh interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PLUGIN = '''
from dataclasses import dataclass

import numpy as np

from kvstore import configfields as F
from kvstore.tiers.local import LocalTier
from kvstore.tiers.spec import TierSpec


class HeapTier(LocalTier):
    """Blocks as bytes objects in this process: a medium with nothing but the contract."""

    name = "heap"

    def __init__(self, capacity_bytes: int, block_bytes: int):
        super().__init__(capacity_bytes=capacity_bytes, ttl_s=None, policy="lru", block_bytes=block_bytes)
        self.blobs = {}

    def write(self, entry, src) -> bool:
        self.blobs[entry.key] = bytes(np.asarray(src, np.uint8).reshape(-1)[: self.block_bytes])
        return True

    def read(self, entry, out) -> bool:
        b = self.blobs.get(entry.key)
        if b is None:
            return False
        np.asarray(out).view(np.uint8).reshape(-1)[: self.block_bytes] = np.frombuffer(b, np.uint8)
        return True

    def _free(self, entry) -> None:
        self.blobs.pop(entry.key, None)


@dataclass(frozen=True)
class HeapConfig(F.Sized):
    capacity_gb: float = F.field(0.0, F.number)


@dataclass(frozen=True)
class HeapEvents:
    medium: str | None = F.field(None, F.word, choices=F.MEDIA, **F.NOT_ANNOUNCED)
    locality: str | None = F.field("LOCAL", F.word, choices=F.LOCALITIES, **F.UNSPECIFIED)


SPEC = TierSpec(name="heap", order=150, config=HeapConfig, events=HeapEvents,
                open=lambda ts, cfg: HeapTier(cfg.capacity_bytes, ts.block_bytes), hit_source="HOST")
'''

DRIVE = '''
import json, sys
import numpy as np
from kvstore.config import ConfigError, from_dict
from kvstore.store import KVStore
from kvstore.store.metrics import TIERS
from kvstore.tiers.registry import NAMES

out = {"names": list(NAMES), "tiers_label": list(TIERS)}
B = 4096
try:
    from_dict({"tiers": {"heap": {"capacity_gb": 1, "colour": "red"}}})
except ConfigError as e:
    out["bad_key"] = str(e)
cfg = from_dict({"tiers": {"dram": {"capacity_gb": 4 * B / 2**30, "headroom_blocks": 0, "pin_memory": False},
                           "heap": {"capacity_gb": 64 * B / 2**30}, "nvme": {"capacity_gb": 0}}})
s = KVStore(cfg, block_bytes=B, fingerprint=b"plugin-test-root")
try:
    keys = [bytes([i]) * 16 for i in range(8)]
    data = np.random.default_rng(0).integers(0, 256, (8, B), dtype=np.uint8)
    for i in range(0, 8, 2):  # two at a time: DRAM (4 blocks) writes its least recent down to the heap
        s.put(keys[i:i + 2], data[i:i + 2])
    s.flush()
    m = s.contains_prefix(keys, record=False)
    got = np.zeros_like(data)
    n = s.get(keys, got)
    out.update(chain=[t.name for t in s.chain.tiers], tiers=list(m.tiers), found=m.num_blocks, got=n,
               right=bool((got[:n] == data[:n]).all()), heap_blocks=len(s.heap))
finally:
    s.close()
print(json.dumps(out))
'''


# A second shared folder below kvstore's own (order 500), taking only victims: "the shared folder,
# then an archive when its sweeper lets a block go", said through the plug-in surface alone.
ARCHIVE = '''
from dataclasses import dataclass

from kvstore import configfields as F
from kvstore.tiers.sharedfs.tier import SharedFsTier
from kvstore.tiers.spec import TierSpec


class ArchiveTier(SharedFsTier):
    name = "archive"


@dataclass(frozen=True)
class ArchiveConfig(F.Sized):
    path: str | None = F.field(None, F.path, what="folder", expand=True)
    capacity_gb: float = F.field(1.0, F.number)

    @property
    def enabled(self) -> bool:
        return self.path is not None


@dataclass(frozen=True)
class ArchiveEvents:
    medium: str | None = F.field(None, F.word, choices=F.MEDIA, **F.NOT_ANNOUNCED)
    locality: str | None = F.field("REMOTE", F.word, choices=F.LOCALITIES, **F.UNSPECIFIED)


def open_tier(ts, cfg):
    return ArchiveTier(path=cfg.path, namespace=ts.namespace("archive"), block_bytes=ts.block_bytes,
                       capacity_bytes=cfg.capacity_bytes, ttl_s=None, write_through=False)


SPEC = TierSpec(name="archive", order=500, config=ArchiveConfig, events=ArchiveEvents, open=open_tier,
                hit_source="DISK", local=False, namespaced=True)
'''

ARCHIVE_DRIVE = '''
import json, os, time
import numpy as np
from kvstore.config import from_dict
from kvstore.store import KVStore

B = 4096
cfg = from_dict({"tiers": {"dram": {"capacity_gb": 16 * B / 2**30, "pin_memory": False}, "nvme": {"capacity_gb": 0},
                           "sharedfs": {"path": os.path.abspath("shared"), "capacity_gb": 2 * (B + 4096) / 2**30,
                                        "sweep_s": 0.05},
                           "archive": {"path": os.path.abspath("archive")}}})
a = KVStore(cfg, block_bytes=B, fingerprint=b"plugin-test-root")
keys = [bytes([i]) * 16 for i in range(6)]
data = np.random.default_rng(1).integers(0, 256, (6, B), dtype=np.uint8)
out = {"chain": [t.name for t in a.chain.tiers], "keeps": a.sharedfs.keeps_victims}
try:
    a.put(keys, data)  # DRAM keeps all 6; the folder gets them at once, and its capacity is 2
    a.flush()
    end = time.monotonic() + 30
    while time.monotonic() < end and sum(a.archive.holds(keys)) < 4:
        time.sleep(0.05)
    a.flush()
    out.update(archive=sum(a.archive.holds(keys)), shared=sum(a.sharedfs.holds(keys)),
               set_aside=a.sharedfs.stats["set_aside"],
               evicted=a.metrics.value("kvstore_tier_evicted_blocks_total", tier="sharedfs"))
finally:
    a.close()
b = KVStore(cfg, block_bytes=B, fingerprint=b"plugin-test-root")  # another host: nothing in its DRAM
try:
    where, right = [], True
    for k, d in zip(keys, data):
        m = b.contains_prefix([k], record=False)
        where += list(m.tiers)
        got = np.zeros((1, B), np.uint8)
        right = right and b.get([k], got) == 1 and bool((got[0] == d).all())
    out.update(where=where, right=right)
finally:
    b.close()
print(json.dumps(out))
'''


def _dist(where: Path, name: str, entry: str, code: str | None) -> None:
    pkg = where / name
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(code if code is not None else "raise ImportError('a broken plug-in')\n")
    info = where / f"{name}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[kvstore.tiers]\n{entry} = {name}:SPEC\n")


def _run(tmp: Path, script: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp), str(ROOT / "tests")]))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script)], env=env, capture_output=True, text=True,
                          timeout=120, cwd=tmp)


def test_a_medium_registered_by_entry_point_only_sits_in_the_chain_and_serves_right(tmp_path):
    _dist(tmp_path, "kvheap", "heap", PLUGIN)
    p = _run(tmp_path, DRIVE)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r["names"] == ["dram", "heap", "nvme", "remote", "sharedfs"] and r["tiers_label"] == r["names"]
    assert "tiers.heap.colour" in r["bad_key"]  # its section is checked like any other
    assert r["chain"] == ["dram", "heap"]  # its order (150): between DRAM and NVMe (off here)
    assert r["found"] == 8 and r["got"] == 8 and r["right"]
    assert r["tiers"].count("heap") >= 4 and r["heap_blocks"] >= 4  # DRAM's victims went down to it


def test_a_plug_in_that_does_not_load_costs_its_own_medium_only(tmp_path):
    _dist(tmp_path, "kvbroken", "broken", None)
    p = _run(tmp_path, "from kvstore.tiers.registry import NAMES; print(list(NAMES))")
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.strip().splitlines()[-1] == "['dram', 'nvme', 'remote', 'sharedfs']"
    assert "the tier plug-in 'broken'" in p.stderr and "left out" in p.stderr


def test_a_shared_folders_victims_go_down_to_a_plug_in_archive(tmp_path):
    """The shared folder's sweeper keeps its capacity (2 blocks of 6): the 4 it lets go are set
    aside, taken by the store that holds the lease and written down to the plug-in below that
    takes victims; another host then finds each block in one of the two, right."""
    _dist(tmp_path, "kvarchive", "archive", ARCHIVE)
    p = _run(tmp_path, ARCHIVE_DRIVE)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r["chain"] == ["dram", "sharedfs", "archive"] and r["keeps"]
    assert (r["archive"], r["shared"], r["set_aside"], r["evicted"]) == (4, 2, 4, 4), r
    assert sorted(r["where"]) == ["archive"] * 4 + ["sharedfs"] * 2 and r["right"], r
