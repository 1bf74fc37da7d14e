"""TierChain: where a block lives, where it goes, and what must move. Pure: no bytes, no metrics.

The chain is a tuple of tiers, top first (DRAM, NVMe, Redis; any of them may be absent). It
answers lookups, decides reservations, pins and victims, and returns what must happen to bytes
as :class:`Transfer` objects, and what it counted as a :class:`Plan`; :mod:`kvstore.store.transfers`
runs the moves, the store's metrics sink reads the counts, and the tuner's simulator drives
this same class over tiers that hold no bytes (:mod:`kvstore.tune.simulate`).

Tiers are of two kinds. A *local* tier keeps its own index (capacity, TTL, pins): a lookup asks
it key by key. A *shared* tier (``tier.shared``: Redis) is written by every engine and keeps its
index itself: it is asked in batches, after the local tiers, for the rest of the prompt, and its
blocks are never pinned. The rules between tiers are :mod:`kvstore.store.placement`'s:

* a stored block enters the top tier, unless a local tier below holds it (or is writing it);
* a victim of a local tier is written down to the next local tier when the rules say so
  (``DEMOTE``), and a victim of the last local tier to the first shared tier that takes victims
  (``write_through`` off: a shared folder under ``write_mode: write_back``); meanwhile a DRAM
  victim keeps its slot and is served from it (:class:`~kvstore.store.demotions.Demotions`), a
  file's victim keeps its file until written but is not served (a miss for that moment); a
  shared tier's victims (those its own sweeper set aside) go to the next such tier below it;
* a hit in a lower tier is copied up into the top tier when a slot is free (a promotion);
* a block stored in a tier is copied at once into every tier below that asks for it
  (``tier.write_through``: NVMe under ``write_mode: write_through``; Redis always);
* ``admit_after`` on a tier gates every write into it (:class:`placement.Admission`).

Locks: each tier's own (index work), :class:`Demotions`'s, and the chain's for the miss-reason
memory and admission; never two at once, except a tier's inside the chain's for a read of
``present_or_writing``.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Sequence

from kvstore.store import placement
from kvstore.store.demotions import Demotions
from kvstore.tiers.base import Tier
from kvstore.tiers.index import Entry

# Transfer kinds
DEMOTE = "demote"  # a victim written down from its (held) slot; the slot is freed when done
COPY = "copy"  # a stored block copied into a write-through tier below (source pinned meanwhile)
STORE = "store"  # the caller's staged buffers written into a tier that has no slots (NVMe, Redis)
FREE = "free"  # media of entries that left an index (files to remove)


@dataclass(slots=True, eq=False)
class Transfer:
    """One transfer the chain decided, for :mod:`kvstore.store.transfers` to run. ``src`` None: the
    caller's buffers (``views``). ``pairs``: (source entry or None, destination entry)."""

    kind: str
    src: Tier | None
    dst: Tier | None
    pairs: list
    views: list | None = None
    background: bool = True
    moving: bool = False  # a demotion registered in :class:`Demotions` (servable from its slot until done)
    victims: bool = False  # a demotion of victims: each source entry's medium is freed once written


@dataclass(slots=True)
class Plan:
    """What a chain call decided: the transfers to run and what it counted, as (event, tier, blocks)
    with event one of ``evicted``, ``expired``, ``no_slot``, ``pinned``, ``not_admitted`` (and the
    movers' ``backlog``)."""

    transfers: list = field(default_factory=list)
    counts: list = field(default_factory=list)

    def count(self, event: str, tier: str, n: int) -> None:
        if n:
            self.counts.append((event, tier, n))


class _Gone:  # a block that left no entry behind, for remember_gone
    __slots__ = ("key", "reason")

    def __init__(self, key: bytes, reason: str = placement.NOT_ADMITTED):
        self.key, self.reason = key, reason


