"""The remote tier's connections to Redis: a call ends by its deadline, whatever the server does.

redis-py's ``socket_timeout`` bounds each ``recv``, not a call: a server that answered the
handshake at once, then sent one byte every 150 ms held a lookup for 9.6 s under ``timeout_ms:
200``; one sending 2 MiB replies at 64 KiB per 150 ms held it for 80 s (the fakes of
``tests/redis_servers.py``). Here a call sets a deadline for its thread (:class:`deadline`; a
call made inside another keeps the sooner one) and the connection waits at most the time left.
The deadline is ``timeout_ms`` after the call began plus 50 ms per MiB it has moved (``MIN_RATE``,
20 MB/s): a lookup moves a few bytes, so ``timeout_ms`` bounds it, while a load of 32 blocks of
2 MiB, which a healthy server delivered here in 0.2-1 s (redis-py reads 0.07-0.34 GB/s per
connection on this VM), is not cut off at the default 200 ms; a server slower than 20 MB/s gains
almost nothing (3 ms per 64 KiB chunk), and a value is read at most to its length cap.

- the socket (:class:`DeadlineSocket`): every ``recv`` and ``send`` waits at most the time left;
  past the deadline, ``socket.timeout``, which redis-py turns into its TimeoutError after
  dropping the connection (so no late reply is ever read by the next call);
- the connect (:func:`_tcp`): the host name resolved on a helper thread (the system resolver
  cannot be interrupted: a late answer is dropped there), the TCP connect and the TLS handshake
  (CPython bounds a whole handshake by the timeout ``ssl`` reads from ``gettimeout()``);
- the wait for a free pooled connection (:class:`DeadlinePool`);
- a handshake reply redis-py cannot use (``HELLO`` answered ``+OK`` raised AttributeError out of
  ``KVStore()``; ``:x`` ValueError) is a ConnectionError, and the socket is dropped.

Without a deadline (``scan``) the configured ``socket_timeout`` applies as before.
"""

from __future__ import annotations

import ipaddress
import socket
import ssl
import threading
import time
from concurrent.futures import wait
from typing import Callable
from urllib.parse import urlsplit

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode
from redis.exceptions import ClusterDownError, ConnectionError as RConnectionError, RedisError, ResponseError
from redis.exceptions import TimeoutError as RTimeoutError
from redis.retry import Retry

ENV_USER, ENV_PASSWORD = "KVSTORE_REDIS_USERNAME", "KVSTORE_REDIS_PASSWORD"

_local = threading.local()
MIN_RATE = 20e6  # bytes/s: the slowest transfer a call is given time for
SLACK = 0.005  # s: how far a socket's timeout may be from the time left before it is set again


class RemoteError(Exception):
    pass


class RemoteUnavailable(RemoteError):
    """The server (or no seed of the cluster) could not be reached."""


class RemoteAuthError(RemoteError):
    """The server refused the credentials (or wants some)."""


class RemoteTLSError(RemoteError):
    """A ``rediss://`` server whose certificate this machine does not trust (a setting to fix,
    not an outage to wait out)."""


def outage(r) -> bool:
    """A failure of the server, the link or the client library, not one command's answer (MOVED,
    OOM, WRONGTYPE are answers; CLUSTERDOWN is the cluster's failure)."""
    return isinstance(r, Exception) and (not isinstance(r, ResponseError) or isinstance(r, ClusterDownError))


def wrongtype(r) -> bool:
    return isinstance(r, ResponseError) and str(r).startswith("WRONGTYPE")


def timed_out(r) -> bool:
    return isinstance(r, (RTimeoutError, socket.timeout))


class Deadline:
    """When a call must end: ``timeout`` after it began, plus ``1 / MIN_RATE`` s for every byte it
    has moved, so a healthy server may send a large batch and a slow one cannot hold it."""

    __slots__ = ("end",)

    def __init__(self, end: float):
        self.end = end

    def left(self) -> float:
        return self.end - time.monotonic()

    def moved(self, nbytes: int) -> None:
        self.end += nbytes / MIN_RATE  # parallel node jobs share it; a lost update only shortens it


class deadline:  # noqa: N801 - used as a function: ``with deadline(0.2):``
    """This thread's calls end by ``share`` (a caller's, for its node jobs), else ``seconds`` from
    now, or by the one already set if sooner (a class: 0.5 us, @contextmanager took 2 us)."""

    __slots__ = ("_dl", "_prev")

    def __init__(self, seconds: float | None = None, *, share: Deadline | None = None):
        self._prev = prev = getattr(_local, "dl", None)
        if share is not None:
            self._dl = share
        elif prev is not None and prev.end <= time.monotonic() + seconds:
            self._dl = prev
        else:
            self._dl = Deadline(time.monotonic() + seconds)

    def __enter__(self) -> Deadline:
        _local.dl = self._dl
        return self._dl

    def __exit__(self, *exc) -> None:
        _local.dl = self._prev


def time_left() -> float | None:
    """Seconds to this thread's deadline (<= 0 once past it); None without one."""
    dl = getattr(_local, "dl", None)
    return None if dl is None else dl.left()


