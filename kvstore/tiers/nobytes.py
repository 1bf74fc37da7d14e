"""A tier that holds no bytes: its index (capacity, TTL, policy, pins) and, for a tier of slots,
how many slots are free. The tuner's stand-in for a medium (each medium's spec says how to make
its own, :attr:`kvstore.tiers.spec.TierSpec.stand_in`): the tuner's replay is a
:class:`kvstore.store.KVStore` over these, so every rule it follows is the store's own, and
nothing is written or read.

A tier of ``slots`` models the DRAM pool: the index holds at most ``capacity_bytes`` (the slots
less the headroom), a reservation finds a free slot or is skipped (``no_slot``), and a victim
being written down keeps its slot until its write is done. A tier without slots models files.
:class:`NoBytesSharedTier` models a shared medium that keeps its own index (a shared folder).
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

import numpy as np

from kvstore.tiers.index import EXPIRED, Entry, TierIndex
from kvstore.tiers.local import LocalTier
from kvstore.tiers.policy import make_policy
from kvstore.tiers.shared import SharedTier

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


class NoBytesSharedTier(SharedTier):
    """A shared medium's stand-in (a shared folder): what the medium holds, kept by an index of its
    own (capacity, idle TTL, least recent first) as the medium's sweeper keeps it, and no bytes.
    Only this engine's writes reach it (a replay is one engine's trace), and room is made at each
    write: the sweeper's lag (it runs every ``sweep_s``) is not modelled."""

    def __init__(self, name: str, *, capacity_bytes: int, ttl_s: float | None, entry_bytes: int, block_bytes: int,
                 clock: Callable[[], float] = time.time, write_through: bool = True):
        super().__init__(block_bytes, write_through)
        self.name = name
        self.clock = clock
        self.ttl = ttl_s
        self.entry_bytes = int(entry_bytes)
        self.index = TierIndex(int(capacity_bytes), ttl_s, make_policy("lru"))
        self.stats: dict = {"evicted": 0, "expired": 0}
        self.corrupt_reasons: dict = {}

    def leading(self, keys: Sequence[bytes]) -> int:
        found = self.index.serving(keys, self.clock())
        return found.index(False) if False in found else len(found)

    def holds(self, keys: Sequence[bytes]) -> list[bool]:
        return self.index.serving(keys, self.clock())

    def is_expired(self, key: bytes) -> bool:
        e = self.index.entries.get(key)
        return e is not None and e.expire_at <= self.clock()

    def consult(self, what: str) -> None:
        self.index.consulted[what] = True

    def stored(self, keys: list[bytes]) -> None:
        """Written by this engine: present now (an overwrite refreshes it), room made at once."""
        ix, now = self.index, self.clock()
        for k in keys:
            e = ix.entries.get(k)
            if e is not None and e.expire_at <= now:
                ix.remove(k, EXPIRED)
                self.stats["expired"] += 1
                e = None
            if e is not None:
                ix.touch(e, now)
                continue
            e, gone = ix.reserve(k, self.entry_bytes, now)
            for v in gone:
                self.stats["expired" if v.reason == EXPIRED else "evicted"] += 1
            if e is not None:
                ix.commit(e, now)

    def gone(self, keys: list[bytes]) -> None:
        for k in keys:
            self.index.remove(k)

    def acquire(self, keys: Sequence[bytes], session: str | None = None, touch: bool = True) -> list[Entry | None]:
        """A read refreshes a block's time (the medium's access time)."""
        ix = self.index
        ix.touch_many([e for e in map(ix.entries.get, keys) if e is not None], self.clock())
        return super().acquire(keys, session, touch)

    def write_many(self, entries: Sequence[Entry], srcs: Sequence[np.ndarray]) -> list[bool]:
        return [True] * len(entries)

    def read_many(self, entries: Sequence[Entry], outs: Sequence[np.ndarray]) -> list[bool]:
        return [True] * len(entries)

    @property
    def used_bytes(self) -> int:
        return self.index.used

    @property
    def capacity_bytes(self) -> int:
        return self.index.capacity

    def __len__(self) -> int:
        return len(self.index)
