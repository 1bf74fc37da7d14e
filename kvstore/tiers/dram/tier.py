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
from kvstore.tiers.dram.pool import CHUNK_BYTES, SlabPool, as_bytes
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
                 headroom: int | str = 0, shared: bool = False):
        """``shared``: the slab is one memfd a node daemon hands to its engines (``pool.memfd``)."""
        # Slots are padded to 4 KiB so NVMe O_DIRECT I/O can use them in place.
        self.slot_bytes = round_up(block_bytes)
        n_slots = capacity_bytes // self.slot_bytes
        self.target_capacity_bytes = n_slots * self.slot_bytes  # configured; capacity_bytes: ready now
        # capacity grows with the pool: initial slots below, background chunks in _on_pool_ready
        super().__init__(capacity_bytes=0, ttl_s=ttl_s, policy=policy,
                         block_bytes=block_bytes, clock=clock, entry_bytes=self.slot_bytes)
        self._closed = False
        # slots the index never fills: victims hold theirs until written down (placement.py)
        self.headroom = headroom_slots(n_slots, headroom)
        self._ready_slots = 0
        self.pool = SlabPool(n_slots, self.slot_bytes, pin=pin, chunk_bytes=chunk_bytes, on_ready=self._on_pool_ready,
                             shared=shared)
        with self.lock:
            self._grow(self.pool.initial_slots)

    def _grow(self, n_new_slots: int) -> None:
        """Under the lock: ``n_new_slots`` more slots are ready; the index may use all but the headroom."""
        self._ready_slots += n_new_slots
        self.index.capacity = max(0, self._ready_slots - self.headroom) * self.slot_bytes

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
        """The slab's ready slots (the memory the tier takes); the index holds all but the
        ``headroom`` of them."""
        return self._ready_slots * self.slot_bytes

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
