"""A tier that holds no bytes: its index (capacity, TTL, policy, pins) and, for a tier of slots,
how many slots are free. The tuner's stand-in for a medium (each medium's spec says how to make
its own, :attr:`kvstore.tiers.spec.TierSpec.stand_in`): the tuner's replay is a
:class:`kvstore.store.KVStore` over these, so every rule it follows is the store's own, and
nothing is written or read.

A tier of ``slots`` models the DRAM pool: the index holds at most ``capacity_bytes`` (the slots
less the headroom), a reservation finds a free slot or is skipped (``no_slot``), and a victim
being written down keeps its slot until its write is done. A tier without slots models files.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

import numpy as np

from kvstore.tiers.index import Entry
from kvstore.tiers.local import LocalTier

# what a view of a block is here: no bytes (the store's copies of it copy nothing)
NO_BYTES = np.empty(0, np.uint8)


class NoBytesTier(LocalTier):
    spreads = True  # one call a batch: a replay's moves are not cut into parts

    def __init__(self, name: str, *, capacity_bytes: int, ttl_s: float | None, policy: str, entry_bytes: int,
                 clock: Callable[[], float] = time.time, slots: int | None = None, **kw):
        """``kw``: :class:`LocalTier`'s ``ttl_shared_s``, ``write_through``, ``admit_after``."""
        super().__init__(capacity_bytes=capacity_bytes, ttl_s=ttl_s, policy=policy, block_bytes=entry_bytes,
                         clock=clock, entry_bytes=entry_bytes, **kw)
        self.name = name
        self.addressable = slots is not None
        self.fan_out = not self.addressable
        self.slots = slots
        self.free_slots = slots  # None: a medium without slots (files)

    def _assign(self, entry: Entry) -> bool:
        if self.free_slots is None:
            return True
        if self.free_slots <= 0:
            return False
        self.free_slots -= 1
        entry.slot = 0
        return True

    def _free(self, entry: Entry) -> None:
        if self.free_slots is not None and entry.slot >= 0:
            self.free_slots += 1
            entry.slot = -1

    def view(self, entry: Entry) -> np.ndarray:
        return NO_BYTES

    def slot_view(self, entry: Entry) -> np.ndarray:
        return NO_BYTES

    def write(self, entry: Entry, src: np.ndarray) -> bool:
        return True

    def read(self, entry: Entry, out: np.ndarray) -> bool:
        return True

    def write_many(self, entries: Sequence[Entry], srcs: Sequence[np.ndarray]) -> list[bool]:
        return [True] * len(entries)

    def read_many(self, entries: Sequence[Entry], outs: Sequence[np.ndarray]) -> list[bool]:
        return [True] * len(entries)
