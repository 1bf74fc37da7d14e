"""One engine attached to a node daemon: what it holds in the daemon's store, and its bounds.

An engine attaches once (its anchor connection) and joins more connections to the same
attachment (a scheduler thread, a copy thread and a load thread each keep one, so a slow NVMe
read never holds up a lookup). The handles it made live here, not in a connection: the
scheduler's connection pins a load that the load thread's connection reads and ends. When the
last of its connections closes (the engine exited, was killed with -9, or lost the daemon),
:meth:`release` ends every load it pinned and aborts every store it reserved: a slot half
written by a dead engine is never published, and none leaks.

Handle ids are the engine's (:func:`new_id`, 63 random bits): a pin whose answer never reached
the engine can still be ended by it. Bounds, so one engine cannot starve the others: at most
``max_blocks`` blocks pinned, reserved or read into bounce slots at once (``node.engine_share``
of the DRAM slots), and at most ``MAX_HANDLES`` handles.
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import Future

import numpy as np

from kvstore.node.eventlog import EventLog, Reader
from kvstore.store import KVStore, LoadHandle, StoreHandle

log = logging.getLogger(__name__)

MAX_HANDLES = 8192  # pins and reservations held at once by one engine (a step makes a few)


def new_id() -> int:
    """A handle id: 63 random bits (msgpack's int64), never 0."""
    return int.from_bytes(os.urandom(8), "little") >> 1 | 1


class _Load:
    """A pinned load, its bounce slots, and the lock its read and its end take in turn (two
    connections naming one id never read into, or free, the same slots at once)."""

    def __init__(self, h: LoadHandle):
        self.h, self.bounce, self.lock = h, [], threading.Lock()


class _Store:
    """A reservation: the store's handle of the engine's keys that needed a slot, where each is
    in the engine's list, and how many slots it holds (charged to the engine's share)."""

    def __init__(self, h: StoreHandle, positions: list[int]):
        self.h, self.positions = h, positions
        self.slots = sum(1 for e in h.entries if e is not None)

    def slot_of(self, n: int) -> list:
        """The entry of each of the engine's ``n`` keys (None: not to be written)."""
        out: list = [None] * n
        for p, e in zip(self.positions, self.h.entries):
            out[p] = e
        return out


class _Bounce:
    """``outs`` for :meth:`KVStore.read_load`: a block the store cannot promote into a DRAM slot is
    read into a slot taken from the pool for this load alone (never into memory the engine cannot
    see), asked for only when the store needs one (after its promotion found no room); past the
    engine's share, or with no free slot, a private buffer, where the load ends."""

    def __init__(self, a: "Attachment", load: _Load, n: int):
        self.a, self.load, self.n = a, load, n
        self.pool = a.store.dram.pool

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        if self.a.take(1):
            slot = self.pool.alloc()
            if slot is not None:
                self.load.bounce.append(slot)
                return self.pool.view(slot)
            self.a._give(1)
        return np.empty(self.pool.slot_bytes, np.uint8)  # not handed over: the load is cut before it


class Attachment:
    def __init__(self, store: KVStore, name: str, max_blocks: int, log: EventLog):
        self.store = store
        self.log = log  # the store's KV events
        self.reader = Reader()  # this engine's place in them
        self.report: dict = {}  # its own counters, as it last reported them (kvstore.node.metrics)
        self.name = name  # the engine's own name (vLLM's engine id and rank), for logs and stats
        self.token = os.urandom(16)  # what its other connections present to join it
        self.max_blocks = max(1, int(max_blocks))
        self.loads: dict[int, _Load] = {}
        self.stores: dict[int, _Store] = {}
        self.prefetches: dict[int, Future] = {}
        self.held = 0  # blocks pinned by its loads, reserved by its stores, read into bounce slots
        self.refused = 0  # blocks it asked for past max_blocks (counted, not held)
        self.connections = 0
        self.lock = threading.Lock()
        self.released = False

    # -- bounds --------------------------------------------------------------------------------
    def take(self, n: int) -> int:
        """Hold up to ``n`` more blocks, as many as its share allows; the rest are refused, counted."""
        with self.lock:
            if self.released or len(self.loads) + len(self.stores) >= MAX_HANDLES:
                got = 0
            else:
                got = max(0, min(n, self.max_blocks - self.held))
            self.held += got
            self.refused += n - got
            return got

    def _give(self, n: int) -> None:
        with self.lock:
            self.held -= n

    def _check_id(self, hid) -> None:
        """Under the lock: a fresh handle id, or ValueError."""
        if type(hid) is not int or not 0 < hid < 1 << 63:
            raise ValueError(f"a handle id is an integer in (0, 2**63), got {hid!r}")
        if hid in self.loads or hid in self.stores:
            raise ValueError(f"handle {hid} is in use")

    # -- loads ---------------------------------------------------------------------------------
    def pin(self, hid: int, keys: list[bytes], session: str | None, ttl: float | None) -> LoadHandle:
        with self.lock:
            self._check_id(hid)
        cap = self.take(len(keys))
        try:
            h = self.store.pin_load(keys[:cap], session=session, ttl_s=ttl)
        except BaseException:
            self._give(cap)
            raise
        self._give(cap - len(h.keys))  # the store may pin fewer (a shorter stored prefix)
        with self.lock:  # the engine went meanwhile, or the same id came twice at once: ended now
            refused = self.released or hid in self.loads or hid in self.stores
            if not refused:
                self.loads[hid] = _Load(h)
        if refused:
            self._end_load(_Load(h))
            raise LookupError(f"load {hid}: this engine was released, or the id is in use")
        return h

    def read(self, hid: int) -> tuple[int, list[int]]:
        """Read a pinned load's lower-tier blocks into slab slots: (the leading blocks now in
        slots, their slots). A block the store promotes lands in its new DRAM slot, another in a
        bounce slot (:class:`_Bounce`, freed at the load's end). Past the first block in neither,
        the load ends."""
        with self.lock:
            load = self.loads.get(hid)
        if load is None:
            raise LookupError(f"unknown load handle {hid}")
        if not load.lock.acquire(blocking=False):
            raise ValueError(f"load {hid} is being read or ended on another connection")
        try:
            h, pool = load.h, self.store.dram.pool
            n = self.store.read_load(h, outs=_Bounce(self, load, h.num_blocks))
            by_view = {pool.view(s).ctypes.data: s for s in load.bounce}
            slots = []
            for i in range(n):
                e, v = h.entries[i], h.views[i]
                slots.append(int(e.slot) if e is not None else by_view.get(v.ctypes.data, -1) if v is not None else -1)
            n = next((i for i, s in enumerate(slots) if s < 0), n)
            used = set(slots[:n])
            for s in [s for s in load.bounce if s not in used]:  # past the end: back at once
                load.bounce.remove(s)
                pool.free(s)
                self._give(1)
            return n, slots[:n]
        finally:
            load.lock.release()

    def end_load(self, hid: int) -> None:
        with self.lock:
            load = self.loads.pop(hid, None)
        if load is None:
            raise LookupError(f"unknown load handle {hid}")
        self._end_load(load)

    def _end_load(self, load: _Load) -> None:
        with load.lock:  # a read on another connection ends first
            try:
                self.store.end_load(load.h)
            finally:
                pool = self.store.dram.pool
                for s in load.bounce:
                    pool.free(s)
                self._give(len(load.h.keys) + len(load.bounce))
                load.bounce = []

    # -- stores --------------------------------------------------------------------------------
    def begin_store(self, sid: int, keys: list[bytes], ttl: float | None) -> list:
        """Reserve slots for the keys not stored yet, as many as the engine's share allows, in its
        order; the entry of each of its keys (None: not to be written). Only slots are charged: a
        key stored already (by another engine, say) neither takes the share nor pushes a new one
        out of it."""
        with self.lock:
            self._check_id(sid)
        missing = set(self.store.chain.unheld(keys))
        todo = [i for i, k in enumerate(keys) if k in missing]
        cap = self.take(len(todo))
        try:
            r = _Store(self.store.begin_store([keys[i] for i in todo[:cap]], ttl_s=ttl), todo[:cap])
        except BaseException:
            self._give(cap)
            raise
        self._give(cap - r.slots)  # stored or being written meanwhile, or no free slot
        with self.lock:
            refused = self.released or sid in self.loads or sid in self.stores
            if not refused:
                self.stores[sid] = r
        if refused:
            self._abort(r)
            raise LookupError(f"store {sid}: this engine was released, or the id is in use")
        return r.slot_of(len(keys))

    def end_store(self, sid: int, oks: list[bool]) -> int:
        """Publish the blocks ``oks`` says were written (missing entries: not written)."""
        if not isinstance(oks, list) or not all(type(o) is bool for o in oks):
            raise ValueError("end_store: oks is a list of booleans")
        with self.lock:
            r = self.stores.pop(sid, None)
        if r is None:
            raise LookupError(f"unknown store handle {sid}")
        try:
            return self.store.end_store(r.h, [p < len(oks) and oks[p] for p in r.positions])
        finally:
            self._give(r.slots)

    def _abort(self, r: _Store) -> None:
        try:
            self.store.end_store(r.h, False)
        except Exception as e:  # noqa: BLE001 - the store closed meanwhile
            log.debug("kvstore node: aborting a store of %s: %s", self.name, e)
        finally:
            self._give(r.slots)

    # -- prefetches (first design: the scheduler asks again until the promotion is done) ---------
    def prefetch(self, keys: list[bytes]) -> int:
        token = new_id()
        f = self.store.prefetch(keys)
        with self.lock:
            if len(self.prefetches) >= MAX_HANDLES:
                self.prefetches.pop(next(iter(self.prefetches)))
            self.prefetches[token] = f
        return token

    def prefetch_done(self, token: int, wait_s: float) -> bool:
        with self.lock:
            f = self.prefetches.get(token)
        if f is None:
            return True
        try:
            f.result(timeout=wait_s)
        except Exception:  # noqa: BLE001 - a timeout (not done), or a failed prefetch (done: the lookup says)
            if not f.done():
                return False
        with self.lock:
            self.prefetches.pop(token, None)
        return True

    # -- the end ---------------------------------------------------------------------------------
    def release(self) -> tuple[int, int]:
        """End what the engine left (its last connection closed): (loads ended, stores aborted).
        A store it reserved and did not end is never published: its slots are freed unread."""
        with self.lock:
            self.released = True
            loads, self.loads = list(self.loads.values()), {}
            stores, self.stores = list(self.stores.values()), {}
            self.prefetches.clear()
        for load in loads:
            try:
                self._end_load(load)
            except Exception as e:  # noqa: BLE001 - the store closed meanwhile
                log.debug("kvstore node: releasing a load of %s: %s", self.name, e)
        for r in stores:
            self._abort(r)
        return len(loads), len(stores)
