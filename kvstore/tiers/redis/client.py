"""The Redis (or Valkey) client of the shared tier: one server or a cluster.

Redis keeps the index (its own TTL and eviction), so this tier has none: every call is one round
trip per server, a pipeline of one command per block (two on a load with a TTL: GETRANGE and
PEXPIRE; a cluster's node groups run in parallel).

Key names: ``kvs:{<namespace hex>.<key[0] hex>}:<key hex>``; the hash tag (in braces) is the
namespace and the key's first byte: a namespace spreads over at most 256 slots evenly (keys are
hashes), which balances a cluster of up to dozens of masters; one tag per namespace would put a
whole model on one master. A batch is pipelined per node, not per slot, so the number of slots it
touches costs nothing. ``scan`` lists namespaces from the names alone, reading no value.

A value is self-describing (:mod:`.value`: the block file's compact header, the payload,
and with ``KVSTORE_REMOTE_SECRET`` a MAC), sent without a copy of the block (:mod:`.pipe`).
Nothing read from Redis is ever unpickled, and nothing is read whole before its length is known:
a lookup asks ``STRLEN`` (as cheap as EXISTS), a load ``GETRANGE`` up to one byte past the
longest value of ours. A value that fails any check is a counted miss; one that is not of our
format under its name (the wrong type, length, header, key or codec, or a payload that does not
decode) is deleted, one of our format whose checksum or MAC fails is kept (:mod:`.value`) and
reported to the caller, which holds it absent a while (:mod:`.presence`). Redis SET is atomic, so
two engines writing one key leave one whole value (the same bytes), never a torn one.

With a secret, values live in a namespace of that secret's own (:mod:`.value`); during a rotation
the previous secret's namespace is read too (a lookup asks both in one pipeline; a load reads
there what the current one lacks, without refreshing its TTL, so those values expire within
``ttl_s`` of their last write and the rotation's last step can follow), and written never.

Failures never raise: every call ends within ``timeout_ms`` of wall time (plus 50 ms per MiB it
moved) whatever the server does (:mod:`.conn`: a deadline over the whole call, not each socket read); a timeout, a lost
connection or any exception from the client library makes that call all misses (a cluster keeps
the answers of the nodes that did answer) and puts the tier in backoff: calls miss at once without
touching the network until it ends. Credentials and the secret come only from the constructor
(the store reads them from the environment); a url that carries them is refused, and no message
or repr shows one. The error classes live in :mod:`.conn`, imported from here.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from itertools import islice
from typing import Callable, Iterator, Sequence

import numpy as np
import redis
from redis.exceptions import AskError, AuthenticationError, ClusterDownError
from redis.exceptions import TimeoutError as RTimeoutError

from kvstore.codecs import Codec
from kvstore.configfields import MAX_TTL_S
from kvstore.keys import KEY_BYTES
from kvstore.tiers.redis import conn as rc
from kvstore.tiers.redis.conn import RemoteAuthError, RemoteError, RemoteTLSError, RemoteUnavailable  # noqa: F401
from kvstore.tiers.redis.conn import outage as _outage, timed_out as _timeout, wrongtype as _wrongtype
from kvstore.tiers.redis.value import ENV_SECRET, Refused, ValueFormat, authenticated_namespace, mac_key
from kvstore.tiers.redis.pipe import SetPipeline

log = logging.getLogger(__name__)

ENV_USER, ENV_PASSWORD = rc.ENV_USER, rc.ENV_PASSWORD
_NAME = re.compile(rb"kvs:\{([0-9a-f]{32})\.[0-9a-f]{2}\}:([0-9a-f]{32})")
_warned_unauthenticated = threading.Event()  # the start-up warning, once per process


def px_of(ttl_s: float) -> int:
    """A TTL as Redis's PX: whole milliseconds, at least 1 and at most ``MAX_TTL_S`` (1e9 s, the
    config's own bound). Redis refuses a SET whose PX overflows its clock (ttl_s 1e300: the block
    was silently not shared) and keeps any other (1e12 s: a PTTL of ~31,700 years); NaN is the
    longest too (never a refused SET)."""
    t = float(ttl_s)
    if not t <= MAX_TTL_S:  # past the bound, inf or NaN
        t = MAX_TTL_S
    return max(1, int(max(t, 0.0) * 1000))


def _major_version(c) -> int:
    """The server's major version from HELLO (in the ACL the docs give), 0 if it does not say."""
    try:
        r = c.execute_command("HELLO")
        if isinstance(r, list):  # RESP2: a flat list of field, value
            r = dict(zip(r[::2], r[1::2]))
        v = r.get(b"version", r.get("version", b"0"))
        return int((v.decode() if isinstance(v, bytes) else str(v)).split(".")[0])
    except Exception:  # noqa: BLE001 - an old server or a refused command: plain PEXPIRE
        return 0