def _moved(nbytes: int) -> None:
    dl = getattr(_local, "dl", None)
    if dl is not None and nbytes > 0:
        dl.moved(nbytes)


def _bounded(timeout: float | None) -> float | None:
    """``timeout`` cut to the time left (socket.timeout once the deadline has passed)."""
    left = time_left()
    if left is None:
        return timeout
    if left <= 0:
        raise socket.timeout("kvstore remote: the call's deadline passed")
    return left if timeout is None or timeout > left else timeout


class DeadlineSocket:
    """A connected socket whose ``recv``/``send`` wait at most until the thread's deadline
    (``settimeout`` sets the timeout used without one: redis-py's own, e.g. 0 to poll)."""

    def __init__(self, sock: socket.socket, timeout: float | None):
        self._sock = sock
        self._tls = isinstance(sock, ssl.SSLSocket)
        self._timeout = self._real = timeout  # redis-py's; the one the socket has now
        sock.settimeout(timeout)

    def _arm(self) -> None:
        """The time left, unless the socket has it within ``SLACK`` (a settimeout is an ioctl:
        one per read made 16-key lookups 22 us slower; a fast call now sets none)."""
        t, real = self._timeout, self._real
        want = t if t == 0 else _bounded(t)
        if want == real or (want and real and want - SLACK <= real <= want + SLACK):
            return
        self._sock.settimeout(want)
        self._real = want

    def settimeout(self, timeout: float | None) -> None:
        self._timeout = self._real = timeout
        self._sock.settimeout(timeout)

    def gettimeout(self) -> float | None:
        return self._timeout

    def recv(self, n: int, flags: int = 0) -> bytes:
        self._arm()
        data = self._sock.recv(n, flags)
        _moved(len(data))
        return data

    def recv_into(self, buf, n: int = 0, flags: int = 0) -> int:
        self._arm()
        got = self._sock.recv_into(buf, n, flags)
        _moved(got)
        return got

    def send(self, data, flags: int = 0) -> int:
        self._arm()
        sent = self._sock.send(data, flags)
        _moved(sent)
        return sent

    def sendall(self, data, flags: int = 0) -> None:
        """Send in pieces, each within the time left and moving the deadline on (an SSL socket's
        own ``sendall`` would give every piece the whole timeout again); a small one at once."""
        if len(data) <= 1 << 16 and not self._tls:  # a plain socket's sendall is bounded as a whole
            self._arm()
            self._sock.sendall(data, flags)
            _moved(len(data))
            return
        with memoryview(data) as view, view.cast("B") as b:
            sent = 0
            while sent < len(b):
                sent += self.send(b[sent:], flags)

    def __getattr__(self, name: str):  # shutdown, close, fileno, getpeername, ...
        return getattr(self._sock, name)


def _resolve(host: str, port: int, family: int) -> list:
    """getaddrinfo, on a helper thread for a host name, waited for until the deadline."""
    try:
        ipaddress.ip_address(host)
        numeric = True
    except ValueError:
        numeric = False
    left = time_left()
    if numeric or left is None:
        return socket.getaddrinfo(host, port, family, socket.SOCK_STREAM)
    box: list = []

    def run() -> None:
        try:
            box.append(socket.getaddrinfo(host, port, family, socket.SOCK_STREAM))
        except OSError as e:
            box.append(e)

    t = threading.Thread(target=run, name="kvs-resolve", daemon=True)
    t.start()
    t.join(max(0.0, left))
    if not box:
        raise socket.timeout(f"kvstore remote: resolving {host} took longer than the call's deadline")
    if isinstance(box[0], OSError):
        raise box[0]
    return box[0]


class _TcpSocket(socket.socket):
    """A socket whose ``gettimeout()`` is the time left: ``ssl`` reads it to bound the handshake
    once the SSL context is built (~50 ms here, loading the system's CA store)."""

    def gettimeout(self) -> float | None:
        return _bounded(super().gettimeout())


def _tcp(conn: redis.Connection) -> socket.socket:
    """redis-py's ``Connection._connect`` (TCP_NODELAY, keepalive), every step within the time
    left, so is a TLS handshake on it (CPython bounds a whole handshake by the socket's timeout)."""
    err: OSError | None = None
    for family, socktype, proto, _, addr in _resolve(conn.host, conn.port, conn.socket_type):
        sock = _TcpSocket(family, socktype, proto)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if conn.socket_keepalive:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
                for k, v in conn.socket_keepalive_options.items():
                    sock.setsockopt(socket.IPPROTO_TCP, k, v)
            sock.settimeout(_bounded(conn.socket_connect_timeout))
            sock.connect(addr)
            sock.settimeout(conn.socket_timeout)
            return sock
        except OSError as e:
            err = e
            sock.close()
    raise err if err is not None else OSError("getaddrinfo returned nothing")


def _handshake(on_connect, check_health: bool) -> None:
    try:
        on_connect(check_health)
    except RedisError:
        raise
    except Exception as e:  # noqa: BLE001 - a reply redis-py did not expect: the server is not usable
        raise RConnectionError(f"unexpected handshake reply ({type(e).__name__}: {str(e)[:80]})") from None


