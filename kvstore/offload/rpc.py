"""The scheduler->store calls across processes: length-prefixed JSON over a Unix socket.

vLLM's multiprocess executor runs the worker (which owns the store) in another process than
the scheduler. The worker serves :class:`~kvstore.offload.client.LocalClient`'s calls on
``<folder>/<sha256(name)[:24]>.sock`` (socket 0600 in a folder of this uid, 0700, checked by
:mod:`kvstore.offload.sockdir`); the scheduler's :class:`RemoteClient` makes them. JSON only
(keys as hex): nothing received is unpickled.

Only this uid is served (``SO_PEERCRED``; the client checks the server's uid too). Each
connection gets its own LocalClient: the handles it pins are its own and are released when it
closes. A connection idle ``IDLE_S`` or a frame not whole ``FRAME_S`` after its first byte is
dropped; at most ``MAX_CONNECTIONS`` are served at once, more are closed at once, in the accepting
thread (300 stalled clients held 305 threads; now 64 at most, each for at most 2 x ``FRAME_S``
with half a frame sent, or ``IDLE_S`` with none).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import socketserver
import stat
import threading
import time

from kvstore import failpoints
from kvstore.offload.client import LocalClient
from kvstore.offload.frames import MAX_MSG, recv_frame, recv_served, send_frame, serve_timeouts  # noqa: F401
from kvstore.offload.metrics import RequestOutcome
from kvstore.offload.private_server import PrivateServer
from kvstore.offload.shared import SharedStore
from kvstore.offload.sockdir import SocketTrustError, open_folder, path_in, peer_uid, who
from kvstore.offload.sockdir import folder_path as _folder_path
from kvstore.store import PrefixMatch

log = logging.getLogger(__name__)
IDLE_S = 120.0  # the server drops a connection with no call this long (the client reconnects first)
CLIENT_IDLE_S = 60.0  # a client idle this long reconnects before its next call
FRAME_S = 5.0  # the rest of a frame must arrive this soon after its first byte (a frame is < 1 ms)
MAX_CONNECTIONS = 64  # a scheduler holds one


def socket_name(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()[:24] + ".sock"  # short: AF_UNIX paths are 108 bytes


def socket_path(name: str) -> str:
    """Where ``name`` is served (for messages; connections go through the checked folder)."""
    return os.path.join(_folder_path(), socket_name(name))


def _send(sock: socket.socket, obj) -> None:
    send_frame(sock, json.dumps(obj, separators=(",", ":")).encode())


def _recv(sock: socket.socket, deadline: float | None = None):
    """One message, whole by ``deadline`` (None: the socket's timeout per read)."""
    return json.loads(recv_frame(sock, deadline))


def _keys(hexes) -> list[bytes]:
    return [bytes.fromhex(h) for h in hexes]


def _serve(c: LocalClient, msg: dict):
    op, a = msg["op"], msg.get("args", {})
    if op == "contains_prefix":
        m = c.contains_prefix(_keys(a["keys"]), a.get("record", False), a.get("num_tokens"), int(a.get("held", 0)))
        return [m.num_blocks, list(m.tiers), m.miss_reason]
    if op == "prefetch":
        return c.prefetch(_keys(a["keys"]))
    if op == "prefetch_done":
        return c.prefetch_done(int(a["token"]))
    if op == "begin_load":
        hid, n, tiers = c.begin_load(_keys(a["keys"]), a.get("session"), a.get("ttl_s"))
        return [hid, n, list(tiers)]
    if op == "end_load":
        return c.end_load(int(a["handle"]))
    if op == "record_request":
        return c.record_request(RequestOutcome.from_json(a["outcome"]))
    if op == "saves_done":
        return c.saves_done(str(a["req_id"]), min(1.0, max(0.0, float(a.get("timeout", 0.0)))))
    if op == "ping":
        return "pong"
    raise ValueError(f"unknown op {op!r}")


class _Rpc:
    """What the scheduler RPC's handlers serve: the store, and the connections' time limits."""

    def __init__(self, shared: SharedStore, idle_s: float, frame_s: float):
        self.shared, self.idle_s, self.frame_s = shared, idle_s, frame_s


class _Handler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        srv: _Rpc = self.server.context  # type: ignore[attr-defined]
        c = LocalClient(srv.shared)  # this connection's handles and prefetches
        try:
            serve_timeouts(self.request, min(srv.frame_s, srv.idle_s))
            while True:
                try:
                    msg = json.loads(recv_served(self.request, srv.idle_s, srv.frame_s))
                    failpoints.fire("rpc.serve", sock=self.request)
                except (ConnectionError, OSError, ValueError):  # closed, idle, a stalled frame, not JSON
                    return
                try:
                    reply = {"ok": True, "result": _serve(c, msg)}
                except Exception as e:  # a bad call is answered, never kills the server
                    log.warning("kvstore rpc: %s failed: %s", msg.get("op") if isinstance(msg, dict) else "?", e)
                    reply = {"ok": False, "error": str(e)}
                try:
                    _send(self.request, reply)
                except OSError:
                    return
        finally:
            c.close()  # the loads it pinned and the worker did not take are released


SOCKET_YOUNG_S = 30.0  # a socket younger than this is left alone (its server may not listen yet)


def _remove_dead_sockets(fd: int, folder: str) -> int:
    """Unlink the sockets in the (checked, private) folder that nobody serves: a connect is refused.
    A server that ended without closing (SIGKILL, OOM) leaves its socket, and vLLM names a new
    engine at each start, so without this they pile up, one per rank and unclean exit."""
    removed = 0
    try:
        names = [n for n in os.listdir(fd) if n.endswith(".sock")]
    except OSError:
        return 0
    for name in names:
        try:
            st = os.lstat(name, dir_fd=fd)
            if not stat.S_ISSOCK(st.st_mode) or time.time() - st.st_ctime < SOCKET_YOUNG_S:
                continue  # a server binds, then listens: a connect in between is refused too
        except OSError:
            continue
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.settimeout(0.5)
            s.connect(path_in(fd, folder, name))
        except ConnectionRefusedError:
            try:
                if os.lstat(name, dir_fd=fd).st_ino == st.st_ino:  # not a server's new socket by that name
                    os.unlink(name, dir_fd=fd)
                    removed += 1
            except OSError:
                pass
        except OSError:
            pass  # busy (its backlog full), gone, or a timeout: left alone
        finally:
            s.close()
    return removed


class StoreServer:
    """Serves a process's store to schedulers in other processes (a daemon thread)."""

    def __init__(self, shared: SharedStore, name: str, *, idle_s: float = IDLE_S, frame_s: float = FRAME_S,
                 max_connections: int = MAX_CONNECTIONS):
        self._dir, folder = open_folder()
        self._name = socket_name(name)
        self.path = os.path.join(folder, self._name)
        try:
            try:
                os.unlink(self._name, dir_fd=self._dir)
            except FileNotFoundError:
                pass
            _remove_dead_sockets(self._dir, folder)
            old = os.umask(0o177)
            try:
                self.server = PrivateServer(path_in(self._dir, folder, self._name), _Handler,
                                            _Rpc(shared, idle_s, frame_s), max_connections,
                                            {"uid": 0, "full": 0}, "kvstore rpc")
            finally:
                os.umask(old)
        except BaseException:
            os.close(self._dir)
            raise
        self.thread = threading.Thread(target=self.server.serve_forever, name="kvstore-rpc", daemon=True)
        self.thread.start()

    @property
    def refused(self) -> dict[str, int]:
        return self.server.refused

    def close(self) -> None:
        if self._dir < 0:
            return
        self.server.stop(self._dir, self._name)
        os.close(self._dir)
        self._dir = -1


class RemoteClient:
    """The scheduler side's view of a store in another process.

    A call that fails (the socket closed, the worker gone, no whole answer within ``timeout_s``)
    raises ConnectionError at once, which the planner turns into a miss; the socket is dropped
    and the next call after a back-off (0.1 s doubling to 5 s) connects again. The scheduler
    never waits on a dead store longer than one timeout. A store served by another uid, or
    from a folder that is not private (:mod:`kvstore.offload.sockdir`), is refused: at start-up
    with SocketTrustError, later as a ConnectionError.
    """

    def __init__(self, name: str, connect_timeout_s: float = 120.0, timeout_s: float = 10.0):
        self._sock_name = socket_name(name)
        self.path = socket_path(name)
        self.timeout_s = timeout_s
        self.sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._backoff = 0.1
        self._retry_at = 0.0
        self._used = 0.0  # when the socket last answered
        self.failures = 0
        deadline = time.monotonic() + connect_timeout_s
        while True:  # at start-up the worker may not serve yet: wait for it
            try:
                self._connect()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise ConnectionError(f"kvstore: no store is serving {self.path} (is the worker-side "
                                          "KVStoreConnector running?)") from None
                time.sleep(0.05)

    def _connect(self) -> None:
        fd, folder = open_folder()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self.timeout_s)
            sock.connect(path_in(fd, folder, self._sock_name))
            uid = peer_uid(sock)
            if uid != os.getuid():
                raise SocketTrustError(f"kvstore rpc: {os.path.join(folder, self._sock_name)} is served by {who(uid)}, "
                                       f"not by this user, {who(os.getuid())}: refused")
        except BaseException:
            sock.close()
            raise
        finally:
            os.close(fd)
        self.sock = sock
        self._used = time.monotonic()

    def _close_sock(self) -> None:
        if self.sock is not None:
            try:
                self.sock.close()
            except OSError:
                pass
        self.sock = None

    def _drop(self) -> None:
        self._close_sock()
        self.failures += 1
        self._retry_at = time.monotonic() + self._backoff
        self._backoff = min(5.0, self._backoff * 2)

    def _call(self, op: str, **args):
        with self._lock:
            now, idle = time.monotonic(), False
            if self.sock is not None and now - self._used > CLIENT_IDLE_S:
                self._close_sock()  # the server drops it at IDLE_S: a fresh one, not a failed call
                self._retry_at, idle = 0.0, True
            if self.sock is None:
                if now < self._retry_at:
                    raise ConnectionError("kvstore rpc: store unreachable (reconnecting)")
                try:
                    self._connect()
                except (OSError, SocketTrustError) as e:
                    self._drop()
                    raise ConnectionError(f"kvstore rpc: reconnect failed: {e}") from None
                if not idle:
                    log.info("kvstore rpc: reconnected to %s", self.path)
            try:
                if self.sock.gettimeout() != self.timeout_s:  # lowered near a past call's deadline
                    self.sock.settimeout(self.timeout_s)
                _send(self.sock, {"op": op, "args": args})
                r = _recv(self.sock, deadline=now + self.timeout_s)
            except (OSError, ValueError) as e:  # ConnectionError and socket timeouts are OSErrors
                self._drop()
                raise ConnectionError(f"kvstore rpc {op}: {type(e).__name__}: {e}") from None
            self._backoff = 0.1
            self._used = time.monotonic()
        if not r.get("ok"):
            raise RuntimeError(f"kvstore rpc {op}: {r.get('error')}")
        return r.get("result")

    def contains_prefix(self, keys, record=False, num_tokens=None, held=0) -> PrefixMatch:
        n, tiers, reason = self._call("contains_prefix", keys=[k.hex() for k in keys], record=record,
                                      num_tokens=num_tokens, held=held)
        return PrefixMatch(n, tuple(tiers), reason)

    def prefetch(self, keys) -> int:
        return self._call("prefetch", keys=[k.hex() for k in keys])

    def prefetch_done(self, token: int) -> bool:
        return bool(self._call("prefetch_done", token=token))

    def begin_load(self, keys, session=None, ttl_s=None):
        hid, n, tiers = self._call("begin_load", keys=[k.hex() for k in keys], session=session, ttl_s=ttl_s)
        return hid, n, tuple(tiers)

    def end_load(self, handle_id: int) -> None:
        self._call("end_load", handle=handle_id)

    def record_request(self, outcome: RequestOutcome) -> None:
        self._call("record_request", outcome=outcome.to_json())

    def saves_done(self, req_id: str, timeout: float = 0.0) -> bool:
        return bool(self._call("saves_done", req_id=req_id, timeout=timeout))

    def close(self) -> None:
        with self._lock:
            self._close_sock()
