"""A tier every engine writes, that keeps its index itself (Redis, a shared folder): the part of the
contract they share, as :class:`~kvstore.tiers.local.LocalTier` is the local tiers'.

Such a tier is asked in batches (:meth:`leading`, :meth:`holds`), reserves nothing and pins
nothing: a write overwrites (in one namespace a key names the same bytes in every engine), a
read may find a block gone or bad (a miss). Its KV events see only what this engine wrote there and
what a read found gone: the medium evicts and expires on its own, unseen.

It takes every block stored in a local tier at once (``write_through``, the default: sharing
needs a block there before this engine lets it go), or only the victims of the tiers above it
(``write_through`` False: a shared folder as the overflow of each host's own tiers).

A shared tier with a capacity it keeps itself (a shared folder's sweeper) has victims too, when
the chain has a tier below it that takes them (``keeps_victims``, set by the chain): the medium
sets each aside instead of removing it, says so (``on_victims``, set by the store), and
:meth:`expire` hands them over, each holding its medium until :meth:`free`, as a local tier's do.
Redis evicts on its own, unseen: it has none.
"""

from __future__ import annotations

import math
import threading
from typing import Sequence

from kvstore.tiers.base import Reservation, Tier
from kvstore.tiers.index import READY, Entry


class SharedTier(Tier):
    shared = True
    keeps_victims = False  # a tier below takes its victims (the chain says so): set aside, not removed
    on_victims = None  # called (no lock held) once victims are set aside: the store takes them soon

    def __init__(self, block_bytes: int, write_through: bool = True):
        self.block_bytes = int(block_bytes)
        self.write_through = bool(write_through)  # else: the victims of the tiers above only
        self.lock = threading.Lock()
        # KV events (kvstore.store.events): (True, key) for what this engine wrote, (False, key) for
        # what a read found gone or bad. None: off
        self.journal: list | None = None

    # -- what the medium says (the subclass) ---------------------------------------------------------
    def stored(self, keys: list[bytes]) -> None:
        """Keys this engine just wrote there (a medium that remembers lookups takes note)."""

    def gone(self, keys: list[bytes]) -> None:
        """Keys a read found gone or bad (ask again next time)."""

    # -- lookups ----------------------------------------------------------------------------------------
    def contains(self, key: bytes) -> bool:
        return self.leading([key]) == 1

    def present_or_writing(self, key: bytes) -> bool:
        return self.holds([key])[0]

    # -- writes: nothing to reserve -----------------------------------------------------------------------
    def _entry(self, key: bytes, ttl: float | None = None) -> Entry:
        return Entry(key=key, nbytes=self.block_bytes, last_access=0.0, expire_at=math.inf, state=READY, ttl=ttl,
                     hint=ttl)

    def begin_reserve(self, keys: Sequence[bytes], ttl: float | None = None) -> Reservation:
        seen: set[bytes] = set()
        out = Reservation()
        for k in keys:  # a repeated key is written once
            out.append(None if k in seen else self._entry(k, ttl))
            seen.add(k)
        return out

    def commit(self, entries, oks, at=None, session=None, keep_pinned=False) -> None:
        done = [e.key for e, ok in zip(entries, oks) if e is not None and ok]
        self.stored(done)
        if self.journal is not None:  # KV events: what this engine wrote is servable here
            with self.lock:
                self.journal.extend((True, k) for k in done)

    # -- reads: nothing to pin ------------------------------------------------------------------------------
    def acquire(self, keys: Sequence[bytes], session: str | None = None, touch: bool = True) -> list[Entry | None]:
        """Entries for keys a lookup found here (the medium refreshes a hit's time as it is read)."""
        return [self._entry(k) for k in keys]

    def release(self, entries, oks=None) -> None:
        if oks is not None:  # found gone or bad at a read
            bad = [e.key for e, ok in zip(entries, oks) if e is not None and not ok]
            self.gone(bad)
            if self.journal is not None and bad:  # KV events: the only removals this engine sees here
                with self.lock:
                    self.journal.extend((False, k) for k in bad)

    def write(self, entry: Entry, src) -> bool:
        return self.write_many([entry], [src])[0]

    def read(self, entry: Entry, out) -> bool:
        return self.read_many([entry], [out])[0]

    # -- KV events ------------------------------------------------------------------------------------
    def journal_on(self) -> list[bytes]:
        with self.lock:
            self.journal = []
        return []

    def journal_take(self) -> list[tuple[bool, bytes]]:
        with self.lock:
            j = self.journal
            if j is None:
                return []
            self.journal = []
        return j
