"""DRAM tier: blocks are slots of one pre-allocated, pre-faulted (and, with CUDA, pinned) pool."""

from __future__ import annotations

import time
from typing import Callable

import numpy as np

from kvstore.fileformat import round_up
from kvstore.index import Entry
from kvstore.memory import SlabPool, as_bytes
from kvstore.tiers.base import Tier


ASSIGN_TIMEOUT_S = 10.0


class DramTier(Tier):
    name = "dram"

    def __init__(self, *, capacity_bytes: int, ttl_s: float | None, policy: str, block_bytes: int,
                 clock: Callable[[], float] = time.time, pin: bool | str = "auto"):
        # Slots are padded to 4 KiB so NVMe O_DIRECT I/O can use them in place.
        self.slot_bytes = round_up(block_bytes)
        n_slots = capacity_bytes // self.slot_bytes
        super().__init__(capacity_bytes=n_slots * self.slot_bytes, ttl_s=ttl_s, policy=policy,
                         block_bytes=block_bytes, clock=clock, entry_bytes=self.slot_bytes)
        self.pool = SlabPool(n_slots, self.slot_bytes, pin=pin)

    def _assign(self, entry: Entry, wait: bool = True) -> bool:
        # The index never holds more entries than there are slots, but a slot whose entry just
        # left the index stays taken until its demotion (another thread) is done: wait for it.
        slot = self.pool.alloc(timeout=ASSIGN_TIMEOUT_S if wait else 0.0)
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

    def close(self) -> None:
        self.pool.close()
