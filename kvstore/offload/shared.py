"""One store per process and model, shared by an engine's scheduler side and worker side.

vLLM runs the scheduler and (for tensor-parallel size 1) the worker in the same process, in
both its in-process and multiprocess modes; both connector halves ask for the store here and
get the same object, so the scheduler's pins protect exactly the bytes the worker copies.
"""

from __future__ import annotations

import atexit
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from kvstore.config import StoreConfig
from kvstore.keys import ModelFingerprint
from kvstore.offload.metrics import OffloadMetrics
from kvstore.store import KVStore, LoadHandle


# A load is planned in the scheduler step that pinned it; a pin this old was orphaned (e.g. the
# scheduler's end_load call was lost with its socket) and is released.
HANDLE_MAX_AGE_S = 300.0


@dataclass
class SharedStore:
    store: KVStore
    metrics: OffloadMetrics
    handles: dict[int, LoadHandle] = field(default_factory=dict)  # pinned loads, by id
    lock: threading.Lock = field(default_factory=threading.Lock)
    refs: int = 0
    _next: int = 0
    # per-request outcome of the last lookups: (req_id, prompt tokens, engine-local hit tokens,
    # tokens loaded from kvstore, tiers of the loaded blocks); bounded
    request_log: deque = field(default_factory=lambda: deque(maxlen=4096))
    jobs: Any = None  # the worker's CopyJobs (kvstore.offload.jobs), when it copies asynchronously

    def put_handle(self, h: LoadHandle) -> int:
        with self.lock:
            self._next += 1
            self.handles[self._next] = h
            stale = [i for i, x in self.handles.items() if time.perf_counter() - x.started > HANDLE_MAX_AGE_S]
            old = [self.handles.pop(i) for i in stale]
        for x in old:  # pinned for a load the scheduler never planned nor dropped (its call failed)
            self.store.end_load(x)
        return self._next

    def take_handle(self, hid: int) -> LoadHandle | None:
        with self.lock:
            return self.handles.pop(hid, None)


_lock = threading.Lock()
_shared: dict[tuple, SharedStore] = {}


def acquire_shared(name: str, config: StoreConfig, fingerprint: ModelFingerprint, block_bytes: int,
                   block_tokens: int) -> SharedStore:
    """The store named ``name`` (e.g. an engine id and rank) in this process, created on first use."""
    with _lock:
        k = (name, fingerprint.digest(), block_bytes, config.to_yaml())
        s = _shared.get(k)
        if s is None:
            store = KVStore(config, block_bytes=block_bytes, fingerprint=fingerprint, block_tokens=block_tokens)
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
    for h in list(s.handles.values()):
        s.store.end_load(h)
    s.handles.clear()
    s.store.close()
    return True


@atexit.register
def _close_all() -> None:
    with _lock:
        items = list(_shared.values())
        _shared.clear()
    for s in items:
        try:
            s.store.close()
        except Exception:
            pass
