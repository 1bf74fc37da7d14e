"""The store's pieces in the simulator (:class:`kvstore.tune.simulate.Simulator` mixes them in, as
:class:`kvstore.store.KVStore` mixes in :class:`kvstore.storepath.StorePath`): reservations with
their victims, demotion, admission to NVMe, write-through copies, background writes completing
at the end of a call, and the remembered reasons of blocks that left. Each mirrors the store
method named in its docstring; the rules come from :mod:`kvstore.placement`."""

from __future__ import annotations

from typing import Hashable, Sequence

from kvstore import placement
from kvstore.index import EXPIRED, READY, Entry, TierIndex


class SimTiers:
    def _name(self, ix: TierIndex) -> str:
        return "dram" if ix is self.D else "nvme"

    def _holds(self, ix: TierIndex, k: Hashable, now: float) -> bool:
        """Tier.holds: READY and unexpired, or being written."""
        e = ix.entries.get(k)
        if e is None:
            return False
        if e.state != READY:
            return True
        if ix.lookup(k, now) is not None:
            return True
        self.ttl_used[self._name(ix)] = True
        return False

    def _reserve(self, ix: TierIndex, keys: Sequence[Hashable], nbytes: int, now: float) -> list[Entry | None]:
        """Tier.reserve: WRITING entries (None where present or no room); victims then go to _evict."""
        out: list[Entry | None] = []
        evicted: list[Entry] = []
        entries = ix.entries
        reserve = ix.reserve
        for k in keys:
            old = entries.get(k)
            if old is not None:
                if old.state == READY and old.expire_at <= now and not old.pins:
                    self.ttl_used["dram" if ix is self.D else "nvme"] = True
                    evicted.append(ix.remove(k, EXPIRED))  # present but expired: replace
                else:
                    out.append(None)
                    continue
            if ix.used + nbytes > ix.capacity:
                self.cap_used["dram" if ix is self.D else "nvme"] = True
            e, ev = reserve(k, nbytes, now)
            if ev:
                evicted.extend(ev)
            out.append(e)
        if evicted:
            self._evict(ix, evicted, now)
        if ix is self.D:  # Tier.attach: free slots in order, never waiting
            kept, skipped = placement.split_by_slots(out, self.free_slots)
            if skipped:
                for e, k in zip(out, kept):
                    if e is not None and k is None:
                        ix.abort(e)
                self.skipped += skipped
            self.free_slots -= sum(1 for e in kept if e is not None)
            out = kept
        return out

    def _evict(self, ix: TierIndex, evicted: list[Entry], now: float) -> None:
        name = self._name(ix)
        exp = 0
        for e in evicted:
            if e.reason == EXPIRED:
                exp += 1
        if exp:
            self.ttl_used[name] = True
            self.expired[name] += exp
        self.evicted[name] += len(evicted) - exp
        if ix is self.D:
            self._demote(evicted, now)
        else:
            D = self.D
            self._remember_gone([e for e in evicted if D is None or D.lookup(e.key, now) is None])

    def _demote(self, entries: list[Entry], now: float) -> None:
        """Demoter.take: the placement rules per victim; a write holds the slot until _complete."""
        N, adm = self.N, self.adm
        ttl = N.ttl if N is not None else None
        todo, lost, away = [], [], []
        for e in entries:
            act = placement.demote_action(e.last_access, now, has_lower=N is not None,
                                          lower_holds=N is not None and self._holds(N, e.key, now), lower_ttl=ttl,
                                          admitted=not adm.active or adm.admits(e.asks))
            if act == placement.DEMOTE:
                todo.append(e)
                continue
            self.free_slots += 1
            if act == placement.STALE:
                self.ttl_used["nvme"] = True
                self._remember_gone([e], EXPIRED)
            elif act == placement.NO_LOWER:
                lost.append(e)
            elif act == placement.NOT_ADMITTED:
                away.append((e.key, e.asks))
        if todo:
            for ne, e in zip(self._reserve(N, [e.key for e in todo], self.nvme_entry_bytes, now), todo):
                if ne is None:
                    self.free_slots += 1
                    lost.append(e)
                else:
                    ne.last_access = e.last_access
                    self._deferred.append((ne, e))
        if lost:
            self._remember_gone(lost)
        self._turn_away(away)

    def _turn_away(self, blocks: list[tuple[Hashable, int]]) -> None:
        """KVStore._turn_away: blocks dropped for want of asks, remembered with them, counted."""
        if blocks:
            for k, asks in blocks:
                self.adm.turn_away(k, asks)
            g = self._ghosts
            for k, _ in blocks:
                g[k] = placement.NOT_ADMITTED
                g.move_to_end(k)
            while len(g) > self._ghost_cap:
                g.popitem(last=False)
            self.not_admitted += len(blocks)

    def _complete(self, now: float) -> None:
        """The end of a store call: background writes complete, in the order they started."""
        N, D = self.N, self.D
        for ne, e in self._deferred:
            if e is None:  # a write-through copy of a block that left DRAM meanwhile: dropped
                N.abort(ne)
            elif isinstance(e, tuple):  # a write-through copy (its DRAM entry pinned meanwhile)
                N.commit(ne, now)
                D.unpin(e[0])
                self.nvme_writes += 1
            else:  # a demotion: the NVMe copy keeps the DRAM recency; the slot is free again
                N.commit(ne, e.last_access)
                self.demotions += 1
                self.nvme_writes += 1
                self.free_slots += 1
        self._deferred.clear()

    def _remember_gone(self, entries: list[Entry], reason: str | None = None) -> None:
        g = self._ghosts
        for e in entries:
            g[e.key] = placement.gone_reason(reason or e.reason)
            g.move_to_end(e.key)
        while len(g) > self._ghost_cap:
            g.popitem(last=False)

    def _forget_gone(self, keys) -> None:
        g = self._ghosts
        if g:
            for k in keys:
                g.pop(k, None)

    def _miss_reason(self, k: Hashable, at: int, now: float) -> str:
        expired = False
        for ix in (self.D, self.N):
            if ix is not None:
                e = ix.entries.get(k)
                if e is not None and e.state == READY and e.expire_at <= now:
                    self.ttl_used[self._name(ix)] = True
                    expired = True
                    break
        return placement.miss_reason(expired=expired, remembered=self._ghosts.get(k), at=at)

    def _put_nvme(self, keys: Sequence[Hashable], now: float) -> None:
        N = self.N
        if self.adm.active:
            keys = self._admit_nvme(keys, now)
        entries = self._reserve(N, keys, self.nvme_entry_bytes, now)
        stored = []
        for e in reversed(entries):
            if e is not None:
                N.commit(e, now)
                stored.append(e.key)
        self.nvme_writes += len(stored)
        self._forget_gone(stored)

    def _admit_nvme(self, keys: Sequence[Hashable], now: float) -> list[Hashable]:
        """KVStore._admit_nvme: the keys a store straight to NVMe may write (one more ask each)."""
        adm, N = self.adm, self.N
        out, seen, away = [], set(), []
        for k in keys:
            if k in seen or self._holds(N, k, now):
                out.append(k)
                continue
            seen.add(k)
            asks = adm.recall(k) + 1
            if adm.admits(asks):
                out.append(k)
            else:
                away.append((k, asks))
        self._turn_away(away)
        return out

    def _write_through(self, keys: list[Hashable], now: float) -> None:
        """KVStore._write_through: pin the DRAM copies, reserve NVMe now, copy in the background."""
        D, N = self.D, self.N
        dents = [D.lookup(k, now) for k in keys]
        for e in dents:
            if e is not None:
                e.pins += 1
        nents = self._reserve(N, keys, self.nvme_entry_bytes, now)
        for de, ne in zip(dents, nents):
            if ne is not None:
                self._deferred.append((ne, (de,) if de is not None else None))
            elif de is not None:
                D.unpin(de)
