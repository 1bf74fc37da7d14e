"""Tier accounting: capacity in bytes, idle TTL, pins and two-phase entries. No I/O, no clock.

This is the code both the live store and the TTL tuner run, so a simulated hit rate is the
store's hit rate. Every method takes ``now`` explicitly.

Life of an entry: ``reserve`` (WRITING, pinned: invisible to lookups, never evicted) ->
``commit`` (READY) or ``abort`` (gone). A READY entry can be ``pin``-ned while it is read, and
is then never evicted until ``unpin``. Eviction order: expired entries first, then the
policy's victims, skipping pinned and WRITING entries; the work per call is bounded.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Hashable, Iterable

from kvstore.tiers.policy import Policy

READY = 0
WRITING = 1

EXPIRED = "expired"
CAPACITY = "capacity"


@dataclass(slots=True, eq=False)
class Entry:
    key: Hashable
    nbytes: int
    last_access: float
    expire_at: float
    state: int = WRITING
    pins: int = 0
    slot: int = -1  # tier-private locator (a DRAM slot); -1 when unused
    reason: str = ""  # why it left the index (EXPIRED / CAPACITY), set on eviction
    ttl: float | None = None  # per-entry TTL (TTL classes); None = the tier's
    first_session: Hashable = None  # the first session that hit it (for ``ttl_shared_s``)
    shared: bool = False  # hit by >= 2 distinct sessions (then ``ttl`` is the tier's shared TTL)
    asks: int = 0  # requests that used it: its commit and each hit (placement.Admission)
    hint: float | None = None  # a request's retention hint (its idle TTL, kv_transfer_params), kept by lower tiers
    heap_at: float = math.inf  # deadline of this entry's live TTL-heap item (inf: none)
    condemned: bool = False  # out of the index while still pinned (see TierIndex.condemn)


class TierIndex:
    def __init__(
        self,
        capacity_bytes: int,
        ttl_s: float | None,
        policy: Policy,
        *,
        max_expire_per_call: int = 256,
        max_scan_per_call: int = 4096,
        ttl_shared_s: float | None = None,
    ) -> None:
        assert capacity_bytes >= 0
        self.capacity = int(capacity_bytes)
        self.ttl = ttl_s
        # TTL class: entries hit by >= 2 distinct sessions get this idle TTL (None: all get ``ttl``)
        self.ttl_shared = ttl_shared_s
        self.policy = policy
        self.max_expire = max_expire_per_call
        self.max_scan = max_scan_per_call
        self.entries: dict[Hashable, Entry] = {}
        self.used = 0
        # did the capacity or the TTL ever decide anything (a reserve found the index full, an
        # entry was seen past its TTL)? A run where one did not gives the same results for any
        # larger value: the tuner skips those (kvstore.tune.grid)
        self.consulted = {"capacity": False, "ttl": False}
        # bytes reserves asked for past the capacity (each made room or was refused): the demand a
        # node daemon's DRAM budget reads to move capacity between its models (kvstore.node.budget)
        self.wanted = 0
        self._heap: list[tuple[float, int, Hashable]] = []
        self._seq = 0
        # KV events (kvstore.store.events): (True, key) when an entry becomes READY, (False, key)
        # when a READY entry leaves; None (the tuner, events off): nothing is recorded
        self.journal: list[tuple[bool, Hashable]] | None = None

    # -- queries -----------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, key: Hashable) -> bool:
        e = self.entries.get(key)
        return e is not None and e.state == READY

    def lookup(self, key: Hashable, now: float) -> Entry | None:
        """The READY, unexpired entry for ``key``, or None. Does not refresh it."""
        e = self.entries.get(key)
        if e is None or e.state != READY:
            return None
        if e.expire_at <= now:
            self.consulted["ttl"] = True
            return None
        return e

    def serving(self, keys, now: float) -> list[bool]:
        """:meth:`lookup` of each key, as found or not, in one call (a replay's lookups are a
        tenth of its work; the per-key calls were half of that)."""
        get, out, seen_expired = self.entries.get, [], False
        for k in keys:
            e = get(k)
            if e is None or e.state != READY:
                out.append(False)
            elif e.expire_at <= now:
                seen_expired = True
                out.append(False)
            else:
                out.append(True)
        if seen_expired:
            self.consulted["ttl"] = True
        return out

    def writing_entry(self, key: Hashable) -> Entry | None:
        """The entry of ``key`` while it is being written (WRITING), else None."""
        e = self.entries.get(key)
        return e if e is not None and e.state == WRITING else None

    @property
    def free(self) -> int:
        return self.capacity - self.used

    # -- time --------------------------------------------------------------------------------
    def _ttl(self, e: Entry) -> float | None:
        return self.ttl if e.ttl is None else e.ttl

    def _rebuild_heap(self) -> None:
        heap = []
        for i, e in enumerate(self.entries.values()):
            e.heap_at = e.expire_at
            if e.expire_at != math.inf:
                heap.append((e.expire_at, i, e.key))
        heapq.heapify(heap)
        self._heap = heap
        self._seq = len(heap)

    def touch(self, e: Entry, now: float, session: str | None = None) -> None:
        """A hit: refresh recency and the idle TTL (:meth:`touch_many` of one entry)."""
        self.touch_many((e,), now, session)

    def touch_many(self, entries, now: float, session: str | None = None, ttl: float | None = None) -> None:
        """A hit of each entry still indexed (after :meth:`extend` with ``ttl``), last first (a
        prefix chain's head ends most recent): refresh recency and the idle deadline.

        With ``ttl_shared`` set, the second distinct ``session`` that hits an entry moves it to
        the shared TTL class (tracked with one remembered session and a flag: O(1) per hit).
        Each touch (a commit, a load's hit: one per request) is one of the entry's ``asks``.
        The TTL heap is lazy: an entry keeps one live item, pushed only when the new deadline
        is earlier than it (a hit, which pushes the deadline later, costs no heap work; the item
        re-schedules itself when it comes due). One call per batch, the steps inlined: a hit's
        blocks are most of a replay's work (kvstore tune), and per-entry calls were half of it.
        """
        index, shared_ttl, tier_ttl = self.entries, self.ttl_shared, self.ttl
        heap, push, inf = self._heap, heapq.heappush, math.inf
        touched = []
        for e in reversed(entries):
            if e is None or index.get(e.key) is not e:
                continue
            if ttl is not None:
                self.extend(e, ttl)
            e.asks += 1
            if shared_ttl is not None and session is not None and not e.shared:
                if e.first_session is None:
                    e.first_session = session
                elif session != e.first_session:
                    e.shared = True
                    e.ttl = shared_ttl if e.hint is None else max(shared_ttl, e.hint)
            t = tier_ttl if e.ttl is None else e.ttl
            e.last_access = now
            if t is None:
                e.expire_at = inf
            else:
                x = e.expire_at = now + t
                if x < e.heap_at:
                    self._seq += 1
                    push(heap, (x, self._seq, e.key))
                    e.heap_at = x
                    if len(heap) > 2 * len(index) + 1024:
                        self._rebuild_heap()
                        heap = self._heap
            touched.append(e.key)
        self.policy.touch_many(touched, session)

    def pin_ready(self, keys, now: float) -> list[Entry | None]:
        """:meth:`lookup` then :meth:`pin` for each key (None where it finds none), in one call."""
        index, out = self.entries, []
        for k in keys:
            e = index.get(k)
            if e is not None and e.state == READY:
                if e.expire_at > now:
                    e.pins += 1
                    out.append(e)
                    continue
                self.consulted["ttl"] = True
            out.append(None)
        return out

    def extend(self, e: Entry, ttl: float) -> None:
        """A retention hint on a hit: the entry's idle TTL becomes at least ``ttl`` (never
        shorter: other sessions may count on it); it applies from the next touch."""
        cur = self._ttl(e)
        if cur is not None and ttl > cur:
            e.ttl = e.hint = ttl

    def due(self, now: float) -> bool:
        """Is a TTL deadline past ``now`` (an expiry for :meth:`expire`, or a stale item it drops)?"""
        return bool(self._heap) and self._heap[0][0] <= now

    def expire(self, now: float, limit: int | None = None) -> list[Entry]:
        """Remove up to ``limit`` expired, unpinned entries (the oldest deadlines first)."""
        limit = self.max_expire if limit is None else limit
        out: list[Entry] = []
        held: list[tuple[float, int, Hashable]] = []
        heap = self._heap
        popped = 0
        while heap and heap[0][0] <= now and len(out) < limit and popped < self.max_scan:
            popped += 1
            item = heapq.heappop(heap)
            e = self.entries.get(item[2])
            if e is None or e.heap_at != item[0]:
                continue  # stale heap item
            if e.expire_at > now:  # refreshed since the item was pushed: re-schedule it
                e.heap_at = math.inf
                if e.expire_at != math.inf:
                    self._seq += 1
                    heapq.heappush(heap, (e.expire_at, self._seq, e.key))
                    e.heap_at = e.expire_at
                continue
            if e.pins or e.state != READY:
                held.append(item)
                continue
            self._drop(e, EXPIRED)
            self.consulted["ttl"] = True
            out.append(e)
        for item in held:
            heapq.heappush(heap, item)
        return out

    # -- two-phase insert ----------------------------------------------------------------------
    def reserve(self, key: Hashable, nbytes: int, now: float, ttl: float | None = None) -> tuple[Entry | None, list[Entry]]:
        """Make room and add ``key`` as WRITING (pinned). Returns (entry, evicted).

        entry is None when there is no room (too big, or everything evictable is pinned); the
        evicted list is still returned because expired entries may have been swept.
        """
        assert key not in self.entries, "reserve of a key already in the index"
        if self.used + nbytes > self.capacity:
            self.consulted["capacity"] = True
            self.wanted += nbytes
        heap = self._heap
        evicted = self.expire(now) if heap and heap[0][0] <= now else []  # (nothing due: no sweep)
        if nbytes > self.capacity:
            return None, evicted
        need = self.used + nbytes - self.capacity
        # expired entries go before any policy victim, even past the per-call sweep limit
        while need > 0 and self._heap and self._heap[0][0] <= now:
            more = self.expire(now, limit=1)
            if not more:
                break  # what is due is pinned
            evicted.extend(more)
            need -= more[0].nbytes
        if need > 0:
            victims = self._pick_victims(need)
            if victims is None:
                return None, evicted
            for v in victims:
                self._drop(v, CAPACITY)
            evicted.extend(victims)
        e = Entry(key=key, nbytes=nbytes, last_access=now, expire_at=math.inf, state=WRITING, pins=1, ttl=ttl,
                  hint=ttl)
        self.entries[key] = e
        self.used += nbytes
        return e, evicted

    def _pick_victims(self, need: int) -> list[Entry] | None:
        got, picked, scanned = 0, [], 0
        for k in self.policy.victims():
            scanned += 1
            if scanned > self.max_scan:
                break
            e = self.entries.get(k)
            if e is None or e.pins or e.state != READY:
                continue
            picked.append(e)
            got += e.nbytes
            if got >= need:
                return picked
        return None

    def shrink(self) -> list[Entry]:
        """Evict the policy's victims until the index fits its capacity again (lowered under it:
        a node daemon's budget moved some to another model); pinned and WRITING entries stay, and
        go at a later call. Bounded work, as :meth:`expire`."""
        out, need, scanned = [], self.used - self.capacity, 0
        if need <= 0:
            return out
        for k in self.policy.victims():  # picked first, dropped after (the policy's order is iterated)
            scanned += 1
            if need <= 0 or scanned > self.max_scan:
                break
            e = self.entries.get(k)
            if e is None or e.pins or e.state != READY:
                continue
            out.append(e)
            need -= e.nbytes
        for e in out:
            self._drop(e, CAPACITY)
        return out

    def oldest_access(self) -> float:
        """The last access of the policy's first unpinned victim (inf: none): how recent the
        block this index would give up next is."""
        scanned = 0
        for k in self.policy.victims():
            scanned += 1
            if scanned > self.max_scan:
                break
            e = self.entries.get(k)
            if e is not None and not e.pins and e.state == READY:
                return e.last_access
        return math.inf

    def commit(self, e: Entry, now: float, session: str | None = None) -> None:
        self.commit_many((e,), now, session)

    def commit_many(self, entries, now: float, session: str | None = None, keep_pinned: bool = False) -> None:
        """:meth:`commit` each entry, in order (``keep_pinned``: each stays pinned once, for a
        caller that reads it next): a store's blocks in one call."""
        index, journal, insert = self.entries, self.journal, self.policy.insert
        for e in entries:
            assert e.state == WRITING and e.pins > 0 and index.get(e.key) is e
            e.state = READY
            if not keep_pinned:
                e.pins -= 1
            insert(e.key)
            if journal is not None:
                journal.append((True, e.key))
        self.touch_many(entries[::-1], now, session)  # (touched last first: back in this order)

    def abort(self, e: Entry) -> None:
        assert e.state == WRITING and self.entries.get(e.key) is e
        del self.entries[e.key]
        self.used -= e.nbytes

    def add_ready(self, key: Hashable, nbytes: int, last_access: float, now: float, ttl: float | None = None) -> tuple[Entry | None, list[Entry]]:
        """Insert an existing READY item (start-up rebuild). Feed oldest first."""
        e, evicted = self.reserve(key, nbytes, now, ttl)
        if e is not None:
            self.commit(e, last_access)
        return e, evicted

    # -- pins and removal ----------------------------------------------------------------------
    def pin(self, e: Entry) -> None:
        assert self.entries.get(e.key) is e
        e.pins += 1

    def unpin(self, e: Entry) -> bool:
        """Returns True when this was the last pin of a condemned entry: its medium is the
        caller's to free now."""
        assert e.pins > 0
        e.pins -= 1
        return e.condemned and not e.pins

    def unpin_many(self, entries) -> list[Entry]:
        """:meth:`unpin` each entry (None skipped); the condemned ones whose last pin this was."""
        last = []
        for e in entries:
            if e is not None:
                assert e.pins > 0
                e.pins -= 1
                if e.condemned and not e.pins:
                    last.append(e)
        return last

    def remove(self, key: Hashable, reason: str = "") -> Entry | None:
        """Remove a READY, unpinned entry (e.g. corrupt on read). Returns it, or None."""
        e = self.entries.get(key)
        if e is None or e.state != READY or e.pins:
            return None
        self._drop(e, reason)
        if reason == EXPIRED:
            self.consulted["ttl"] = True
        return e

    def condemn(self, e: Entry, reason: str) -> bool:
        """Take a READY entry out of the index even while other readers pin it: its medium
        failed a read (corrupt, gone), so every later lookup must miss it at once. Waiting for
        the last pin instead let the lookups of retried requests re-pin it, one failed load
        after another (vLLM reschedules a failed load at once): 26 failed loads of one bad file
        in the engine fault test, up to ~1,000 on a loaded machine. Returns True when nobody
        pins it (free its medium now); else the last :meth:`unpin` returns True."""
        assert e.state == READY and self.entries.get(e.key) is e
        self._drop(e, reason)
        e.condemned = True
        return not e.pins

    def _drop(self, e: Entry, reason: str) -> None:
        if self.journal is not None:
            self.journal.append((False, e.key))
        del self.entries[e.key]
        self.policy.remove(e.key)
        self.used -= e.nbytes
        e.reason = reason

    def keys(self) -> Iterable[Hashable]:
        return [k for k, e in self.entries.items() if e.state == READY]

    def check(self) -> None:
        """Invariants (used by tests)."""
        assert self.used == sum(e.nbytes for e in self.entries.values()), "used bytes drifted"
        # over it only while a lowered capacity waits for pinned entries (see shrink)
        held = sum(e.nbytes for e in self.entries.values() if e.pins or e.state != READY)
        assert self.used <= max(self.capacity, held), f"over capacity: {self.used} > {self.capacity}"
        ready = {k for k, e in self.entries.items() if e.state == READY}
        assert len(self.policy) == len(ready), "policy and index disagree on the number of entries"
        assert set(self.policy.victims()) == ready, "policy and index disagree on the keys"
        due = {(item[0], item[2]) for item in self._heap}
        for k, e in self.entries.items():
            assert e.key == k
            assert e.pins >= 0, f"negative pins on {k!r}"
            if e.state == WRITING:
                assert e.pins >= 1, "a WRITING entry must be pinned"
            elif e.expire_at != math.inf:
                assert e.heap_at <= e.expire_at and (e.heap_at, k) in due, \
                    "an expiring entry has no TTL heap item at or before its deadline"