class TierChain:
    def __init__(self, tiers: Sequence[Tier], *, clock: Callable[[], float], ghost_capacity: int = 1 << 17):
        self.tiers = tuple(tiers)
        self.local = tuple(t for t in self.tiers if not t.shared)
        self.shared = tuple(t for t in self.tiers if t.shared)
        assert self.local == self.tiers[: len(self.local)], "shared tiers come after the local ones"
        self.top = self.tiers[0] if self.tiers else None
        self.clock = clock
        # where each tier's victims go: the next local tier; below the last, the first shared tier
        # that takes victims (a write-through one holds every block already, or let it go itself)
        takes = next((t for t in self.shared if not t.write_through), None)
        self._below = {t: self.local[i + 1] if i + 1 < len(self.local) else takes for i, t in enumerate(self.local)}
        for i, t in enumerate(self.shared):  # a shared tier's victims (its own sweeper's): the next that takes them
            self._below[t] = next((s for s in self.shared[i + 1:] if not s.write_through), None)
            t.keeps_victims = self._below[t] is not None
        # admission (tiers.<tier>.admit_after): the asks of blocks turned away from that tier
        self.adm_tier = next((t for t in self.local if t.admit_after), None)
        after = self.adm_tier.admit_after if self.adm_tier is not None else 0
        self.adm = placement.Admission(after, ghost_capacity)
        self._above_adm = self.local[: self.local.index(self.adm_tier)] if self.adm_tier is not None else ()
        self.demotions = Demotions()
        self._ghosts: OrderedDict[bytes, str] = OrderedDict()  # why a block left (miss reasons)
        self._ghost_cap = ghost_capacity
        self.lock = threading.Lock()  # the ghosts and the admission's memory

    def __len__(self) -> int:
        return len(self.tiers)

    def below(self, t: Tier) -> Tier | None:
        """The tier a victim of ``t`` is written down to (None: it is dropped)."""
        return self._below.get(t)

    # -- lookups -----------------------------------------------------------------------------------
    def unheld(self, keys: Sequence[bytes]) -> list[bytes]:
        """The keys no local tier serves (its index, or a demotion still in its slot): one batch
        per tier (a store's victims, each looked up in every tier one by one, were a tenth of a
        replay's work)."""
        for t in self.local:
            if not keys:
                break
            moving = len(self.demotions) > 0
            keys = [k for k, there in zip(keys, t.serving(keys)) if not there and not (moving and self.demotions.has(t, k))]
        return list(keys)

    def locate(self, keys: Sequence[bytes]) -> list[Tier]:
        """The tier of each leading block that some tier serves: the local tiers key by key, then
        the shared ones for the rest of the prompt (one batch each)."""
        n_keys = len(keys)
        where: list[Tier | None] = [None] * n_keys
        miss: Sequence[int] = range(n_keys)
        for t in self.local:  # one batch per tier, for the keys the tiers above do not serve
            if not miss:
                break
            got = t.serving(keys if len(miss) == n_keys else [keys[i] for i in miss])
            moving = len(self.demotions) > 0
            rest = []
            for i, g in zip(miss, got):
                if g or (moving and self.demotions.has(t, keys[i])):  # (or still in its slot, moving down)
                    where[i] = t
                else:
                    rest.append(i)
            miss = rest
        found: list[Tier] = where[: miss[0] if miss else n_keys]
        for t in self.shared:
            if len(found) < len(keys):
                found += [t] * t.leading(keys[len(found):])
        return found

    def miss_reason(self, key: bytes, at: int) -> str:
        """Why the block at position ``at`` of a lookup is missing (:func:`placement.miss_reason`)."""
        expired = any(t.is_expired(key) for t in self.local)  # past its TTL, not swept yet
        with self.lock:
            why = self._ghosts.get(key)
        return placement.miss_reason(expired=expired, remembered=why, at=at)

    def remember_gone(self, entries, reason: str | None = None) -> None:
        with self.lock:
            g = self._ghosts
            for e in entries:
                g[e.key] = placement.gone_reason(reason or e.reason)
                g.move_to_end(e.key)
            while len(g) > self._ghost_cap:
                g.popitem(last=False)

    def forget_gone(self, keys: Sequence[bytes]) -> None:
        if self._ghosts:
            with self.lock:
                for k in keys:
                    self._ghosts.pop(k, None)

    # -- reservations ------------------------------------------------------------------------------
    def reserve(self, t: Tier, keys: Sequence[bytes], plan: Plan, ttl: float | None = None, *,
                stored: bool = True, background: bool = False) -> list[Entry | None]:
        """Entries of tier ``t`` for ``keys`` (None: present, pending, turned away or no room).
        Its victims go down first (those that need no write free their slots at once, so the new
        entries find them); the rest are moves in ``plan``. ``stored``: a block the caller
        computed (a write into the admission tier must have its asks; an entry above it carries
        those remembered for it), else a copy from another tier (admitted already).
        ``background``: victims' files are removed on the I/O pool (the caller is the engine's
        thread)."""
        if t is self.adm_tier and self.adm.active and stored:
            ok = self._admit(keys, plan)
            if not all(ok):
                got = iter(self._reserve(t, [k for k, o in zip(keys, ok) if o], plan, ttl, stored, background))
                return [next(got) if o else None for o in ok]
        return self._reserve(t, keys, plan, ttl, stored, background)

    def _reserve(self, t: Tier, keys: Sequence[bytes], plan: Plan, ttl: float | None, stored: bool,
                 background: bool) -> list[Entry | None]:
        res = t.begin_reserve(keys, ttl)
        try:
            self.victims(t, res.victims, plan, background)
        except BaseException:
            t.abort(res)
            raise
        t.attach(res)
        plan.count("no_slot", t.name, res.no_slot)
        plan.count("pinned", t.name, res.pinned)
        adm = self.adm
        if adm.active and t in self._above_adm:
            with self.lock:
                for e in res:
                    if e is not None:
                        e.asks = adm.recall(e.key) if stored else adm.after
        return list(res)

    def _admit(self, keys: Sequence[bytes], plan: Plan) -> list[bool]:
        """For a store straight into the admission tier: which keys may be written. Each key it
        does not hold yet is asked once more; those still short of their asks are turned away."""
        adm, t = self.adm, self.adm_tier
        out, seen, away = [], set(), []
        for k in keys:
            if k in seen or t.present_or_writing(k):  # stored or being written: the reservation skips it
                out.append(True)
                continue
            seen.add(k)
            with self.lock:
                asks = adm.recall(k) + 1
            out.append(adm.admits(asks))
            if not out[-1]:
                away.append((k, asks))
        self.turn_away(away, plan)
        return out

    def turn_away(self, blocks: list[tuple[bytes, int]], plan: Plan) -> None:
        """Blocks dropped for want of asks: their asks remembered, the miss reason too, counted."""
        if blocks:
            with self.lock:
                for k, asks in blocks:
                    self.adm.turn_away(k, asks)
            self.remember_gone([_Gone(k) for k, _ in blocks])
            plan.count("not_admitted", self.adm_tier.name, len(blocks))

    def store_entries(self, keys: Sequence[bytes], plan: Plan, ttl: float | None = None) -> list[Entry | None]:
        """The top tier's entries for a store (``begin_store``): keys a local tier below holds, or
        is writing, are not stored again; a repeated key is reserved once."""
        top = self.top
        if top.shared:  # a store without local tiers: keys the shared tier holds (one batch) are skipped
            seen, want = set(), []
            for k, there in zip(keys, top.holds(keys)):
                want.append(not there and k not in seen)
                seen.add(k)
            got = iter(top.begin_reserve([k for k, w in zip(keys, want) if w], ttl))
            return [next(got) if w else None for w in want]
        want = keys
        for t in self.local[1:]:  # one batch per tier below
            want = [k for k, there in zip(want, t.holds(want)) if placement.admit(there)]
        # a repeated key is reserved once (its later copies get None): keep that entry, never
        # overwrite it with a later None (it would stay WRITING and pinned forever)
        got = {k: e for k, e in zip(want, self.reserve(top, want, plan, ttl)) if e is not None} if want else {}
        return [got.pop(k, None) for k in keys]

    def overflow(self, keys: Sequence[bytes], entries: Sequence[Entry | None]) -> tuple[Tier | None, list[int]]:
        """Blocks a ``put`` found no room for in the top tier (every free slot held by a
        demotion or a pin) and nowhere else: the local tier below takes them directly."""
        below = self.below(self.top) if self.top is not None else None
        if below is None:
            return None, []
        idx = [j for j, e in enumerate(entries) if e is None]
        held = self.top.holds([keys[j] for j in idx]) if idx else []  # one batch: most are stored already (hits)
        return below, [j for j, h in zip(idx, held) if not h]

    def committed(self, t: Tier, entries: Sequence[Entry | None], oks: Sequence[bool], plan: Plan,
                  views: list | None = None, ttl: float | None = None) -> None:
        """A store into ``t`` ended: publish it, and copy what was stored into every tier below
        that asks for it (moves in ``plan``; from ``t``'s slots, pinned meanwhile, or from the
        caller's ``views``)."""
        t.commit(entries, oks)
        stored = [e.key for e, o in zip(entries, oks) if e is not None and o]
        self.forget_gone(stored)
        if not stored:
            return
        for lower in self.tiers[self.tiers.index(t) + 1:]:
            if not lower.write_through:
                continue
            keys = stored
            if lower is self.adm_tier and self.adm.active:  # short of their asks: written at eviction if they get them
                keys = [e.key for e, o in zip(entries, oks) if e is not None and o and self.adm.admits(e.asks)]
            if keys:
                plan.transfers.append(self.copy(t, lower, keys, plan, ttl, views and
                                            [v for e, o, v in zip(entries, oks, views) if e is not None and o]))

    def copy(self, src: Tier, dst: Tier, keys: list[bytes], plan: Plan, ttl: float | None,
             views: list | None = None) -> Transfer:
        """A write-through copy of freshly stored blocks (pinned in ``src``, or staged ``views``)."""
        if views is None:
            pinned = src.acquire(keys, touch=False)
        else:
            pinned = [None] * len(keys)
        if dst.shared:  # one batch; blocks gone from src meanwhile are not sent
            keep = [i for i, e in enumerate(pinned) if e is not None or views is not None]
            dentries = dst.begin_reserve([keys[i] for i in keep], ttl)
            return Transfer(COPY, src if views is None else None, dst,
                        [(pinned[i], de) for i, de in zip(keep, dentries)],
                        views=[views[i] for i in keep] if views is not None else None)
        dentries = self.reserve(dst, keys, plan, ttl, stored=False)
        pairs = [(se, de) for se, de in zip(pinned, dentries) if se is not None or de is not None]
        return Transfer(COPY, src, dst, pairs)

    # -- victims -----------------------------------------------------------------------------------
    def victims(self, t: Tier, victims: list[Entry], plan: Plan, background: bool = False) -> None:
        """Entries that left ``t``'s index (evicted or expired), each still holding its medium:
        written down where the rules say so (a move; the slot stays taken and servable until it
        is done), freed otherwise (a slot at once; files by a move)."""
        if not victims:
            return
        exp = sum(1 for e in victims if e.reason == "expired")
        plan.count("expired", t.name, exp)
        plan.count("evicted", t.name, len(victims) - exp)
        below = self.below(t)
        if below is None:
            gone = set(self.unheld([e.key for e in victims]))
            self.remember_gone([e for e in victims if e.key in gone])
            self.free(t, victims, plan, background)
            return
        now = self.clock()
        free, todo, gone, away = [], [], [], []
        held = self._held_below(below, victims)
        for e, there in zip(victims, held):
            act = self.demote_action(e, below, now, there)
            if act == placement.DEMOTE:
                todo.append(e)
                continue
            free.append(e)
            if act == placement.STALE:
                gone.append((e, "expired"))
            elif act == placement.NOT_ADMITTED:
                away.append(e)
        jobs = []
        if todo:
            by_hint: dict = {}  # a retention hint goes down with its block
            for e in todo:
                by_hint.setdefault(e.hint, []).append(e)
            pairs = [p for hint, es in by_hint.items()
                     for p in zip(self.reserve(below, [e.key for e in es], plan, hint, stored=False,
                                               background=True), es)]
            for ne, e in pairs:
                if ne is None:  # no room below (everything there pinned): the block is lost
                    free.append(e)
                    gone.append((e, None))
                else:
                    ne.last_access = e.last_access  # the file's mtime: recency survives a restart
                    jobs.append((e, ne))
            if t.addressable:  # a slot's victim is served from it until written (a file's is not: a
                # load's pin of it would be released by its tier, never through Demotions, and leak)
                self.demotions.add(t, [e for e, _ in jobs])
        self.free(t, free, plan, background)
        for e, why in gone:
            self.remember_gone([e], why)
        self.turn_away([(e.key, e.asks) for e in away], plan)
        if jobs:
            plan.transfers.append(Transfer(DEMOTE, t, below, jobs, moving=t.addressable, victims=True))

    @staticmethod
    def _held_below(below: Tier, victims: Sequence[Entry]) -> list[bool]:
        """Which victims ``below`` holds already (not written again). A shared tier is not asked
        here: victims arise on the caller's thread (a store's reservation), which a stalled mount
        would hold for its deadline; the write-down job asks it instead, on the I/O pool."""
        if below.shared:
            return [False] * len(victims)
        return below.holds([e.key for e in victims])

    def demote_action(self, e: Entry, below: Tier, now: float, there: bool) -> str:
        """:func:`placement.demote_action` for victim ``e`` (``there``: ``below`` holds it or is
        writing it; admitted: its asks)."""
        adm = self.adm
        act = placement.demote_action(e.last_access, now, has_lower=True, lower_holds=there,
                                      lower_ttl=below.ttl, admitted=below is not self.adm_tier or not adm.active
                                      or adm.admits(e.asks))
        if act == placement.STALE:
            below.consult("ttl")
        return act

    def free(self, t: Tier, entries: list[Entry], plan: Plan, background: bool = False) -> None:
        """Return media of entries that left ``t``: a slot of memory at once (bookkeeping), a
        file by a move (I/O)."""
        if not entries:
            return
        if t.addressable:
            t.free(entries)
        else:
            plan.transfers.append(Transfer(FREE, t, None, entries, background=background))

    def demoted(self, move: Transfer, oks: Sequence[bool]) -> list[tuple[Entry, Entry]]:
        """A demotion ended: the lower copies are published with the upper recency (their TTL
        counts from the last real access); a failed one is remembered as gone. Returns the pairs
        whose upper slot (or file) is free now."""
        free = []
        for (e, ne), ok in zip(move.pairs, oks):
            move.dst.commit([ne], [ok], at=e.last_access)
            if not ok:
                self.remember_gone([e])
            if not move.moving or self.demotions.done(e):
                free.append((e, ne))
        if (move.moving or move.victims) and free:  # (a write-back's entries stay: the caller's, pinned)
            move.src.free([e for e, _ in free])
        return free

    def copied(self, move: Transfer, oks: Sequence[bool]) -> None:
        """A write-through copy ended: publish it below, unpin the source."""
        dst = move.dst
        for (_, de), ok in zip(move.pairs, oks):  # in order, one by one: as the copies end (recency)
            dst.commit([de], [ok])
        if dst.shared:
            self.forget_gone([de.key for (_, de), ok in zip(move.pairs, oks) if ok])
        if move.src is not None:
            move.src.release([se for se, _ in move.pairs if se is not None])

    # -- loads -------------------------------------------------------------------------------------
    def pin(self, keys: Sequence[bytes], session: str | None = None, ttl: float | None = None
            ) -> tuple[list[Tier], list[Entry | None]]:
        """Pin the leading blocks some tier serves (local ones pinned, shared ones only found);
        only the blocks of that prefix count as hits. Returns (tier per block, entry per block)."""
        n_keys = len(keys)
        entries: list[Entry | None] = [None] * n_keys
        where: list[Tier | None] = [None] * n_keys
        miss: Sequence[int] = range(n_keys)
        used = []  # the tiers that pinned something, top first
        for t in self.local:
            if not miss:
                break
            got = t.acquire(keys if len(miss) == n_keys else [keys[i] for i in miss], touch=False)
            if len(self.demotions) and None in got:  # still in the slot it is being written down from
                # only where the index missed: a key may be both stored again and still moving
                # (the old copy's pin, dropped here, leaked its slot: 1 run in 8 of test_concurrency)
                holes = [j for j, e in enumerate(got) if e is None]
                for j, m in zip(holes, self.demotions.pin(t, [keys[miss[j]] for j in holes])):
                    got[j] = m
            if len(miss) == n_keys and None not in got:  # (the common hit: the whole prompt in one tier)
                entries, where, miss = list(got), [t] * n_keys, ()
                used.append(t)
                break
            rest = []
            for i, e in zip(miss, got):
                if e is None:
                    rest.append(i)
                else:
                    entries[i] = e
                    where[i] = t
            if len(rest) < len(miss):
                used.append(t)
            miss = rest
        n = miss[0] if miss else n_keys
        for t in used:
            if n < n_keys:
                self.release(t, [e for e, w in zip(entries[n:], where[n:]) if w is t])
            t.touch(entries[:n] if len(used) == 1 else [e if w is t else None for e, w in zip(entries[:n], where[:n])],
                    session, ttl)
        found: list[Tier] = where[:n]
        out = entries[:n]
        for t in self.shared:
            if len(found) < n_keys:
                m = t.leading(keys[len(found):])
                out += t.acquire(keys[len(found):len(found) + m], touch=False)
                found += [t] * m
        return found, out

    def release(self, t: Tier, entries: Sequence[Entry | None], oks: Sequence[bool] | None = None) -> None:
        """Unpin entries of ``t`` (those of blocks still being written down through :class:`Demotions`)."""
        if oks is None and len(self.demotions.held):
            entries, free = self.demotions.release(entries)
            if free:
                t.free(free)
        t.release(entries, oks)

    def promotion(self, keys: Sequence[bytes], plan: Plan) -> list[Entry | None]:
        """Top-tier entries for lower-tier hits about to be read (a promotion), where room is."""
        top = self.top
        if top is None or not top.addressable or not placement.promote(True):
            return [None] * len(keys)
        return self.reserve(top, keys, plan, stored=False)

    def promoted(self, src: Tier, src_entries: list[Entry], up: list[Entry | None], oks: Sequence[bool]) -> None:
        """Reads out of ``src`` ended: unpin them (a failed one leaves its index at once: corrupt
        or gone, remembered so); publish the top-tier copies, pinned for the caller (a retention
        hint follows a block up)."""
        src.release(src_entries, oks)
        for se, de, ok in zip(src_entries, up, oks):
            if de is not None:
                if se.hint is not None:
                    de.ttl = de.hint = se.hint
                self.top.commit([de], [ok], keep_pinned=True)  # pinned for the caller until end_load
        bad = [e for e, ok in zip(src_entries, oks) if not ok]
        if bad and not src.shared:
            for e in bad:
                e.reason = "corrupt"
            self.remember_gone(bad)

    # -- time --------------------------------------------------------------------------------------
    def expire(self, plan: Plan) -> int:
        """Expire what is due in every tier (bounded work per tier); a shared tier's victims are
        those its medium set aside for the tier below."""
        n = 0
        for t in self.tiers:
            ev = t.expire()
            n += len(ev)
            self.victims(t, ev, plan)
        return n

    def persist(self) -> tuple[list[Entry], list[Entry]]:
        """A write-back: every block of the top tier, pinned (the policy's first victims first;
        the caller releases them), and those the rules write down (a block without its asks,
        ``admit_after``, is not written)."""
        below = self.below(self.top) if self.top is not None else None
        if below is None:
            return [], []
        entries = self.top.pin_all()
        now = self.clock()
        held = self._held_below(below, entries)
        return entries, [e for e, there in zip(entries, held)
                         if self.demote_action(e, below, now, there) == placement.DEMOTE]

    def write_down(self, entries: list[Entry], plan: Plan) -> None:
        """Move pinned top-tier ``entries`` down, the caller waiting (a batch of a write-back)."""
        below = self.below(self.top)
        pairs = [(e, ne) for ne, e in zip(self.reserve(below, [e.key for e in entries], plan, stored=False), entries)
                 if ne is not None]
        for e, ne in pairs:
            ne.last_access = e.last_access
        if pairs:
            plan.transfers.append(Transfer(DEMOTE, self.top, below, pairs, background=False))
