"""A tier that holds no bytes: its index (capacity, TTL, policy, pins) and, for a tier of slots,
how many slots are free. The tuner's stand-in for DRAM and NVMe (:mod:`kvstore.tune.simulate`):
the tier chain runs over it exactly as it runs over the real media, and nothing is written.

A tier of ``slots`` models the DRAM pool: the index holds at most ``capacity_bytes`` (the slots
less the headroom), a reservation finds a free slot or is skipped (``no_slot``), and a victim
being written down keeps its slot until its write is done.
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np

from kvstore.tiers.index import Entry
from kvstore.tiers.local import LocalTier


class NoBytesTier(LocalTier):
    def __init__(self, name: str, *, capacity_bytes: int, ttl_s: float | None, policy: str, entry_bytes: int,
                 clock: Callable[[], float] = time.time, slots: int | None = None):
        super().__init__(capacity_bytes=capacity_bytes, ttl_s=ttl_s, policy=policy, block_bytes=entry_bytes,
                         clock=clock, entry_bytes=entry_bytes)
        self.name = name
        self.addressable = slots is not None
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

    def write(self, entry: Entry, src: np.ndarray) -> bool:
        return True

    def read(self, entry: Entry, out: np.ndarray) -> bool:
        return True
