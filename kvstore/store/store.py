"""KVStore: the batched, thread-safe block store over a chain of tiers (DRAM, NVMe, Redis).

Blocks are fixed-size byte buffers (``block_bytes`` of uint8, numpy or anything with the
buffer protocol). Keys are 16-byte chain keys (:mod:`kvstore.keys`); because key *i* hashes
the whole prefix, a store answers "how many *leading* keys do you hold".

* ``contains_prefix(keys)`` -> PrefixMatch(num_blocks, tiers, miss_reason)
* ``put(keys, blocks)``      -> number of blocks newly stored
* ``get(keys, out)``         -> number of leading blocks copied into ``out``
* ``prefetch(keys)``         -> Future: promotes the leading lower-tier blocks into the top tier
* ``begin_store/end_store``, ``pin_load/read_load/end_load``: zero-copy two-phase moves for the
  connector (the slots are pinned while in flight and cannot be evicted)

Three collaborators, composed: the tiers (:class:`kvstore.tiers.TierSet`, from the config),
the :class:`~kvstore.store.chain.TierChain` over them (which decides: no bytes), the
:class:`~kvstore.store.transfers.Transfers` (which move the bytes), and one metrics sink. This class
holds the public API and the order of a call's steps; it never asks which tiers exist.
"""

from __future__ import annotations

import functools
import logging
import time
from concurrent.futures import Executor, Future
from typing import Callable, Sequence

import numpy as np

from kvstore import failpoints
from kvstore.config import StoreConfig
from kvstore.keys import ModelFingerprint, root_of
from kvstore.store import placement
from kvstore.store.chain import Plan, TierChain
from kvstore.store.cost import Rates
from kvstore.store.events import TierEvents
from kvstore.store.gate import Gate
from kvstore.store.machine import check_dram
from kvstore.store.handles import LoadHandle, PrefixMatch, StoreHandle, check_keys, check_ttl, rows_of
from kvstore.store.metrics import StoreMetrics
from kvstore.store.transfers import Transfers
from kvstore.tiers import TierSet
from kvstore.tiers.registry import NAMES, SPECS
from kvstore.tiers.base import Tier
from kvstore.tiers.memory import PAGE, alloc_aligned

log = logging.getLogger(__name__)

__all__ = ["KVStore", "PrefixMatch", "StoreHandle", "LoadHandle"]


def _io_threads(config: StoreConfig) -> int:
    """The store's I/O pool: as many threads as the local tier that asks the most."""
    return max((getattr(config.tiers, s.name).io_threads for s in SPECS
                if s.local and hasattr(getattr(config.tiers, s.name), "io_threads")), default=4)


