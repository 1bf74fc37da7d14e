"""DRAM and NVMe rows of ``kvstore bench tiers``: a store with that tier alone, its put and get
from N callers, beside the limit measured on the same bytes right before (bench/limits.py)."""

from __future__ import annotations

import os
import shutil
import statistics
import time

import numpy as np

from kvstore.bench import stores
from kvstore.bench.limits import memcpy_rows_s, odirect_gbps, odirect_rows_s
from kvstore.bench.tiers_ops import fingerprint, nbytes_gb, not_measured, pct, put_then_get
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


def measure(tier, codec, c, bt, bb, n, src, out, folder, a, bar, peer=None) -> dict:
    """``repeats`` rounds of (limit, then each path's put and get) back to back, the paths in a
    rotated order each round, so a busy machine slows every side of each ratio alike. Paths: the
    store ("store"), on NVMe the batched engine on the tier ("blockio", ``--nvme-paths``), and the
    peer ("lmcache", ``--peer``). DRAM limit: one-thread-per-caller memcpy of the same rows, one
    block per copy. NVMe limit: the better of a dd-style O_DIRECT sequential write/read (4 MiB,
    queue depth 1) and an O_DIRECT write/read of the same rows, one block per I/O, at the store's
    I/O parallelism (``io_threads``)."""
    if tier == "remote":
        from kvstore.bench.tiers_remote import measure_remote

        return measure_remote(codec, c, bt, bb, n, src, out, a, bar)
    paths = ["store"]
    if tier == "nvme" and codec == "none":
        paths += [p for p in str(getattr(a, "nvme_paths", "store")).split(",") if p == "blockio"]
    if peer is not None and codec == "none":
        paths.append("lmcache")
    lim = {"put": [], "get": [], "put_seq": [], "get_seq": []}
    runs: dict[str, dict] = {p: {"put": [], "get": [], "put_lat": [], "get_lat": [], "ok": True, "got": []}
                             for p in paths}
    direct = None
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
        for path in paths[r % len(paths):] + paths[: r % len(paths)]:
            run = runs[path]
            try:
                if path == "store":
                    res = _store_path(tier, codec, c, bt, bb, n, src, out, folder, a, r)
                    stored.append(res["stored"])
                    none_bytes = res["none_bytes"]
                    if res.get("on_disk") is not None:
                        on_disk.append(res["on_disk"])
                elif path == "blockio":
                    res = engine_path(c, bb, n, src, out, folder, a, r)
                else:  # the peer checks its own bytes against the same blocks
                    res = peer.run(tier, c, a.batch, os.path.join(folder, f"lmcache-{r}"), a.io_threads)
            except Exception as e:
                if path == "store":
                    bar.advance(a.repeats - r)
                    return not_measured(tier, codec, bt, c, e)
                run.update({"put": [], "get": [], "error": f"{type(e).__name__}: {e}"})
                paths.remove(path)  # the other paths go on
                continue
            if "engine" in res:
                run["engine"] = res["engine"]
            for op in ("put", "get"):
                run[op].append(res[op + "_s"])
                run[op + "_lat"] += res[op + "_lat"]
                run.setdefault(op + "_cpu", []).append(res.get(op + "_cpu"))
            run["got"].append(res["got"])
            run["ok"] = _and(run["ok"], res["verified"])
        bar.advance()
    nbytes = n * bb
    used = statistics.median(stored) if stored else 0
    comp = {"stored_bytes": int(used), "disk_bytes": int(statistics.median(on_disk)) if on_disk else None,
            "comp_ratio": nbytes / used if used else None,
            "capacity_gain": none_bytes * n / used if used and none_bytes else None,
            "blocks_per_gb": n / used * 1e9 if used else None}
    rows = []
    for op in ("put", "get"):
        limit, name = _limit(tier, op, lim, nbytes, c, direct, a.io_threads)
        for path in paths:
            run = runs[path]
            if not run[op]:
                continue
            gbps = nbytes / statistics.median(run[op]) / 1e9
            lat = run[op + "_lat"]
            rows.append({"tier": tier, "op": op, "codec": codec, "block_tokens": bt, "block_bytes": bb,
                         "concurrency": c, "path": path, "gbps": gbps, "limit": name, "limit_gbps": limit,
                         "ratio": gbps / limit, "p50_ms": pct(lat, 0.5), "p99_ms": pct(lat, 0.99),
                         "cpu_us_blk": _cpu_us(run.get(op + "_cpu"), n),
                         "verified": run["ok"], **(comp if path == "store" else {}), "blocks": n,
                         "get_returned_min": min(run["got"]) if run["got"] else None,
                         "gbps_runs": [nbytes / t / 1e9 for t in run[op]],
                         "limit_runs": [nbytes / t / 1e9 for t in lim[op]],
                         "limit_alt_runs": lim.get(op + "_seq"),  # seq 4M (NVMe) or x1 (DRAM)
                         **({"engine": run["engine"]} if "engine" in run else {})})
    return {"rows": rows, "errors": [{"tier": tier, "codec": codec, "block_tokens": bt, "concurrency": c,
                                      "path": p, "error": v["error"]} for p, v in runs.items() if "error" in v]}


