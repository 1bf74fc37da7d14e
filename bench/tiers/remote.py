"""Remote rows of ``kvstore bench tiers`` (Redis / Valkey): a store with the remote tier alone,
its put (up to the end of its write-through) and get, beside a raw pipelined SET / GETEX of values
of the store's size with the same client type, server, batch and threads. Each op has two rows:
``remote`` (no ``KVSTORE_REMOTE_SECRET``) and ``remote+mac`` (a secret: every value carries an
HMAC-SHA256 over header and payload, made at the put and checked at the get), timed in the same
rounds against the same raw limit, so the ratio of the two rows is the MAC's cost."""

from __future__ import annotations

import os
import secrets as _secrets
import statistics
import time
from contextlib import contextmanager

import numpy as np

from kvstore.bench.common import stores
from kvstore.bench.common.paired import paired_median, stalled
from kvstore.bench.tiers.ops import fingerprint, not_measured, pct, run_op, timed_get
from kvstore.keys import chain_keys
from kvstore.store import KVStore
from kvstore.tiers.redis.value import ENV_PREVIOUS, ENV_SECRET, MAC_BYTES

REMOTE_HEADER = 88  # kvstore.tiers.fileformat.HEADER_CORE: what a remote value carries before the payload


def _remote_cfg(a, c: int, codec: str, bb: int, dram_blocks: int = 0) -> dict:
    """Store config: DRAM off (or room for ``dram_blocks`` and 1 MiB in front, for the put fallback),
    NVMe off, the remote tier on, its I/O pool and connection pool as wide as the callers."""
    dram = {"capacity_gb": stores.capacity_gb(dram_blocks, bb, "dram", spare_bytes=1 << 20), "ttl_s": None}
    return {"tiers": {"dram": dram if dram_blocks else {"capacity_gb": 0},
                      "nvme": {"capacity_gb": 0, "io_threads": c},
                      "remote": {"url": a._redis_url, "codec": codec, "io_threads": c,
                                 "timeout_ms": a.redis_timeout_ms}}}


@contextmanager
def _secret_env(secret: str | None):
    """The store opened inside reads this secret (None: none) from the environment, as an engine would."""
    saved = {k: os.environ.pop(k, None) for k in (ENV_SECRET, ENV_PREVIOUS)}
    if secret is not None:
        os.environ[ENV_SECRET] = secret
    try:
        yield
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None)
            if v is not None:
                os.environ[k] = v


