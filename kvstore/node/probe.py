"""Is a node daemon serving? (``kvstore serve --ping``, a readiness check.)"""

from __future__ import annotations

import os
import socket
import time

from kvstore.config import StoreConfig
from kvstore.node import wire
from kvstore.node.daemon import socket_name
from kvstore.offload.sockdir import open_folder, path_in, peer_uid


def ping(config: StoreConfig, timeout_s: float = 2.0) -> int | None:
    """The pid of the daemon serving ``node.name`` for this user, or None if none answers."""
    fd, folder = open_folder()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout_s)
            s.connect(path_in(fd, folder, socket_name(config.node.name)))
            if peer_uid(s) != os.getuid():
                return None
            wire.send(s, ["ping"])
            ok, res = wire.recv(s, time.monotonic() + timeout_s)
            return int(res["pid"]) if ok else None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    finally:
        os.close(fd)
