"""Demotion: DRAM victims written down to NVMe on the store's I/O pool, never on the caller.

A DRAM reservation (or a sweep) returns its victims as data, each still holding its slot
(:meth:`kvstore.tiers.Tier.begin_reserve`). :meth:`Demoter.take` applies the rules of
:mod:`kvstore.placement` to each: a victim that needs no write (nothing below, already below,
past NVMe's TTL, without the asks ``tiers.nvme.admit_after`` wants, no room on NVMe) frees its
slot at once; the others get an NVMe entry (reserved now, on the caller: index work only) and a
write job on the I/O pool. Until that write is done the block stays servable from its slot:
:meth:`has` and :meth:`pin` find it (a DRAM hit). The slot is freed when the write is done,
success or failure, or, if a load pinned the block meanwhile, when the last pin is released
(:meth:`release`): a block promised to a load is never lost, even when its demotion fails.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Sequence

from kvstore import placement
from kvstore.index import Entry

if TYPE_CHECKING:
    from kvstore.store import KVStore


class Demoter:
    def __init__(self, store: "KVStore") -> None:
        self.s = store
        self.lock = threading.Lock()
        self.inflight: dict[bytes, Entry] = {}  # key -> DRAM victim being written down
        self.held: set[Entry] = set()  # victims whose slot is still taken (in flight, or pinned)

    def __len__(self) -> int:
        return len(self.inflight)

    def has(self, key: bytes) -> bool:
        with self.lock:
            return key in self.inflight

    def pin(self, keys: Sequence[bytes]) -> list[Entry | None]:
        """Pin blocks still being demoted (readable from their slots until released)."""
        out = []
        with self.lock:
            for k in keys:
                e = self.inflight.get(k)
                if e is not None:
                    e.pins += 1
                out.append(e)
        return out

    def release(self, entries: Sequence[Entry | None]) -> list[Entry | None]:
        """Unpin the demoting entries among ``entries`` (a slot whose write is done is freed with
        its last pin); returns the others (DRAM index entries) for the tier to release."""
        rest, free = [], []
        with self.lock:
            for e in entries:
                if e is None or e not in self.held:
                    rest.append(e)
                    continue
                e.pins -= 1
                if not e.pins and self.inflight.get(e.key) is not e:
                    self.held.discard(e)
                    free.append(e)
        if free:
            self.s.dram.free(free)
        return rest

    def action(self, e: Entry, now: float) -> str:
        """:func:`kvstore.placement.demote_action` for DRAM victim ``e`` (admitted: its asks)."""
        nv, adm = self.s.nvme, self.s._admission
        return placement.demote_action(e.last_access, now, has_lower=nv is not None,
                                       lower_holds=nv is not None and nv.present_or_writing(e.key),
                                       lower_ttl=nv.index.ttl if nv is not None else None,
                                       admitted=not adm.active or adm.admits(e.asks))

    def take(self, victims: list[Entry]) -> None:
        """Decide for each DRAM victim; free what needs no write, submit the rest."""
        if not victims:
            return
        s, dram = self.s, self.s.dram
        s._count_evictions(dram, victims)
        now = s.clock()
        free, todo, gone, away = [], [], [], []
        for e in victims:
            act = self.action(e, now)
            if act == placement.DEMOTE:
                todo.append(e)
                continue
            free.append(e)
            if act == placement.STALE:
                gone.append((e, "expired"))
            elif act == placement.NO_LOWER:
                gone.append((e, None))
            elif act == placement.NOT_ADMITTED:
                away.append(e)
        jobs = []
        if todo:
            by_hint: dict = {}  # a retention hint goes down with its block
            for e in todo:
                by_hint.setdefault(e.hint, []).append(e)
            pairs = [p for hint, es in by_hint.items()
                     for p in zip(s._reserve_nvme([e.key for e in es], background=True, ttl=hint), es)]
            for ne, e in pairs:
                if ne is None:  # no room on NVMe (everything there pinned): the block is lost
                    free.append(e)
                    gone.append((e, None))
                else:
                    ne.last_access = e.last_access  # the file's mtime: recency survives a restart
                    jobs.append((ne, e))
            with self.lock:
                for _, e in jobs:
                    self.inflight[e.key] = e
                    self.held.add(e)
        dram.free(free)
        for e, why in gone:
            s._remember_gone([e], why)
        s._turn_away([(e.key, e.asks) for e in away])
        for ne, e in jobs:
            s._submit(self._job, ne, e)

    def _job(self, ne: Entry, e: Entry) -> None:
        """On the I/O pool: write the block from its slot, commit it, then free the slot."""
        try:
            self.s._write_down(ne, e)
        finally:
            with self.lock:
                if self.inflight.get(e.key) is e:
                    del self.inflight[e.key]
                done = not e.pins
                if done:
                    self.held.discard(e)
            if done:
                self.s.dram.free([e])
