"""The calls in flight on a store and the handles it has open, so that its close waits for them.

A close that freed a tier under a call did harm (issue 47): an NVMe batch whose folder fd was
just closed fails with EBADF, and a reused fd number can put a block file in another folder; a
slab unmapped or ``cudaHostUnregister``-ed while an engine still copies into a view of it. So:

* ``call()`` wraps every call of the store. Once the close has begun, a new call raises
  ``RuntimeError("KVStore is closed")``; a call made inside another call of the same thread (a
  ``put`` ending its own store) and a call on a handle already open (``read_load``,
  ``end_store``, ``end_load``: what the close waits for) still run.
* ``opened()`` / ``ending()`` count the store and load handles not yet ended; an end that comes
  after the close stopped waiting touches nothing (a store's blocks are not published).
* ``close(wait_s)`` refuses new calls, then waits up to ``wait_s`` for the calls in flight to
  end and the handles to be ended, and says which did. After it every call is refused.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

OPEN, CLOSING, CLOSED = 0, 1, 2


class Gate:
    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._state = OPEN
        self._depth = threading.local()  # this thread's calls in flight (nested calls pass)
        self.calls = 0
        self.handles = 0

    @property
    def closed(self) -> bool:
        return self._state != OPEN

    @contextmanager
    def call(self, on_handle: bool = False):
        """One call of the store (``on_handle``: on a handle already open)."""
        depth = getattr(self._depth, "n", 0)
        with self._cv:
            if self._state == CLOSED or (self._state == CLOSING and not on_handle and depth == 0):
                raise RuntimeError("KVStore is closed")
            self.calls += 1
        self._depth.n = depth + 1
        try:
            yield
        finally:
            self._depth.n = depth
            with self._cv:
                self.calls -= 1
                if self._state != OPEN:  # only a close waits on the counts (drain, after begin_close)
                    self._cv.notify_all()

    def opened(self) -> None:
        with self._cv:
            self.handles += 1

    def ending(self) -> "_Ending":
        """The end of a handle: ``with gate.ending() as live`` (False once the close is past
        waiting: the end then touches nothing); counts the handle ended. A class, not a
        generator: every load and store ends through it (kvstore tune replays 2-4 a request)."""
        return _Ending(self)

    def begin_close(self) -> bool:
        """Refuse new calls; False if the close had begun already (one closer closes)."""
        with self._cv:
            if self._state != OPEN:
                return False
            self._state = CLOSING
            return True

    def drain(self, wait_s: float) -> tuple[int, int]:
        """Wait up to ``wait_s`` for the calls in flight (other than the caller's own) and the open
        handles; then refuse every call. (calls, handles) still there (0, 0: drained)."""
        mine = getattr(self._depth, "n", 0)
        end = time.monotonic() + wait_s
        with self._cv:
            self._cv.wait_for(lambda: self.calls <= mine and self.handles <= 0, max(0.0, end - time.monotonic()))
            self._state = CLOSED
            return self.calls - mine, max(0, self.handles)


class _Ending:
    __slots__ = ("gate", "live")

    def __init__(self, gate: Gate) -> None:
        self.gate = gate
        self.live = False

    def __enter__(self) -> bool:
        g = self.gate
        with g._cv:
            self.live = live = g._state != CLOSED
            if live:
                g.calls += 1
        return live

    def __exit__(self, *exc) -> None:
        g = self.gate
        with g._cv:
            g.calls -= self.live
            g.handles -= 1
            if g._state != OPEN:
                g._cv.notify_all()
