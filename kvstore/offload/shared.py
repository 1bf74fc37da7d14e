"""One store per process and model, shared by an engine's scheduler side and worker side.

vLLM runs the scheduler and (for tensor-parallel size 1) the worker in the same process, in
both its in-process and multiprocess modes; both connector halves ask for the store here and
get the same object, so the scheduler's pins protect exactly the bytes the worker copies.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from kvstore.config import StoreConfig
from kvstore.keys import ModelFingerprint
from kvstore.offload.metrics import OffloadMetrics
from kvstore.store import KVStore, LoadHandle

log = logging.getLogger(__name__)

# A load is planned in the scheduler step that pinned it; a pin this old was orphaned (e.g. the
# scheduler's end_load call was lost with its socket) and is released.
HANDLE_MAX_AGE_S = 300.0
ATEXIT_WAIT_S = 2.0  # what a close at interpreter exit waits for calls and handles still open


def new_id() -> int:
    """A load handle id or prefetch token: 127 random bits, never 0 (0 is "no handle"), not
    guessable from another's (ids used to be 1, 2, 3 ...). 0.75 us (getrandom; secrets.randbits: 0.91)."""
    return int.from_bytes(os.urandom(16), "little") | 1


@dataclass
class SharedStore:
    store: KVStore
    metrics: OffloadMetrics
    handles: dict[int, LoadHandle] = field(default_factory=dict)  # pinned loads, by id
    owners: dict[int, object] = field(default_factory=dict)  # id -> the client (one per connection) that pinned it
    lock: threading.Lock = field(default_factory=threading.Lock)
    refs: int = 0
    # per-request outcome of the last lookups: (req_id, prompt tokens, engine-local hit tokens,
    # tokens loaded from kvstore, tiers of the loaded blocks); bounded
    request_log: deque = field(default_factory=lambda: deque(maxlen=4096))
    jobs: Any = None  # the worker's CopyJobs (kvstore.offload.jobs), when it copies asynchronously

    def put_handle(self, h: LoadHandle, owner: object = None) -> int:
        hid = new_id()
        with self.lock:
            self.handles[hid] = h
            if owner is not None:
                self.owners[hid] = owner
            stale = [i for i, x in self.handles.items() if time.perf_counter() - x.started > HANDLE_MAX_AGE_S]
            old = [self._pop(i) for i in stale]
        for x in old:  # pinned for a load the scheduler never planned nor dropped (its call failed)
            self.store.end_load(x)
        return hid

    def _pop(self, hid: int) -> LoadHandle | None:
        self.owners.pop(hid, None)
        return self.handles.pop(hid, None)

    def take_handle(self, hid: int, owner: object = None) -> LoadHandle | None:
        """The pinned load ``hid``, removed: for the worker (``owner`` None, the id came in a step
        plan), or for the client that pinned it. Any other client gets None, as for an unknown id."""
        with self.lock:
            if owner is not None and self.owners.get(hid) is not owner:
                return None
            return self._pop(hid)

    def release(self, owner: object) -> int:
        """End the loads ``owner`` pinned that nobody took (its connection closed: a scheduler
        that died leaves no block pinned). Returns how many."""
        with self.lock:
            old = [self._pop(i) for i, o in list(self.owners.items()) if o is owner]
        for h in old:
            if h is not None:
                try:
                    self.store.end_load(h)
                except Exception as e:  # the store closed meanwhile (release_shared ended it)
                    log.debug("kvstore: releasing a pinned load: %s", e)
        return len(old)


_lock = threading.Lock()
_shared: dict[tuple, SharedStore] = {}


def open_store(name: str, config: StoreConfig, fingerprint: ModelFingerprint, block_bytes: int, block_tokens: int,
               events: bool = False):
    """The engine's store: its own (``mode: embedded``), or the host's node daemon (``mode: node``)."""
    if config.mode == "node":
        from kvstore.node.client import NodeStore

        return NodeStore(config, block_bytes=block_bytes, fingerprint=fingerprint, block_tokens=block_tokens,
                         name=name, events=events)
    return KVStore(config, block_bytes=block_bytes, fingerprint=fingerprint, block_tokens=block_tokens,
                   events=events)


def acquire_shared(name: str, config: StoreConfig, fingerprint: ModelFingerprint, block_bytes: int,
                   block_tokens: int, events: bool = False) -> SharedStore:
    """The store named ``name`` (e.g. an engine id and rank) in this process, created on first use."""
    with _lock:
        k = (name, fingerprint.digest(), block_bytes, config.to_yaml(), events)
        s = _shared.get(k)
        if s is None:
            store = open_store(name, config, fingerprint, block_bytes, block_tokens, events)
            s = _shared[k] = SharedStore(store, OffloadMetrics(store.metrics.registry))
        s.refs += 1
        return s


def find(name: str) -> SharedStore | None:
    """The open store named ``name`` in this process, if any."""
    with _lock:
        for k, v in _shared.items():
            if k[0] == name:
                return v
    return None


def live() -> list[SharedStore]:
    """The stores open in this process (for tests and ``stats``)."""
    with _lock:
        return list(_shared.values())


def release_shared(s: SharedStore) -> bool:
    """Drop one reference; the last one closes the store (persisting DRAM to NVMe). True if closed."""
    with _lock:
        s.refs -= 1
        if s.refs > 0:
            return False
        for k, v in list(_shared.items()):
            if v is s:
                del _shared[k]
    _close(s)
    return True


def _close(s: SharedStore, wait_s: float | None = None) -> None:
    """End the loads still pinned (nobody will take them now), then close the store."""
    with s.lock:  # popped under the lock: a closing connection's release() ends none of them twice
        old = list(s.handles.values())
        s.handles.clear()
        s.owners.clear()
    for h in old:
        s.store.end_load(h)
    if wait_s is not None and isinstance(s.store, KVStore):  # a node client waits on nothing of its own
        s.store.close(wait_s=wait_s)
    else:
        s.store.close()


@atexit.register
def _close_all() -> None:
    with _lock:
        items = list(_shared.values())
        _shared.clear()
    for s in items:
        try:
            # a pinned load left in the table would hold the close for its whole wait (30 s) and
            # leave the slab mapped; a save still in flight at exit (a daemon thread's) gets 2 s
            _close(s, wait_s=ATEXIT_WAIT_S)
        except Exception as e:
            log.debug("kvstore: closing at exit: %s", e)
