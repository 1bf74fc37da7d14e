"""Remote tier: blocks shared by several engines in Redis or Valkey (one server or a cluster).

Redis keeps the index (its own TTL and eviction), so this tier has none: every call is one round
trip per server, a pipeline of one command per block (a cluster's node groups run in parallel).

Key names: ``kvs:{<namespace hex>.<key[0] hex>}:<key hex>``; the hash tag (in braces) is the
namespace and the key's first byte: a namespace spreads over at most 256 slots evenly (keys are
hashes), which balances a cluster of up to dozens of masters; one tag per namespace would put a
whole model on one master. A batch is pipelined per node, not per slot, so the number of slots it
touches costs nothing. ``scan`` lists namespaces from the names alone, reading no value.

A value is self-describing (:mod:`.remotevalue`: the block file's compact header, then the
payload), sent without a copy of the block (:mod:`.setpipe`). A value that fails any check
is a counted miss and is deleted; nothing read from Redis is ever unpickled. Redis SET is atomic,
so two engines writing one key leave one whole value (the same bytes), never a torn one.

Failures never raise: a timeout or a lost connection makes that call all misses (a cluster keeps
the answers of the nodes that did answer) and puts the tier in backoff, during which calls miss
at once without touching the network; the first call after it tries again. Credentials come only
from the constructor (the store reads ``KVSTORE_REDIS_USERNAME`` / ``KVSTORE_REDIS_PASSWORD``);
a url that carries them is refused, and no message or repr shows a password.
"""

from __future__ import annotations

import logging
import re
import ssl
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from itertools import islice
from typing import Callable, Iterator, Sequence
from urllib.parse import urlsplit

import numpy as np
import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode
from redis.exceptions import (AskError, AuthenticationError, ClusterDownError, ConnectionError as RConnectionError,
                              RedisClusterException, RedisError, TimeoutError as RTimeoutError)
from redis.retry import Retry

from kvstore.codecs import Codec
from kvstore.keys import KEY_BYTES
from kvstore.tiers.remotevalue import ValueFormat
from kvstore.tiers.setpipe import SetPipeline

log = logging.getLogger(__name__)

ENV_USER, ENV_PASSWORD = "KVSTORE_REDIS_USERNAME", "KVSTORE_REDIS_PASSWORD"
_NAME = re.compile(rb"kvs:\{([0-9a-f]{32})\.[0-9a-f]{2}\}:([0-9a-f]{32})")
_NETWORK = (RConnectionError, RTimeoutError, RedisClusterException, OSError)  # the server, not one command


class RemoteError(Exception):
    pass


class RemoteUnavailable(RemoteError):
    """The server (or no seed of the cluster) could not be reached."""


class RemoteAuthError(RemoteError):
    """The server refused the credentials (or wants some)."""


class RemoteTLSError(RemoteError):
    """A ``rediss://`` server whose certificate this machine does not trust (a setting to fix,
    not an outage to wait out)."""


def _tls_failure(e: BaseException) -> BaseException | None:
    """The ssl error behind a connection error, if there is one (redis-py wraps it)."""
    seen = 0
    while e is not None and seen < 8:
        if isinstance(e, ssl.SSLError):
            return e
        if "CERTIFICATE_VERIFY_FAILED" in str(e) or "WRONG_VERSION_NUMBER" in str(e):
            return e
        e, seen = e.__cause__ or e.__context__, seen + 1
    return None


def _parse_url(url: str) -> tuple[str, int, int, bool, str]:
    """host, port, db, tls, and the url as messages show it (never with credentials)."""
    u = urlsplit(url)
    if u.scheme not in ("redis", "rediss") or not u.hostname:
        raise ValueError(f"remote url must look like redis://host:port[/db] (or rediss://), got {u.scheme}://...")
    shown = f"{u.scheme}://{u.hostname}:{u.port or 6379}{u.path if u.path not in ('', '/') else ''}"
    if u.username or u.password:
        raise ValueError(f"remote url {shown} carries credentials; put them in {ENV_PASSWORD} (and {ENV_USER}) "
                         f"instead, not in a url or a config file")
    db = int(u.path.strip("/") or 0)
    return u.hostname, u.port or 6379, db, u.scheme == "rediss", shown


