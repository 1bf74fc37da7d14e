"""Demotions: the victims being written down to a lower tier, still in their slots.

A victim of the top tier that the chain writes down (a demotion) keeps its slot until the write
is done: until then lookups find it and loads pin it there (a hit of its tier). The slot is
freed when the write is done, success or failure, or, if a load pinned the block meanwhile, when
the last pin is released: a block promised to a load is never lost, even when its demotion
fails. Bookkeeping only (no bytes), under its own lock.
"""

from __future__ import annotations

import threading
from typing import Sequence

from kvstore.tiers.base import Tier
from kvstore.tiers.index import Entry


class Demotions:
    """Victims being written down: each still holds its slot and is served from it until its
    write is done; a load may pin it meanwhile, and the slot is freed with the last pin (a block
    promised to a load is never lost, even when its demotion fails)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.inflight: dict[bytes, tuple[Tier, Entry]] = {}  # what a lookup of a key finds
        self.writing: set[Entry] = set()  # victims whose write is not done (a key may have two)
        self.held: set[Entry] = set()  # victims whose slot is still taken (in flight, or pinned)

    def __len__(self) -> int:
        return len(self.inflight)

    def has(self, tier: Tier, key: bytes) -> bool:
        if not self.inflight:  # (a dict's length reads safely without the lock)
            return False
        with self.lock:
            got = self.inflight.get(key)
        return got is not None and got[0] is tier

    def add(self, tier: Tier, entries: list[Entry]) -> None:
        with self.lock:
            for e in entries:
                self.inflight[e.key] = (tier, e)
                self.writing.add(e)
                self.held.add(e)

    def pin(self, tier: Tier, keys: Sequence[bytes]) -> list[Entry | None]:
        out = []
        with self.lock:
            for k in keys:
                got = self.inflight.get(k)
                e = got[1] if got is not None and got[0] is tier else None
                if e is not None:
                    e.pins += 1
                out.append(e)
        return out

    def release(self, entries: Sequence[Entry | None]) -> tuple[list[Entry | None], list[Entry]]:
        """Unpin the moving entries among ``entries``; returns (the others, for their tier to
        release; slots to free now: written down and no longer pinned)."""
        if not self.held:
            return list(entries), []
        rest, free = [], []
        with self.lock:
            for e in entries:
                if e is None or e not in self.held:
                    rest.append(e)
                    continue
                e.pins -= 1
                if not e.pins and e not in self.writing:
                    self.held.discard(e)
                    free.append(e)
        return rest, free

    def done(self, e: Entry) -> bool:
        """The write of ``e`` ended (either way): True when its slot may be freed now."""
        with self.lock:
            self.writing.discard(e)
            if self.inflight.get(e.key, (None, None))[1] is e:
                del self.inflight[e.key]
            free = not e.pins
            if free:
                self.held.discard(e)
        return free
