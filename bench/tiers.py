"""``kvstore bench tiers``: store/load GB/s and latency per tier, beside the machine's limits.

Every figure is printed beside a limit measured in the same run, on the same bytes, right
before it (so a busy machine slows both sides of the ratio alike):

* DRAM put/get: a memcpy of the same blocks, one block per copy, from as many threads as the
  bench has callers (numpy releases the GIL while it copies), or from one thread when that is
  faster (more threads than cores);
* NVMe put/get: the better of an O_DIRECT sequential write/read in 4 MiB chunks at queue depth 1
  (what ``dd oflag=direct bs=4M`` does) and an O_DIRECT write/read of the same blocks, one block
  per I/O, at the store's I/O parallelism (``--io-threads``; the store writes one file per block
  from that many threads, which a virtual disk serves faster than queue depth 1);
* remote put/get (``--tiers remote``, Redis or Valkey: ``--redis-url``, else a private
  ``redis-server`` started for the run, ``bench/redis_local.py``): a raw pipelined ``SET ... PX``
  then ``GETEX ... PX`` of values of the store's size (block bytes + the 88-byte header, built
  before the clock starts), with the same redis-py client type (a ``BlockingConnectionPool`` of
  as many connections as callers), on the same server, the same batch per pipeline and as many
  caller threads. The store under test has DRAM and NVMe off and ``tiers.remote.url`` set (its remote
  connection pool and I/O pool as wide as the callers); its put is timed up to ``store.flush()``,
  so a write-through still running on the store's I/O pool is counted. Should a put with no local tier store nothing (the store writes Redis only through a
  local tier), the put side is measured with a DRAM tier in front (write-through, the DRAM copy
  included in the time) and the row says so; the get side always reads a store with no local tier.

The default block is shaped like a 7B-class model: 32 layers, 8 KV heads, head size 128, fp16,
so 16 / 32 / 128 tokens are 2 / 4 / 16 MiB. Latency is per put/get call of ``--batch`` blocks.
``--codecs`` measures the tiers with a codec (GB/s of uncompressed bytes); a codec the store does
not implement yet is listed as skipped. Each row also gives the compression ratio (raw bytes / bytes
the tier accounts for the blocks, which are the files' real sizes, cross-checked against the files on
disk) and the capacity gain (blocks per GB vs codec none on the same tier). A codec's ratio depends on
the bytes, so ``--kv-data`` picks KV-like contents (``bench/kvdata.py``): ``tiny-llama`` (KV captured
from the tiny random-weight Llama; the default when a codec other than none is measured) or
``synthetic`` (normal values with per-head scales; the default otherwise). Options can come from a
YAML (``--config``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time

import numpy as np

from bench.kvdata import KINDS
from bench.kvdata import fill as fill_kv
from bench.limits import memcpy_gbps, memcpy_rows_s, odirect_gbps, odirect_rows_s
from bench.report import markdown_table, progress, write_json
from kvstore.config import from_dict
from kvstore.keys import ModelFingerprint, chain_keys
from kvstore.memory import alloc_aligned
from kvstore.store import KVStore

GiB = 1 << 30


DEFAULTS = {
    "total_mb": 512, "block_tokens": "16,32,128", "layers": 32, "kv_heads": 8, "head_size": 128, "dtype_bytes": 2,
    "batch": 32, "concurrency": "1,4", "io_threads": 4, "repeats": 3, "tiers": "dram,nvme", "codecs": "none",
    "dir": None, "o_direct": "auto", "json": None, "plots": None, "kv_data": "auto",
    "redis_url": None, "redis_timeout_ms": 10000,
}


def add_args(p: argparse.ArgumentParser) -> None:
    d = DEFAULTS
    p.add_argument("--config", default=None, help="YAML of any of these options (keys as the flags, with _), "
                   "e.g. configs/bench_tiers.yaml; flags win")
    p.add_argument("--total-mb", type=int, default=None, help=f"bytes moved per measurement, MiB ({d['total_mb']})")
    p.add_argument("--block-tokens", default=None, help=f"comma list of tokens per block ({d['block_tokens']})")
    p.add_argument("--layers", type=int, default=None, help=f"({d['layers']})")
    p.add_argument("--kv-heads", type=int, default=None, help=f"({d['kv_heads']})")
    p.add_argument("--head-size", type=int, default=None, help=f"({d['head_size']})")
    p.add_argument("--dtype-bytes", type=int, default=None, help="2 = fp16/bf16, 1 = fp8/int8 (2)")
    p.add_argument("--batch", type=int, default=None, help=f"blocks per put/get call ({d['batch']})")
    p.add_argument("--concurrency", default=None, help=f"comma list of caller threads ({d['concurrency']})")
    p.add_argument("--io-threads", type=int, default=None, help=f"NVMe I/O threads ({d['io_threads']})")
    p.add_argument("--repeats", type=int, default=None, help=f"({d['repeats']})")
    p.add_argument("--tiers", default=None, help=f"comma list of dram, nvme, remote ({d['tiers']})")
    p.add_argument("--redis-url", default=None, help="remote tier: redis://host:port of the server to measure (its "
                   "password from KVSTORE_REDIS_PASSWORD); default: a private redis-server started for the run")
    p.add_argument("--redis-timeout-ms", type=int, default=None,
                   help=f"remote tier: socket timeout of the store and the raw client ({d['redis_timeout_ms']})")
    p.add_argument("--codecs", default=None, help="comma list of tier codecs to measure (none | int8 | fp8 | "
                   "...+zstd); a codec the store does not implement yet is reported as such (none)")
    p.add_argument("--kv-data", default=None, choices=["auto", *KINDS],
                   help="block contents: KV captured from the tiny random-weight Llama, or synthetic normal KV with "
                   "per-head scales (auto: tiny-llama when a codec other than none is measured)")
    p.add_argument("--dir", default=None, help="folder for the NVMe tier (default: a temp folder)")
    p.add_argument("--o-direct", default=None, choices=["auto", "true", "false"])
    p.add_argument("--json", default=None, help="write results as JSON here")
    p.add_argument("--plots", default=None, help="write PNG plots into this folder")


def resolve(a: argparse.Namespace) -> argparse.Namespace:
    """flags > YAML (--config) > DEFAULTS."""
    import yaml

    y = {}
    if getattr(a, "config", None):
        with open(a.config) as f:
            y = yaml.safe_load(f) or {}
        bad = set(y) - set(DEFAULTS)
        if bad:
            raise SystemExit(f"{a.config}: unknown keys {sorted(bad)}; known: {sorted(DEFAULTS)}")
    out = argparse.Namespace(**vars(a))
    for k, v in DEFAULTS.items():
        if getattr(out, k, None) is None:
            val = y.get(k, v)
            if isinstance(val, list):
                val = ",".join(str(x) for x in val)
            setattr(out, k, val)
    return out


def _block_bytes(a, block_tokens: int) -> int:
    return 2 * a.layers * a.kv_heads * a.head_size * a.dtype_bytes * block_tokens


def _make_store(tier: str, n_blocks: int, block_bytes: int, folder: str, a, tokens: int, codec: str) -> KVStore:
    slot = (block_bytes + 4095) // 4096 * 4096
    if tier == "dram":
        tiers = {"dram": {"capacity_gb": (n_blocks * slot + (1 << 20)) / GiB, "ttl_s": None, "codec": codec},
                 "nvme": {"capacity_gb": 0}}
    else:
        tiers = {"dram": {"capacity_gb": 0},
                 "nvme": {"capacity_gb": (n_blocks * (slot + 4096) * 2) / GiB, "ttl_s": None, "path": folder,
                          "o_direct": {"auto": "auto", "true": True, "false": False}[a.o_direct],
                          "io_threads": a.io_threads, "codec": codec}}
    cfg = from_dict({"tiers": tiers})
    dtype = {2: "float16", 4: "float32"}.get(a.dtype_bytes, "uint8")  # what a codec needs to know
    fp = ModelFingerprint(model=f"bench-{tier}-{time.perf_counter_ns()}", dtype=dtype, block_size=tokens,
                          num_layers=a.layers, num_kv_heads=a.kv_heads, head_size=a.head_size, codec=codec)
    s = KVStore(cfg, block_bytes=block_bytes, fingerprint=fp, block_tokens=tokens)
    s.wait_ready()  # time the tiers, not the pool's preparation
    return s


def _run_op(fn, keys: list[bytes], rows: np.ndarray, batch: int, threads: int,
            counted: list[int] | None = None) -> tuple[float, list[float]]:
    """Call fn(keys[i:i+batch], rows[i:i+batch]) over all keys from ``threads`` callers
    (the sum of fn's results is appended to ``counted``)."""
    starts = list(range(0, len(keys), batch))
    per = [starts[t::threads] for t in range(threads)]
    lat: list[float] = []
    total = [0]
    lock = threading.Lock()

    def worker(my):
        mine, got = [], 0
        for s in my:
            t = time.perf_counter()
            got += int(fn(keys[s:s + batch], rows[s:s + batch]) or 0)
            mine.append(time.perf_counter() - t)
        with lock:
            lat.extend(mine)
            total[0] += got

    ths = [threading.Thread(target=worker, args=(p,)) for p in per]
    t0 = time.perf_counter()
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    if counted is not None:
        counted.append(total[0])
    return time.perf_counter() - t0, lat


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1e3 if xs else 0.0


def _fill(src: np.ndarray, a, tokens: int) -> str:
    """KV-like content (what a codec would see, see bench/kvdata.py), block index in the first bytes
    (so a block served under another's key is seen). Returns what the data is."""
    n, bb = src.shape
    dtype = {2: "float16", 4: "float32"}.get(a.dtype_bytes)
    if dtype is None:  # 1-byte elements: no codec quantizes them further
        src[:] = np.random.default_rng(0).integers(0, 256, size=bb, dtype=np.uint8)[None, :]
        what = "uint8 noise (--dtype-bytes 1)"
    else:
        what = fill_kv(src, a.kv_data, layers=a.layers, tokens=tokens, kv_heads=a.kv_heads, head_size=a.head_size,
                       dtype=dtype)
    src[:, :8] = np.arange(n, dtype=np.uint64).view(np.uint8).reshape(n, 8)
    return what


def nbytes_gb(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def _verify(out: np.ndarray, src: np.ndarray, codec: str) -> bool | None:
    """True: bytes identical. None: a lossy codec, values within its error bound. False: wrong."""
    if np.array_equal(out, src):
        return True
    if codec.split("+")[0] not in ("int8", "fp8"):
        return False
    a = src.view(np.float16)[:, 4:].astype(np.float32)  # past the 8-byte block index
    b = out.view(np.float16)[:, 4:].astype(np.float32)
    ok = np.abs(a - b) <= 0.15 * np.abs(a) + 0.05 * float(np.abs(a).max())
    return None if bool(ok.all()) else False


def run(a: argparse.Namespace) -> dict:
    a = resolve(a)
    block_tokens = [int(x) for x in str(a.block_tokens).split(",") if x]
    concurrency = [int(x) for x in str(a.concurrency).split(",") if x]
    tiers = [t for t in str(a.tiers).split(",") if t]
    codecs = [c for c in str(a.codecs).split(",") if c]
    if a.kv_data == "auto":
        a.kv_data = "tiny-llama" if any(c != "none" for c in codecs) else "synthetic"
    data_notes: list[str] = []
    total = a.total_mb << 20
    folder_ctx = tempfile.TemporaryDirectory(prefix="kvstore-bench-", dir=a.dir)
    folder = folder_ctx.name
    results: list[dict] = []
    skipped: list[dict] = []
    bad = [t for t in tiers if t not in ("dram", "nvme", "remote")]
    if bad:
        raise SystemExit(f"--tiers: unknown {bad}; known: dram, nvme, remote")
    server = None
    a._redis_url, a._redis_password = None, None
    if "remote" in tiers:
        if a.redis_url:
            a._redis_url, a._redis_password = a.redis_url, os.environ.get("KVSTORE_REDIS_PASSWORD") or None
        else:
            from bench import redis_local

            if redis_local.available():
                server = redis_local.start()
                a._redis_url = server.url
            else:  # the other tiers are still measured
                tiers = [t for t in tiers if t != "remote"]
                skipped += [{"tier": "remote", "codec": c, "block_tokens": None, "concurrency": None,
                             "error": "no redis-server on PATH (install it, or pass --redis-url)"} for c in codecs]
    n_steps = len(block_tokens) * (len(concurrency) * len(tiers) * len(codecs) * a.repeats) + 2
    bar, task = progress(n_steps, "bench tiers")
    limits: dict = {}
    try:
        with bar:
            _run_all(a, block_tokens, concurrency, tiers, codecs, total, folder, data_notes, results, skipped,
                     bar, task, limits)
    finally:
        if server is not None:
            server.stop()
    folder_ctx.cleanup()
    data = {"limits": limits, "results": results, "skipped": skipped, "kv_data": data_notes,
            "params": {"kv_data": a.kv_data, "total_mb": a.total_mb, "layers": a.layers, "kv_heads": a.kv_heads, "head_size": a.head_size,
                       "dtype_bytes": a.dtype_bytes, "batch": a.batch, "repeats": a.repeats,
                       "io_threads": a.io_threads, "block_tokens": block_tokens, "concurrency": concurrency,
                       "codecs": codecs, "tiers": tiers,
                       **({"redis": "--redis-url" if a.redis_url else "private redis-server",
                           "redis_timeout_ms": a.redis_timeout_ms} if "remote" in tiers else {})}}
    print(render(data))
    write_json(a.json, data)
    if a.plots:
        plot(data, a.plots)
    return data


def _run_all(a, block_tokens, concurrency, tiers, codecs, total, folder, data_notes, results, skipped, bar, task,
             limits: dict) -> None:
    # the dd-style reference limits (one big buffer; DESIGN.md section 6), for the header
    mem = memcpy_gbps(total)
    bar.advance(task)
    dw, dr, direct = odirect_gbps(folder, total)
    bar.advance(task)
    limits.update({"memcpy_gbps": mem, "odirect_write_gbps": dw, "odirect_read_gbps": dr, "o_direct": direct})
    for bt in block_tokens:
        bb = _block_bytes(a, bt)
        n = max(a.batch, total // bb)
        _m1, flat = alloc_aligned(n * bb)
        src = flat.reshape(n, bb)
        what = _fill(src, a, bt)
        if what not in data_notes:
            data_notes.append(what)
        _m2, oflat = alloc_aligned(n * bb)
        out = oflat.reshape(n, bb)
        for tier in tiers:
            for codec in codecs:
                for c in concurrency:
                    row = _measure(tier, codec, c, bt, bb, n, src, out, folder, a, bar, task)
                    if "error" in row:
                        skipped.append(row)
                    else:
                        results.extend(row["rows"])
        del src, out, flat, oflat
        _m1.close()
        _m2.close()


def _measure(tier, codec, c, bt, bb, n, src, out, folder, a, bar, task) -> dict:
    """``repeats`` rounds of (limit, store put, limit, store get) back to back, so a busy machine
    slows both sides of each ratio alike. DRAM limit: one-thread-per-caller memcpy of the same
    rows, one block per copy. NVMe limit: the better of a dd-style O_DIRECT sequential write/read
    (4 MiB, queue depth 1) and an O_DIRECT write/read of the same rows, one block per I/O, at the
    store's I/O parallelism (``io_threads``)."""
    if tier == "remote":
        return _measure_remote(codec, c, bt, bb, n, src, out, a, bar, task)
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
            bar.advance(task, a.repeats - r)
            return {"tier": tier, "codec": codec, "block_tokens": bt, "concurrency": c,
                    "error": f"{type(e).__name__}: {e}"}
        keys = chain_keys(store.root, np.arange(n * bt) % 50000 + r, bt)
        try:
            t, lat = _run_op(store.put, keys, src, a.batch, c)
            put_t.append(t)
            put_l += lat
            tier_obj = store.dram if tier == "dram" else store.nvme
            stored.append(tier_obj.index.used)
            if tier == "nvme":
                none_bytes = tier_obj.file_bytes_for(bb)
                on_disk.append(_files_bytes(tier_obj.root))
            else:
                none_bytes = tier_obj.index.used // max(1, len(tier_obj.index.entries))
            out[:] = 0
            t, lat = _run_op(store.get, keys, out, a.batch, c, got)
            get_t.append(t)
            get_l += lat
            v = _verify(out, src, codec) if got[-1] == n else False
            ok = False if (ok is False or v is False) else (None if (ok is None or v is None) else True)
        except Exception as e:
            bar.advance(task, a.repeats - r)
            return {"tier": tier, "codec": codec, "block_tokens": bt, "concurrency": c,
                    "error": f"{type(e).__name__}: {e}"}
        finally:
            store.close(persist=False)
        bar.advance(task)
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
                     "p50_ms": _pct(lat, 0.5), "p99_ms": _pct(lat, 0.99), "verified": ok, **comp,
                     "blocks": n, "get_returned_min": min(got) if got else None,
                     "gbps_runs": [nbytes / t / 1e9 for t in ts],
                     "limit_runs": [nbytes / t / 1e9 for t in lim[op]], "limit_alt_runs": lim.get(op + "_seq")})  # seq 4M (NVMe) or x1 (DRAM)
    return {"rows": rows}


# -- remote tier (Redis / Valkey) --------------------------------------------------------------------

REMOTE_HEADER = 88  # kvstore.fileformat.HEADER_CORE: what a remote value carries before the payload


def _remote_cfg(a, c: int, codec: str, dram_bytes: int = 0) -> dict:
    """Store config: DRAM off (or ``dram_bytes`` in front, for the put fallback), NVMe off, the
    remote tier on, its I/O pool and connection pool as wide as the callers."""
    return {"tiers": {"dram": ({"capacity_gb": dram_bytes / GiB, "ttl_s": None} if dram_bytes else {"capacity_gb": 0}),
                      "nvme": {"capacity_gb": 0, "io_threads": c},
                      "remote": {"url": a._redis_url, "codec": codec, "io_threads": c,
                                 "timeout_ms": a.redis_timeout_ms}}}


def _remote_store(a, c: int, codec: str, fp, bb: int, tokens: int, dram_bytes: int = 0) -> KVStore:
    s = KVStore(from_dict(_remote_cfg(a, c, codec, dram_bytes)), block_bytes=bb, fingerprint=fp, block_tokens=tokens)
    s.wait_ready()
    if s.remote is None:
        s.close(persist=False)
        raise RuntimeError("the store opened no remote tier")
    return s


def _remote_put_direct(store: KVStore, bb: int) -> bool:
    """Does a put into a store with no local tier reach Redis? (one probe block, removed after)"""
    key = np.random.default_rng().bytes(16)
    before = store.remote.stats.get("puts", 0)
    store.put([key], np.zeros((1, bb), np.uint8))
    store.flush()
    ok = store.remote.stats.get("puts", 0) > before
    store.remote.remove([key])
    return ok


def _raw_client(a, c: int):
    """The client the store uses (redis-py, a BlockingConnectionPool of ``c`` connections, no retries)."""
    from urllib.parse import urlsplit

    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    u = urlsplit(a._redis_url)
    t = a.redis_timeout_ms / 1000
    pool = redis.BlockingConnectionPool(max_connections=c, timeout=None, host=u.hostname, port=u.port or 6379,
                                        db=int(u.path.strip("/") or 0), retry=Retry(NoBackoff(), 0),
                                        username=os.environ.get("KVSTORE_REDIS_USERNAME") or None,
                                        password=a._redis_password, socket_timeout=t, socket_connect_timeout=t,
                                        **({"connection_class": redis.SSLConnection} if u.scheme == "rediss" else {}))
    return redis.Redis(connection_pool=pool)


def _unlink(client, names: list[bytes]) -> None:
    for i in range(0, len(names), 512):
        pipe = client.pipeline(transaction=False)
        for k in names[i:i + 512]:
            pipe.unlink(k)
        pipe.execute()


def _measure_remote(codec, c, bt, bb, n, src, out, a, bar, task) -> dict:
    """``repeats`` rounds of (raw SET, store put, raw GET, store get) back to back. Raw: a pipeline
    of ``batch`` ``SET name value PX ttl`` (then ``GETEX name PX ttl``) per call from ``c`` threads,
    values of the store's size prepared before the clock starts; store: ``put`` from ``c`` threads
    then ``flush()`` (the write-through on the I/O pool), ``get`` from ``c`` threads."""
    import secrets

    put_t, get_t, put_l, get_l, lim = [], [], [], [], {"put": [], "get": []}
    ok: bool | None = True
    got: list[int] = []
    written: list[int] = []  # value bytes the store sent to Redis for the n blocks
    put_via = "no local tier"
    client = _raw_client(a, c)
    ttl_ms = 86400 * 1000  # the store's default tiers.remote.ttl_s
    tag = secrets.token_hex(16).encode()
    # raw values: the store's value size (header + payload), the block's bytes after a fake header
    head = np.frombuffer(secrets.token_bytes(REMOTE_HEADER), np.uint8)
    values = [head.tobytes() + src[i].tobytes() for i in range(n)]
    raw_lat_put: list[float] = []
    raw_lat_get: list[float] = []
    raw_bad = [0]

    def raw_set(names, vals):
        pipe = client.pipeline(transaction=False)
        for k, v in zip(names, vals):
            pipe.set(k, v, px=ttl_ms)
        return sum(1 for r in pipe.execute() if r is True)

    def raw_get(names, _rows):
        pipe = client.pipeline(transaction=False)
        for k in names:
            pipe.execute_command("GETEX", k, "PX", ttl_ms)
        res = pipe.execute()
        good = sum(1 for r in res if isinstance(r, bytes) and len(r) == bb + REMOTE_HEADER)
        if good != len(names):
            raw_bad[0] += len(names) - good
        return good

    try:
        fp = ModelFingerprint(model=f"bench-remote-{tag.decode()}", dtype={2: "float16", 4: "float32"}.get(
            a.dtype_bytes, "uint8"), block_size=bt, num_layers=a.layers, num_kv_heads=a.kv_heads,
            head_size=a.head_size, codec=codec)
        for r in range(a.repeats):
            try:
                gstore = _remote_store(a, c, codec, fp, bb, bt)
            except Exception as e:  # e.g. a codec the remote tier does not implement
                bar.advance(task, a.repeats - r)
                return {"tier": "remote", "codec": codec, "block_tokens": bt, "concurrency": c,
                        "error": f"{type(e).__name__}: {e}"}
            pstore = None
            try:
                if r == 0 and not _remote_put_direct(gstore, bb):
                    put_via = "DRAM write-through"
                if put_via != "no local tier":  # DRAM as large as the run, in front, written through
                    slot = (bb + 4095) // 4096 * 4096
                    pstore = _remote_store(a, c, codec, fp, bb, bt, dram_bytes=n * slot + (1 << 20))
                else:
                    pstore = gstore
                keys = chain_keys(gstore.root, np.arange(n * bt) % 50000 + r, bt)
                names = [gstore.remote.redis_key(k) for k in keys]
                raw_names = [b"raw:{" + tag + b".%02x}:" % (i & 255) + b"%032x" % (r << 40 | i) for i in range(n)]
                # raw SET (the put's limit)
                t, lat = _run_op(raw_set, raw_names, values, a.batch, c)
                lim["put"].append(t)
                raw_lat_put += lat
                # store put, up to the end of its write-through
                w0 = pstore.remote.stats.get("bytes_written", 0)
                t0 = time.perf_counter()
                _t, lat = _run_op(pstore.put, keys, src, a.batch, c)
                pstore.flush()
                put_t.append(time.perf_counter() - t0)
                put_l += lat
                written.append(pstore.remote.stats.get("bytes_written", 0) - w0)
                # raw GET (the get's limit)
                t, lat = _run_op(raw_get, raw_names, out, a.batch, c)
                lim["get"].append(t)
                raw_lat_get += lat
                # store get (no local tier: every block from Redis)
                out[:] = 0
                t, lat = _run_op(gstore.get, keys, out, a.batch, c, got)
                get_t.append(t)
                get_l += lat
                v = _verify(out, src, codec) if got[-1] == n else False
                ok = False if (ok is False or v is False) else (None if (ok is None or v is None) else True)
                _unlink(client, raw_names + names)
            except Exception as e:
                bar.advance(task, a.repeats - r)
                return {"tier": "remote", "codec": codec, "block_tokens": bt, "concurrency": c,
                        "error": f"{type(e).__name__}: {e}"}
            finally:
                if pstore is not None and pstore is not gstore:
                    pstore.close(persist=False)
                gstore.close(persist=False)
            bar.advance(task)
    finally:
        client.close()
    nbytes = n * bb
    used = statistics.median(written) if written else 0
    none_bytes = bb + REMOTE_HEADER
    comp = {"stored_bytes": int(used), "disk_bytes": None, "comp_ratio": nbytes / used if used else None,
            "capacity_gain": none_bytes * n / used if used else None,
            "blocks_per_gb": n / used * 1e9 if used else None}
    rows = []
    for op, ts, lat, rlat in (("put", put_t, put_l, raw_lat_put), ("get", get_t, get_l, raw_lat_get)):
        gbps = nbytes / statistics.median(ts) / 1e9
        limit = nbytes / statistics.median(lim[op]) / 1e9
        name = f"redis {'SET' if op == 'put' else 'GETEX'} x{c}"
        rows.append({"tier": "remote", "op": op, "codec": codec, "block_tokens": bt, "block_bytes": bb,
                     "concurrency": c, "gbps": gbps, "limit": name, "limit_gbps": limit, "ratio": gbps / limit,
                     "p50_ms": _pct(lat, 0.5), "p99_ms": _pct(lat, 0.99), "verified": ok, **comp,
                     "blocks": n, "get_returned_min": min(got) if got else None,
                     "gbps_runs": [nbytes / t / 1e9 for t in ts], "limit_runs": [nbytes / t / 1e9 for t in lim[op]],
                     "limit_alt_runs": [], "limit_p50_ms": _pct(rlat, 0.5), "limit_p99_ms": _pct(rlat, 0.99),
                     "limit_bad_values": raw_bad[0], "put_via": put_via if op == "put" else "no local tier"})
    return {"rows": rows}


def _files_bytes(root) -> int:
    """Sum of the sizes of the block files under an NVMe tier folder."""
    import os

    total = 0
    for d, _, files in os.walk(root):
        for f in files:
            if f.endswith(".kvb"):
                total += os.stat(os.path.join(d, f), follow_symlinks=False).st_size
    return total


def render(data: dict) -> str:
    L = data["limits"]
    head = (f"Reference limits (one 2-buffer copy / dd-style file, whole run size): memcpy {L['memcpy_gbps']:.2f} GB/s; "
            f"{'O_DIRECT' if L['o_direct'] else 'buffered+fsync'} sequential write {L['odirect_write_gbps']:.2f} GB/s, "
            f"read {L['odirect_read_gbps']:.2f} GB/s. Each row's own limit (same bytes, measured beside it) is in "
            f"its 'limit' columns; latency is per call of {data['params']['batch']} blocks.\n")
    for what in data.get("kv_data", []):
        head += f"Block contents: {what}.\n"
    head += ("ratio = GB/s / limit. comp = raw bytes / bytes the tier holds for them (files at their real size); "
             "cap x = blocks per GB vs codec none on the same tier.\n")
    rows = [{**r, "mib": r["block_bytes"] / 2**20,
             "ok": {True: "yes", False: "NO", None: "lossy, in bound"}[r["verified"]]
             + ("" if r.get("get_returned_min") in (None, r.get("blocks")) else
                f" (get returned {r['get_returned_min']}/{r['blocks']} blocks)")} for r in data["results"]]
    cols = ["tier", "op", "codec", "block_tokens", "mib", "concurrency", "gbps", "limit", "limit_gbps", "ratio",
            "comp_ratio", "capacity_gain", "p50_ms", "p99_ms", "ok"]
    out = head + "\n" + markdown_table(rows, cols, ["tier", "op", "codec", "tokens/blk", "MiB/blk", "threads", "GB/s",
                                                    "limit", "limit GB/s", "ratio", "comp", "cap x", "p50 ms",
                                                    "p99 ms", "bytes ok"])
    remote = [r for r in data["results"] if r["tier"] == "remote"]
    if remote:
        out += ("\n\nremote: limit = raw pipelined SET PX / GETEX PX of values of the store's size (block + "
                f"{REMOTE_HEADER}-byte header, built before timing), same client type, server, batch and threads; "
                "store put timed up to flush() (write-through done); store get with no local tier.")
        via = sorted({r["put_via"] for r in remote if r["op"] == "put"} - {"no local tier"})
        if via:
            out += (f"\nremote put measured through {', '.join(via)}: a put into a store with no local tier stored "
                    "nothing in Redis (the store writes Redis only as a write-through of a local tier).")
    if data.get("skipped"):
        seen = set()
        notes = []
        for s in data["skipped"]:
            k = (s["tier"], s["codec"])
            if k not in seen:
                seen.add(k)
                notes.append(f"- {s['tier']} codec {s['codec']}: not measured ({s['error']})")
        out += "\n\nSkipped:\n" + "\n".join(notes)
    return out


def plot(data: dict, folder: str) -> list[str]:
    import os

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(folder, exist_ok=True)
    paths = []
    tiers = [t for t in ("dram", "nvme", "remote") if any(r["tier"] == t for r in data["results"])]
    if not tiers:
        return paths
    fig, axes = plt.subplots(len(tiers), 1, figsize=(11, 3.6 * len(tiers)), squeeze=False)
    for ax, tier in zip(axes[:, 0], tiers):
        rows = [r for r in data["results"] if r["tier"] == tier]
        labels = [f"{r['op']} {r['block_tokens']}t x{r['concurrency']}"
                  + ("" if r["codec"] == "none" else f"\n{r['codec']}") for r in rows]
        x = np.arange(len(rows))
        ax.bar(x - 0.2, [r["gbps"] for r in rows], 0.4, label="kvstore GB/s")
        ax.bar(x + 0.2, [r["limit_gbps"] for r in rows], 0.4, label="limit GB/s (same bytes, same run)")
        for i, r in enumerate(rows):
            ax.text(i, max(r["gbps"], r["limit_gbps"]), f"{r['ratio']:.0%}", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(x, labels, fontsize=8)
        ax.set_ylabel("GB/s")
        ax.set_title(f"{tier.upper()} tier vs. its limit (ratio above the bars)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    path = os.path.join(folder, "tiers_gbps.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    paths.append(path)
    fig, axes = plt.subplots(1, len(tiers), figsize=(6 * len(tiers), 4), squeeze=False)
    for ax, tier in zip(axes[0], tiers):
        for op in ("put", "get"):
            for c in sorted({r["concurrency"] for r in data["results"]}):
                rows = sorted([r for r in data["results"] if r["tier"] == tier and r["op"] == op
                               and r["concurrency"] == c and r["codec"] == "none"], key=lambda r: r["block_tokens"])
                if not rows:
                    continue
                xs = [r["block_tokens"] for r in rows]
                line, = ax.plot(xs, [r["p50_ms"] for r in rows], "-o", label=f"{op} x{c} p50")
                ax.plot(xs, [r["p99_ms"] for r in rows], "--", color=line.get_color(), alpha=0.7,
                        label=f"{op} x{c} p99")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens per block")
        ax.set_ylabel(f"ms per call ({data['params']['batch']} blocks)")
        ax.set_title(f"{tier.upper()} latency")
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = os.path.join(folder, "tiers_latency.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    paths.append(path)
    return paths


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="kvstore bench tiers", description=__doc__)
    add_args(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    main()