class DeadlineConnection(redis.Connection):
    def _connect(self):
        return DeadlineSocket(_tcp(self), self.socket_timeout)

    def on_connect_check_health(self, check_health: bool = True):
        _handshake(super().on_connect_check_health, check_health)


class DeadlineSSLConnection(redis.SSLConnection):
    def _connect(self):
        sock = _tcp(self)
        try:
            return DeadlineSocket(self._wrap_socket_with_ssl(sock), self.socket_timeout)
        except BaseException:
            sock.close()
            raise

    def on_connect_check_health(self, check_health: bool = True):
        _handshake(super().on_connect_check_health, check_health)


class DeadlinePool(redis.BlockingConnectionPool):
    """Waits for a free connection until the thread's deadline at most."""

    @property
    def timeout(self) -> float | None:
        left = time_left()
        if left is None:
            return self._wait
        return max(0.0, left if self._wait is None else min(self._wait, left))

    @timeout.setter
    def timeout(self, value: float | None) -> None:
        self._wait = value


def connection_class(tls: bool) -> type:
    return DeadlineSSLConnection if tls else DeadlineConnection


def pipelines(pool, jobs: list, n: int, add: Callable, per: int, pipeline: Callable | None, dl: Deadline) -> list[list]:
    """``(client, indices)`` jobs: each one pipeline of ``add(pipe, i)`` (``per`` commands for each
    index; ``pipeline(client)`` or redis-py's), the first on this thread and the others on ``pool``
    in parallel, all by the deadline ``dl``; a job not started by then is cancelled, so none
    touches the caller's blocks after the call. Per index, the list of its replies (exceptions
    where commands failed)."""
    out: list = [None] * n

    def run(job) -> None:
        node, ix = job
        try:
            pipe = node.pipeline(transaction=False) if pipeline is None else pipeline(node)
            for i in ix:
                add(pipe, i)
            res = pipe.execute(raise_on_error=False)
        except Exception as e:  # noqa: BLE001 - any failure is this node's miss
            res = [e] * (len(ix) * per)
        if len(res) < len(ix) * per:
            res = [redis.RedisError("kvstore remote: fewer replies than commands")] * (len(ix) * per)
        for k, i in enumerate(ix):
            out[i] = res[k * per:(k + 1) * per]

    def run_on_pool(job) -> None:
        with deadline(share=dl):
            run(job)

    futures = [pool.submit(run_on_pool, j) for j in jobs[1:]]
    run(jobs[0])  # this thread: under ``dl`` already
    while futures and dl.left() > 0 and wait(futures, timeout=max(0.0, dl.left())).not_done:
        pass  # data flowing moves the deadline on
    if futures:
        for f in futures:
            f.cancel()
        wait(futures)  # those started end by the deadline: their sockets do
        late = RTimeoutError("kvstore remote: the call's deadline passed before this server's turn")
        out = [rs if rs is not None else [late] * per for rs in out]
    return out


# -- clients -----------------------------------------------------------------------------------
def parse_url(url: str) -> tuple[str, int, int, bool, str]:
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


def tls_failure(e: BaseException) -> BaseException | None:
    """The ssl error behind a connection error, if there is one (redis-py wraps it)."""
    seen = 0
    while e is not None and seen < 8:
        if isinstance(e, ssl.SSLError):
            return e
        if "CERTIFICATE_VERIFY_FAILED" in str(e) or "WRONG_VERSION_NUMBER" in str(e):
            return e
        e, seen = e.__cause__ or e.__context__, seen + 1
    return None


def plain_client(seed, kw: dict) -> redis.Redis:
    """One connection's client to one server (start-up checks)."""
    host, port, db, tls, _ = seed
    pool = redis.ConnectionPool(host=host, port=port, db=db, connection_class=connection_class(tls),
                                retry=Retry(NoBackoff(), 0), **kw)
    return redis.Redis(connection_pool=pool)


def server_client(seed, connections: int, kw: dict) -> redis.Redis:
    """A single server's client: at most ``connections`` sockets, waited for until the deadline."""
    host, port, db, tls, _ = seed
    pool = DeadlinePool(max_connections=connections, timeout=None, host=host, port=port, db=db,
                        connection_class=connection_class(tls), retry=Retry(NoBackoff(), 0), **kw)
    return redis.Redis(connection_pool=pool)


def cluster_client(seeds: list, kw: dict) -> redis.RedisCluster:
    """A cluster's client (reads the slots from a seed now). Its node clients are built with our
    connection class only on redis-py's ``url`` path (``connection_pool_class(**kwargs)``), so
    the first seed is given as a plain ``redis://`` url and TLS comes with the class."""
    host, port = seeds[0][0], seeds[0][1]
    return redis.RedisCluster(url=f"redis://{host}:{port}", startup_nodes=[ClusterNode(s[0], s[1]) for s in seeds[1:]],
                              retry=Retry(NoBackoff(), 0), connection_class=connection_class(seeds[0][3]), **kw)
