"""DRAM, NVMe and shared-folder rows of ``kvstore bench tiers``: a store with that tier alone, its put
and get from N callers, beside the limit measured on the same bytes right before
(bench/tiers/limits.py)."""

from __future__ import annotations

import os
import shutil
import statistics
import time

import numpy as np

from kvstore.bench.common import stores
from kvstore.bench.tiers.limits import buffered_files_s, memcpy_rows_s, odirect_rows_s, odirect_seq_rows_gbps, settle
from kvstore.bench.tiers.ops import (call_batch, cpu_s, fingerprint, nbytes_gb, not_measured, pct, put_then_get,
                                     run_op, timed_get)
from kvstore.keys import chain_keys
from kvstore.store import KVStore
from kvstore.tiers.fileformat import file_bytes


NVME_PATHS = {"store": None, "blockio": "engine", "noengine": "off"}  # path -> tiers.nvme.engine (None: default)


def _make_store(tier: str, n_blocks: int, block_bytes: int, folder: str, a, tokens: int, codec: str,
                engine: str | None = None) -> KVStore:
    """Room for ``n_blocks`` in ``tier`` alone (DRAM: plus 1 MiB; NVMe: plus half a file, so that
    as many other blocks evict them all; with a codec, twice as many). ``engine``: tiers.nvme.engine (None: its default;
    "engine": ``--engine-backend``, at ``--engine-depth`` when given)."""
    if tier == "dram":
        tiers = {"dram": {"capacity_gb": stores.capacity_gb(n_blocks, block_bytes, "dram", spare_bytes=1 << 20),
                          "ttl_s": None, "codec": codec},
                 "nvme": {"capacity_gb": 0}}
    elif tier == "sharedfs":  # a folder every host would mount: here the bench's own (room for twice the blocks)
        os.makedirs(os.path.join(folder, "shared"), mode=0o700, exist_ok=True)
        tiers = {"dram": {"capacity_gb": 0}, "nvme": {"capacity_gb": 0},
                 "sharedfs": {"path": os.path.join(folder, "shared"), "capacity_gb": 2 * n_blocks * file_bytes(block_bytes) / 2**30,
                              "ttl_s": None, "codec": codec, "io_threads": a.io_threads}}
    else:  # codec none: room for the blocks alone (a full-cache put evicts them all); a codec: twice
        xattr = stores.nvme_xattr(folder)
        half = stores.entry_bytes("nvme", block_bytes, xattr=xattr) // 2
        room = stores.capacity_gb(n_blocks, block_bytes, "nvme", xattr=xattr, spare_bytes=half) if codec == "none" \
            else stores.capacity_gb(2 * n_blocks, block_bytes, "nvme")
        tiers = {"dram": {"capacity_gb": 0},
                 "nvme": {"capacity_gb": room,
                          "ttl_s": None, "path": folder, "io_threads": a.io_threads, "codec": codec,
                          "o_direct": {"auto": "auto", "true": True, "false": False}[a.o_direct]}}
        if engine is not None:
            tiers["nvme"]["engine"] = getattr(a, "engine_backend", "auto") or "auto" if engine == "engine" else engine
    fp = fingerprint(a, f"bench-{tier}-{time.perf_counter_ns()}", tokens, codec)
    s = stores.open_store({"tiers": tiers}, block_bytes=block_bytes, fingerprint=fp, block_tokens=tokens)
    if engine == "engine" and getattr(a, "engine_depth", None) and s.nvme.engine is not None:
        from kvstore.tiers.nvme.blockio import BlockIO

        old, s.nvme.engine = s.nvme.engine, BlockIO(s.nvme.engine.backend, a.engine_depth)
        old.close()
    return s


