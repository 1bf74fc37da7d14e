"""What the scheduler side may ask of the store, whether it is in this process or not.

The worker side owns the store (the bytes and the index). The scheduler side needs lookups,
prefetches, pins for planned loads, and to report what it decided. ``LocalClient`` calls the
store directly (vLLM in-process mode); :class:`kvstore.offload.rpc.RemoteClient` sends the
same calls to the worker's process (vLLM's multiprocess executor).
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, wait
from typing import Protocol, Sequence

from kvstore.offload.metrics import RequestOutcome
from kvstore.offload.shared import SharedStore
from kvstore.store import PrefixMatch


class StoreClient(Protocol):
    def contains_prefix(self, keys: Sequence[bytes], record: bool = False, num_tokens: int | None = None,
                        held: int = 0) -> PrefixMatch: ...

    def prefetch(self, keys: Sequence[bytes]) -> int: ...

    def prefetch_done(self, token: int) -> bool: ...

    def begin_load(self, keys: Sequence[bytes], session: str | None = None,
                   ttl_s: float | None = None) -> tuple[int, int, tuple[str, ...]]: ...

    def end_load(self, handle_id: int) -> None: ...

    def record_request(self, outcome: RequestOutcome) -> None: ...

    def saves_done(self, req_id: str, timeout: float = 0.0) -> bool: ...

    def close(self) -> None: ...


# How long one "is the prefetch done?" may wait for it. An engine with nothing else to run asks
# again at once, in a loop; without a short blocking wait that loop spins on the GIL and starves
# the I/O threads doing the prefetch (measured on 2 cores: a 31-block NVMe prefetch took 290 ms
# instead of 6 ms). A busy engine pays at most this per step while a prefetch is pending.
PREFETCH_WAIT_S = 0.002


class LocalClient:
    """Direct calls into a store of this process."""

    def __init__(self, shared: SharedStore):
        self.shared = shared
        self.store = shared.store
        self._prefetches: dict[int, Future] = {}
        self._next = 0
        self._lock = threading.Lock()

    def contains_prefix(self, keys, record=False, num_tokens=None, held=0) -> PrefixMatch:
        return self.store.contains_prefix(keys, record=record, num_tokens=num_tokens, held=held)

    def prefetch(self, keys) -> int:
        f = self.store.prefetch(keys)
        with self._lock:
            self._next += 1
            self._prefetches[self._next] = f
            return self._next

    def prefetch_done(self, token: int) -> bool:
        with self._lock:
            f = self._prefetches.get(token)
        if f is not None and not f.done():
            wait([f], timeout=PREFETCH_WAIT_S)  # blocks without the GIL: the I/O threads run
        with self._lock:
            f = self._prefetches.get(token)
            if f is None or f.done():
                self._prefetches.pop(token, None)
                return True
            return False

    def begin_load(self, keys, session=None, ttl_s=None) -> tuple[int, int, tuple[str, ...]]:
        h = self.store.pin_load(keys, session=session, ttl_s=ttl_s)  # no I/O here: the worker reads (Mover.load)
        return self.shared.put_handle(h), h.num_blocks, tuple(h.tier_of)

    def end_load(self, handle_id: int) -> None:
        h = self.shared.take_handle(handle_id)
        if h is not None:
            self.store.end_load(h)

    def record_request(self, outcome: RequestOutcome) -> None:
        self.shared.metrics.record(outcome)
        self.shared.request_log.append((outcome.req_id, outcome.prompt, outcome.local, outcome.got,
                                        tuple(outcome.tiers)))

    def saves_done(self, req_id: str, timeout: float = 0.0) -> bool:
        jobs = self.shared.jobs
        return True if jobs is None else jobs.saves_done(req_id, timeout)

    def close(self) -> None:
        pass
