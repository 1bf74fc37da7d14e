"""The scheduler->store calls across processes: length-prefixed JSON over a Unix socket.

vLLM's multiprocess executor runs the worker (which owns the store) in another process than
the scheduler. The worker serves :class:`~kvstore.offload.client.LocalClient`'s calls on
``<tmp>/kvstore-<uid>/<name>.sock`` (folder 0700, socket 0600); the scheduler's
:class:`RemoteClient` makes them. JSON only (keys as hex): nothing received is unpickled.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import socketserver
import struct
import tempfile
import threading
import time

from kvstore import failpoints
from kvstore.offload.client import LocalClient
from kvstore.offload.metrics import RequestOutcome
from kvstore.offload.shared import SharedStore
from kvstore.store import PrefixMatch

log = logging.getLogger(__name__)
_LEN = struct.Struct("<I")
MAX_MSG = 64 << 20


def socket_path(name: str) -> str:
    d = os.path.join(tempfile.gettempdir(), f"kvstore-{os.getuid()}")
    os.makedirs(d, mode=0o700, exist_ok=True)
    os.chmod(d, 0o700)
    digest = hashlib.sha256(name.encode()).hexdigest()[:24]  # socket paths are short (108 bytes)
    return os.path.join(d, f"{digest}.sock")


def _send(sock: socket.socket, obj) -> None:
    data = json.dumps(obj, separators=(",", ":")).encode()
    sock.sendall(_LEN.pack(len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("kvstore rpc: connection closed")
        buf += chunk
    return bytes(buf)


def _recv(sock: socket.socket):
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    if n > MAX_MSG:
        raise ConnectionError(f"kvstore rpc: message of {n} bytes refused")
    return json.loads(_recv_exact(sock, n))


def _keys(hexes) -> list[bytes]:
    return [bytes.fromhex(h) for h in hexes]


class _Handler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        c: LocalClient = self.server.client  # type: ignore[attr-defined]
        while True:
            try:
                msg = _recv(self.request)
                failpoints.fire("rpc.serve", sock=self.request)
            except (ConnectionError, OSError, ValueError):
                return
            try:
                op, a = msg["op"], msg.get("args", {})
                if op == "contains_prefix":
                    m = c.contains_prefix(_keys(a["keys"]), a.get("record", False), a.get("num_tokens"),
                                          int(a.get("held", 0)))
                    res = [m.num_blocks, list(m.tiers), m.miss_reason]
                elif op == "prefetch":
                    res = c.prefetch(_keys(a["keys"]))
                elif op == "prefetch_done":
                    res = c.prefetch_done(int(a["token"]))
                elif op == "begin_load":
                    hid, n, tiers = c.begin_load(_keys(a["keys"]), a.get("session"), a.get("ttl_s"))
                    res = [hid, n, list(tiers)]
                elif op == "end_load":
                    res = c.end_load(int(a["handle"]))
                elif op == "record_request":
                    res = c.record_request(RequestOutcome.from_json(a["outcome"]))
                elif op == "saves_done":
                    res = c.saves_done(str(a["req_id"]), min(1.0, max(0.0, float(a.get("timeout", 0.0)))))
                elif op == "ping":
                    res = "pong"
                else:
                    raise ValueError(f"unknown op {op!r}")
                _send(self.request, {"ok": True, "result": res})
            except Exception as e:  # a bad call is answered, never kills the server
                log.warning("kvstore rpc: %s failed: %s", msg.get("op") if isinstance(msg, dict) else "?", e)
                try:
                    _send(self.request, {"ok": False, "error": str(e)})
                except OSError:
                    return


class _Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    allow_reuse_address = True


class StoreServer:
    """Serves a process's store to schedulers in other processes (a daemon thread)."""

    def __init__(self, shared: SharedStore, name: str):
        self.path = socket_path(name)
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        old = os.umask(0o177)
        try:
            self.server = _Server(self.path, _Handler)
        finally:
            os.umask(old)
        self.server.client = LocalClient(shared)  # type: ignore[attr-defined]
        self.thread = threading.Thread(target=self.server.serve_forever, name="kvstore-rpc", daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        try:
            os.unlink(self.path)
        except OSError:
            pass


class RemoteClient:
    """The scheduler side's view of a store in another process.

    A call that fails (the socket closed, the worker gone, no answer within ``timeout_s``)
    raises ConnectionError at once, which the planner turns into a miss; the socket is dropped
    and the next call after a back-off (0.1 s doubling to 5 s) connects again. The scheduler
    never waits on a dead store longer than one timeout.
    """

    def __init__(self, name: str, connect_timeout_s: float = 120.0, timeout_s: float = 10.0):
        self.path = socket_path(name)
        self.timeout_s = timeout_s
        self.sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._backoff = 0.1
        self._retry_at = 0.0
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
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self.timeout_s)
            sock.connect(self.path)
        except OSError:
            sock.close()
            raise
        self.sock = sock

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
            if self.sock is None:
                if time.monotonic() < self._retry_at:
                    raise ConnectionError("kvstore rpc: store unreachable (reconnecting)")
                try:
                    self._connect()
                except OSError as e:
                    self._drop()
                    raise ConnectionError(f"kvstore rpc: reconnect failed: {e}") from None
                log.info("kvstore rpc: reconnected to %s", self.path)
            try:
                _send(self.sock, {"op": op, "args": args})
                r = _recv(self.sock)
            except (OSError, ValueError) as e:  # ConnectionError and socket timeouts are OSErrors
                self._drop()
                raise ConnectionError(f"kvstore rpc {op}: {type(e).__name__}: {e}") from None
            self._backoff = 0.1
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
