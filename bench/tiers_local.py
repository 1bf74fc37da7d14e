"""DRAM and NVMe rows of ``kvstore bench tiers``: a store with that tier alone, its put and get
from N callers, beside the limit measured on the same bytes right before (bench/limits.py)."""

from __future__ import annotations

import os
import statistics
import time

import numpy as np

from bench import stores
from bench.limits import memcpy_rows_s, odirect_gbps, odirect_rows_s
from bench.tiers_ops import fingerprint, nbytes_gb, not_measured, pct, run_op, timed_get
from kvstore.keys import chain_keys
from kvstore.store import KVStore


def _make_store(tier: str, n_blocks: int, block_bytes: int, folder: str, a, tokens: int, codec: str) -> KVStore:
    """Room for ``n_blocks`` (DRAM: plus 1 MiB; NVMe: twice as many files) in ``tier`` alone."""
    if tier == "dram":
        tiers = {"dram": {"capacity_gb": stores.capacity_gb(n_blocks, block_bytes, "dram", spare_bytes=1 << 20),
                          "ttl_s": None, "codec": codec},
                 "nvme": {"capacity_gb": 0}}
    else:
        tiers = {"dram": {"capacity_gb": 0},
                 "nvme": {"capacity_gb": stores.capacity_gb(2 * n_blocks, block_bytes, "nvme"), "ttl_s": None,
                          "path": folder, "o_direct": {"auto": "auto", "true": True, "false": False}[a.o_direct],
                          "io_threads": a.io_threads, "codec": codec}}
    fp = fingerprint(a, f"bench-{tier}-{time.perf_counter_ns()}", tokens, codec)
    return stores.open_store({"tiers": tiers}, block_bytes=block_bytes, fingerprint=fp, block_tokens=tokens)


def measure(tier, codec, c, bt, bb, n, src, out, folder, a, bar) -> dict:
    """``repeats`` rounds of (limit, store put, limit, store get) back to back, so a busy machine
    slows both sides of each ratio alike. DRAM limit: one-thread-per-caller memcpy of the same
    rows, one block per copy. NVMe limit: the better of a dd-style O_DIRECT sequential write/read
    (4 MiB, queue depth 1) and an O_DIRECT write/read of the same rows, one block per I/O, at the
    store's I/O parallelism (``io_threads``)."""
    if tier == "remote":
        from bench.tiers_remote import measure_remote

        return measure_remote(codec, c, bt, bb, n, src, out, a, bar)
    put_t, get_t, put_l, get_l, lim = [], [], [], [], {"put": [], "get": [], "put_seq": [], "get_seq": []}
    ok: bool | None = True
    direct = None
    got: list[int] = []  # blocks get() returned, per repeat
    stored: list[int] = []  # bytes the tier accounts for the n blocks after the put (its files' real sizes)
    on_disk: list[int] = []  # the same, summed over the block files' sizes (NVMe)
    none_bytes = 0  # what one block takes in this tier with codec none
    for r in range(a.repeats):
        if tier == "dram":
            lim["put"].append(memcpy_rows_s(src, out, c))
            lim["get"].append(memcpy_rows_s(src, out, c))
            if c > 1:  # more threads than cores can copy slower than one: the limit is the better
                lim["put_seq"].append(nbytes_gb(n * bb, memcpy_rows_s(src, out, 1)))
                lim["get_seq"].append(nbytes_gb(n * bb, memcpy_rows_s(src, out, 1)))
        else:
            w, rd, direct = odirect_rows_s(folder, src, out, a.io_threads)
            lim["put"].append(w)
            lim["get"].append(rd)
            sw, sr, _ = odirect_gbps(folder, n * bb, repeats=1)  # GB/s
            lim["put_seq"].append(sw)
            lim["get_seq"].append(sr)
        try:
            store = _make_store(tier, n, bb, folder, a, bt, codec)
        except Exception as e:  # e.g. a codec the store does not implement yet
            bar.advance(a.repeats - r)
            return not_measured(tier, codec, bt, c, e)
        keys = chain_keys(store.root, np.arange(n * bt) % 50000 + r, bt)
        try:
            t, lat = run_op(store.put, keys, src, a.batch, c)
            put_t.append(t)
            put_l += lat
            tier_obj = store.dram if tier == "dram" else store.nvme
            stored.append(tier_obj.index.used)
            if tier == "nvme":
                none_bytes = tier_obj.file_bytes_for(bb)
                on_disk.append(_files_bytes(tier_obj.root))
            else:
                none_bytes = tier_obj.index.used // max(1, len(tier_obj.index.entries))
            t, lat, ok = timed_get(store.get, keys, src, out, a.batch, c, codec, got, ok)
            get_t.append(t)
            get_l += lat
        except Exception as e:
            bar.advance(a.repeats - r)
            return not_measured(tier, codec, bt, c, e)
        finally:
            store.close(persist=False)
        bar.advance()
    rows = []
    nbytes = n * bb
    used = statistics.median(stored) if stored else 0
    comp = {"stored_bytes": int(used), "disk_bytes": int(statistics.median(on_disk)) if on_disk else None,
            "comp_ratio": nbytes / used if used else None,
            "capacity_gain": none_bytes * n / used if used and none_bytes else None,
            "blocks_per_gb": n / used * 1e9 if used else None}
    for op, ts, lat in (("put", put_t, put_l), ("get", get_t, get_l)):
        gbps = nbytes / statistics.median(ts) / 1e9
        if tier == "dram":
            limit, name = nbytes / statistics.median(lim[op]) / 1e9, f"memcpy x{c}"
            if lim[op + "_seq"] and statistics.median(lim[op + "_seq"]) > limit:
                limit, name = statistics.median(lim[op + "_seq"]), "memcpy x1"
        else:
            per_block = nbytes / statistics.median(lim[op]) / 1e9
            seq = statistics.median(lim[op + "_seq"])
            kind = "write" if op == "put" else "read"
            if per_block >= seq:
                limit, name = per_block, f"{'O_DIRECT' if direct else 'fsync'} {kind} x{a.io_threads}"
            else:
                limit, name = seq, f"{'O_DIRECT' if direct else 'fsync'} {kind} seq 4M"
        rows.append({"tier": tier, "op": op, "codec": codec, "block_tokens": bt, "block_bytes": bb, "concurrency": c,
                     "gbps": gbps, "limit": name, "limit_gbps": limit, "ratio": gbps / limit,
                     "p50_ms": pct(lat, 0.5), "p99_ms": pct(lat, 0.99), "verified": ok, **comp,
                     "blocks": n, "get_returned_min": min(got) if got else None,
                     "gbps_runs": [nbytes / t / 1e9 for t in ts],
                     "limit_runs": [nbytes / t / 1e9 for t in lim[op]], "limit_alt_runs": lim.get(op + "_seq")})  # seq 4M (NVMe) or x1 (DRAM)
    return {"rows": rows}


def _files_bytes(root) -> int:
    """Sum of the sizes of the block files under an NVMe tier folder."""
    total = 0
    for d, _, files in os.walk(root):
        for f in files:
            if f.endswith(".kvb"):
                total += os.stat(os.path.join(d, f), follow_symlinks=False).st_size
    return total