def _scratch(n: int, block_bytes: int) -> np.ndarray:
    """``n`` rows of ``block_bytes`` rounded up to whole pages, page aligned, in one mapping."""
    if n == 0:
        return np.empty((0, block_bytes), np.uint8)
    row = -(-block_bytes // PAGE) * PAGE
    return alloc_aligned(n * row, prefault=False)[1].reshape(n, row)


# How long a close waits for the calls in flight and the handles still open (kvstore.store.gate):
# past it, what they may still touch is left to the process's exit (a warning says so)
CLOSE_WAIT_S = 30.0


def _call(fn):
    """A call of the store: refused once its close has begun, waited for by the close."""
    @functools.wraps(fn)
    def run(self, *args, **kw):
        with self._gate.call():
            return fn(self, *args, **kw)
    return run


def _on_handle(fn):
    """A call on a handle already open: runs while the close waits for the handles."""
    @functools.wraps(fn)
    def run(self, *args, **kw):
        with self._gate.call(on_handle=True):
            return fn(self, *args, **kw)
    return run


class KVStore:
    def __init__(
        self,
        config: StoreConfig | None = None,
        *,
        block_bytes: int,
        fingerprint: ModelFingerprint | bytes,
        block_tokens: int = 1,
        clock: Callable[[], float] = time.time,
        metrics: StoreMetrics | None = None,
        ghost_capacity: int = 1 << 17,
        kv_dtype: str | None = None,
        group_elems: int | None = None,
        io_executor: Executor | None = None,
        events: bool = False,
        tier_options: dict[str, dict] | None = None,
        check_memory: bool = True,
        stand_ins: bool = False,
    ):
        """``tier_options``: per medium, what its tier takes beyond its config section (a node
        daemon's DRAM slab in one memfd it hands to its engines, :mod:`kvstore.node`);
        ``check_memory``: refuse a config asking more memory than this machine has (a node
        daemon checks its whole budget once, at its start); ``stand_ins``: tiers that hold no
        bytes, by the same rules (the tuner's replay, :mod:`kvstore.tune.simulate`)."""
        if block_bytes <= 0:
            raise ValueError(f"block_bytes must be positive, got {block_bytes}")
        self.config = config or StoreConfig()
        self.block_bytes = int(block_bytes)
        self.block_tokens = int(block_tokens)
        self.clock = clock
        self.root = root_of(fingerprint)
        self._gate = Gate()  # the calls in flight and the handles open, for close
        if check_memory:
            check_dram(self.config)  # a pool above this machine's free memory: ConfigError (tiers.dram.capacity_gb)
        self.metrics = metrics or StoreMetrics(port=self.config.metrics.port, host=self.config.metrics.host)
        try:
            self._tiers = TierSet(self.config, block_bytes=self.block_bytes, fingerprint=fingerprint,
                                  clock=clock, kv_dtype=kv_dtype, group_elems=group_elems, events=events,
                                  options=tier_options, stand_ins=stand_ins)
        except BaseException:
            self.metrics.close()
            raise
        self.geometry = self._tiers.geometry
        self.namespace = self._tiers.first_namespace
        self.chain = TierChain(self._tiers.tiers, clock=clock, ghost_capacity=ghost_capacity)
        self.transfers = Transfers(self.chain, self.metrics, block_bytes=self.block_bytes,
                           io_threads=_io_threads(self.config), executor=io_executor)
        self.rates = Rates(use=self.config.io.load_only_if_faster)  # tier reads (measured here), the engine's prefill
        self.metrics.attach(self, fingerprint)
        # KV events (issue 32; ``events``: someone drains them, take_events): the announced tiers'
        # journals and the metadata of their blocks
        ev = self.config.events
        self.events = TierEvents(self.chain.tiers, [s.name for s in SPECS if getattr(ev, s.name).medium]) \
            if events else None
        self._sweeping: Future | None = None
        for t in self.chain.shared:  # its sweeper's victims, set aside for the tier below: taken here
            if t.keeps_victims:
                t.on_victims = self._victims_ready

    # -- the tiers, by name (for operators and tests; the store itself loops over the chain) --------
    def tier(self, name: str) -> Tier | None:
        return next((t for t in self.chain.tiers if t.name == name), None)

    def __getattr__(self, name: str):
        """``store.<medium>``: that tier, or None when it is off (a registered medium's name)."""
        if name in NAMES:
            return self.tier(name)
        raise AttributeError(f"'KVStore' object has no attribute {name!r}")

    @property
    def tiers(self) -> tuple[Tier, ...]:
        return self.chain.local

    # -- lookups -------------------------------------------------------------------------------
    @_call
    def contains_prefix(self, keys: Sequence[bytes], *, record: bool = True, num_tokens: int | None = None,
                        held: int = 0) -> PrefixMatch:
        """How many leading ``keys`` are worth loading, and in which tier each one is: the stored
        prefix, cut where loading is slower than recomputing (``held``: leading blocks the
        engine holds itself, never read)."""
        return self._match(check_keys(keys), record, num_tokens, held)

    def _match(self, keys: list[bytes], record: bool, num_tokens: int | None, held: int) -> PrefixMatch:
        tiers = [t.name for t in self.chain.locate(keys)]
        for t in self.chain.shared:
            self.metrics.sync(t)
        n = placement.worth_loading(tiers, *self.rates.seconds_per_block(self.block_bytes, self.block_tokens), held)
        reason = "slower_than_recompute" if n < len(tiers) else None
        del tiers[n:]
        if not keys:
            reason = "below_min"
        elif n < len(keys) and reason is None:
            reason = self.chain.miss_reason(keys[n], n)
        if record:
            self.metrics.lookup(len(keys), tiers, reason, num_tokens, self.block_tokens)
        return PrefixMatch(n, tuple(tiers), reason)

    # -- stores --------------------------------------------------------------------------------
    @_call
    def put(self, keys: Sequence[bytes], blocks, *, ttl_s: float | None = None) -> int:
        """Store blocks under keys. Returns how many were newly stored (present keys are skipped).
        Never waits for a demotion or a free slot; blocks that found no free slot are written to
        the tier below by this call. ``ttl_s``: a retention hint (see :meth:`begin_store`)."""
        keys = check_keys(keys)
        return self._put(keys, check_ttl(ttl_s), rows_of(blocks, len(keys), self.block_bytes, writable=False,
                                                         name="blocks"))

    def _put(self, keys: list[bytes], ttl_s: float | None, rows: list) -> int:
        if self.chain.top is None:
            return 0
        h = self._begin_store(keys, ttl_s, rows)
        if h.tier is not None and h.tier.addressable:
            try:
                for v, r in zip(h.views, rows):
                    if v is not None:
                        np.copyto(v, r[: self.block_bytes], casting="no")
            except BaseException:
                self.end_store(h, False)
                raise
        n = self.end_store(h, True)
        below, rest = self.chain.overflow(keys, h.entries)
        if rest:  # no free slot (all held by demotions or pins): written below by this call, never a demotion
            plan = Plan()
            ks = [keys[j] for j in rest]
            entries = self.chain.reserve(below, ks, plan, ttl_s)
            self.transfers.run(plan)
            h2 = StoreHandle(ks, entries, [rows[j] if e is not None else None for j, e in zip(rest, entries)],
                             below, ttl=ttl_s, borrowed=True)
            self._gate.opened()
            n += self.end_store(h2, True)
        return n

    @_call
    def begin_store(self, keys: Sequence[bytes], *, ttl_s: float | None = None) -> StoreHandle:
        """Reserve room for the keys not yet stored; returns writable views (None = skip: the key
        is stored or being written, or no free slot). Never waits on I/O. ``ttl_s``: the
        request's retention hint, the idle TTL of these blocks in every tier (None: the config's)."""
        return self._begin_store(check_keys(keys), check_ttl(ttl_s), None)

    def _begin_store(self, keys: list[bytes], ttl: float | None, rows: list | None) -> StoreHandle:
        top = self.chain.top
        if top is None:
            self._gate.opened()  # ended by end_store
            return StoreHandle(keys, [None] * len(keys), [None] * len(keys), None, ttl=ttl)
        plan = Plan()
        entries = self.chain.store_entries(keys, plan, ttl)
        self.transfers.run(plan)
        if top.addressable:
            views = [top.view(e) if e is not None else None for e in entries]
        elif rows is not None:  # put: the caller's rows are written as they are (borrowed, below)
            views = [r if e is not None else None for e, r in zip(entries, rows)]
        else:  # a tier without slots: staged in private buffers, written at end_store
            views = [np.empty(self.block_bytes, np.uint8) if e is not None else None for e in entries]
        h = StoreHandle(keys, entries, views, top, ttl=ttl, borrowed=rows is not None and not top.addressable)
        self._gate.opened()  # ended by end_store
        return h

    def end_store(self, h: StoreHandle, ok: bool | Sequence[bool] = True) -> int:
        """Phase 2: publish what was written (``ok`` may be per key). Returns blocks stored (0 once
        the store's close stopped waiting for it: nothing is published then)."""
        if h.done:
            raise RuntimeError("end_store called twice for one handle")
        h.done = True
        with self._gate.ending() as live:
            return self._end_store(h, ok) if live else 0

    def _end_store(self, h: StoreHandle, ok: bool | Sequence[bool]) -> int:
        oks = [ok] * len(h.keys) if isinstance(ok, (bool, np.bool_)) else list(ok)
        if len(oks) != len(h.keys):
            if h.tier is not None:
                h.tier.abort(h.entries)
            raise ValueError(f"end_store: {len(oks)} results for {len(h.keys)} keys (nothing was stored)")
        oks = [bool(o) and e is not None for o, e in zip(oks, h.entries)]
        tier = h.tier
        if tier is None:
            return 0
        if not tier.addressable:  # staged: written into the tier now
            oks = self.transfers.store(tier, h.entries, h.views, oks)
        plan = Plan()
        self.chain.committed(tier, h.entries, oks, plan, None if tier.addressable else h.views, h.ttl)
        n = sum(oks)
        self.metrics.wrote(tier.name, n, 0, time.perf_counter() - h.started)
        # write-through copies: in the background, unless they read the caller's rows (put's)
        self.transfers.run(plan, borrowed=h.borrowed)
        self.update_gauges()
        return n

    # -- loads -----------------------------------------------------------------------------------
    @_call
    def get(self, keys: Sequence[bytes], out, *, session: str | None = None) -> int:
        """Copy the leading stored blocks into ``out`` (rows). Returns how many were copied."""
        keys = check_keys(keys)
        rows = rows_of(out, len(keys), self.block_bytes, writable=True, name="out")
        h = self.begin_load(keys, outs=rows, session=session)
        try:
            for i in range(h.num_blocks):
                if h.views[i] is not rows[i]:
                    np.copyto(rows[i][: self.block_bytes], h.views[i][: self.block_bytes], casting="no")
        finally:
            self.end_load(h)
        return h.num_blocks

    @_call
    def begin_load(self, keys: Sequence[bytes], *, outs: list[np.ndarray] | None = None,
                   session: str | None = None) -> LoadHandle:
        """Pin the leading stored blocks and read the lower-tier ones (:meth:`pin_load` then
        :meth:`read_load`). ``views[i]`` holds block i; call ``end_load`` to unpin."""
        h = self._pin(check_keys(keys), session)
        try:
            self._read(h, outs)
        except BaseException:
            self.end_load(h)
            raise
        return h

    @_call
    def pin_load(self, keys: Sequence[bytes], *, session: str | None = None, ttl_s: float | None = None) -> LoadHandle:
        """Phase 1 of a load, without I/O of bytes (the scheduler side): pin the leading stored
        blocks in whichever tier holds them. Top-tier blocks get their views now; the others are
        read later by :meth:`read_load` (the worker side), where a failed read is the worker's to
        report. ``ttl_s``: the request's retention hint; the blocks it hits keep at least that
        idle TTL."""
        return self._pin(check_keys(keys), session, ttl=check_ttl(ttl_s))

    @_on_handle
    def read_load(self, h: LoadHandle, outs: list[np.ndarray] | None = None) -> int:
        """Read a pinned load's lower-tier blocks (into fresh top-tier slots when there is room,
        else into ``outs[i]`` or a private buffer). A failed or corrupt read ends the prefix there:
        returns the number of leading blocks now readable through ``views``."""
        if h.done:
            raise RuntimeError("read_load after end_load")
        self._read(h, outs)
        return h.num_blocks

    def _pin(self, keys: list[bytes], session: str | None, failpoint: bool = True, ttl: float | None = None) -> LoadHandle:
        if failpoint:
            failpoints.fire("store.pin", store=self, keys=keys)
            if self._gate.closed:  # the failpoint may have closed it
                raise RuntimeError("KVStore is closed")
        where, entries = self.chain.pin(keys, session, ttl)
        for t in self.chain.shared:
            self.metrics.sync(t)
        n = len(where)
        h = LoadHandle(keys, n, [None] * n, [None] * n, [t.name for t in where])
        top = self.chain.top
        view = top.view if top is not None and top.addressable else None
        views, pinned, unread = h.views, h.entries, h.unread
        for i, (t, e) in enumerate(zip(where, entries)):
            if t is top and view is not None:
                views[i] = view(e)
                pinned[i] = e
            else:
                unread[i] = (t, e)
        self._gate.opened()  # ended by end_load
        return h

    def _read(self, h: LoadHandle, outs: list[np.ndarray] | None) -> None:
        if h.read:
            return
        h.read = True
        if not h.unread:
            self.metrics.read(self.chain.top.name if self.chain.top else "", h.num_blocks)
            return
        for t in self.chain.tiers:  # tier by tier, top down; past a failed read nothing is needed
            idx = sorted(i for i, (ti, _) in h.unread.items() if ti is t and i < h.num_blocks)
            if idx:
                self._read_from(t, h, idx, outs)

    def _read_from(self, t: Tier, h: LoadHandle, idx: list[int], outs: list[np.ndarray] | None) -> None:
        """Read blocks ``idx`` of a load out of tier ``t``: into fresh top-tier slots (a promotion)
        where there is room, else into ``outs[i]`` or a private buffer."""
        t0 = time.perf_counter()
        src = [h.unread.pop(i)[1] for i in idx]
        keys = [h.keys[i] for i in idx]
        plan = Plan()
        try:
            failpoints.fire("store.read", store=self, keys=keys)
            up = self.chain.promotion(keys, plan)
        except BaseException:
            t.release(src)
            self._cut(h, idx[0])
            raise
        self.transfers.run(plan)
        top = self.chain.top
        mine = [de is None and (outs is None or i >= len(outs)) for i, de in zip(idx, up)]
        # private buffers: page aligned and padded, so a file tier reads into them at depth (its
        # engine takes only such buffers; np.empty's went one by one through the tier's bounce buffer)
        spare = iter(_scratch(sum(mine), self.block_bytes))
        dsts = [top.slot_view(de) if de is not None else next(spare) if m else outs[i]
                for i, de, m in zip(idx, up, mine)]
        try:
            oks = self.transfers.read(t, src, dsts)
        except BaseException:
            top.abort(up)
            t.release(src)
            self._cut(h, idx[0])
            raise
        self.chain.promoted(t, src, up, oks)
        for i, dst, de, ok in zip(idx, dsts, up, oks):
            h.views[i] = dst[: self.block_bytes] if ok else None
            h.entries[i] = de if ok else None
        n_ok, promoted = sum(oks), sum(1 for de, ok in zip(up, oks) if de is not None and ok)
        bad = next((j for j, ok in enumerate(oks) if not ok), None)
        if bad is not None:  # gone, corrupt, or the medium failed: a miss from there on
            self.metrics.failed_read(t.name)
            self._cut(h, idx[bad])
        self.metrics.moved(promoted=promoted)
        self.metrics.wrote(top.name, promoted)
        dt = time.perf_counter() - t0
        self.metrics.read(t.name, n_ok, dt)
        self.rates.observe_read(t.name, len(idx) * self.block_bytes, dt)  # failed reads cost time too
        self.metrics.sync(t)

    def _cut(self, h: LoadHandle, cut: int) -> None:
        """End a load's prefix at block ``cut`` (a read failed there): unpin what lies beyond."""
        top = self.chain.top
        if top is not None:
            self.chain.release(top, [e for e in h.entries[cut:] if e is not None])
        for i in [i for i in h.unread if i >= cut]:
            t, e = h.unread.pop(i)
            t.release([e])
        h.views, h.entries, h.tier_of, h.num_blocks = h.views[:cut], h.entries[:cut], h.tier_of[:cut], cut

    def end_load(self, h: LoadHandle) -> None:
        if h.done:
            raise RuntimeError("end_load called twice for one handle")
        h.done = True
        with self._gate.ending() as live:
            if live:
                self._unpin(h)

    def _unpin(self, h: LoadHandle) -> None:
        top = self.chain.top
        if top is not None:
            self.chain.release(top, [e for e in h.entries if e is not None])
        for t, e in h.unread.values():  # pinned, never read (the load was dropped)
            t.release([e])
        h.unread.clear()
        self.update_gauges()

    @_call
    def prefetch(self, keys: Sequence[bytes]) -> Future:
        """Start promoting the leading lower-tier blocks of ``keys`` into the top tier; resolves
        to the count."""
        keys = check_keys(keys)
        top = self.chain.top
        if top is None or not top.addressable or len(self.chain.tiers) < 2:  # nowhere to promote into or from
            f: Future = Future()
            f.set_result(0)
            return f

        def job() -> int:
            h = self._pin(keys, None, failpoint=False)
            try:
                self._read(h, None)
                return sum(1 for t in h.tier_of if t != top.name)
            finally:
                self.end_load(h)

        return self.transfers.background(job)

    # -- maintenance ---------------------------------------------------------------------------
    @_call
    def sweep(self) -> int:
        """Expire what is due in every tier (bounded work): victims written down in the
        background where the rules say so, files removed here."""
        return self._sweep()

    def _sweep(self) -> int:
        plan = Plan()
        n = self.chain.expire(plan)
        self.transfers.run(plan)
        self.update_gauges()
        return n

    def _victims_ready(self) -> None:
        """A shared tier set victims aside (its sweeper's thread): the chain takes them on the
        store's background thread (one sweep at a time), written down to the tier below."""
        if self._gate.closed or not (self._sweeping is None or self._sweeping.done()):
            return
        try:
            self._sweeping = self.transfers.background(self._sweep_open)
        except RuntimeError:  # the store is closing: the victims stay aside (the tmp/ rule removes them)
            pass

    def _sweep_open(self) -> None:
        try:
            for _ in range(4):  # a round sets aside up to VICTIMS_MAX (1024); a sweep takes 256 a tier
                if not self.sweep():
                    break
        except RuntimeError:  # closed meanwhile
            pass

    def take_events(self) -> list:
        """What became servable in, or left, each announced tier since the last call
        (:class:`~kvstore.store.events.TierEvents`; [] with events off). Past-TTL blocks are swept on
        the store's background (prefetch) thread when any is due, so an expiry is seen without traffic: by the next call."""
        if self.events is None or self._gate.closed:
            return []
        if (self._sweeping is None or self._sweeping.done()) and self.events.due(self.clock()):
            self._sweeping = self.transfers.background(self._sweep)
        return self.events.take()

    @_call
    def persist(self) -> int:
        """Write blocks only the top tier holds down to the next (write-back), oldest first, in
        batches of 64. Returns how many."""
        return self._persist()

    def _persist(self) -> int:
        pinned, todo = self.chain.persist()
        try:
            n = 0
            for i in range(0, len(todo), 64):
                plan = Plan()
                self.chain.write_down(todo[i:i + 64], plan)
                n += self.transfers.run(plan)
            self.transfers.flush()  # victims' files
            return n
        finally:
            if pinned:
                self.chain.top.release(pinned)

    def flush(self) -> None:
        """Wait for background work: demotions, write-through copies, file removals, prefetches."""
        self.transfers.flush()

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait for every tier to have its configured capacity (the DRAM pool is prepared in the
        background after its first chunk); for benchmarks and replays."""
        return all(t.wait_ready(timeout) for t in self.chain.tiers)

    def stats(self) -> dict:
        """Counts per tier plus every metric sample."""
        self.update_gauges()
        return {
            "tiers": {t.name: {"blocks": len(t), "bytes": t.used_bytes, "capacity_bytes": t.capacity_bytes,
                               **t.stats} for t in self.chain.local},
            "metrics": self.metrics.snapshot(),
        }

    def update_gauges(self) -> None:
        """Bring the tiers' gauges up to date (vLLM's stats take them at a step, once a second)."""
        self.metrics.gauges(self.chain.local)

    def close(self, persist: bool = True, wait_s: float = CLOSE_WAIT_S) -> None:
        """Refuse new calls, wait (up to ``wait_s``) for the calls in flight and the handles open
        (kvstore.store.gate), finish background work, write top-tier-only blocks down
        (``persist``; not into an NVMe folder this store made for itself, which is removed now),
        free everything. Past ``wait_s``, a call still in flight keeps the tiers (their fds and
        memory go with the process) and an open handle keeps the DRAM slab mapped."""
        if not self._gate.begin_close():  # two closers at once (release_shared and the atexit close): one closes
            return
        calls, handles = self._gate.drain(wait_s)
        if calls or handles:
            log.warning("kvstore: closing with %d calls in flight and %d handles open after %.0f s: %s", calls,
                        handles, wait_s, "the tiers are left open" if calls else "the DRAM slab is left mapped")
        try:
            for f in self.transfers.pending():  # demotions, write-through copies, removals, prefetches
                try:
                    f.result()
                except Exception as e:  # a failed background job must not stop the close
                    log.warning("kvstore: a background job failed: %s", e)
            if persist and not self._tiers.temporary and not calls:
                t0 = time.perf_counter()
                n = self._persist()
                below = self.chain.below(self.chain.top) if self.chain.top is not None else None
                if below is not None:  # said, so a restart's empty disk tier is explained by its absence
                    log.info("kvstore: closing: wrote %d blocks only %s held down to %s in %.1f s", n,
                             self.chain.top.name, below.name, time.perf_counter() - t0)
        finally:
            self.transfers.shutdown()
            if not calls:
                self._tiers.close(keep_memory=handles > 0)
            self.metrics.close()

    def __enter__(self) -> "KVStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
