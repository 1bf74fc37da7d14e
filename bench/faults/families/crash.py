"""Fault family 1, ``crash``: a writer process killed with SIGKILL at random points, over and
over; after each restart every indexed block reads back byte-identical, no temporary or orphan
file is left, the index matches the folder."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time
from pathlib import Path
from typing import Callable

import numpy as np

from kvstore.bench.faults.families.common import (_child_cmd, block_of, key_of, open_store, read_check, tier_vs_folder,
                                                  walk_cache)

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