class RedisClient:

    def __init__(self, *, url: str | list[str], cluster: bool, namespace: bytes, block_bytes: int,
                 ttl_s: float | None, timeout_ms: int, io_threads: int = 4, codec: Codec | None = None,
                 codec_id: int = 0, username: str | None = None, password: str | None = None,
                 secret: bytes | None = None, secret_previous: bytes | None = None,
                 backoff_s: tuple[float, float] = (0.5, 30.0), clock: Callable[[], float] = time.monotonic):
        urls = [url] if isinstance(url, str) else list(url)
        if not urls or (len(urls) > 1 and not cluster):
            raise ValueError("remote url: one url for a single server, one or more seeds for a cluster")
        self.seeds = [rc.parse_url(u) for u in urls]
        self.url = self.seeds[0][4] if not cluster else ",".join(s[4] for s in self.seeds)
        if len(namespace) != 16:
            raise ValueError(f"namespace must be 16 bytes (a digest), got {len(namespace)}")
        if ttl_s is not None and ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive or None, got {ttl_s}")
        if secret_previous and not secret:
            raise ValueError("a previous secret is only read beside a current one")
        key = mac_key(secret) if secret else None
        self.cluster = cluster
        self.namespace = authenticated_namespace(namespace, key) if key else bytes(namespace)
        self.block_bytes = int(block_bytes)
        self.ttl_ms = None if ttl_s is None else px_of(ttl_s)
        self.values = ValueFormat(self.namespace, self.block_bytes, codec, codec_id, key)
        # what is read: the current namespace, then during a rotation the previous secret's
        self.spaces = [self.values]
        old = mac_key(secret_previous) if secret_previous else None
        if old is not None and old != key:
            self.spaces.append(ValueFormat(authenticated_namespace(namespace, old), self.block_bytes, codec, codec_id,
                                           old))
        self._tags = {f.namespace: b"kvs:{" + f.namespace.hex().encode() + b"." for f in self.spaces}
        if key is None and not _warned_unauthenticated.is_set():
            _warned_unauthenticated.set()
            log.warning("kvstore remote: %s is not set, so the shared tier trusts every writer: any client that "
                        "may write kvs:* keys to %s can make this engine serve KV of its choice (see "
                        "docs/security.md)", ENV_SECRET, self.url)
        self._timeout = timeout_ms / 1000
        # no retries inside redis-py: a failure is a miss here and the backoff decides when to retry
        self._kw = dict(username=username, password=password, socket_timeout=self._timeout,
                        socket_connect_timeout=self._timeout)
        self._io_threads = max(1, int(io_threads))
        self._backoff = backoff_s
        self._clock = clock
        self._lock = threading.Lock()  # stats and backoff
        self._conn_lock = threading.Lock()  # building the client, rereading a cluster's slots
        self._client: redis.Redis | redis.RedisCluster | None = None
        self._refresh = False  # a cluster answered MOVED/ASK or CLUSTERDOWN: reread its slots first
        self._pool = ThreadPoolExecutor(self._io_threads, "kvs-remote") if cluster else None
        self._delay = 0.0
        # PEXPIRE ... GT at a read (Redis >= 7.0, Valkey): a hit refreshes the TTL, never shortens
        # it: a block stored with a longer TTL hint (86,400 s on a 600 s tier) was cut back to the
        # tier's at its first read. Older servers refuse GT: learnt from HELLO at check()
        self._pexpire_gt = False
        self._down_until = float("-inf")
        # per block (per key): timeouts, errors_* and skipped_down count blocks, not calls
        self.stats = {k: 0 for k in ("hits", "misses", "puts", "bytes_read", "bytes_written", "errors_get",
                                     "errors_put", "errors_exists", "errors_remove", "timeouts", "corrupt",
                                     "deleted_corrupt", "skipped_down", "encode_failed")}
        self.corrupt_reasons: dict[str, int] = {}

    def __repr__(self) -> str:
        mac = " mac" if self.values.authenticated else ""
        return f"<RedisClient {'cluster' if self.cluster else 'server'} {self.url} ns={self.namespace.hex()[:16]}{mac}>"

    def redis_key(self, key: bytes, values: ValueFormat | None = None) -> bytes:
        """The name of ``key`` in the current namespace (or in that of ``values``, one of :attr:`spaces`)."""
        if len(key) != KEY_BYTES:
            raise ValueError(f"block keys are {KEY_BYTES} bytes, got {len(key)}")
        return self._tags[(values or self.values).namespace] + b"%02x}:" % key[0] + key.hex().encode()

    def deadline(self):
        """``timeout_ms`` for this thread's calls to the tier, together: a caller that makes several
        in one step (a lookup's probe, then the rest of the prompt) wraps them in one."""
        return rc.deadline(self._timeout)

    # -- connections -------------------------------------------------------------------------------
    def _connect(self):
        """The client, built on first use (a cluster's is built by reading its slots from a seed)."""
        left = rc.time_left()
        if not self._conn_lock.acquire(timeout=-1 if left is None else max(0.0, left)):
            raise RTimeoutError("kvstore remote: another call is connecting past this call's deadline")
        try:
            if self._client is None:
                self._client = (rc.cluster_client(self.seeds, self._kw) if self.cluster
                                else rc.server_client(self.seeds[0], self._io_threads, self._kw))
                self._refresh = False
            elif self._refresh and self.cluster:
                self._refresh = False
                self._client.nodes_manager.initialize()
            return self._client
        finally:
            self._conn_lock.release()

    def _nodes(self) -> list[redis.Redis]:
        c = self._connect()
        return [c.get_redis_connection(n) for n in c.get_primaries()] if self.cluster else [c]

    def check(self) -> None:
        """PING every server at start-up (within one deadline): RemoteAuthError on refused
        credentials, RemoteUnavailable if unreachable or not answering as Redis does (the caller
        decides whether that is fatal)."""
        with self.deadline():
            for seed in self.seeds if self.cluster else []:  # plain clients first: clear auth errors
                try:
                    with rc.plain_client(seed, self._kw) as c:
                        c.ping()
                    break
                except AuthenticationError as e:
                    raise self._auth_error(e) from None
                except Exception:  # noqa: BLE001 - the next seed, then the cluster client says why
                    continue
            try:
                nodes = self._nodes()
                for c in nodes:
                    c.ping()
                self._pexpire_gt = all(_major_version(c) >= 7 for c in nodes)
            except AuthenticationError as e:
                raise self._auth_error(e) from None
            except Exception as e:  # noqa: BLE001 - whatever the client library raised
                self._failed(e)
                if any(s[3] for s in self.seeds) and (bad := rc.tls_failure(e)) is not None:
                    raise RemoteTLSError(f"kvstore remote: the TLS handshake with {self.url} failed ({bad}); if its "
                                         f"certificate is signed by a private CA, point SSL_CERT_FILE at that CA's "
                                         f"PEM file in the engine's environment") from None
                raise RemoteUnavailable(f"kvstore remote: {self.url} is unreachable: {type(e).__name__}: {e}") from None
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
    def _call(self, op: str, names: Sequence[bytes], add: Callable, per: int = 1,
              pipeline: Callable | None = None) -> list[list] | None:
        """Run ``add(pipe, i)`` (``per`` commands) for every name, one pipeline per server
        (``pipeline(node)``, else redis-py's), all within one deadline; per name, the list of its
        replies (an exception where a command failed). None = the tier is down (skipped, or
        failed now)."""
        if not self.available:
            self.count("skipped_down", len(names))
            return None
        with self.deadline() as dl:
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
                out = rc.pipelines(self._pool, jobs, len(names), add, per, pipeline, dl)
            except Exception as e:  # noqa: BLE001 - whatever the client library raised is a failure here
                self._down(op, e, len(names))
                return None
        errors = [r for rs in out for r in rs if isinstance(r, Exception) and not _wrongtype(r)]
        failed = [rs for rs in out if any(isinstance(r, Exception) and not _wrongtype(r) for r in rs)] if errors else []
        if any(isinstance(r, (AskError, ClusterDownError)) for r in errors):
            self._refresh = True  # slots moved (MovedError is an AskError) or the cluster is changing
        outage = [r for r in errors if _outage(r)]
        if outage:  # a server gone, slow or speaking nonsense: back off; any other error is that key's miss
            self._down(op, outage[0], 0)
            self.count("timeouts", sum(any(_timeout(r) for r in rs) for rs in failed))
        else:
            self._succeeded()
        self.count(f"errors_{op}", len(failed))
        return out

    def _down(self, op: str, e: Exception, n: int) -> None:
        self._failed(e)
        self.count("timeouts", n if _timeout(e) else 0)
        self.count(f"errors_{op}", n)

    def _refused(self, reasons: list[str]) -> None:
        """Values refused at a read or a lookup, counted by reason."""
        if reasons:
            with self._lock:
                for r in reasons:
                    self.corrupt_reasons[r] = self.corrupt_reasons.get(r, 0) + 1
            self.count("corrupt", len(reasons))

    def _bad(self, bad: list[tuple[bytes, str]]) -> None:
        """(name, reason) of values that are not of our format under their name (garbage, a
        foreign or replayed header, the wrong type, size or codec, a payload that does not
        decode): counted by reason, then deleted; another engine may have rewritten one since:
        deleting it costs a miss, never a wrong block."""
        if not bad:
            return
        names = [name for name, _ in bad]
        self._refused([r for _, r in bad])
        gone = self._call("remove", names, lambda p, i: p.delete(names[i])) or []
        self.count("deleted_corrupt", sum(rs[0] for rs in gone if type(rs[0]) is int))

    # -- the medium --------------------------------------------------------------------------------
    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        """Which keys hold a value that could be ours (in any namespace read: one pipeline):
        ``STRLEN`` (as cheap as EXISTS) gives the length before anything is read; a value of the
        wrong length or type is counted, deleted and reported absent (never "present" while every
        load of it fails)."""
        names = [self.redis_key(k, f) for f in self.spaces for k in keys]
        res = self._call("exists", names, lambda p, i: p.strlen(names[i])) if names else []
        found = [False] * len(keys)
        if res is None:
            return found
        bad = []
        for j, f in enumerate(self.spaces):
            for i in range(len(keys)):
                name, (n,) = names[j * len(keys) + i], res[j * len(keys) + i]
                if type(n) is int and f.value_min <= n <= f.value_max:
                    found[i] = True
                elif (type(n) is int and n > 0) or _wrongtype(n):
                    bad.append((name, "type" if _wrongtype(n) else f.length_bad(n)))
        self._bad(bad)
        return found

    def get(self, keys: Sequence[bytes], outs: Sequence[np.ndarray], refused: list | None = None) -> list[bool]:
        """Fill ``outs[i][:block_bytes]`` for every key found whole; refreshes the TTL of hits in
        the current namespace; then, during a rotation, reads what is left from the previous
        secret's (one deadline for both). Keys whose values were refused and kept (checksum, MAC)
        and not served are appended to ``refused``. Length first: ``GETRANGE 0 max`` reads at
        most one byte past the longest value of ours, so a 64 MiB value costs that, not 64 MiB;
        ``PEXPIRE`` beside it refreshes the TTL (if the tier has one), and an empty value is a
        miss like a missing key. Measured on 2 MiB values, 64 a round in pipelines of 32, one
        thread: GETRANGE+PEXPIRE ran at 0.99 of GETEX's rate, a Lua script that checks STRLEN first
        at 0.50 (the value crosses Lua's heap twice)."""
        oks = [False] * len(keys)
        if not keys:
            return oks
        bad: list[tuple[bytes, str]] = []
        kept: list[tuple[int, str]] = []
        with self.deadline():
            for f in self.spaces:
                idx = [i for i, ok in enumerate(oks) if not ok]
                if not idx or not self._read(f, keys, outs, idx, oks, bad, kept):
                    break
        self.count("hits", sum(oks))
        self.count("misses", len(oks) - sum(oks))
        self._refused([r for _, r in kept])
        if refused is not None:
            refused.extend(dict.fromkeys(keys[i] for i, _ in kept if not oks[i]))
        self._bad(bad)
        return oks

    def _read(self, f: ValueFormat, keys: Sequence[bytes], outs: Sequence[np.ndarray], idx: list[int],
              oks: list[bool], bad: list, kept: list) -> bool:
        """Read keys ``idx`` from the namespace of ``f`` into ``oks``; the refused ones into
        ``bad`` (name, reason: to delete) or ``kept`` (index, reason). False: the tier is down."""
        names = [self.redis_key(keys[i], f) for i in idx]
        cap = f.value_max
        px = self.ttl_ms if f is self.values else None  # the previous secret's values are not kept alive
        gt = self._pexpire_gt

        def add(p, j) -> None:
            p.getrange(names[j], 0, cap)
            if px is not None:
                p.pexpire(names[j], px, gt=gt)

        res = self._call("get", names, add, per=1 if px is None else 2)
        if res is None:
            return False
        for j, (value, *_) in enumerate(res):
            i = idx[j]
            if _wrongtype(value):
                why = Refused("type")
            elif not isinstance(value, bytes):
                continue  # an error, counted by _call
            elif not value:
                # No such key, or an empty value (exists() reports it absent and a put overwrites
                # it): a plain miss. Never "truncated": GETRANGE and PEXPIRE are two commands, and
                # another engine's SET may land between them (an empty GETRANGE, then PEXPIRE 1);
                # counting that as corrupt gave 1 phantom in ~95,000 reads under SET/DEL churn.
                continue
            else:
                why = f.decode(keys[i], value, outs[i])
            if why is None:
                oks[i] = True
                self.count("bytes_read", len(value))
            elif why.kept:
                kept.append((i, why.reason))
            else:
                bad.append((names[j], why.reason))
        return True

    def put(self, keys: Sequence[bytes], blocks: Sequence[np.ndarray], ttl_s: float | None = None) -> list[bool]:
        """Store each block, overwriting: in one namespace a key names the same bytes in every
        engine. ``ttl_s``: this call's idle TTL (a request's retention hint), else the tier's."""
        px = self.ttl_ms if ttl_s is None else px_of(ttl_s)
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

            def add(p, j) -> None:
                head, payload, mac = values[todo[j]]
                p.set(names[todo[j]], head, payload, px=px, tail=mac)

            res = self._call("put", [names[i] for i in todo], add, pipeline=SetPipeline)
            for j, rs in enumerate(res or []):
                if rs[0] is True:
                    head, payload, mac = values[todo[j]]
                    oks[todo[j]] = True
                    self.count("bytes_written", len(head) + payload.nbytes + len(mac))
        finally:
            values = None  # the memoryviews are released before their buffers are reused
            self.values.give_bufs(bufs)
        self.count("puts", sum(oks))
        return oks

    def remove(self, keys: Sequence[bytes]) -> int:
        """Delete ``keys`` in every namespace read; the values deleted."""
        names = [self.redis_key(k, f) for f in self.spaces for k in keys]
        res = self._call("remove", names, lambda p, i: p.delete(names[i])) if names else []
        return sum(rs[0] for rs in res or [] if type(rs[0]) is int)

    def scan(self, match_namespace: bytes | None = None, limit: int | None = None
             ) -> Iterator[tuple[bytes, bytes, int]]:
        """(namespace, key, value bytes) of every block value (of one namespace), each master
        SCANned in turn, with no deadline (``kvstore inspect`` has its own SCAN, which also reads
        each value's header and PTTL). Raises RemoteUnavailable if a server fails."""
        ns = b"*" if match_namespace is None else bytes(match_namespace).hex().encode()
        left = float("inf") if limit is None else limit
        try:
            for node in self._nodes():
                names = node.scan_iter(match=b"kvs:{" + ns + b".*", count=1000)
                while left > 0 and (batch := list(islice(names, 512))):
                    pipe = node.pipeline(transaction=False)
                    for name in batch:
                        pipe.strlen(name)
                    for name, n in zip(batch, pipe.execute(raise_on_error=False)):
                        m = _NAME.fullmatch(name)
                        if m and type(n) is int and n and left > 0:  # a key gone since the SCAN has length 0
                            left -= 1
                            yield bytes.fromhex(m[1].decode()), bytes.fromhex(m[2].decode()), n
        except Exception as e:  # noqa: BLE001 - whatever the client library raised
            raise RemoteUnavailable(f"kvstore remote: scanning {self.url} failed: {e}") from None

    def close(self) -> None:
        """Ends by the deadline too: node jobs in flight end by theirs, and the sockets are
        closed, not said goodbye to."""
        with self.deadline():
            if self._pool is not None:
                self._pool.shutdown(wait=True, cancel_futures=True)
            left = rc.time_left()
            locked = self._conn_lock.acquire(timeout=max(0.0, left or 0.0))
            client, self._client = self._client, None
            if locked:
                self._conn_lock.release()
        if client is not None:
            try:
                client.close()
            except Exception as e:  # noqa: BLE001 - closing sockets of a dead peer
                log.debug("kvstore remote: closing %s: %s", self.url, e)
