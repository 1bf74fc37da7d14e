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
from kvstore.bench.common.paired import paired_median, stalled
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
    rotated order each round, so a busy machine slows every side of each ratio alike; then each
    stalled phase re-run once, and each row's ratio the median of its rounds' ratios
    (bench/common/paired.py). Paths: the store ("store"), on NVMe the batched engine on the tier
    ("blockio", ``--nvme-paths``), and the peer ("lmcache", ``--peer``). DRAM limit:
    one-thread-per-caller memcpy of the same rows, one block per copy. NVMe limit: the better of a
    dd-style O_DIRECT sequential write/read of the same rows (4 MiB at a time, queue depth 1, from
    and into the same memory) and an O_DIRECT write/read of the same rows, one block per I/O, at the
    store's I/O parallelism (``io_threads``)."""
    if tier == "remote":
        from kvstore.bench.tiers.remote import measure_remote

        return measure_remote(codec, c, bt, bb, n, src, out, a, bar)
    paths = ["store"]
    if tier == "nvme" and codec == "none":
        paths += [p for p in str(getattr(a, "nvme_paths", "store")).split(",") if p in NVME_PATHS and p != "store"]
    if peer is not None and codec == "none":
        paths.append("lmcache")
    ops = ("put", "get", "put_full") if tier == "nvme" and codec == "none" else ("put", "get")
    nbytes = n * bb
    direct = None

    def limit_phase() -> dict[str, float]:
        """One round's limits: seconds, or GB/s for the ``_seq`` ones (see :func:`_lim_gbps`)."""
        nonlocal direct
        if tier == "dram":
            ph = {"put": memcpy_rows_s(src, out, c), "get": memcpy_rows_s(src, out, c)}
            if c > 1:  # more threads than cores can copy slower than one: the limit is the better
                ph["put_seq"] = nbytes_gb(nbytes, memcpy_rows_s(src, out, 1))
                ph["get_seq"] = nbytes_gb(nbytes, memcpy_rows_s(src, out, 1))
            return ph
        if tier == "sharedfs":  # a buffered file per block, and O_DIRECT, on the same folder
            w, rd = buffered_files_s(folder, src, out, a.io_threads)
            wd, rdd, direct = odirect_rows_s(folder, src, out, a.io_threads)
            return {"put": w, "get": rd, "put_direct": wd, "get_direct": rdd}
        ow: list[float] = []
        w, rd, direct = odirect_rows_s(folder, src, out, a.io_threads, overwrite=ow)
        sw, sr = odirect_seq_rows_gbps(folder, src, out)  # GB/s: dd-style, the same rows and memory
        # a full cache's files are overwritten: its limit may be the overwrite
        return {"put": w, "get": rd, "put_full": w, "put_full_over": ow[0], "put_seq": sw, "put_full_seq": sw,
                "get_seq": sr}

    def path_phase(path: str, r: int, again: bool = False) -> dict:
        if tier != "dram":
            settle()  # the files the previous phase removed are freed before this one starts
        if path in NVME_PATHS:
            return _store_path(tier, codec, c, bt, bb, n, src, out, folder, a, r, NVME_PATHS[path])
        # the peer checks its own bytes against the same blocks, with the same calls as kvstore's (run_op)
        return peer.run(tier, c, call_batch(n, a.batch, c),
                        os.path.join(folder, f"lmcache-{r}{'-again' if again else ''}"), a.io_threads)

    lims: list[dict[str, float]] = []  # per round
    got: dict[str, list[dict]] = {p: [] for p in paths}  # per path, per round
    errors: dict[str, str] = {}
    for r in range(a.repeats):
        lims.append(limit_phase())
        for path in paths[r % len(paths):] + paths[: r % len(paths)]:
            try:
                got[path].append(path_phase(path, r))
            except Exception as e:
                if path == "store":
                    bar.advance(a.repeats - r)
                    return not_measured(tier, codec, bt, c, e)
                errors[path] = f"{type(e).__name__}: {e}"
                paths.remove(path)  # the other paths go on
        bar.advance()
    stalls = _rerun_stalls(lims, got, paths, ops, nbytes, limit_phase, path_phase)

    lim = {k: [ph[k] for ph in lims] for k in lims[0]}
    runs: dict[str, dict] = {}
    stored: list[int] = []  # bytes the tier accounts for the n blocks after the put (its files' real sizes)
    on_disk: list[int] = []  # the same, summed over the block files' sizes (NVMe)
    none_bytes = 0  # what one block takes in this tier with codec none
    for path in paths:
        run = runs[path] = {**{op: [] for op in ops}, **{op + "_lat": [] for op in ops}, "ok": True, "got": []}
        for res in got[path]:
            if path == "store":
                stored.append(res["stored"])
                none_bytes = res["none_bytes"]
                if res.get("on_disk") is not None:
                    on_disk.append(res["on_disk"])
            if "engine" in res:
                run["engine"] = res["engine"]
            for op in ops:
                run[op].append(res.get(op + "_s"))  # None: not measured that round (the peer: no full-cache put)
                run[op + "_lat"] += res.get(op + "_lat", [])
                run.setdefault(op + "_cpu", []).append(res.get(op + "_cpu"))
            run["got"].append(res["got"])
            run["ok"] = _and(run["ok"], res["verified"])
    used = statistics.median(stored) if stored else 0
    comp = {"stored_bytes": int(used), "disk_bytes": int(statistics.median(on_disk)) if on_disk else None,
            "comp_ratio": nbytes / used if used else None,
            "capacity_gain": none_bytes * n / used if used and none_bytes else None,
            "blocks_per_gb": n / used * 1e9 if used else None}
    rows = []
    for op in ops:
        limit, name, key = _limit(tier, op, lim, nbytes, c, direct, a.io_threads)
        limit_runs = [_lim_gbps(key, v, nbytes) for v in lim[key]]
        for path in paths:
            run = runs[path]
            times = [t for t in run[op] if t is not None]
            if not times:
                continue
            gbps = nbytes / statistics.median(times) / 1e9
            gbps_runs = [nbytes / t / 1e9 if t is not None else None for t in run[op]]
            lat = run[op + "_lat"]
            seen = [x for x in stalls if (x["phase"] == f"{path} {op}" or x["phase"] == f"limit {key}")]
            rows.append({"tier": tier, "op": op, "codec": codec, "block_tokens": bt, "block_bytes": bb,
                         "concurrency": c, "path": path, "gbps": gbps, "limit": name, "limit_gbps": limit,
                         "ratio": paired_median(gbps_runs, limit_runs), "ratio_of_medians": gbps / limit,
                         "repeats": a.repeats, "stalls": seen, "p50_ms": pct(lat, 0.5), "p99_ms": pct(lat, 0.99),
                         "cpu_us_blk": _cpu_us(run.get(op + "_cpu"), n),
                         "verified": run["ok"], **(comp if path == "store" else {}), "blocks": n,
                         "get_returned_min": min(run["got"]) if run["got"] else None,
                         "gbps_runs": gbps_runs, "limit_runs": limit_runs,
                         "limit_alt_runs": lim.get(op + "_seq"),  # seq 4M (NVMe) or x1 (DRAM)
                         **({"limit_over_runs": [nbytes / t / 1e9 for t in lim[op + "_over"]]}
                            if lim.get(op + "_over") else {}),
                         **({"engine": run["engine"]} if "engine" in run else {})})
    return {"rows": rows, "errors": [{"tier": tier, "codec": codec, "block_tokens": bt, "concurrency": c,
                                      "path": p, "error": e} for p, e in errors.items()]}


