"""Fault family 5, ``sharing``: two processes on one NVMe folder at once (one deletes what the
other reads, both write, both reopen to see the other's files): no wrong read, no lost write."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import time
import traceback
from pathlib import Path
from typing import Callable

import numpy as np

from kvstore.bench.faults.families.common import _child_cmd, block_of, key_of, open_store, read_check, tier_vs_folder

HANDOFF = 4  # blocks the parent writes that only the last, ordered step touches


def _wait_for(path: Path, timeout: float = 300.0) -> None:
    end = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > end:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.005)


def _sharer(job: dict) -> None:
    me, other, bb, ops = job["id"], 1 - job["id"], job["block_bytes"], job["ops"]
    rng = random.Random(job["seed"] * 7 + me)
    kw = dict(block_bytes=bb, dram_blocks=job["dram_blocks"], nvme_blocks=job["nvme_blocks"], header=job["header"])
    pre = [key_of("pre", i) for i in range(job["pre"])]
    hand = [key_of("handoff", i) for i in range(HANDOFF)]
    pre_set = set(pre) | set(hand)  # the reopen's reads are of the other's own blocks only
    r = {"reads_ok": 0, "wrong": 0, "misses": 0, "errors": 0, "deleted": 0, "reopens": 0, "other_reads_ok": 0,
         "common_writes": 0, "rewritten": 0, "written": [], "examples": []}
    out = np.zeros((4, bb), np.uint8)
    sync = Path(job["sync"])
    s = open_store(job["path"], **kw)
    n_own = 0
    # Both start the loop together: each interpreter's start-up takes 1-3 s, and on a loaded machine
    # one sharer could finish its 250 ops (~0.5 s) before the other began (fresh-clone CI: 0 rewrites).
    (sync / f"ready{me}").touch()
    _wait_for(sync / "go")
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
        # Then one ordered step, so that a rewrite of what the other deleted happens in every run, not
        # only when the random loop's timing allows it: 0 deletes the handoff blocks, 1 (which never
        # touched them) finds them gone and writes them again.
        if me == 0:
            r["deleted"] += s.nvme.remove(hand)
            (sync / "deleted").touch()
        else:
            _wait_for(sync / "deleted")
            n, w = read_check(s, hand, np.zeros((len(hand), bb), np.uint8))
            r["wrong"] += w
            r["misses"] += len(hand) - n
            r["rewritten"] += s.put(hand, np.stack([block_of(k, bb) for k in hand]))
    except Exception:
        r["errors"] += 1
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
    pk = [key_of("pre", i) for i in range(pre)] + [key_of("handoff", i) for i in range(HANDOFF)]
    s.put(pk, np.stack([block_of(k, block_bytes) for k in pk]))
    header = s.nvme.header
    s.close()
    procs = []
    sync = folder.parent / (folder.name + ".sync")
    shutil.rmtree(sync, ignore_errors=True)  # a go left by an earlier run would start nobody together
    sync.mkdir(mode=0o700)
    for me in (0, 1):
        job = {"role": "sharer", "id": me, "path": str(folder), "block_bytes": block_bytes, "ops": ops, "sync": str(sync),
               "seed": seed, "pre": pre, "dram_blocks": 8 if me else 0, "nvme_blocks": big, "header": header}
        procs.append(subprocess.Popen(_child_cmd(job), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    end = time.monotonic() + 300
    while not all((sync / f"ready{me}").exists() for me in (0, 1)) and time.monotonic() < end:
        if any(p.poll() is not None for p in procs):
            break  # a child died before the start: its error is reported below
        time.sleep(0.005)
    (sync / "go").touch()
    results, errors, examples = [], 0, []
    for p in procs:
        out, err = p.communicate(timeout=1800)
        line = next((ln for ln in out.splitlines() if ln.startswith("RESULT ")), None)
        if p.returncode != 0 or line is None:
            errors += 1
            examples.append(err[-2000:])
            continue
        results.append(json.loads(line[7:]))
    shutil.rmtree(sync, ignore_errors=True)
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
