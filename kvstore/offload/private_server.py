"""A threaded Unix-socket server for this uid alone: the scheduler's RPC (:mod:`kvstore.offload.rpc`)
and the node daemon (:mod:`kvstore.node.daemon`) serve through it.

Each accepted connection is checked in the accepting thread, before a thread is made for it: a
peer of another uid (``SO_PEERCRED``) is closed unserved, and so is one past ``max_connections``
(300 stalled clients held 305 threads before this cap). Refusals are counted by reason and
logged once each, so a flood does not flood the log. ``context`` is what the handlers serve
(``self.server.context``)."""

from __future__ import annotations

import logging
import os
import socket
import socketserver
import threading

from kvstore.offload.sockdir import peer_uid, who

log = logging.getLogger(__name__)


class PrivateServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True

    def __init__(self, path: str, handler, context, max_connections: int, refused: dict, label: str):
        self.context, self.max_connections, self.refused, self.label = context, max_connections, refused, label
        self.refused.setdefault("uid", 0)
        self.refused.setdefault("full", 0)
        self.live: set[socket.socket] = set()
        self._live_lock = threading.Lock()
        super().__init__(path, handler)

    def verify_request(self, request, client_address) -> bool:  # in the accepting thread: no thread yet
        try:
            uid = peer_uid(request)
        except OSError:  # gone already (an error here would end serve_forever)
            return False
        if uid != os.getuid():
            return self._refuse("uid", f"a client of {who(uid)}; only {who(os.getuid())} is served")
        with self._live_lock:
            if len(self.live) < self.max_connections:
                self.live.add(request)
                return True
        return self._refuse("full", f"{self.max_connections} connections are open already")

    def _refuse(self, reason: str, what: str) -> bool:
        self.refused[reason] += 1
        if self.refused[reason] == 1:  # once: a flood of them must not flood the log
            log.warning("%s: refused %s (further refusals are counted, not logged)", self.label, what)
        return False

    def shutdown_request(self, request) -> None:  # every end of a connection, served or not
        with self._live_lock:
            self.live.discard(request)
        super().shutdown_request(request)

    def drop_all(self) -> None:
        """End every connection (its handler sees the end and releases what it held)."""
        with self._live_lock:
            live = list(self.live)
        for r in live:
            try:
                r.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def stop(self, dir_fd: int, name: str) -> None:
        """Stop accepting, end every connection, and remove the socket ``name`` from its folder
        (opened as ``dir_fd``, which the caller closes)."""
        self.shutdown()
        self.server_close()
        self.drop_all()
        try:
            os.unlink(name, dir_fd=dir_fd)
        except OSError:
            pass
