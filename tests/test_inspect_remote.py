"""``kvstore inspect redis://...`` against real redis-server processes (a password-protected server
and a 3-master cluster): blocks and bytes per namespace, codecs, ages, TTLs left, bad values,
--limit; read-only (no TTL refreshed, no value changed); credentials from the environment only,
a url carrying them refused, and the password never printed."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from kvstore.tiers import fileformat as ff
from kvstore.ops.cli import main
from kvstore.tiers.redis.client import RedisClient

from redis_servers import redis_cluster, redis_single  # noqa: F401

BB = 4096
VALUE = ff.HEADER_CORE + BB  # bytes of one stored value (codec none)


def fill(url, cluster: bool, password: str, counts: dict[bytes, int], seed: int = 0, ttl_s: float | None = 600.0):
    rng = np.random.default_rng(seed)
    written = {}
    for ns, n in counts.items():
        t = RedisClient(url=url, cluster=cluster, namespace=ns, block_bytes=BB, ttl_s=ttl_s, timeout_ms=2000,
                       password=password)
        keys = [rng.bytes(16) for _ in range(n)]
        assert all(t.put(keys, [rng.integers(0, 256, BB, dtype=np.uint8) for _ in range(n)]))
        written[ns] = [t.redis_key(k) for k in keys]
        t.close()
    return written


def garbage_name(ns: bytes) -> bytes:
    key = os.urandom(16)
    return b"kvs:{" + ns.hex().encode() + b"." + b"%02x" % key[0] + b"}:" + key.hex().encode()


def run_json(capsys, argv) -> dict:
    assert main(["inspect", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_single_counts_bytes_bad_and_read_only(redis_single, monkeypatch, capsys):
    a, b = os.urandom(16), os.urandom(16)
    written = fill(redis_single.url, False, redis_single.password, {a: 5, b: 3})
    c = redis_single.client()
    bad = garbage_name(a)
    c.set(bad, b"not a block at all", px=900_000)
    c.set(b"kvs:{unrelated}", b"x")  # under the prefix, not a tier name: counted, not read
    names = [n for ns in written.values() for n in ns] + [bad]
    values = {n: c.get(n) for n in names}
    for n in written[a]:  # lower TTLs: a refresh (GETEX PX 600000) would show
        c.pexpire(n, 300_000)
    before = {n: c.pttl(n) for n in names}
    monkeypatch.setenv("KVSTORE_REDIS_PASSWORD", redis_single.password)

    info = run_json(capsys, [redis_single.url])
    assert set(info["namespaces"]) == {a.hex(), b.hex()}
    na, nb = info["namespaces"][a.hex()], info["namespaces"][b.hex()]
    assert (na["blocks"], na["bytes"], na["payload_bytes"]) == (5, 5 * VALUE, 5 * BB)
    assert (nb["blocks"], nb["bytes"], nb["payload_bytes"]) == (3, 3 * VALUE, 3 * BB)
    assert na["bad_values"] == 1 and na["bad_reasons"] == {"truncated": 1} and nb["bad_values"] == 0
    assert na["codecs"] == {"none": 5} and nb["codecs"] == {"none": 3}
    assert na["age"]["<1m"] == 5 and sum(nb["age"].values()) == nb["age"]["<1m"] == 3
    assert 0 < na["ttl_s"]["min"] <= na["ttl_s"]["median"] <= na["ttl_s"]["max"] <= 300
    assert 300 < nb["ttl_s"]["min"] <= nb["ttl_s"]["max"] <= 600 and nb["no_ttl"] == 0
    assert (info["blocks"], info["bytes"], info["bad_values"]) == (8, 8 * VALUE, 1)
    assert info["other_keys"] == 1 and info["values_read"] == 9 and not info["limit_reached"]
    assert info["servers"] == 1 and info["cluster"] is False and "kvstore_store_info" in info["note"]

    after = {n: c.pttl(n) for n in names}
    assert all(0 < after[n] <= before[n] for n in names), (before, after)
    assert {n: c.get(n) for n in names} == values  # nothing rewritten, nothing deleted (the bad value stays)
    assert c.dbsize() == len(names) + 1


def test_text_output_no_ttl_and_limit(redis_single, monkeypatch, capsys):
    a, b = os.urandom(16), os.urandom(16)
    fill(redis_single.url, False, redis_single.password, {a: 4, b: 2}, ttl_s=None)
    monkeypatch.setenv("KVSTORE_REDIS_PASSWORD", redis_single.password)
    assert main(["inspect", redis_single.url]) == 0
    out = capsys.readouterr().out
    assert a.hex() in out and b.hex() in out and "6 blocks" in out and "2 namespace(s)" in out
    assert "ttl remaining: none" in out and "kvstore_store_info" in out
    assert redis_single.password not in out

    info = run_json(capsys, [redis_single.url, "--limit", "4"])
    assert info["values_read"] == 4 and info["limit_reached"] and info["blocks"] == 4
    assert all(ns["ttl_s"] is None for ns in info["namespaces"].values())
    assert sum(ns["no_ttl"] for ns in info["namespaces"].values()) == 4


def test_cluster_seeds(redis_cluster, monkeypatch, capsys):
    a, b = os.urandom(16), os.urandom(16)
    written = fill(redis_cluster.url, True, redis_cluster.password, {a: 40, b: 25}, seed=1)
    cc = redis_cluster.client()
    bad = garbage_name(b)
    header = ff.header_bytes(ff.Header(0, BB, 0, 0.0, a, bytes(16)))  # a valid header naming the wrong block
    cc.set(bad, header + bytes(BB), px=600_000)
    names = [n for ns in written.values() for n in ns]
    before = {n: cc.pttl(n) for n in names[:10]}
    monkeypatch.setenv("KVSTORE_REDIS_PASSWORD", redis_cluster.password)

    info = run_json(capsys, [",".join(redis_cluster.url), "--cluster"])
    mine = {k: v for k, v in info["namespaces"].items() if k in (a.hex(), b.hex())}  # the cluster is per module
    assert mine[a.hex()]["blocks"] == 40 and mine[a.hex()]["bytes"] == 40 * VALUE
    assert mine[b.hex()]["blocks"] == 25 and mine[b.hex()]["bytes"] == 25 * VALUE
    assert mine[b.hex()]["bad_reasons"] == {"foreign": 1} and mine[a.hex()]["bad_values"] == 0
    assert info["servers"] == 3 and info["cluster"] is True
    assert all(0 < cc.pttl(n) <= before[n] for n in before)  # not refreshed
    assert cc.exists(bad) == 1
    cc.close()

    info = run_json(capsys, [redis_cluster.url[1], "--cluster"])  # one seed finds every master
    assert info["namespaces"][a.hex()]["blocks"] == 40 and info["servers"] == 3
    info = run_json(capsys, [f"redis://127.0.0.1:1,{redis_cluster.url[2]}", "--cluster", "--limit", "7"])
    assert info["servers"] == 3 and info["values_read"] == 7 and info["limit_reached"]  # a dead seed is skipped


def _fails(capsys, argv: list[str], code: int) -> str:
    """``kvstore ARGV`` fails with one line on stderr, ``kvstore inspect: error: ...``, and ``code``."""
    assert main(argv) == code
    cap = capsys.readouterr()
    lines = cap.err.strip().splitlines()
    assert cap.out == "" and len(lines) == 1 and lines[0].startswith("kvstore inspect: error: "), cap.err
    return lines[0]


def test_credentials_refused_and_never_printed(redis_single, monkeypatch, capsys):
    pw = redis_single.password
    for url in (f"redis://:{pw}@127.0.0.1:{redis_single.port}", f"redis://admin:{pw}@127.0.0.1:{redis_single.port}"):
        msg = _fails(capsys, ["inspect", url, "--json"], 2)  # bad input
        assert "KVSTORE_REDIS_PASSWORD" in msg and "credentials" in msg and pw not in msg

    monkeypatch.delenv("KVSTORE_REDIS_PASSWORD", raising=False)
    msg = _fails(capsys, ["inspect", redis_single.url], 1)  # no password: says which variable to set
    assert "requires a password" in msg and "KVSTORE_REDIS_PASSWORD" in msg
    monkeypatch.setenv("KVSTORE_REDIS_PASSWORD", pw + "-wrong")
    msg = _fails(capsys, ["inspect", redis_single.url], 1)
    assert "refused" in msg and pw not in msg

    monkeypatch.setenv("KVSTORE_REDIS_PASSWORD", pw)
    msg = _fails(capsys, ["inspect", f"{redis_single.url},{redis_single.url}"], 2)  # several urls without --cluster
    assert "--cluster" in msg
    msg = _fails(capsys, ["inspect", redis_single.url, "--cluster"], 1)  # a plain server: a clear failure
    assert "Cluster mode is not enabled" in msg and pw not in msg


def test_folder_options_rejected(tmp_path, capsys):
    assert main(["inspect", str(tmp_path), "--cluster"]) == 2
    err = capsys.readouterr().err
    assert "redis://" in err and err.startswith("kvstore inspect: error: ") and err.count("\n") == 1
