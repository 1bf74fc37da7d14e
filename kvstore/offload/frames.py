"""Length-prefixed frames over a Unix socket, with deadlines: the framing of the scheduler's
RPC (:mod:`kvstore.offload.rpc`, JSON) and of the node daemon (:mod:`kvstore.node.wire`, msgpack).
A frame is a 4-byte little-endian length, then the body; a length past the caller's maximum is
refused before a byte of the body is read, and the body is read 1 MiB at a time."""

from __future__ import annotations

import socket
import struct
import time

_LEN = struct.Struct("<I")
MAX_MSG = 64 << 20
_CHUNK = 1 << 20


def send_frame(sock: socket.socket, data: bytes) -> None:
    sock.sendall(_LEN.pack(len(data)) + data)


def recv_exact(sock: socket.socket, n: int, deadline: float | None = None, exact: bool = True) -> bytes:
    """``n`` bytes, the last by ``deadline``: each read's timeout is what is left (``exact``: to
    1 ms; the socket's timeout is lowered only once a read took longer, settimeout costing 0.4 us
    a call), or the socket's own (the last read may end one read timeout past the deadline)."""
    buf = bytearray()
    while len(buf) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"kvstore rpc: {len(buf)} of {n} bytes in time")
            if exact and left < sock.gettimeout() - 0.001:
                sock.settimeout(left)
        chunk = sock.recv(min(n - len(buf), _CHUNK))  # never a buffer for bytes not yet come
        if not chunk:
            raise ConnectionError("kvstore rpc: connection closed")
        buf += chunk
    return bytes(buf)


def recv_frame(sock: socket.socket, deadline: float | None = None, max_bytes: int = MAX_MSG) -> bytes:
    """One length-prefixed frame's body, whole by ``deadline`` (None: the socket's timeout per read)."""
    (n,) = _LEN.unpack(recv_exact(sock, _LEN.size, deadline))
    if n > max_bytes:
        raise ConnectionError(f"kvstore rpc: message of {n} bytes refused")
    return recv_exact(sock, n, deadline)


def serve_timeouts(sock: socket.socket, s: float) -> None:
    """Kernel read and write timeouts (SO_RCVTIMEO/SO_SNDTIMEO) on a blocking socket: a read that
    waits ``s`` raises BlockingIOError, and a read costs what it did without a timeout (Python's
    own timeouts add a poll per read, 0.9 us, and a settimeout to change one, 0.4 us)."""
    tv = struct.pack("ll", int(s), int((s - int(s)) * 1e6))
    sock.settimeout(None)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


def recv_served(sock: socket.socket, idle_s: float, frame_s: float, max_bytes: int = MAX_MSG) -> bytes:
    """A served connection's next frame body (its socket set by serve_timeouts(frame_s)): the
    first byte may take ``idle_s``, the frame must then be whole within ``frame_s`` (a read
    begun before that may take ``frame_s`` more: a stalled frame is dropped by 2 x frame_s)."""
    t0 = time.monotonic()
    while True:
        try:
            head = sock.recv(_LEN.size)
            break
        except BlockingIOError:  # frame_s without a byte: idle
            if time.monotonic() - t0 >= idle_s:
                raise TimeoutError("kvstore rpc: idle") from None
    if not head:
        raise ConnectionError("kvstore rpc: connection closed")
    deadline = time.monotonic() + frame_s
    (n,) = _LEN.unpack(head + recv_exact(sock, _LEN.size - len(head), deadline, exact=False))
    if n > max_bytes:
        raise ConnectionError(f"kvstore rpc: message of {n} bytes refused")
    return recv_exact(sock, n, deadline, exact=False)


