"""One engine attached to a node daemon: what it holds in the daemon's store, and its bounds.

An engine attaches once (its first connection) and may join more connections to the same
attachment (a scheduler thread, a copy thread and a load thread each keep one, so a slow NVMe
read never holds up a lookup). The handles it made live here, not in a connection: the
scheduler's connection pins a load that the load thread's connection reads and ends. When the
last of its connections closes (the engine exited, was killed with -9, or its daemon link
broke), :meth:`release` ends every load it pinned and aborts every store it reserved: a slot
half written by a dead engine is never published, and none leaks.

Bounds, so one engine cannot starve the others: at most ``max_blocks`` blocks pinned or
reserved at once (``node.engine_share`` of the DRAM slots), and at most ``MAX_HANDLES`` handles
(a scheduler that never ends its loads is cut off, not the daemon's memory).
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import Future

from kvstore.store import KVStore, LoadHandle, StoreHandle

log = logging.getLogger(__name__)

MAX_HANDLES = 8192  # pins and reservations held at once by one engine (a step makes a few)


def new_id() -> int:
    """A handle id: 63 random bits (msgpack's int64), never 0."""
    return int.from_bytes(os.urandom(8), "little") >> 1 | 1


class Attachment:
    def __init__(self, store: KVStore, name: str, max_blocks: int):
        self.store = store
        self.name = name  # the engine's own name (vLLM's engine id and rank), for logs and stats
        self.token = os.urandom(16)  # what its other connections present to join it
        self.max_blocks = max(1, int(max_blocks))
        self.loads: dict[int, LoadHandle] = {}
        self.stores: dict[int, StoreHandle] = {}
        self.prefetches: dict[int, Future] = {}
        self.bounce: dict[int, list[int]] = {}  # a load's bounce slots (see read), freed at its end
        self.held = 0  # blocks pinned by its loads and reserved by its stores
        self.refused = 0  # blocks it asked for past max_blocks (counted, not pinned)
        self.connections = 0
        self.lock = threading.Lock()
        self.released = False

    # -- bounds --------------------------------------------------------------------------------
    def room(self, n: int) -> int:
        """How many of ``n`` more blocks it may hold now (the rest are refused, counted)."""
        with self.lock:
            if len(self.loads) + len(self.stores) >= MAX_HANDLES:
                return 0
            return max(0, min(n, self.max_blocks - self.held))

    def _hold(self, n: int) -> None:
        with self.lock:
            self.held += n

    # -- loads ---------------------------------------------------------------------------------
    def pin(self, keys: list[bytes], session: str | None, ttl: float | None) -> tuple[int, LoadHandle]:
        cap = self.room(len(keys))
        if cap < len(keys):
            with self.lock:
                self.refused += len(keys) - cap
        h = self.store.pin_load(keys[:cap], session=session, ttl_s=ttl)
        self._hold(len(h.keys))
        hid = new_id()
        with self.lock:
            self.loads[hid] = h
        return hid, h

    def read(self, hid: int) -> tuple[int, list[int]]:
        """Read a pinned load's lower-tier blocks into slab slots: (the leading blocks now in
        slots, their slots). A block the store promotes into DRAM lands in its new slot; one it
        cannot (DRAM full, its victims still being written down) lands in a slot taken from the
        pool for this load alone (a bounce slot, freed at its end), never in memory the engine
        cannot see. Past the first block with neither, the load ends."""
        with self.lock:
            h = self.loads.get(hid)
        if h is None:
            raise LookupError(f"unknown load handle {hid}")
        pool = self.store.dram.pool
        outs: list = []  # outs[i]: where unread block i goes unless promoted (None: in DRAM, never read)
        bounce = self.bounce.setdefault(hid, [])
        for i in range(h.num_blocks):
            if i in h.unread:
                slot = pool.alloc()
                if slot is None:
                    break  # this block and the rest: into the store's private buffers, cut below
                bounce.append(slot)
                outs.append(pool.view(slot))
            else:
                outs.append(None)
        n = self.store.read_load(h, outs=outs)
        by_view = {pool.view(s).ctypes.data: s for s in bounce}
        slots = []
        for i in range(n):
            e, v = h.entries[i], h.views[i]
            slots.append(int(e.slot) if e is not None else by_view.get(v.ctypes.data, -1) if v is not None else -1)
        n = next((i for i, s in enumerate(slots) if s < 0), n)
        used = set(slots[:n])
        keep = [s for s in bounce if s in used]
        for s in bounce:
            if s not in used:  # promoted after all, or past the end: back at once
                pool.free(s)
        self.bounce[hid] = keep
        return n, slots[:n]

    def end_load(self, hid: int) -> None:
        with self.lock:
            h = self.loads.pop(hid, None)
        if h is None:
            raise LookupError(f"unknown load handle {hid}")
        self._end_load(hid, h)

    def _end_load(self, hid: int, h: LoadHandle) -> None:
        try:
            self.store.end_load(h)
        finally:
            for s in self.bounce.pop(hid, ()):
                self.store.dram.pool.free(s)
            self._hold(-len(h.keys))

    # -- stores --------------------------------------------------------------------------------
    def begin_store(self, keys: list[bytes], ttl: float | None) -> tuple[int, StoreHandle]:
        cap = self.room(len(keys))
        if cap < len(keys):
            with self.lock:
                self.refused += len(keys) - cap
        h = self.store.begin_store(keys[:cap], ttl_s=ttl)
        self._hold(len(h.keys))
        sid = new_id()
        with self.lock:
            self.stores[sid] = h
        return sid, h

    def end_store(self, sid: int, oks: list[bool]) -> int:
        with self.lock:
            h = self.stores.pop(sid, None)
        if h is None:
            raise LookupError(f"unknown store handle {sid}")
        try:
            return self.store.end_store(h, [bool(o) for o in oks[: len(h.keys)]] + [False] * (len(h.keys) - len(oks)))
        finally:
            self._hold(-len(h.keys))

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
            loads, self.loads = list(self.loads.items()), {}
            stores, self.stores = list(self.stores.values()), {}
            self.prefetches.clear()
        for hid, h in loads:
            try:
                self._end_load(hid, h)
            except Exception as e:  # noqa: BLE001 - the store closed meanwhile
                log.debug("kvstore node: releasing a load of %s: %s", self.name, e)
        for h in stores:
            try:
                self.store.end_store(h, False)
            except Exception as e:  # noqa: BLE001
                log.debug("kvstore node: aborting a store of %s: %s", self.name, e)
            finally:
                self._hold(-len(h.keys))
        return len(loads), len(stores)
