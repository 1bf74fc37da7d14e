"""The remote tier over TLS (``rediss://``) and as a restricted ACL user, against a real
redis-server: a private CA and server certificate made with ``openssl`` for each module, the
server trusted through ``SSL_CERT_FILE`` (what an operator with a private CA sets), byte-identical
round trips through the tier and the store, and clear start-up errors for an untrusted
certificate, a plain client on the TLS port, and an ACL user's wrong password. Skipped where
``redis-server`` or ``openssl`` is missing (or the server was built without TLS)."""

from __future__ import annotations

import os
import shutil
import subprocess

import numpy as np
import pytest
import redis

from kvstore.bench.common.redis_local import free_port, launch, redis_server_path, server_argv
from kvstore.config import from_dict
from kvstore.keys import ModelFingerprint
from kvstore.store import KVStore
from kvstore.tiers.redis.client import RemoteAuthError, RedisClient, RemoteTLSError, RemoteUnavailable

from conftest import BLOCK, blocks_for, dram_gb, make_keys

PASSWORD = "tls-test-pw-9f3"


def _openssl(*args, cwd) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory):
    exe, ssl_cli = redis_server_path(), shutil.which("openssl")
    if exe is None or ssl_cli is None:
        pytest.skip("redis-server or openssl is not on PATH")
    d = tmp_path_factory.mktemp("tls")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=kvstore-test-ca",
             "-keyout", "ca.key", "-out", "ca.crt", cwd=d)
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1", "-keyout", "server.key",
             "-out", "server.csr", cwd=d)
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    _openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
             "-days", "2", "-extfile", "san.ext", "-out", "server.crt", cwd=d)
    port = free_port()
    argv = server_argv(exe, 0, d, password=PASSWORD) + [
        "--tls-port", str(port), "--tls-cert-file", str(d / "server.crt"), "--tls-key-file", str(d / "server.key"),
        "--tls-ca-cert-file", str(d / "ca.crt"), "--tls-auth-clients", "no"]

    def client(**kw):
        return redis.Redis(host="127.0.0.1", port=port, password=PASSWORD, ssl=True, ssl_ca_certs=str(d / "ca.crt"),
                           socket_timeout=2, socket_connect_timeout=0.5, **kw)

    def ping() -> bool:
        with client() as c:
            return c.ping()

    try:
        proc = launch(argv, d, ping)
    except RuntimeError as e:
        if "tls" in str(e).lower():
            pytest.skip(f"redis-server without TLS: {e}")
        raise
    yield {"url": f"rediss://127.0.0.1:{port}", "port": port, "ca": str(d / "ca.crt"), "client": client}
    proc.kill()
    proc.wait()


def _tier(url: str, **kw) -> RedisClient:
    args = dict(url=url, cluster=False, namespace=os.urandom(16), block_bytes=4096, ttl_s=600.0,
                timeout_ms=1000, password=PASSWORD)
    args.update(kw)
    return RedisClient(**args)


def test_tls_round_trip(tls_server, monkeypatch):
    monkeypatch.setenv("SSL_CERT_FILE", tls_server["ca"])
    t = _tier(tls_server["url"])
    try:
        t.check()
        rng = np.random.default_rng(3)
        keys = [rng.bytes(16) for _ in range(8)]
        blocks = [rng.integers(0, 256, 4096, dtype=np.uint8) for _ in keys]
        assert t.put(keys, blocks) == [True] * 8
        outs = [np.zeros(4096, np.uint8) for _ in keys]
        assert t.get(keys, outs) == [True] * 8
        assert all(np.array_equal(o, b) for o, b in zip(outs, blocks))
        with tls_server["client"]() as c:  # the values are on the TLS server, with their TTL
            assert 0 < c.pttl(t.redis_key(keys[0])) <= 600_000
    finally:
        t.close()


def test_untrusted_certificate_is_a_clear_error(tls_server, monkeypatch, tmp_path):
    monkeypatch.setenv("SSL_CERT_FILE", str(tmp_path / "no-such-ca.pem"))  # the system store lacks our CA
    monkeypatch.delenv("SSL_CERT_DIR", raising=False)
    t = _tier(tls_server["url"])
    with pytest.raises(RemoteTLSError) as ei:
        t.check()
    msg = str(ei.value)
    assert tls_server["url"] in msg and "SSL_CERT_FILE" in msg and PASSWORD not in msg
    assert t.get([os.urandom(16)], [np.zeros(4096, np.uint8)]) == [False]  # later calls: misses
    t.close()


def test_plain_client_on_the_tls_port_is_unavailable(tls_server):
    t = _tier(f"redis://127.0.0.1:{tls_server['port']}", timeout_ms=300)
    with pytest.raises(RemoteUnavailable):
        t.check()
    t.close()


def _store(tmp_path, url: str) -> KVStore:
    cfg = from_dict({"tiers": {"dram": {"capacity_gb": dram_gb(8), "pin_memory": False, "ttl_s": None},
                               "nvme": {"path": None},
                               "remote": {"url": url, "timeout_ms": 1000}}})
    return KVStore(cfg, block_bytes=BLOCK, fingerprint=ModelFingerprint(model="tls-acl", block_size=16),
                   block_tokens=16)


def test_store_over_tls_as_an_acl_user(tls_server, monkeypatch, tmp_path):
    """A user that may touch only ``kvs:*`` keys with the commands the tier sends: two stores
    (one writes, one hits) work through it over TLS; the wrong password is a start-up error."""
    monkeypatch.setenv("SSL_CERT_FILE", tls_server["ca"])
    with tls_server["client"]() as c:
        # docs/security.md's list: exactly what the tier sends (STRLEN at a lookup, GETRANGE + PEXPIRE at
        # a load, SET, DEL of a bad value; SCAN and PTTL for kvstore inspect)
        c.execute_command("ACL", "SETUSER", "kvs-engine", "reset", "on", ">engine-pw-1", "~kvs:*", "+ping",
                          "+hello", "+strlen", "+getrange", "+pexpire", "+pttl", "+set", "+del", "+scan")
    monkeypatch.setenv("KVSTORE_REDIS_USERNAME", "kvs-engine")
    monkeypatch.setenv("KVSTORE_REDIS_PASSWORD", "engine-pw-1")
    keys = make_keys(6, seed=41)
    a = _store(tmp_path / "a", tls_server["url"])
    b = _store(tmp_path / "b", tls_server["url"])
    try:
        assert a.put(keys, blocks_for(keys)) == 6
        a.flush()
        m = b.contains_prefix(keys)
        assert m.num_blocks == 6 and set(m.tiers) == {"remote"}
        out = np.zeros((6, BLOCK), np.uint8)
        assert b.get(keys, out) == 6 and np.array_equal(out, np.stack(blocks_for(keys)))
    finally:
        a.close()
        b.close()
    monkeypatch.setenv("KVSTORE_REDIS_PASSWORD", "not-the-engine-pw")
    with pytest.raises(RemoteAuthError) as ei:
        _store(tmp_path / "c", tls_server["url"])
    assert "KVSTORE_REDIS_USERNAME" in str(ei.value) and "not-the-engine-pw" not in str(ei.value)
