"""The node daemon's wire: length-prefixed msgpack frames over a Unix socket (the framing and
the served socket's timeouts of :mod:`kvstore.offload.frames`), and a memfd handed beside a frame
(``SCM_RIGHTS``).

msgpack, not the scheduler RPC's JSON: keys travel as 16-byte binaries, not hex. An 8k-token
prompt's lookup (512 keys of 16-token blocks) encodes and decodes in 12.6 us here, against 143 us
as JSON with hex keys; its whole round trip to a daemon takes 0.42 ms against 0.19 ms for the same
lookup in process (min of 100, 2-core VM: bench/micro/test_node_wire.py). Nothing received is unpickled: msgpack
decodes to lists, dicts, ints, floats, strings and bytes only.

A request is ``[op, args...]``; a reply ``[True, result]`` or ``[False, message]``.
"""

from __future__ import annotations

import os
import socket
from typing import Any

import msgspec

from kvstore.offload.frames import recv_frame, recv_served, send_frame

MAX_FRAME = 16 << 20  # a lookup of 64k blocks is 1.2 MiB; anything past this is refused unread
_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder()
_FD_TAG = b"F"


def send(sock: socket.socket, obj: Any) -> None:
    send_frame(sock, _enc.encode(obj))


def recv(sock: socket.socket, deadline: float | None = None) -> Any:
    """One frame, whole by ``deadline``; ValueError for one that is not msgpack."""
    return decode(recv_frame(sock, deadline, MAX_FRAME))


def recv_request(sock: socket.socket, idle_s: float, frame_s: float) -> Any:
    """A served connection's next frame (see :func:`kvstore.offload.rpc.recv_served`)."""
    return decode(recv_served(sock, idle_s, frame_s, MAX_FRAME))


def decode(data: bytes) -> Any:
    try:
        return _dec.decode(data)
    except msgspec.DecodeError as e:
        raise ValueError(f"kvstore node: a frame that is not msgpack: {e}") from None


def send_fd(sock: socket.socket, fd: int) -> None:
    socket.send_fds(sock, [_FD_TAG], [fd])


def recv_fd(sock: socket.socket) -> int:
    """The file descriptor sent beside one byte; ConnectionError if none came (any extra
    descriptors are closed, never leaked)."""
    data, fds, _flags, _addr = socket.recv_fds(sock, 1, 4)
    if data != _FD_TAG or len(fds) != 1:
        for fd in fds:
            os.close(fd)
        raise ConnectionError("kvstore node: expected one file descriptor from the daemon")
    return fds[0]