def _and(a, b):
    """True and True; None (lossy, in bound) beside True; False wins."""
    return False if (a is False or b is False) else (None if (a is None or b is None) else True)


def _cpu_us(cpus, n: int) -> float | None:
    """Median CPU microseconds per block over the repeats (the store's own process; the peer's own)."""
    xs = [x for x in (cpus or []) if x is not None]
    return statistics.median(xs) / n * 1e6 if xs else None


def _limit(tier, op, lim, nbytes, c, direct, io_threads) -> tuple[float, str]:
    if tier == "dram":
        limit, name = nbytes / statistics.median(lim[op]) / 1e9, f"memcpy x{c}"
        if lim[op + "_seq"] and statistics.median(lim[op + "_seq"]) > limit:
            limit, name = statistics.median(lim[op + "_seq"]), "memcpy x1"
        return limit, name
    per_block = nbytes / statistics.median(lim[op]) / 1e9
    seq = statistics.median(lim[op + "_seq"])
    kind = "write" if op == "put" else "read"
    if per_block >= seq:
        return per_block, f"{'O_DIRECT' if direct else 'fsync'} {kind} x{io_threads}"
    return seq, f"{'O_DIRECT' if direct else 'fsync'} {kind} seq 4M"


def _store_path(tier, codec, c, bt, bb, n, src, out, folder, a, r) -> dict:
    """Today's path: a store with this tier alone, ``store.put`` / ``store.get`` from c callers."""
    store = _make_store(tier, n, bb, folder, a, bt, codec)
    keys = chain_keys(store.root, np.arange(n * bt) % 50000 + r, bt)
    try:
        tier_obj = store.dram if tier == "dram" else store.nvme
        res = put_then_get(store.put, store.get, keys, src, out, a.batch, c, codec)
        res["stored"] = tier_obj.index.used  # (a get from one tier alone moves nothing)
        res["on_disk"] = None
        if tier == "nvme":
            res["none_bytes"] = tier_obj.file_bytes_for(bb)
            res["on_disk"] = _files_bytes(tier_obj.root)
        else:
            res["none_bytes"] = tier_obj.index.used // max(1, len(tier_obj.index.entries))
    finally:
        root = store.nvme.root if store.nvme is not None else None
        store.close(persist=False)
        if root is not None:
            shutil.rmtree(root, ignore_errors=True)  # the next path starts on an empty folder too
    return res


def engine_path(c, bb, n, src, out, folder, a, r) -> dict:
    """The batched engine (kvstore/tiers/blockio.py) on an NVMe tier of the same folder: each
    caller's batch is reserved, written in one engine call and committed (read: acquired, read in
    one call, released), as the store will drive it once wired (issue 34)."""
    from kvstore.tiers.nvme.blockio import BlockIO
    from kvstore.tiers.nvme import NvmeTier

    o_direct = {"auto": "auto", "true": True, "false": False}[a.o_direct]
    t = NvmeTier(path=folder, namespace=os.urandom(16), capacity_bytes=2 * n * (bb + 8192), ttl_s=None,
                 policy="lru", block_bytes=bb, o_direct=o_direct)
    bio = BlockIO(getattr(a, "engine_backend", "auto") or "auto", getattr(a, "engine_depth", None) or a.io_threads)
    keys = [k.tobytes() for k in np.random.default_rng(r).integers(0, 256, (n, 16), dtype=np.uint8)]

    def put(ks, rows):
        es = t.reserve(ks)
        take = [i for i, e in enumerate(es) if e is not None]
        oks = bio.write(t, [es[i] for i in take], [rows[i] for i in take])
        t.commit([es[i] for i in take], oks)
        return sum(oks)

    def get(ks, rows):
        es = t.acquire(ks)
        take = [i for i, e in enumerate(es) if e is not None]
        oks = bio.read(t, [es[i] for i in take], [rows[i] for i in take])
        t.release([es[i] for i in take], oks)
        return sum(oks)

    try:
        res = put_then_get(put, get, keys, src, out, a.batch, c, "none")
    finally:
        engine = f"{bio.backend}, depth {bio._e.depth}"
        bio.close()
        t.close()
        shutil.rmtree(t.root, ignore_errors=True)
    return {**res, "engine": engine}


def _files_bytes(root) -> int:
    """Sum of the sizes of the block files under an NVMe tier folder."""
    total = 0
    for d, _, files in os.walk(root):
        for f in files:
            if f.endswith(".kvb"):
                total += os.stat(os.path.join(d, f), follow_symlinks=False).st_size
    return total