class RemoteTier:
    name = "remote"

    def __init__(self, *, url: str | list[str], cluster: bool, namespace: bytes, block_bytes: int,
                 ttl_s: float | None, timeout_ms: int, io_threads: int = 4, codec: Codec | None = None,
                 codec_id: int = 0, username: str | None = None, password: str | None = None,
                 backoff_s: tuple[float, float] = (0.5, 30.0), clock: Callable[[], float] = time.monotonic):
        urls = [url] if isinstance(url, str) else list(url)
        if not urls or (len(urls) > 1 and not cluster):
            raise ValueError("remote url: one url for a single server, one or more seeds for a cluster")
        self.seeds = [_parse_url(u) for u in urls]
        self.url = self.seeds[0][4] if not cluster else ",".join(s[4] for s in self.seeds)
        if len(namespace) != 16:
            raise ValueError(f"namespace must be 16 bytes (a digest), got {len(namespace)}")
        if ttl_s is not None and ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive or None, got {ttl_s}")
        self.cluster = cluster
        self.namespace = bytes(namespace)
        self._tag = b"kvs:{" + self.namespace.hex().encode() + b"."
        self.block_bytes = int(block_bytes)
        self.ttl_ms = None if ttl_s is None else max(1, int(ttl_s * 1000))
        self.values = ValueFormat(self.namespace, self.block_bytes, codec, codec_id)
        timeout = timeout_ms / 1000
        # no retries inside redis-py: a failure is a miss here and the backoff decides when to retry
        self._kw = dict(username=username, password=password, socket_timeout=timeout,
                        socket_connect_timeout=timeout)
        self._io_threads = max(1, int(io_threads))
        self._backoff = backoff_s
        self._clock = clock
        self._lock = threading.Lock()  # stats and backoff
        self._conn_lock = threading.Lock()  # building the client, rereading a cluster's slots
        self._client: redis.Redis | redis.RedisCluster | None = None
        self._refresh = False  # a cluster answered MOVED/ASK or CLUSTERDOWN: reread its slots first
        self._pool = ThreadPoolExecutor(self._io_threads, "kvs-remote") if cluster else None
        self._delay = 0.0
        self._down_until = float("-inf")
        # per block (per command): timeouts, errors_* and skipped_down count blocks, not calls
        self.stats = {k: 0 for k in ("hits", "misses", "puts", "bytes_read", "bytes_written", "errors_get",
                                     "errors_put", "errors_exists", "errors_remove", "timeouts", "corrupt",
                                     "deleted_corrupt", "skipped_down", "encode_failed")}
        self.corrupt_reasons: dict[str, int] = {}

    def __repr__(self) -> str:
        kind = "cluster" if self.cluster else "server"
        return f"<RemoteTier {kind} {self.url} ns={self.namespace.hex()[:16]}>"

    def redis_key(self, key: bytes) -> bytes:
        if len(key) != KEY_BYTES:
            raise ValueError(f"block keys are {KEY_BYTES} bytes, got {len(key)}")
        return self._tag + b"%02x}:" % key[0] + key.hex().encode()

    # -- connections -------------------------------------------------------------------------------
    def _plain(self, seed) -> redis.Redis:
        host, port, db, tls, _ = seed
        return redis.Redis(host=host, port=port, db=db, ssl=tls, retry=Retry(NoBackoff(), 0), **self._kw)

    def _connect(self):
        """The client, built on first use (a cluster's is built by reading its slots from a seed)."""
        with self._conn_lock:
            if self._client is None:
                if not self.cluster:
                    host, port, db, tls, _ = self.seeds[0]
                    pool = redis.BlockingConnectionPool(max_connections=self._io_threads, timeout=None, host=host,
                                                        port=port, db=db, retry=Retry(NoBackoff(), 0),
                                                        **self._kw, **({"connection_class": redis.SSLConnection}
                                                                       if tls else {}))
                    self._client = redis.Redis(connection_pool=pool)
                else:
                    nodes = [ClusterNode(s[0], s[1]) for s in self.seeds]
                    self._client = redis.RedisCluster(startup_nodes=nodes, retry=Retry(NoBackoff(), 0),
                                                      ssl=self.seeds[0][3], **self._kw)
                self._refresh = False
            elif self._refresh and self.cluster:
                self._refresh = False
                self._client.nodes_manager.initialize()
            return self._client

    def _nodes(self) -> list[redis.Redis]:
        c = self._connect()
        return [c.get_redis_connection(n) for n in c.get_primaries()] if self.cluster else [c]

    def check(self) -> None:
        """PING every server at start-up: RemoteAuthError on refused credentials, RemoteUnavailable
        if unreachable (the caller decides whether that is fatal)."""
        for seed in self.seeds if self.cluster else []:  # plain clients first: clear auth errors
            try:
                with self._plain(seed) as c:
                    c.ping()
                break
            except AuthenticationError as e:
                raise self._auth_error(e) from None
            except _NETWORK:
                continue
        try:
            for c in self._nodes():
                c.ping()
        except AuthenticationError as e:
            raise self._auth_error(e) from None
        except (*_NETWORK, RedisError) as e:
            self._failed(e)
            if any(s[3] for s in self.seeds) and (bad := _tls_failure(e)) is not None:
                raise RemoteTLSError(f"kvstore remote: the TLS handshake with {self.url} failed ({bad}); if its "
                                     f"certificate is signed by a private CA, point SSL_CERT_FILE at that CA's "
                                     f"PEM file in the engine's environment") from None
            raise RemoteUnavailable(f"kvstore remote: {self.url} is unreachable: {e}") from None
        self._succeeded()

    def _auth_error(self, e: Exception) -> RemoteAuthError:
        what = ("requires a password and none was given" if self._kw["password"] is None
                else "refused the username/password given")
        return RemoteAuthError(f"kvstore remote: {self.url} {what} ({type(e).__name__}); set {ENV_PASSWORD} "
                               f"(and {ENV_USER} for an ACL user) in the engine's environment")

    # -- backoff -----------------------------------------------------------------------------------
    @property
    def available(self) -> bool:
        return self._clock() >= self._down_until

    @property
    def up(self) -> bool:
        """No failure since the last call that succeeded (``kvstore_remote_up``; not :attr:`available`,
        which turns true when the backoff ends, before anything has answered)."""
        return self._delay == 0

    def _failed(self, e: Exception) -> None:
        with self._lock:
            now = self._clock()
            if now < self._down_until:
                return  # calls already in flight when it failed: one failure, one step
            self._delay = self._backoff[0] if self._delay == 0 else min(self._delay * 2, self._backoff[1])
            self._down_until = now + self._delay
            self._refresh = True
            delay = self._delay
        log.warning("kvstore remote: %s failed (%s: %s); misses for %.2fs", self.url, type(e).__name__, e, delay)

    def _succeeded(self) -> None:
        if self._delay:
            with self._lock:
                self._delay, self._down_until = 0.0, float("-inf")

    def count(self, stat: str, n: int = 1) -> None:
        if n:
            with self._lock:
                self.stats[stat] = self.stats.get(stat, 0) + n

    # -- one pipeline per server -------------------------------------------------------------------
    def _call(self, op: str, names: Sequence[bytes], add: Callable, pipeline: Callable | None = None) -> list | None:
        """Run ``add(pipe, i)`` for every name, one pipeline per server (``pipeline(node)``, else
        redis-py's); per-name results (an exception where that command failed). None = the tier is
        down (skipped, or failed now)."""
        if not self.available:
            self.count("skipped_down", len(names))
            return None
        out: list = [None] * len(names)
        try:
            client = self._connect()
            if self.cluster:
                groups: dict = {}
                for i, name in enumerate(names):
                    node = client.get_node_from_key(name)
                    groups.setdefault(node.name, (node, []))[1].append(i)
                jobs = [(client.get_redis_connection(node), ix) for node, ix in groups.values()]
            else:
                jobs = [(client, range(len(names)))]
        except (*_NETWORK, RedisError) as e:
            self._down(op, e, len(names))
            return None

        def run(job) -> None:
            node, ix = job
            pipe = node.pipeline(transaction=False) if pipeline is None else pipeline(node)
            for i in ix:
                add(pipe, i)
            try:
                res = pipe.execute(raise_on_error=False)
            except (*_NETWORK, RedisError) as e:
                res = [e] * len(ix)
            for i, r in zip(ix, res):
                out[i] = r

        if len(jobs) == 1:
            run(jobs[0])
        else:
            list(self._pool.map(run, jobs))
        errors = [r for r in out if isinstance(r, Exception)]
        # a server gone, or a cluster that cannot serve (CLUSTERDOWN): back off; any other error
        # (MOVED, OOM, WRONGTYPE) is that command's miss alone
        outage = [r for r in errors if isinstance(r, (*_NETWORK, ClusterDownError))]
        if any(isinstance(r, (AskError, ClusterDownError)) for r in errors):
            self._refresh = True  # slots moved (MovedError is an AskError) or the cluster is changing
        if outage:
            self._down(op, outage[0], 0)
            self.count("timeouts", sum(isinstance(r, RTimeoutError) for r in outage))
        else:
            self._succeeded()
        self.count(f"errors_{op}", len(errors))
        return out

    def _down(self, op: str, e: Exception, n: int) -> None:
        self._failed(e)
        self.count("timeouts", n if isinstance(e, RTimeoutError) else 0)
        self.count(f"errors_{op}", n)

    # -- the medium --------------------------------------------------------------------------------
    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        names = [self.redis_key(k) for k in keys]
        res = self._call("exists", names, lambda p, i: p.exists(names[i])) if names else []
        return [r == 1 for r in res] if res is not None else [False] * len(keys)

    def get(self, keys: Sequence[bytes], outs: Sequence[np.ndarray]) -> list[bool]:
        """Fill ``outs[i][:block_bytes]`` for every key found whole; refreshes the TTL of hits."""
        names = [self.redis_key(k) for k in keys]
        oks = [False] * len(keys)
        if not names:
            return oks
        if self.ttl_ms is None:
            res = self._call("get", names, lambda p, i: p.get(names[i]))
        else:
            res = self._call("get", names, lambda p, i: p.execute_command("GETEX", names[i], "PX", self.ttl_ms))
        if res is None:
            self.count("misses", len(keys))
            return oks
        bad = []
        for i, value in enumerate(res):
            if isinstance(value, bytes):
                reason = self.values.decode(keys[i], value, outs[i])
                if reason is None:
                    oks[i] = True
                    self.count("bytes_read", len(value))
                    continue
                bad.append(names[i])
                with self._lock:
                    self.corrupt_reasons[reason] = self.corrupt_reasons.get(reason, 0) + 1
        self.count("hits", sum(oks))
        self.count("misses", len(oks) - sum(oks))
        if bad:
            # another engine may have rewritten one since: deleting it costs a miss, never a wrong block
            self.count("corrupt", len(bad))
            gone = self._call("remove", bad, lambda p, i: p.delete(bad[i])) or []
            self.count("deleted_corrupt", sum(r for r in gone if isinstance(r, int)))
        return oks

    def put(self, keys: Sequence[bytes], blocks: Sequence[np.ndarray], ttl_s: float | None = None) -> list[bool]:
        """Store each block, overwriting: in one namespace a key names the same bytes in every
        engine. ``ttl_s``: this call's idle TTL (a request's retention hint), else the tier's."""
        px = self.ttl_ms if ttl_s is None else max(1, int(ttl_s * 1000))
        names = [self.redis_key(k) for k in keys]
        oks = [False] * len(keys)
        if not self.available:  # do not encode what will not be sent
            self.count("skipped_down", len(keys))
            return oks
        bufs = self.values.take_bufs(len(keys))
        try:
            values = [self.values.encode(k, b, buf) for k, b, buf in zip(keys, blocks, bufs)]
            self.count("encode_failed", sum(v is None for v in values))
            todo = [i for i, v in enumerate(values) if v is not None]
            if not todo:
                return oks
            res = self._call("put", [names[i] for i in todo],
                             lambda p, j: p.set(names[todo[j]], *values[todo[j]], px=px), SetPipeline)
            for j, r in enumerate(res or []):
                if r is True:
                    oks[todo[j]] = True
                    self.count("bytes_written", len(values[todo[j]][0]) + values[todo[j]][1].nbytes)
        finally:
            values = None  # the memoryviews are released before their buffers are reused
            self.values.give_bufs(bufs)
        self.count("puts", sum(oks))
        return oks

    def remove(self, keys: Sequence[bytes]) -> int:
        names = [self.redis_key(k) for k in keys]
        res = self._call("remove", names, lambda p, i: p.delete(names[i])) if names else []
        return sum(r for r in res or [] if isinstance(r, int))

    def scan(self, match_namespace: bytes | None = None, limit: int | None = None
             ) -> Iterator[tuple[bytes, bytes, int]]:
        """(namespace, key, value bytes) of every block value (of one namespace), each master
        SCANned in turn; for ``kvstore inspect``. Raises RemoteUnavailable if a server fails."""
        ns = b"*" if match_namespace is None else bytes(match_namespace).hex().encode()
        left = float("inf") if limit is None else limit
        try:
            for node in self._nodes():
                names = node.scan_iter(match=b"kvs:{" + ns + b".*", count=1000)
                while left > 0 and (batch := list(islice(names, 512))):
                    pipe = node.pipeline(transaction=False)
                    for name in batch:
                        pipe.strlen(name)
                    for name, n in zip(batch, pipe.execute()):
                        m = _NAME.fullmatch(name)
                        if m and n and left > 0:  # a key gone since the SCAN has length 0
                            left -= 1
                            yield bytes.fromhex(m[1].decode()), bytes.fromhex(m[2].decode()), n
        except (*_NETWORK, RedisError) as e:
            raise RemoteUnavailable(f"kvstore remote: scanning {self.url} failed: {e}") from None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        with self._conn_lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()
