"""Fault family 6, ``churn``: a long put/get/prefetch/evict/expire/reopen run; RSS, open files and
threads sampled (drift = last sample minus the sample after warm-up)."""

from __future__ import annotations

import os
import random
import traceback
from typing import Callable

import numpy as np
import xxhash

from kvstore.bench.faults.families.common import block_of, key_of, open_store, read_check

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
                # the store's background writes done first: a demotion mid-write holds its file's fd
                # (and a loaded machine keeps it open longer), which is work in flight, not a leak
                s.flush()
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
