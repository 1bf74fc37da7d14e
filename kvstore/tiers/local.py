"""A tier with its own index: DRAM, NVMe, and the tuner's tiers that hold no bytes.

Index work (reserve/commit/acquire/release) happens under the tier's lock and is cheap; data
movement (``write``/``read``) happens outside it, on entries that are pinned, so it can run on
an I/O pool. Victims are data, not callbacks (see :mod:`kvstore.tiers.base`).
"""

from __future__ import annotations

import threading
import time
from abc import abstractmethod
from typing import Callable, Sequence

import numpy as np

from kvstore.tiers.base import Reservation, Tier
from kvstore.tiers.index import EXPIRED, READY, Entry, TierIndex
from kvstore.tiers.policy import make_policy


class LocalTier(Tier):
    """A tier with its own index (:class:`kvstore.tiers.index.TierIndex`): capacity, TTL, policy
    and pins here; the medium (``write``/``read``/``_free``/``_assign``) in the subclass."""


    def __init__(self, *, capacity_bytes: int, ttl_s: float | None, policy: str, block_bytes: int,
                 clock: Callable[[], float] = time.time, entry_bytes: int | None = None,
                 ttl_shared_s: float | None = None, write_through: bool = False, admit_after: int = 0):
        """``ttl_shared_s``: the idle TTL of blocks two sessions hit (None: ``ttl_s``);
        ``write_through``: every block stored above is copied here at once (else victims only);
        ``admit_after``: a block is written here once this many requests asked for it."""
        self.block_bytes = int(block_bytes)
        self.write_through = bool(write_through)
        self.admit_after = int(admit_after)
        # what one block costs this medium (padding, header): the unit of capacity accounting
        self.entry_bytes = int(entry_bytes or block_bytes)
        self.clock = clock
        self.index = TierIndex(capacity_bytes, ttl_s, make_policy(policy), ttl_shared_s=ttl_shared_s)
        self.lock = threading.RLock()
        self.stats = {"evicted": 0, "expired": 0, "corrupt": 0, "write_failed": 0}
        self.corrupt_reasons: dict[str, int] = {}

    # -- medium (no lock held; entries are pinned) -----------------------------------------------
    @abstractmethod
    def write(self, entry: Entry, src: np.ndarray) -> bool:
        """Store ``src`` (block_bytes of uint8) for a reserved entry. False on failure."""

    @abstractmethod
    def read(self, entry: Entry, out: np.ndarray) -> bool:
        """Fill ``out`` with a pinned entry's bytes. False if the medium failed or was corrupt."""

    @abstractmethod
    def _free(self, entry: Entry) -> None:
        """Release the medium behind an entry that left the index."""

    def _assign(self, entry: Entry) -> bool:
        """Attach medium to a freshly reserved entry (e.g. a free DRAM slot), never waiting.
        False = none free now."""
        return True

    # -- index (cheap, under the lock) -----------------------------------------------------------
    def contains(self, key: bytes) -> bool:
        with self.lock:
            return self.index.lookup(key, self.clock()) is not None

    def serving(self, keys: Sequence[bytes]) -> list[bool]:
        with self.lock:
            return self.index.serving(keys, self.clock())

    def begin_reserve(self, keys: Sequence[bytes], ttl: float | None = None) -> Reservation:
        """Phase 1 of a write, index only: WRITING entries (pinned, no medium yet), None where
        present, pending or no room (counted in ``pinned``); ``victims``: what left the index to
        make room, medium intact (the caller moves it if it must, then :meth:`free`; then
        :meth:`attach`)."""
        out = Reservation()
        evicted = out.victims
        with self.lock:
            now = self.clock()
            for k in keys:
                e = None
                old = self.index.entries.get(k)
                if old is not None and old.state == READY and old.expire_at <= now and not old.pins:
                    evicted.append(self.index.remove(k, EXPIRED))  # present but expired: replace
                    old = None
                if old is None:
                    e, ev = self.index.reserve(k, self.entry_bytes, now, ttl)
                    evicted.extend(ev)
                    if e is None:  # no room in the index: every entry held by a write or a pin
                        out.pinned += 1
                out.append(e)
        self._count_victims(evicted)
        return out

    def attach(self, res: Reservation) -> Reservation:
        """Give reserved entries their medium (outside the lock: WRITING entries are the caller's
        alone). Never waits: an entry with none free is aborted, set to None, counted in
        ``res.no_slot``."""
        failed = []
        for i, e in enumerate(res):
            if e is not None and not self._assign(e):
                failed.append(e)
                res[i] = None
        if failed:
            with self.lock:
                for e in failed:
                    self.index.abort(e)
                self.stats["no_room"] = self.stats.get("no_room", 0) + len(failed)
            res.no_slot += len(failed)
        return res

    def abort(self, entries: Sequence[Entry | None]) -> None:
        """Drop reserved entries never written (their medium, if any, is freed)."""
        self.commit(entries, [False] * len(entries))

    def reserve(self, keys: Sequence[bytes], ttl: float | None = None) -> Reservation:
        """The three steps for a tier used alone: victims are freed at once (nothing below)."""
        res = self.begin_reserve(keys, ttl)
        self.free(res.victims)
        return self.attach(res)

    def free(self, victims: Sequence[Entry]) -> None:
        """Release the medium of entries that left the index (victims, once moved)."""
        for e in victims:
            self._free(e)

    def commit(self, entries: Sequence[Entry | None], oks: Sequence[bool], at: float | None = None,
               session: str | None = None, keep_pinned: bool = False) -> None:
        """Phase 2 of a write: make written entries visible, drop failed ones.

        ``keep_pinned`` leaves committed entries pinned (atomically), for a caller that reads
        them next; it must ``release`` them.
        """
        entries, oks = list(entries), list(oks)
        if len(entries) != len(oks):
            raise ValueError(f"commit: {len(oks)} results for {len(entries)} entries")
        failed = [e for e, ok in zip(entries, oks) if e is not None and not ok]
        with self.lock:
            now = self.clock() if at is None else at
            for e in failed:
                self.index.abort(e)
            # last block first: within a batch (a prefix chain) the head ends most recent, so
            # the policy evicts a chain from its tail (a chain without its head is unreachable)
            self.index.commit_many([e for e, ok in zip(reversed(entries), reversed(oks)) if e is not None and ok],
                                   now, session, keep_pinned)
        for e in failed:
            self._free(e)

    def acquire(self, keys: Sequence[bytes], session: str | None = None, touch: bool = True) -> list[Entry | None]:
        """Pin READY entries for reading. A hit refreshes recency and TTL (``touch=False``: the
        caller decides later, with :meth:`touch`, which of them count as hits)."""
        with self.lock:
            now = self.clock()
            out = self.index.pin_ready(keys, now)
            if touch:
                self.index.touch_many(out, now, session)  # head of the chain ends most recent (see commit)
        return out

    def touch(self, entries: Sequence[Entry | None], session: str | None = None, ttl: float | None = None) -> None:
        """Count pinned entries as hits (refresh recency and TTL; ``ttl``: a retention hint,
        the entries' idle TTL becomes at least that)."""
        with self.lock:
            self.index.touch_many(entries, self.clock(), session, ttl)

    def holds(self, keys: Sequence[bytes]) -> list[bool]:
        with self.lock:
            now, lookup, writing = self.clock(), self.index.lookup, self.index.writing_entry
            return [lookup(k, now) is not None or writing(k) is not None for k in keys]

    def present_or_writing(self, key: bytes) -> bool:
        """READY and unexpired, or being written (WRITING)."""
        with self.lock:
            return self.index.lookup(key, self.clock()) is not None or self.index.writing_entry(key) is not None

    def is_expired(self, key: bytes) -> bool:
        """Still in the index, but past its TTL (not yet swept)."""
        with self.lock:
            e = self.index.entries.get(key)
            if e is not None and e.state == READY and e.expire_at <= self.clock():
                self.index.consulted["ttl"] = True
                return True
            return False

    # -- KV events: the index journals (TierIndex.journal) --------------------------------------
    def journal_on(self) -> list[bytes]:
        with self.lock:
            self.index.journal = []
            return list(self.index.keys())

    def journal_take(self) -> list[tuple[bool, bytes]]:
        with self.lock:
            j = self.index.journal
            if j is None:
                return []
            self.index.journal = []
        return j

    def held_keys(self) -> list[bytes]:
        with self.lock:
            return list(self.index.keys())

    def state_of(self, key: bytes) -> int | None:
        e = self.index.entries.get(key)  # (a dict read; the caller takes what it sees)
        return None if e is None else e.state

    def due(self, now: float) -> bool:
        return self.index.due(now)

    def consult(self, what: str) -> None:
        """Its capacity or TTL decided something outside the index (a demotion past its TTL)."""
        self.index.consulted[what] = True

    def release(self, entries: Sequence[Entry | None], oks: Sequence[bool] | None = None) -> None:
        """Unpin after a read; an entry whose read failed leaves the index at once (corrupt or
        gone), its medium freed by its last reader."""
        if oks is None:  # (every load's end: one call for the batch)
            with self.lock:
                dropped = self.index.unpin_many(entries)
            for e in dropped:
                self._free(e)
            return
        dropped = []
        with self.lock:
            for i, e in enumerate(entries):
                if e is None:
                    continue
                if self.index.unpin(e):  # the last reader of a condemned entry
                    dropped.append(e)
                elif oks is not None and not oks[i] and self.index.entries.get(e.key) is e:
                    if self.index.condemn(e, "corrupt"):
                        dropped.append(e)
        for e in dropped:
            self._free(e)

    def remove(self, keys: Sequence[bytes]) -> int:
        gone = []
        with self.lock:
            for k in keys:
                e = self.index.remove(k, "removed")
                if e is not None:
                    gone.append(e)
        for e in gone:
            self._free(e)
        return len(gone)

    def expire(self, limit: int | None = None) -> list[Entry]:
        """Take what is due out of the index (bounded), and what a lowered capacity no longer
        holds (:meth:`TierIndex.shrink`); the victims keep their medium (see :meth:`begin_reserve`)
        until :meth:`free`."""
        with self.lock:
            ev = self.index.expire(self.clock(), limit)
            ev += self.index.shrink()
        self._count_victims(ev)
        return ev

    def sweep(self, limit: int | None = None) -> int:
        """Expire what is due and free it (a tier used alone)."""
        ev = self.expire(limit)
        self.free(ev)
        return len(ev)

    def _count_victims(self, evicted: list[Entry]) -> None:
        if evicted:
            exp = sum(1 for e in evicted if e.reason == EXPIRED)
            self.count("expired", exp)
            self.count("evicted", len(evicted) - exp)

    def count(self, stat: str, n: int = 1) -> None:
        """Add to a tier statistic (thread-safe)."""
        if n:
            with self.lock:
                self.stats[stat] = self.stats.get(stat, 0) + n

    # -- conveniences (used by tests and simple callers) -------------------------------------------
    def put(self, keys: Sequence[bytes], blocks: Sequence[np.ndarray]) -> int:
        entries = self.reserve(keys)
        oks = [self.write(e, b) if e is not None else False for e, b in zip(entries, blocks)]
        self.commit(entries, oks)
        return sum(oks)

    def get(self, keys: Sequence[bytes], outs: Sequence[np.ndarray]) -> list[bool]:
        entries = self.acquire(keys)
        oks = [self.read(e, o) if e is not None else False for e, o in zip(entries, outs)]
        self.release(entries, oks)
        return oks

    @property
    def used_bytes(self) -> int:
        return self.index.used

    @property
    def capacity_bytes(self) -> int:
        return self.index.capacity

    @property
    def ttl(self) -> float | None:
        return self.index.ttl

    def pin_all(self) -> list[Entry]:
        with self.lock:
            now = self.clock()
            entries = [e for k in list(self.index.policy.victims()) if (e := self.index.lookup(k, now)) is not None]
            for e in entries:
                self.index.pin(e)
        return entries

    def __len__(self) -> int:
        return len(self.index)

    def close(self) -> None:
        pass