def _remote_store(a, c: int, codec: str, fp, bb: int, tokens: int, dram_blocks: int = 0,
                  secret: str | None = None) -> KVStore:
    with _secret_env(secret):
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
    store.remote.client.remove([key])
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
    """``repeats`` rounds of (raw SET, store put, MAC'd store put, raw GET, store get, MAC'd store
    get) back to back. Raw: a pipeline of ``batch`` ``SET name value PX ttl`` (then ``GETEX name PX
    ttl``) per call from ``c`` threads, values of the store's size prepared before the clock
    starts; store: ``put`` from ``c`` threads then ``flush()`` (the write-through on the I/O
    pool), ``get`` from ``c`` threads. The MAC'd store uses ``KVSTORE_REMOTE_SECRET`` if set,
    else a random one."""
    ttl_ms = 86400 * 1000  # the store's default tiers.remote.ttl_s
    tag = _secrets.token_hex(16).encode()
    secret = os.environ.get(ENV_SECRET) or _secrets.token_urlsafe(32)
    # raw values: the store's value size (header + payload), the block's bytes after a fake header
    head = np.frombuffer(_secrets.token_bytes(REMOTE_HEADER), np.uint8)
    values = [head.tobytes() + src[i].tobytes() for i in range(n)]
    lim: dict = {"put": [], "get": [], "put_lat": [], "get_lat": [], "bad": [0]}
    runs = {mac: {"put": [], "get": [], "put_lat": [], "get_lat": [], "written": [], "got": [], "ok": True}
            for mac in (False, True)}
    put_via = "no local tier"
    client = _raw_client(a, c)

    def raw_set(names, vals):
        pipe = client.pipeline(transaction=False)
        for k, v in zip(names, vals):
            pipe.set(k, v, px=ttl_ms)
        return sum(1 for r in pipe.execute() if r is True)

    def raw_get(names, _rows):
        pipe = client.pipeline(transaction=False)
        for k in names:
            pipe.execute_command("GETEX", k, "PX", ttl_ms)
        good = sum(1 for r in pipe.execute() if isinstance(r, bytes) and len(r) == bb + REMOTE_HEADER)
        lim["bad"][0] += len(names) - good
        return good

    def timed(mac: bool, op: str, fn, *args) -> None:
        t, lat = run_op(fn, *args, a.batch, c)
        (runs[mac] if mac is not None else lim)[op].append(t)
        (runs[mac] if mac is not None else lim)[f"{op}_lat"].extend(lat)

    try:
        fp = fingerprint(a, f"bench-remote-{tag.decode()}", bt, codec)
        for r in range(a.repeats):
            opened: list[KVStore] = []
            try:
                gets = {}
                for mac in (False, True):
                    opened.append(_remote_store(a, c, codec, fp, bb, bt, secret=secret if mac else None))
                    gets[mac] = opened[-1]
            except Exception as e:  # e.g. a codec the remote tier does not implement
                for s_ in opened:
                    s_.close(persist=False)
                bar.advance(a.repeats - r)
                return not_measured("remote", codec, bt, c, e)
            try:
                if r == 0 and not _remote_put_direct(gets[False], bb):
                    put_via = "DRAM write-through"
                puts = dict(gets)
                if put_via != "no local tier":  # DRAM as large as the run, in front, written through
                    for mac in (False, True):
                        opened.append(_remote_store(a, c, codec, fp, bb, bt, dram_blocks=n,
                                                    secret=secret if mac else None))
                        puts[mac] = opened[-1]
                keys = chain_keys(gets[False].root, np.arange(n * bt) % 50000 + r, bt)
                names = [g.remote.client.redis_key(k) for g in gets.values() for k in keys]
                raw_names = [b"raw:{" + tag + b".%02x}:" % (i & 255) + b"%032x" % (r << 40 | i) for i in range(n)]
                timed(None, "put", raw_set, raw_names, values)  # the put's limit
                for mac in (False, True):  # store put, up to the end of its write-through
                    w0 = puts[mac].remote.stats.get("bytes_written", 0)
                    t0 = time.perf_counter()
                    _t, lat = run_op(puts[mac].put, keys, src, a.batch, c)
                    puts[mac].flush()
                    runs[mac]["put"].append(time.perf_counter() - t0)
                    runs[mac]["put_lat"] += lat
                    runs[mac]["written"].append(puts[mac].remote.stats.get("bytes_written", 0) - w0)
                timed(None, "get", raw_get, raw_names, out)  # the get's limit
                for mac in (False, True):  # store get (no local tier: every block from Redis)
                    t, lat, runs[mac]["ok"] = timed_get(gets[mac].get, keys, src, out, a.batch, c, codec,
                                                        runs[mac]["got"], runs[mac]["ok"])
                    runs[mac]["get"].append(t)
                    runs[mac]["get_lat"] += lat
                _unlink(client, raw_names + names)
            except Exception as e:
                bar.advance(a.repeats - r)
                return not_measured("remote", codec, bt, c, e)
            finally:
                for s_ in opened:
                    s_.close(persist=False)
            bar.advance()
    finally:
        client.close()
    return {"rows": [_row(op, mac, runs[mac], lim, codec, bt, bb, c, n, put_via)
                     for op in ("put", "get") for mac in (False, True)]}


def _row(op: str, mac: bool, run: dict, lim: dict, codec: str, bt: int, bb: int, c: int, n: int, put_via: str) -> dict:
    nbytes = n * bb
    used = statistics.median(run["written"]) if run["written"] else 0
    none_bytes = bb + REMOTE_HEADER + (MAC_BYTES if mac else 0)
    gbps = nbytes / statistics.median(run[op]) / 1e9
    limit = nbytes / statistics.median(lim[op]) / 1e9
    gbps_runs, limit_runs = [nbytes / t / 1e9 for t in run[op]], [nbytes / t / 1e9 for t in lim[op]]
    # a round opens its own stores, so a stalled phase is counted here, not re-run (its row says so)
    stalls = [{"phase": f"{who} {op}", "repeat": i, "of_median": xs[i] / statistics.median(xs), "again": None}
              for who, xs in (("limit", limit_runs), ("store", gbps_runs)) for i in stalled(xs)]
    return {"tier": "remote+mac" if mac else "remote", "op": op, "codec": codec, "block_tokens": bt, "block_bytes": bb,
            "concurrency": c, "gbps": gbps, "limit": f"redis {'SET' if op == 'put' else 'GETEX'} x{c}",
            "limit_gbps": limit, "ratio": paired_median(gbps_runs, limit_runs), "ratio_of_medians": gbps / limit,
            "repeats": len(run[op]), "stalls": stalls, "p50_ms": pct(run[f"{op}_lat"], 0.5),
            "p99_ms": pct(run[f"{op}_lat"], 0.99), "verified": run["ok"], "mac": mac,
            "stored_bytes": int(used), "disk_bytes": None, "comp_ratio": nbytes / used if used else None,
            "capacity_gain": none_bytes * n / used if used else None, "blocks_per_gb": n / used * 1e9 if used else None,
            "blocks": n, "get_returned_min": min(run["got"]) if run["got"] else None,
            "gbps_runs": gbps_runs, "limit_runs": limit_runs,
            "limit_alt_runs": [], "limit_p50_ms": pct(lim[f"{op}_lat"], 0.5),
            "limit_p99_ms": pct(lim[f"{op}_lat"], 0.99), "limit_bad_values": lim["bad"][0],
            "put_via": put_via if op == "put" else "no local tier"}
