"""DRAM tier: blocks are slots of one pre-allocated, pre-faulted (and, with CUDA, pinned) pool.

A big pool is prepared in the background (see ``SlabPool``): the tier starts with the capacity
of the slots ready when it is built and grows, chunk by chunk, to ``target_capacity_bytes``;
the index never admits more blocks than there are ready slots.
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np

from kvstore.tiers.fileformat import round_up
from kvstore.tiers.index import Entry
from kvstore.tiers.dram.pool import CHUNK_BYTES, SlabPool
from kvstore.tiers.memory import as_bytes
from kvstore.tiers.local import LocalTier


def headroom_slots(n_slots: int, configured: int | str = "auto", *, has_lower: bool = True) -> int:
    """Slots held back from the index for victims still being written down: with ``H`` of them,
    a step may store ``H`` blocks into a full DRAM while the last step's victims are still on
    their way to NVMe, and none is skipped (``no_slot``). ``auto``: an eighth of the slots.
    Never more than half of them (the index keeps the rest); none without a lower tier (a victim
    frees its slot at once)."""
    if n_slots < 2 or not has_lower:
        return 0
    h = max(1, n_slots // 8) if configured == "auto" else int(configured)
    return min(h, n_slots // 2)


class DramTier(LocalTier):
    name = "dram"
    addressable = True

    def __init__(self, *, capacity_bytes: int, ttl_s: float | None, policy: str, block_bytes: int,
                 clock: Callable[[], float] = time.time, pin: bool | str = "auto", chunk_bytes: int = CHUNK_BYTES,
                 headroom: int | str = 0, shared: bool = False, prefault_bytes: int | None = None,
                 ttl_shared_s: float | None = None):
        """``shared``: the slab is one memfd a node daemon hands to its engines (``pool.memfd``).
        ``prefault_bytes``: only so much of the slab is pre-faulted (None: all of it); the rest
        takes pages on first touch (a node daemon's model that grows into its budget)."""
        # Slots are padded to 4 KiB so NVMe O_DIRECT I/O can use them in place.
        self.slot_bytes = round_up(block_bytes)
        n_slots = capacity_bytes // self.slot_bytes
        self.target_capacity_bytes = n_slots * self.slot_bytes  # configured; capacity_bytes: ready now
        # capacity grows with the pool: initial slots below, background chunks in _on_pool_ready
        super().__init__(capacity_bytes=0, ttl_s=ttl_s, policy=policy, block_bytes=block_bytes, clock=clock,
                         entry_bytes=self.slot_bytes, ttl_shared_s=ttl_shared_s)
        self._closed = False
        # slots the index never fills: victims hold theirs until written down (placement.py)
        self.headroom = headroom_slots(n_slots, headroom)
        self._ready_slots = 0
        # a node daemon's budget for this slab (kvstore.node.budget; None: all of it): the slots it
        # may hold, its headroom included
        self._limit_slots: int | None = None
        self.pool = SlabPool(n_slots, self.slot_bytes, pin=pin, chunk_bytes=chunk_bytes, on_ready=self._on_pool_ready,
                             shared=shared,
                             prefault_slots=None if prefault_bytes is None else prefault_bytes // self.slot_bytes)
        with self.lock:
            self._grow(self.pool.initial_slots)

    def _grow(self, n_new_slots: int) -> None:
        """Under the lock: ``n_new_slots`` more slots are ready; the index may use all but the headroom."""
        self._ready_slots += n_new_slots
        self._set_capacity()

    def _set_capacity(self) -> None:
        n = self._ready_slots if self._limit_slots is None else min(self._ready_slots, self._limit_slots)
        head = self.headroom if self._limit_slots is None else headroom_slots(n, self.headroom and "auto")
        self.index.capacity = max(0, n - head) * self.slot_bytes

    def limit(self, nbytes: int | None) -> None:
        """Hold at most ``nbytes`` of slots (a node daemon's budget moved the rest to another
        model; None: the whole slab). Blocks past a lowered limit leave at the next
        :meth:`expire` (the store's sweep writes them down); :meth:`trim` then gives their memory
        back."""
        with self.lock:
            self._limit_slots = None if nbytes is None else max(0, int(nbytes) // self.slot_bytes)
            self._set_capacity()

    @property
    def limited(self) -> bool:
        """A limit was set (a node daemon's budget shares the host's DRAM among its models)."""
        return self._limit_slots is not None

    @property
    def limit_bytes(self) -> int:
        """The bytes of slots it may hold: its limit, or the whole slab (ready or not yet)."""
        return self.target_capacity_bytes if self._limit_slots is None else self._limit_slots * self.slot_bytes

    def trim(self) -> int:
        """Give the memory of every free slot back (a shared slab's pages go back to the host;
        a slot used again is zero-filled on its first touch). Returns the bytes released."""
        return self.pool.trim()

    def _on_pool_ready(self, n_new_slots: int) -> None:
        """A background chunk of the pool is ready (its slots already free): admit its blocks."""
        # Never block forever on the tier lock: close() may run under it, waiting for this thread.
        while not self.lock.acquire(timeout=0.05):
            if self._closed:
                return
        try:
            self._grow(n_new_slots)
        finally:
            self.lock.release()

    @property
    def capacity_bytes(self) -> int:
        """The slab's ready slots (the memory the tier takes), to its limit if a node daemon's
        budget set one; the index holds all but the ``headroom`` of them."""
        n = self._ready_slots if self._limit_slots is None else min(self._ready_slots, self._limit_slots)
        return n * self.slot_bytes

    @property
    def ready(self) -> bool:
        """The whole pool is prepared (capacity_bytes == target_capacity_bytes)."""
        return self.pool.ready

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait until the whole pool is prepared. False on timeout or if preparation stopped short."""
        return self.pool.wait_ready(timeout)

    def _assign(self, entry: Entry) -> bool:
        # The index never holds more entries than there are slots, but a victim that left the
        # index keeps its slot until its demotion is done: then there may be none free. Never wait.
        slot = self.pool.alloc()
        if slot is None:
            return False
        entry.slot = slot
        return True

    def _free(self, entry: Entry) -> None:
        if entry.slot >= 0:
            self.pool.free(entry.slot)
            entry.slot = -1

    def slot_view(self, entry: Entry) -> np.ndarray:
        """The whole padded slot (page aligned): ``[:block_bytes]`` is the block."""
        assert entry.slot >= 0
        return self.pool.view(entry.slot)

    def view(self, entry: Entry) -> np.ndarray:
        return self.pool.view(entry.slot)[: self.block_bytes]

    def write(self, entry: Entry, src) -> bool:
        np.copyto(self.view(entry), as_bytes(src)[: self.block_bytes], casting="no")
        return True

    def read(self, entry: Entry, out) -> bool:
        np.copyto(as_bytes(out)[: self.block_bytes], self.view(entry), casting="no")
        return True

    def resident_bytes(self) -> int:
        return self.pool.resident_bytes()

    def close(self) -> None:
        self._closed = True
        self.pool.close()