def _lim_gbps(key: str, v: float, nbytes: int) -> float:
    """A limit phase's figure as GB/s (the ``_seq`` ones are GB/s already, the others seconds)."""
    return v if key.endswith("_seq") else nbytes / v / 1e9


def _rerun_stalls(lims, got, paths, ops, nbytes, limit_phase, path_phase) -> list[dict]:
    """Re-run once each phase that stalled (bench/common/paired.py), in place; what was seen.
    A limit round re-runs whole (its figures that did not stall are kept); a path's round too
    (its store is a fresh one), its bytes checked again."""
    out: list[dict] = []
    redo: dict[int, list[str]] = {}
    for key in lims[0] if lims else ():
        xs = [_lim_gbps(key, ph[key], nbytes) for ph in lims]
        for i in stalled(xs):
            redo.setdefault(i, []).append(key)
            out.append({"phase": f"limit {key}", "repeat": i, "of_median": xs[i] / statistics.median(xs)})
    for i, keys in sorted(redo.items()):
        again = limit_phase()
        for key in keys:
            med = statistics.median(_lim_gbps(key, ph[key], nbytes) for ph in lims)
            x = next(x for x in out if x["phase"] == f"limit {key}" and x["repeat"] == i)
            lims[i][key] = again[key]
            x["again"] = _lim_gbps(key, again[key], nbytes) / med
    for path in paths:
        rounds = got[path]
        redo = {}
        for op in ops:
            at = [i for i, res in enumerate(rounds) if res.get(op + "_s")]
            xs = [nbytes / rounds[i][op + "_s"] / 1e9 for i in at]
            for j in stalled(xs):
                redo.setdefault(at[j], []).append(op)
                out.append({"phase": f"{path} {op}", "repeat": at[j], "of_median": xs[j] / statistics.median(xs),
                            "median": statistics.median(xs)})
        for i, ops_ in sorted(redo.items()):
            try:
                again = path_phase(path, i, again=True)
            except Exception as e:  # noqa: BLE001 - the stalled figure stays, and says why
                for x in out:
                    if x["phase"] in {f"{path} {op}" for op in ops_} and x["repeat"] == i:
                        x["again_error"] = f"{type(e).__name__}: {e}"
                continue
            res = rounds[i]
            res["verified"] = _and(res["verified"], again["verified"])
            for op in ops_:
                if not again.get(op + "_s"):
                    continue
                for k in ("_s", "_lat", "_cpu"):
                    if op + k in again:
                        res[op + k] = again[op + k]
                x = next(x for x in out if x["phase"] == f"{path} {op}" and x["repeat"] == i)
                x["again"] = nbytes / again[op + "_s"] / 1e9 / x.pop("median")
    for x in out:
        x.pop("median", None)
    return out


