"""Remote rows of ``kvstore bench tiers`` (Redis / Valkey): a store with the remote tier alone,
its put (up to the end of its write-through) and get, beside a raw pipelined SET / GETEX of values
of the store's size with the same client type, server, batch and threads."""

from __future__ import annotations

import os
import statistics
import time

import numpy as np

from bench import stores
from bench.tiers_ops import fingerprint, not_measured, pct, run_op, timed_get
from kvstore.keys import chain_keys
from kvstore.store import KVStore

REMOTE_HEADER = 88  # kvstore.fileformat.HEADER_CORE: what a remote value carries before the payload


def _remote_cfg(a, c: int, codec: str, bb: int, dram_blocks: int = 0) -> dict:
    """Store config: DRAM off (or room for ``dram_blocks`` and 1 MiB in front, for the put fallback),
    NVMe off, the remote tier on, its I/O pool and connection pool as wide as the callers."""
    dram = {"capacity_gb": stores.capacity_gb(dram_blocks, bb, "dram", spare_bytes=1 << 20), "ttl_s": None}
    return {"tiers": {"dram": dram if dram_blocks else {"capacity_gb": 0},
                      "nvme": {"capacity_gb": 0, "io_threads": c},
                      "remote": {"url": a._redis_url, "codec": codec, "io_threads": c,
                                 "timeout_ms": a.redis_timeout_ms}}}


def _remote_store(a, c: int, codec: str, fp, bb: int, tokens: int, dram_blocks: int = 0) -> KVStore:
    s = stores.open_store(_remote_cfg(a, c, codec, bb, dram_blocks), block_bytes=bb, fingerprint=fp,
                          block_tokens=tokens)
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


def measure_remote(codec, c, bt, bb, n, src, out, a, bar) -> dict:
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
        fp = fingerprint(a, f"bench-remote-{tag.decode()}", bt, codec)
        for r in range(a.repeats):
            try:
                gstore = _remote_store(a, c, codec, fp, bb, bt)
            except Exception as e:  # e.g. a codec the remote tier does not implement
                bar.advance(a.repeats - r)
                return not_measured("remote", codec, bt, c, e)
            pstore = None
            try:
                if r == 0 and not _remote_put_direct(gstore, bb):
                    put_via = "DRAM write-through"
                if put_via != "no local tier":  # DRAM as large as the run, in front, written through
                    pstore = _remote_store(a, c, codec, fp, bb, bt, dram_blocks=n)
                else:
                    pstore = gstore
                keys = chain_keys(gstore.root, np.arange(n * bt) % 50000 + r, bt)
                names = [gstore.remote.redis_key(k) for k in keys]
                raw_names = [b"raw:{" + tag + b".%02x}:" % (i & 255) + b"%032x" % (r << 40 | i) for i in range(n)]
                # raw SET (the put's limit)
                t, lat = run_op(raw_set, raw_names, values, a.batch, c)
                lim["put"].append(t)
                raw_lat_put += lat
                # store put, up to the end of its write-through
                w0 = pstore.remote.stats.get("bytes_written", 0)
                t0 = time.perf_counter()
                _t, lat = run_op(pstore.put, keys, src, a.batch, c)
                pstore.flush()
                put_t.append(time.perf_counter() - t0)
                put_l += lat
                written.append(pstore.remote.stats.get("bytes_written", 0) - w0)
                # raw GET (the get's limit)
                t, lat = run_op(raw_get, raw_names, out, a.batch, c)
                lim["get"].append(t)
                raw_lat_get += lat
                # store get (no local tier: every block from Redis)
                t, lat, ok = timed_get(gstore.get, keys, src, out, a.batch, c, codec, got, ok)
                get_t.append(t)
                get_l += lat
                _unlink(client, raw_names + names)
            except Exception as e:
                bar.advance(a.repeats - r)
                return not_measured("remote", codec, bt, c, e)
            finally:
                if pstore is not None and pstore is not gstore:
                    pstore.close(persist=False)
                gstore.close(persist=False)
            bar.advance()
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
                     "p50_ms": pct(lat, 0.5), "p99_ms": pct(lat, 0.99), "verified": ok, **comp,
                     "blocks": n, "get_returned_min": min(got) if got else None,
                     "gbps_runs": [nbytes / t / 1e9 for t in ts], "limit_runs": [nbytes / t / 1e9 for t in lim[op]],
                     "limit_alt_runs": [], "limit_p50_ms": pct(rlat, 0.5), "limit_p99_ms": pct(rlat, 0.99),
                     "limit_bad_values": raw_bad[0], "put_via": put_via if op == "put" else "no local tier"})
    return {"rows": rows}
