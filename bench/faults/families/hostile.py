"""Hostile fake Redis servers on loopback (issue 29), for the ``trust`` fault family and the tests
(tests/redis_servers.py re-exports them): real sockets that speak just enough RESP to be taken for
Redis, then trickle, stall, or answer the handshake wrongly.

    FakeRedis("trickle")    answers the handshake (HELLO, AUTH, CLIENT, SELECT; CLUSTER SLOTS and
                            COMMAND as a cluster node when ``slots`` is set) at once, then every
                            other reply one byte per ``gap`` s (a congested link, a hostile peer)
    FakeRedis("slow_big")   the handshake at once, then a 2 MiB bulk string for every command, sent
                            ``chunk`` bytes per ``gap`` s
    FakeRedis("silent")     accepts, reads, never answers anything
    FakeRedis("hello_ok")   answers HELLO with ``+OK`` (redis-py expects a map)
    FakeRedis("garbage")    answers HELLO with bytes that are not RESP
    FakeRedis("bad_int")    answers HELLO with an integer reply that is not a number
    FakeRedis("bad_reply")  the handshake right, then every reply an integer that is not a number

``commands`` lists the command names received (upper case), so a caller can tell that a call did
reach the network. ``close()`` stops it and drops every connection.
"""

from __future__ import annotations

import socket
import threading

MODES = ("trickle", "slow_big", "silent", "hello_ok", "garbage", "bad_int", "bad_reply")
_HANDSHAKE = {b"HELLO", b"AUTH", b"CLIENT", b"SELECT", b"CLUSTER", b"COMMAND"}
_HELLO_MAP = b"%3\r\n+server\r\n+redis\r\n+version\r\n+7.0.0\r\n+proto\r\n:3\r\n"
_BAD_HELLO = {"hello_ok": b"+OK\r\n", "garbage": b"\x00\xffnot resp at all\r\n", "bad_int": b":notanumber\r\n"}


def _reply(name: bytes, args: list[bytes], slots: list | None = None) -> bytes:
    """What a real server with no keys answers (the fake holds nothing)."""
    if name == b"CLUSTER" and slots:  # CLUSTER SLOTS: [start, end, [host, port, id]] per range
        out = b"*%d\r\n" % len(slots)
        for start, end, port in slots:
            out += b"*3\r\n:%d\r\n:%d\r\n*3\r\n$9\r\n127.0.0.1\r\n:%d\r\n$40\r\n%s\r\n" % (
                start, end, port, b"%040d" % port)
        return out
    if name == b"COMMAND":
        return b"*0\r\n"
    if name == b"HELLO":
        return _HELLO_MAP
    if name == b"CLIENT" and args[1:2] and args[1].upper() == b"MAINT_NOTIFICATIONS":
        return b"-ERR unknown subcommand\r\n"
    if name in (b"AUTH", b"CLIENT", b"SELECT", b"SET"):
        return b"+OK\r\n"
    if name == b"PING":
        return b"+PONG\r\n"
    if name in (b"GET", b"GETEX"):
        return b"$-1\r\n"
    if name == b"GETRANGE":
        return b"$0\r\n\r\n"
    if name == b"PTTL":
        return b":-2\r\n"
    return b":0\r\n"  # EXISTS, STRLEN, DEL, UNLINK, PEXPIRE


def _parse(buf: bytearray) -> list[bytes] | None:
    """One command (a RESP array of bulk strings) from the front of ``buf``, removed from it; None
    while it is incomplete."""
    if not buf.startswith(b"*"):
        end = buf.find(b"\r\n")
        if end < 0:
            return None
        line = bytes(buf[:end])
        del buf[:end + 2]
        return line.split()  # an inline command
    pos = buf.find(b"\r\n")
    if pos < 0:
        return None
    n, pos, args = int(buf[1:pos]), pos + 2, []
    for _ in range(n):
        end = buf.find(b"\r\n", pos)
        if end < 0:
            return None
        size = int(buf[pos + 1:end])
        if len(buf) < end + 2 + size + 2:
            return None
        args.append(bytes(buf[end + 2:end + 2 + size]))
        pos = end + 2 + size + 2
    del buf[:pos]
    return args


class FakeRedis:
    def __init__(self, mode: str, *, gap: float = 0.15, chunk: int = 64 * 1024, big: int = 2 << 20):
        assert mode in MODES, mode
        self.mode, self.gap, self.chunk, self.big = mode, gap, chunk, big
        self.slots: list | None = None  # set: a cluster node answering CLUSTER SLOTS with these ranges
        self.commands: list[str] = []
        self._stop = threading.Event()
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self._sock.settimeout(0.05)
        self.port = self._sock.getsockname()[1]
        self._accept = threading.Thread(target=self._serve, name=f"fake-redis-{mode}", daemon=True)
        self._accept.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                continue
            with self._lock:
                self._conns.append(conn)
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _send(self, conn: socket.socket, data: bytes, step: int) -> None:
        for i in range(0, len(data), step):
            if self._stop.wait(self.gap):
                return
            conn.sendall(data[i:i + step])

    def _handle(self, conn: socket.socket) -> None:
        buf = bytearray()
        conn.settimeout(0.05)
        try:
            while not self._stop.is_set():
                try:
                    data = conn.recv(1 << 20)
                except socket.timeout:
                    continue
                if not data:
                    return
                buf += data
                while (cmd := _parse(buf)) is not None:
                    name = cmd[0].upper() if cmd else b""
                    with self._lock:
                        self.commands.append(name.decode(errors="replace"))
                    if self.mode == "silent":
                        continue
                    if name == b"HELLO" and self.mode in _BAD_HELLO:
                        conn.sendall(_BAD_HELLO[self.mode])
                    elif name in _HANDSHAKE or self.mode in _BAD_HELLO:
                        conn.sendall(_reply(name, cmd, self.slots))
                    elif self.mode == "bad_reply":
                        conn.sendall(b":notanumber\r\n")
                    elif self.mode == "trickle":
                        self._send(conn, _reply(name, cmd), 1)
                    else:  # slow_big
                        self._send(conn, b"$%d\r\n" % self.big + bytes(self.big) + b"\r\n", self.chunk)
        except OSError:
            return
        finally:
            conn.close()

    def data_commands(self) -> list[str]:
        """The commands received past the handshake."""
        with self._lock:
            return [c for c in self.commands if c.encode() not in _HANDSHAKE]

    def close(self) -> None:
        self._stop.set()
        self._sock.close()
        with self._lock:
            conns, self._conns = self._conns, []
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._accept.join(timeout=1)

    def __enter__(self) -> "FakeRedis":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