def _and(a, b):
    """True and True; None (lossy, in bound) beside True; False wins."""
    return False if (a is False or b is False) else (None if (a is None or b is None) else True)


def _cpu_us(cpus, n: int) -> float | None:
    """Median CPU microseconds per block over the repeats (the store's own process; the peer's own)."""
    xs = [x for x in (cpus or []) if x is not None]
    return statistics.median(xs) / n * 1e6 if xs else None


def _limit(tier, op, lim, nbytes, c, direct, io_threads) -> tuple[float, str, str]:
    """(GB/s, name, the limit phase's key) of the better limit for ``op``, by their medians."""
    def med(key: str) -> float:
        return statistics.median(_lim_gbps(key, v, nbytes) for v in lim[key])

    if tier == "dram":
        best = [(med(op), f"memcpy x{c}", op)]
        if lim.get(op + "_seq"):
            best.append((med(op + "_seq"), "memcpy x1", op + "_seq"))
        return max(best, key=lambda b: b[0])
    how = "O_DIRECT" if direct else "fsync"
    kind = "read" if op == "get" else "write"
    if tier == "sharedfs":  # the better of a buffered file per block and O_DIRECT rows, same threads
        return max([(med(op), f"buffered {kind} files x{io_threads}", op),
                    (med(op + "_direct"), f"{how} {kind} x{io_threads}", op + "_direct")], key=lambda b: b[0])
    best = [(med(op + "_seq"), f"{how} {kind} seq 4M", op + "_seq"), (med(op), f"{how} {kind} x{io_threads}", op)]
    if lim.get(op + "_over"):  # a full cache: the same rows overwritten in place (recycled files)
        best.append((med(op + "_over"), f"{how} overwrite x{io_threads}", op + "_over"))
    return max(best, key=lambda b: b[0])


def _store_path(tier, codec, c, bt, bb, n, src, out, folder, a, r, engine: str | None = None) -> dict:
    """A store with this tier alone, ``store.put`` / ``store.get`` from c callers. NVMe, then:
    ``put_full``, a put into a full cache (other blocks evicted, one for each block written, as
    in a store that has run a while: their files recycled, the fan-out folders there already),
    timed up to ``store.flush()`` (the victims' files), its bytes read back and checked."""
    store = _make_store(tier, n, bb, folder, a, bt, codec, engine)
    keys = chain_keys(store.root, np.arange(n * bt) % 50000 + r, bt)
    if tier != "dram":
        # the store's start made its folders (NVMe: 256 fan-out folders): written back before the
        # timed put, as limits.settle promises for every timed phase. No effect seen on this VM
        # (2026-11-30): 16-token fresh puts read 0.50-0.87 of their limit without it, 0.53-0.78 with
        settle()
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
    settle()  # the other blocks' files are written back before the timed phase, as before every timed NVMe phase
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
