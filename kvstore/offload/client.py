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
from kvstore.offload.shared import SharedStore, new_id
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

# Prefetch tokens a client keeps for its "is it done?" calls. A request aborted before it asks
# again leaves its token behind (the table grew without bound); past this many the oldest is
# dropped: if it is asked about after all, it answers done, and that request's lookup sees what
# the prefetch had promoted by then (a lookup is always right, only perhaps slower).
MAX_PREFETCHES = 4096


class LocalClient:
    """Direct calls into a store of this process: the scheduler's own (vLLM in-process), or one
    per connection of a :class:`kvstore.offload.rpc.StoreServer`.

    Load handle ids and prefetch tokens are random (:func:`~kvstore.offload.shared.new_id`) and
    belong to the client that made them: another client naming one gets "unknown handle" (or,
    for a prefetch, "done"). ``close`` ends the loads it pinned that the worker did not take.
    The cost in process (timeit min, 4 DRAM blocks, 2 busy cores): the handle bookkeeping of a
    begin_load+end_load pair 1.6 -> 2.75 us (the random id 0.75, the owner 0.15), the pair
    29.5 -> 32 us; a prefetch+prefetch_done pair ~105 us, as before (within the noise).
    """

    def __init__(self, shared: SharedStore):
        self.shared = shared
        self.store = shared.store
        self._prefetches: dict[int, Future] = {}
        self._lock = threading.Lock()
        self.dropped_prefetches = 0  # tokens dropped from a full table (MAX_PREFETCHES)

    def contains_prefix(self, keys, record=False, num_tokens=None, held=0) -> PrefixMatch:
        return self.store.contains_prefix(keys, record=record, num_tokens=num_tokens, held=held)

    def prefetch(self, keys) -> int:
        f = self.store.prefetch(keys)
        token = new_id()
        with self._lock:
            if len(self._prefetches) >= MAX_PREFETCHES:  # the oldest goes (dicts keep insertion order)
                del self._prefetches[next(iter(self._prefetches))]
                self.dropped_prefetches += 1
            self._prefetches[token] = f
        return token

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
        h = self.store.pin_load(keys, session=session, ttl_s=ttl_s)  # no I/O here: the worker reads (StepRunner.load)
        return self.shared.put_handle(h, self), h.num_blocks, tuple(h.tier_of)

    def end_load(self, handle_id: int) -> None:
        h = self.shared.take_handle(handle_id, self)
        if h is None:  # never ours, or released (aged out, our connection closed)
            raise LookupError(f"unknown handle {handle_id}")
        self.store.end_load(h)

    def record_request(self, outcome: RequestOutcome) -> None:
        self.shared.metrics.record(outcome)
        self.shared.request_log.append((outcome.req_id, outcome.prompt, outcome.local, outcome.got,
                                        tuple(outcome.tiers)))

    def saves_done(self, req_id: str, timeout: float = 0.0) -> bool:
        jobs = self.shared.jobs
        return True if jobs is None else jobs.saves_done(req_id, timeout)

    def close(self) -> None:
        with self._lock:
            self._prefetches.clear()
        self.shared.release(self)