def measure(tier, codec, c, bt, bb, n, src, out, folder, a, bar, peer=None) -> dict:
    """``repeats`` rounds of (limit, then each path's put and get) back to back, the paths in a
    rotated order each round, so a busy machine slows every side of each ratio alike. Paths: the
    store ("store"), on NVMe the batched engine on the tier ("blockio", ``--nvme-paths``), and the
    peer ("lmcache", ``--peer``). DRAM limit: one-thread-per-caller memcpy of the same rows, one
    block per copy. NVMe limit: the better of a dd-style O_DIRECT sequential write/read of the same
    rows (4 MiB at a time, queue depth 1, from and into the same memory) and an O_DIRECT write/read
    of the same rows, one block per I/O, at the store's I/O parallelism (``io_threads``)."""
    if tier == "remote":
        from kvstore.bench.tiers.remote import measure_remote

        return measure_remote(codec, c, bt, bb, n, src, out, a, bar)
    paths = ["store"]
    if tier == "nvme" and codec == "none":
        paths += [p for p in str(getattr(a, "nvme_paths", "store")).split(",") if p in NVME_PATHS and p != "store"]
    if peer is not None and codec == "none":
        paths.append("lmcache")
    ops = ("put", "get", "put_full") if tier == "nvme" and codec == "none" else ("put", "get")
    lim = {"put": [], "get": [], "put_seq": [], "get_seq": [], "put_full": [], "put_full_seq": [], "put_full_over": [],
           "put_direct": [], "get_direct": []}
    runs: dict[str, dict] = {p: {**{op: [] for op in ops}, **{op + "_lat": [] for op in ops}, "ok": True, "got": []}
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
        elif tier == "sharedfs":  # a buffered file per block, and O_DIRECT, on the same folder
            w, rd = buffered_files_s(folder, src, out, a.io_threads)
            lim["put"].append(w)
            lim["get"].append(rd)
            w, rd, direct = odirect_rows_s(folder, src, out, a.io_threads)
            lim["put_direct"].append(w)
            lim["get_direct"].append(rd)
        else:
            ow: list[float] = []
            w, rd, direct = odirect_rows_s(folder, src, out, a.io_threads, overwrite=ow)
            lim["put"].append(w)
            lim["get"].append(rd)
            lim["put_full"].append(w)
            lim["put_full_over"].append(ow[0])  # a full cache's files are overwritten: its limit may be this
            sw, sr = odirect_seq_rows_gbps(folder, src, out)  # GB/s: dd-style, the same rows and memory
            lim["put_seq"].append(sw)
            lim["put_full_seq"].append(sw)
            lim["get_seq"].append(sr)
        for path in paths[r % len(paths):] + paths[: r % len(paths)]:
            run = runs[path]
            if tier != "dram":
                settle()  # the files the previous phase removed are freed before this one starts
            try:
                if path in NVME_PATHS:
                    res = _store_path(tier, codec, c, bt, bb, n, src, out, folder, a, r, NVME_PATHS[path])
                    if path == "store":
                        stored.append(res["stored"])
                        none_bytes = res["none_bytes"]
                        if res.get("on_disk") is not None:
                            on_disk.append(res["on_disk"])
                else:  # the peer checks its own bytes against the same blocks
                    res = peer.run(tier, c, call_batch(n, a.batch, c), os.path.join(folder, f"lmcache-{r}"),
                                   a.io_threads)  # the same calls as kvstore's (run_op)
            except Exception as e:
                if path == "store":
                    bar.advance(a.repeats - r)
                    return not_measured(tier, codec, bt, c, e)
                run.update({"put": [], "get": [], "error": f"{type(e).__name__}: {e}"})
                paths.remove(path)  # the other paths go on
                continue
            if "engine" in res:
                run["engine"] = res["engine"]
            for op in ops:
                if op + "_s" not in res:  # the peer: no full-cache put
                    continue
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
    for op in ops:
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
                         **({"limit_over_runs": [nbytes / t / 1e9 for t in lim[op + "_over"]]}
                            if lim.get(op + "_over") else {}),
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
    how = "O_DIRECT" if direct else "fsync"
    kind = "read" if op == "get" else "write"
    if tier == "sharedfs":  # the better of a buffered file per block and O_DIRECT rows, same threads
        return max((nbytes / statistics.median(lim[op]) / 1e9, f"buffered {kind} files x{io_threads}"),
                   (nbytes / statistics.median(lim[op + "_direct"]) / 1e9, f"{how} {kind} x{io_threads}"))
    best = [(statistics.median(lim[op + "_seq"]), f"{how} {kind} seq 4M"),
            (nbytes / statistics.median(lim[op]) / 1e9, f"{how} {kind} x{io_threads}")]
    if lim.get(op + "_over"):  # a full cache: the same rows overwritten in place (recycled files)
        best.append((nbytes / statistics.median(lim[op + "_over"]) / 1e9, f"{how} overwrite x{io_threads}"))
    return max(best)


def _store_path(tier, codec, c, bt, bb, n, src, out, folder, a, r, engine: str | None = None) -> dict:
    """A store with this tier alone, ``store.put`` / ``store.get`` from c callers. NVMe, then:
    ``put_full``, a put into a full cache (other blocks evicted, one for each block written, as
    in a store that has run a while: their files recycled, the fan-out folders there already),
    timed up to ``store.flush()`` (the victims' files), its bytes read back and checked."""
    store = _make_store(tier, n, bb, folder, a, bt, codec, engine)
    keys = chain_keys(store.root, np.arange(n * bt) % 50000 + r, bt)
    try:
        tier_obj = store.tier(tier)
        res = put_then_get(store.put, store.get, keys, src, out, a.batch, c, codec)
        if tier == "nvme" and codec == "none" and res["verified"] is not False:
            res.update(_put_full(store, keys, src, out, a.batch, c, codec, r))
            res["verified"] = _and(res["verified"], res.pop("full_verified"))
        eng = getattr(tier_obj, "engine", None)
        if tier == "nvme":
            res["engine"] = f"{eng.backend}, depth {eng.depth}" if eng is not None else "off"
        res["on_disk"] = None
        if tier == "sharedfs":  # no index of its own: the folder is what it holds
            res["on_disk"] = res["stored"] = _files_bytes(tier_obj.folder)
            res["none_bytes"] = file_bytes(bb)
        else:
            res["stored"] = tier_obj.index.used  # (a get from one tier alone moves nothing)
        if tier == "nvme":
            res["none_bytes"] = tier_obj.file_bytes_for(bb)
            res["on_disk"] = _files_bytes(tier_obj.root)
        elif tier == "dram":
            res["none_bytes"] = tier_obj.index.used // max(1, len(tier_obj.index.entries))
    finally:
        root = store.nvme.root if store.nvme is not None else \
            (tier_obj.folder if tier == "sharedfs" and tier_obj is not None else None)
        store.close(persist=False)
        if root is not None:
            shutil.rmtree(root, ignore_errors=True)  # the next path starts on an empty folder too
    return res


def _put_full(store, keys, src, out, batch: int, c: int, codec: str, r: int) -> dict:
    """Other blocks put over ``keys`` (untimed: they evict them all), then ``keys`` again (timed up
    to flush: each evicts one of the others), then read back (untimed) and checked."""
    other = chain_keys(store.root, np.arange(len(keys) * 7) % 50000 + 60000 + r, 7)[: len(keys)]
    run_op(store.put, other, src, batch, c)
    store.flush()
    c0 = cpu_s()
    t, lat = run_op(store.put, keys, src, batch, c)
    t0 = time.perf_counter()
    store.flush()
    t += time.perf_counter() - t0
    cpu = cpu_s() - c0
    got: list[int] = []
    _t, _lat, ok = timed_get(store.get, keys, src, out, batch, c, codec, got, True)
    return {"put_full_s": t, "put_full_lat": lat, "put_full_cpu": cpu, "full_verified": ok}


def _files_bytes(root) -> int:
    """Sum of the sizes of the block files under an NVMe tier folder."""
    total = 0
    for d, _, files in os.walk(root):
        for f in files:
            if f.endswith(".kvb"):
                total += os.stat(os.path.join(d, f), follow_symlinks=False).st_size
    return total
