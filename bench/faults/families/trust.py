"""Fault family 10, ``trust``: the store across its trust boundaries (issue 29), tried as an
outsider would, through the real KVStore and real servers, sockets and files:

- ``stalls``: hostile Redis servers on loopback (:mod:`.hostile`: a trickler sending one byte per
  150 ms, one sending 2 MiB replies slowly, one that never answers, four that answer the handshake
  or every command wrongly); the wall time of a lookup, a load, a store and ``close()`` under
  ``timeout_ms`` 200, and the exceptions that escaped;
- ``forged``: a store with a secret beside writers to the same real redis-server that forge
  values (valid header and xxh3 without a MAC, a random MAC, a MAC under another secret, another
  key's value replayed, a value in the namespace of engines without a secret); the blocks served
  that no holder of the secret wrote (a value of our shape whose MAC alone fails is kept, one of
  a shape no engine writes there deleted). The same writers against stores without a secret are the
  control: there forged blocks are served, so the check can fail;
- ``hijacks`` and ``bad settings``: :mod:`.trust_local`;
- ``heal``: a LIST under a kvstore key and a folder planted at a block path, before and after the
  key was stored: a later store and load serve the block;
- ``bombs``: zstd frames that declare 4 GiB or 1 TiB, or lie about their size, in Redis and in
  block files (issue 45): :mod:`.trust_bombs`;
- ``cross secret``: an engine with another secret beside a fleet's blocks, and one rotating
  (issue 45): :mod:`.trust_secrets`.

Headline figures (all but the first two must be 0): trust_longest_stall_s, trust_stall_ratio
(to timeout_ms; a problem above 1.5), trust_escaped, trust_forged_served, trust_hijacks_accepted,
trust_bad_settings_accepted, trust_heal_failures, trust_bombs_unbounded, trust_cross_secret_deleted,
trust_cross_secret_lost."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import time
from pathlib import Path
from typing import Callable

import numpy as np

from kvstore.bench.common import redis_local
from kvstore.bench.faults.families.common import FP, block_of, key_of, open_store
from kvstore.bench.faults.families.hostile import MODES, FakeRedis
from kvstore.bench.faults.families.trust_bombs import bombs
from kvstore.bench.faults.families.trust_local import bad_settings, env, hijacks
from kvstore.bench.faults.families.trust_secrets import cross_secret
from kvstore.bench.common.stores import capacity_gb
from kvstore.tiers import fileformat as ff
from kvstore.config import from_dict
from kvstore.store import KVStore
from kvstore.tiers.redis.value import MAC_BYTES, ValueFormat, mac_key

T_MS = 200  # timeout_ms of the stores facing hostile servers
STALL_LIMIT = 1.5  # x timeout_ms: the bound per call
BB = 8192  # block bytes
SECRET_A = "trust-bench-secret-a-" + "a" * 24
SECRET_B = "trust-bench-secret-b-" + "b" * 24
FORGERIES = ("no_mac", "random_mac", "secret_b", "replay", "plain_namespace")


def trust(folder, *, rounds: int = 1, seed: int = 0, advance: Callable[[], None] | None = None) -> dict:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    step = advance or (lambda: None)
    out = stalls(rounds, seed)
    step()
    if redis_local.available():
        with redis_local.start(folder / "redis", password=secrets.token_hex(12)) as srv:
            out.update(forged(srv, rounds, seed, secret=SECRET_A))
            control = forged(srv, 1, seed + 1, secret=None)
            out["trust_forged_control_tried"] = control["trust_forged_tried"]
            out["trust_forged_control_served"] = control["trust_forged_served"]
            out.update(heal(folder / "heal", srv, rounds, seed))
            out.update(bombs(folder / "bombs", srv, _bomb_store, seed))
            out.update(cross_secret(srv, _secret_store, seed, secret_a=SECRET_A, secret_b=SECRET_B))
    else:
        out.update(forged_skipped="skipped: redis-server is not on PATH", **heal(folder / "heal", None, rounds, seed),
                   **bombs(folder / "bombs", None, _bomb_store, seed))
    step()
    out.update(hijacks(folder / "hijacks"))
    step()
    out.update(bad_settings(folder / "settings"))
    step()
    return out


def remote_store(url, *, timeout_ms: int, dram_blocks: int = 0, password: str | None = None,
                 secret: str | None = None, previous: str | None = None, codec: str = "none",
                 block_bytes: int = BB) -> KVStore:
    """A store on ``url`` with no NVMe tier (``dram_blocks`` 0: the remote tier alone), the
    credentials and secrets given through the environment only, as an engine gets them."""
    cfg = from_dict({"tiers": {"dram": {"capacity_gb": capacity_gb(dram_blocks, block_bytes, "dram"),
                                        "pin_memory": False, "ttl_s": None},
                               "nvme": {"capacity_gb": 0},
                               "remote": {"url": url, "timeout_ms": timeout_ms, "codec": codec}}})
    with env(KVSTORE_REMOTE_SECRET=secret, KVSTORE_REMOTE_SECRET_PREVIOUS=previous, KVSTORE_REDIS_PASSWORD=password):
        return KVStore(cfg, block_bytes=block_bytes, fingerprint=FP, block_tokens=FP.block_size)


def _bomb_store(url, password, codec: str, block_bytes: int) -> KVStore:
    return remote_store(url, timeout_ms=5000, password=password, codec=codec, block_bytes=block_bytes)


def _secret_store(url, password, *, secret: str, previous: str | None = None) -> KVStore:
    return remote_store(url, timeout_ms=5000, password=password, secret=secret, previous=previous)


def _network_now(tier) -> None:
    """Wait out the tier's backoff (made 10 ms from now on), so the next call goes to the server:
    each call is timed against the hostile server itself, not answered from the backoff."""
    tier._backoff = (0.01, 0.01)
    give_up = time.monotonic() + 5
    while not tier.available and time.monotonic() < give_up:
        time.sleep(0.01)


# -- stalls ------------------------------------------------------------------------------------------
def stalls(rounds: int, seed: int) -> dict:
    rows, escaped = [], []
    for r in range(rounds):
        for mode in MODES:
            with FakeRedis(mode) as srv:
                rows += _stall_calls(srv, mode, f"stall-{seed}-{r}-{mode}", escaped)
    longest = max(rows, key=lambda x: x["seconds"])
    by_mode = {m: round(max(x["seconds"] for x in rows if x["mode"] == m), 3) for m in MODES}
    return {"trust_timeout_ms": T_MS, "trust_stall_calls": len(rows),
            "trust_stall_calls_reached": sum(x["reached"] for x in rows),
            "trust_longest_stall_s": round(longest["seconds"], 3),
            "trust_stall_ratio": round(longest["seconds"] * 1000 / T_MS, 2),
            "trust_longest_stall_call": f"{longest['mode']} {longest['call']}",
            "trust_escaped": len(escaped), "trust_escaped_examples": escaped[:5],
            "trust_stall_by_mode": by_mode, "stall_rows": _stall_table(rows)}


def _stall_calls(srv: FakeRedis, mode: str, tag: str, escaped: list) -> list[dict]:
    """Open a store on ``srv``, then time a lookup, a load, a store (put + flush) and close()."""
    keys = [key_of(tag, i) for i in range(32)]
    out = np.zeros((4, BB), np.uint8)
    t0 = time.monotonic()
    try:
        s = remote_store(srv.url, timeout_ms=T_MS, dram_blocks=8)  # the start-up check fails: a warning
    except Exception as e:
        escaped.append(f"{mode} open: {type(e).__name__}: {e}"[:200])
        return [{"mode": mode, "call": "open", "seconds": time.monotonic() - t0, "reached": True}]
    rows, closed = [], []

    def close() -> None:
        s.put(keys[24:28], np.stack([block_of(k, BB) for k in keys[24:28]]))  # a write-through in flight
        closed.append(True)
        s.close()

    calls = (("lookup", lambda: s.contains_prefix(keys[:8])), ("load", lambda: s.get(keys[8:12], out)),
             ("store", lambda: (s.put(keys[16:20], np.stack([block_of(k, BB) for k in keys[16:20]])), s.flush())),
             ("close", close))
    for name, op in calls:
        if s.remote is not None:
            _network_now(s.remote.client)
        n0 = len(srv.commands)
        t0 = time.monotonic()
        try:
            op()
        except Exception as e:
            escaped.append(f"{mode} {name}: {type(e).__name__}: {e}"[:200])
        rows.append({"mode": mode, "call": name, "seconds": time.monotonic() - t0, "reached": len(srv.commands) > n0})
    if not closed:  # the put before close() raised
        with contextlib.suppress(Exception):
            s.close()
    return rows


def _stall_table(rows: list[dict]) -> list[dict]:
    """The longest of each (mode, call) over the rounds, one row per mode: a table for the report."""
    calls = ("lookup", "load", "store", "close")
    out = []
    for m in MODES:
        row: dict = {"server": m}
        for c in calls:
            got = [x["seconds"] for x in rows if x["mode"] == m and x["call"] == c]
            row[f"{c} s"] = round(max(got), 3) if got else None
        row["reached"] = f"{sum(x['reached'] for x in rows if x['mode'] == m)}/{sum(x['mode'] == m for x in rows)}"
        out.append(row)
    return out


# -- forged values -----------------------------------------------------------------------------------
def forge(namespace: bytes, codec_id: int, key: bytes, block: np.ndarray, *, flags: int = 0, tail: bytes = b""):
    """A value with a valid header and xxh3 for ``key``, as any writer to Redis builds it from the
    key name alone (the name shows the namespace and the key)."""
    head = ff.Header(codec_id, block.nbytes, ff.checksum(block), time.time(), namespace, key, flags)
    return ff.header_bytes(head) + block.tobytes() + tail


def forged(srv, rounds: int, seed: int, *, secret: str | None) -> dict:
    """Forgeries against a reader with ``secret`` (None: the control, no secret); every served
    block is checked byte for byte against what a holder of the secret wrote (nothing, for a
    forged key: anything served is forged)."""
    pw, url, c = srv.password, srv.url, srv.client(socket_timeout=5)
    honest = remote_store(url, timeout_ms=5000, password=pw, secret=secret)  # real server: no deadline misses
    reader = remote_store(url, timeout_ms=5000, password=pw, secret=secret)
    plain = remote_store(url, timeout_ms=5000, password=pw)
    served, tried, deleted, by_case, examples = 0, 0, 0, {f: 0 for f in FORGERIES}, []
    hon_written = hon_served = 0
    try:
        ns, cid = honest.remote.client.namespace, honest.remote.client.values.codec_id
        for r in range(rounds):
            hkeys = [key_of(f"honest-{seed}-{r}-{secret is None}", i) for i in range(4)]
            hon_written += honest.put(hkeys, np.stack([block_of(k, BB) for k in hkeys]))
            got = np.zeros((4, BB), np.uint8)
            n = reader.get(hkeys, got)
            hon_served += sum(np.array_equal(got[i], block_of(hkeys[i], BB)) for i in range(n))
            for case in FORGERIES:
                k = key_of(f"forged-{seed}-{r}-{case}-{secret is None}", 0)
                evil = np.full(BB, 7, np.uint8)
                name = honest.remote.client.redis_key(k)
                if case == "no_mac":
                    c.set(name, forge(ns, cid, k, evil))
                elif case == "random_mac":
                    c.set(name, forge(ns, cid, k, evil, flags=ff.FLAG_MAC, tail=os.urandom(MAC_BYTES)))
                elif case == "secret_b":  # a holder of another secret MACs it into the reader's namespace
                    head, payload, mac = ValueFormat(ns, BB, None, cid, mac_key(SECRET_B.encode())).encode(k, evil, None)
                    c.set(name, head + payload.tobytes() + mac)
                elif case == "replay":  # an honest value of another key, under this key
                    c.set(name, c.get(honest.remote.client.redis_key(hkeys[0])))
                else:  # a valid value where engines without a secret keep theirs
                    plain.put([k], evil[None])
                    name = plain.remote.client.redis_key(k)
                tried += 1
                reader.contains_prefix([k])
                out = np.zeros((1, BB), np.uint8)
                if reader.get([k], out) and not np.array_equal(out[0], block_of(k, BB)):
                    served += 1
                    by_case[case] += 1
                    examples.append(case)
                deleted += c.exists(name) == 0
        reasons = dict(reader.remote.corrupt_reasons)
    finally:
        for s in (honest, reader, plain):
            s.close()
        c.close()
    return {"trust_forged_tried": tried, "trust_forged_served": served, "trust_forged_served_by_case": by_case,
            "trust_forged_unauthenticated": reasons.get("unauthenticated", 0),
            "trust_forged_foreign": reasons.get("foreign", 0), "trust_forged_reasons": reasons,
            "trust_forged_deleted": deleted, "trust_honest_written": hon_written, "trust_honest_served": hon_served}


# -- heal ----------------------------------------------------------------------------------------------
def heal(folder: Path, srv, rounds: int, seed: int) -> dict:
    """Permanent misses before issue 29: each planted thing, then a store and a load of its key."""
    results: list[tuple[str, bool]] = []
    for r in range(rounds):
        if srv is not None:
            results += _heal_redis(srv, f"heal-{seed}-{r}")
        results += _heal_nvme(folder / f"r{r}", f"heal-{seed}-{r}")
    failed = [name for name, ok in results if not ok]
    return {"trust_heal_tried": len(results), "trust_heal_failures": len(failed), "trust_heal_failed": failed}


def _served(store, keys) -> int:
    out = np.zeros((len(keys), BB), np.uint8)
    n = store.get(keys, out)
    return sum(np.array_equal(out[i], block_of(keys[i], BB)) for i in range(n))


def _heal_redis(srv, tag: str) -> list[tuple[str, bool]]:
    """A LIST under a stored key's name, found by a lookup or not: a later store and a load (by a
    fresh reader: a reader's lookup memo of "absent" lasts a second) serve the block."""
    pw, c = srv.password, srv.client(socket_timeout=5)
    out = []
    for how in ("list after a lookup", "list, no lookup"):
        keys = [key_of(f"{tag}-{how}", i) for i in range(3)]
        writer = remote_store(srv.url, timeout_ms=5000, password=pw)
        reader = remote_store(srv.url, timeout_ms=5000, password=pw)
        fresh = remote_store(srv.url, timeout_ms=5000, password=pw)
        try:
            writer.put(keys, np.stack([block_of(k, BB) for k in keys]))
            name = writer.remote.client.redis_key(keys[1])
            c.delete(name)
            c.rpush(name, b"not a block")
            if how == "list after a lookup":
                reader.contains_prefix(keys)
            writer.put(keys, np.stack([block_of(k, BB) for k in keys]))
            out.append((f"redis: {how}", _served(fresh, keys) == 3))
        except Exception as e:
            out.append((f"redis: {how}: {type(e).__name__}: {e}"[:200], False))
        finally:
            for s in (writer, reader, fresh):
                s.close()
    c.close()
    return out


def _heal_nvme(folder: Path, tag: str) -> list[tuple[str, bool]]:
    """A folder (holding a file) planted at a block path, after the key was stored and before."""
    out = []
    for how in ("folder after the store", "folder before the store"):
        keys = [key_of(f"{tag}-{how}", i) for i in range(3)]
        blocks = np.stack([block_of(k, BB) for k in keys])
        s = open_store(folder / how.replace(" ", "_"), block_bytes=BB, nvme_blocks=16)
        try:
            if how == "folder after the store":
                s.put(keys, blocks)
            p = Path(s.nvme.path_of(keys[1]))
            if p.exists():
                p.unlink()
            old = os.umask(0o077)  # its parents too, as the store makes them (0700)
            try:
                p.mkdir(parents=True)
            finally:
                os.umask(old)
            (p / "inside").write_bytes(b"planted")
            _served(s, keys)  # a load finds it (or nothing, before the store)
            s.put(keys, blocks)
            out.append((f"nvme: {how}", _served(s, keys) == 3))
        except Exception as e:
            out.append((f"nvme: {how}: {type(e).__name__}: {e}"[:200], False))
        finally:
            s.close()
    shutil.rmtree(folder, ignore_errors=True)
    return out
