"""Fault family 4, ``disk_full``: the NVMe tier on a small tmpfs filled far past its size: writes
fail soft, the tier shrinks, the store keeps serving (the mount needs root; skipped otherwise)."""

from __future__ import annotations

import shutil
import traceback
from pathlib import Path
from typing import Callable

import numpy as np

from kvstore.bench.faults.families.common import MountError, block_of, key_of, open_store, read_check, tmpfs
from kvstore.tiers import fileformat as ff

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
