"""The store path of :class:`kvstore.store.KVStore`: ``put``, ``begin_store``/``end_store``, the
reservations that feed demotion, write-through, and the writes down to NVMe.

Nothing here waits on an NVMe write on the caller's thread when DRAM is on: DRAM victims are
demoted on the I/O pool (:mod:`kvstore.demote`), a block with no free DRAM slot is skipped and
counted (``kvstore_tier_skipped_blocks_total{tier="dram",reason="no_slot"}``; ``put`` writes
those of its own blocks to NVMe instead), write-through copies run in the background. A store
without DRAM writes NVMe in ``end_store``/``put`` (its only medium). ``tiers.nvme.admit_after``
gates every write to NVMe (:class:`kvstore.placement.Admission`): a block without its asks is
not written, counted (``kvstore_tier_skipped_blocks_total{tier="nvme",reason="not_admitted"}``)
and remembered (the miss reason ``not_admitted``).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from typing import Callable, NamedTuple, Sequence

import numpy as np

from kvstore import failpoints, placement
from kvstore.handles import StoreHandle, _check_keys, check_ttl, _rows
from kvstore.index import Entry
from kvstore.tiers import Reservation

log = logging.getLogger(__name__)


class _Gone(NamedTuple):  # a block that left no entry behind, for KVStore._remember_gone
    key: bytes
    reason: str = placement.NOT_ADMITTED


class StorePath:
    # -- reservations ----------------------------------------------------------------------------
    def _reserve_dram(self, keys: Sequence[bytes], stored: bool = False, ttl: float | None = None) -> Reservation:
        """DRAM entries for ``keys``: victims go to the demoter first (those that need no write
        free their slots at once), then free slots are attached; none free: skipped, counted.
        The entries' asks (admission): those remembered for a ``stored`` block; a copy from a
        lower tier (a promotion) was admitted already."""
        res = self.dram.begin_reserve(keys, ttl)
        try:
            self._demoter.take(res.victims)
        except BaseException:
            self.dram.abort(res)
            raise
        self.dram.attach(res)
        if res.no_slot:
            self.metrics.skipped.labels("dram", "no_slot").inc(res.no_slot)
        adm = self._admission
        if adm.active:
            with self._ghost_lock:
                for e in res:
                    if e is not None:
                        e.asks = adm.recall(e.key) if stored else adm.after
        return res

    # -- admission (tiers.nvme.admit_after) ----------------------------------------------------------
    def _admit_nvme(self, keys: Sequence[bytes]) -> list[bool]:
        """For a store straight to NVMe (no DRAM entry): which keys may be written. Each key NVMe
        does not hold yet is asked once more; those still short of their asks are turned away."""
        adm, nv = self._admission, self.nvme
        if not adm.active:
            return [True] * len(keys)
        out, seen, away = [], set(), []
        for k in keys:
            if k in seen or nv.present_or_writing(k):  # stored or being written: the reservation skips it
                out.append(True)
                continue
            seen.add(k)
            with self._ghost_lock:
                asks = adm.recall(k) + 1
            out.append(adm.admits(asks))
            if not out[-1]:
                away.append((k, asks))
        self._turn_away(away)
        return out

    def _turn_away(self, blocks: list[tuple[bytes, int]]) -> None:
        """Blocks dropped for want of asks: their asks remembered, the miss reason too, counted."""
        if blocks:
            with self._ghost_lock:
                for k, asks in blocks:
                    self._admission.turn_away(k, asks)
            self._remember_gone([_Gone(k) for k, _ in blocks])
            self.metrics.skipped.labels("nvme", placement.NOT_ADMITTED).inc(len(blocks))

    def _reserve_nvme_admitted(self, keys: list[bytes], ttl: float | None = None) -> list[Entry | None]:
        """:meth:`_reserve_nvme` for the keys :meth:`_admit_nvme` lets through (None elsewhere)."""
        ok = self._admit_nvme(keys)
        if all(ok):
            return list(self._reserve_nvme(keys, ttl=ttl))
        got = iter(self._reserve_nvme([k for k, o in zip(keys, ok) if o], ttl=ttl))
        return [next(got) if o else None for o in ok]

    def _reserve_nvme(self, keys: Sequence[bytes], background: bool = False, ttl: float | None = None) -> Reservation:
        """NVMe entries for ``keys`` (``ttl``: a retention hint); its victims' files are removed
        here, or on the I/O pool (``background``: a reservation made on the engine's thread)."""
        nv = self.nvme
        res = nv.begin_reserve(keys, ttl)
        if res.victims:
            self._count_evictions(nv, res.victims)
            dram = self.dram
            self._remember_gone([e for e in res.victims if dram is None or not
                                 (dram.contains(e.key) or self._demoter.has(e.key))])
            if background:
                self._submit(nv.free, res.victims)
            else:
                nv.free(res.victims)
        return nv.attach(res)

    # -- I/O pool --------------------------------------------------------------------------------
    def _submit(self, fn: Callable, *args) -> Future | None:
        try:
            f = self._io.submit(fn, *args)
        except RuntimeError:  # the pool is shut down (close, interpreter exit): do it here
            fn(*args)
            return None
        self._track(f)
        return f

    def _track(self, f: Future) -> None:
        with self._pending_lock:
            self._pending.add(f)
        f.add_done_callback(self._untrack)

    def _untrack(self, f: Future) -> None:
        with self._pending_lock:
            self._pending.discard(f)

    def flush(self) -> None:
        """Wait for background work: demotions, write-through copies, NVMe writes, prefetches."""
        while True:
            with self._pending_lock:
                todo = list(self._pending)
            if not todo:
                return
            for f in todo:
                f.result()

    def _run_io(self, fns: list[Callable[[], bool]]) -> list[bool]:
        if not fns:
            return []
        if len(fns) == 1:
            return [fns[0]()]
        try:
            return list(self._io.map(lambda f: f(), fns))
        except RuntimeError:  # the pool is shut down (interpreter exit): do it here
            return [f() for f in fns]

    def _write_down(self, ne: Entry, e: Entry) -> bool:
        """Write DRAM entry ``e`` (its slot held by the caller) to reserved NVMe entry ``ne`` and
        commit it with the DRAM recency (its TTL counts from the last real access)."""
        nv, ok = self.nvme, False
        try:
            failpoints.fire("demote.write", key=e.key)
            ok = nv.write(ne, self.dram.slot_view(e))
        except Exception as ex:  # never lost silently: counted below as a failed write
            log.warning("kvstore: writing %s down to NVMe failed: %s", e.key.hex(), ex)
        finally:
            nv.commit([ne], [ok], at=e.last_access)
        if ok:
            self.metrics.demotions.inc()
            self.metrics.bytes_in.labels("nvme").inc(self.block_bytes)
        else:
            self.metrics.failed.labels("nvme", "write").inc()
            self._remember_gone([e])
        return ok

    # -- put -------------------------------------------------------------------------------------
    def put(self, keys: Sequence[bytes], blocks, *, ttl_s: float | None = None) -> int:
        """Store blocks under keys. Returns how many were newly stored (present keys are skipped).
        Never waits for a demotion or a DRAM slot; blocks that found no free slot are written to
        NVMe by this call. ``ttl_s``: a retention hint (see :meth:`begin_store`)."""
        self._check_open()
        keys = _check_keys(keys)
        ttl_s = check_ttl(ttl_s)
        rows = _rows(blocks, len(keys), self.block_bytes, writable=False, name="blocks")
        if self.dram is None and self.nvme is None:  # remote only (or nothing): no staging copy
            return self._put_remote_only(keys, rows, ttl_s) if self.remote is not None else 0
        if self.dram is None:
            return self._put_nvme(keys, rows, ttl_s)
        h = self.begin_store(keys, ttl_s=ttl_s)
        try:
            for v, r in zip(h.views, rows):
                if v is not None:
                    np.copyto(v, r[: self.block_bytes], casting="no")
        except BaseException:
            self.end_store(h, False)
            raise
        n = self.end_store(h, True)
        if self.nvme is not None:
            # no DRAM slot (all held by demotions or pins): these blocks go straight to NVMe,
            # written here (put's own blocks, with nowhere else to keep them; never a demotion)
            rest = [j for j, e in enumerate(h.entries) if e is None and not self.dram.present_or_writing(keys[j])]
            if rest:
                n += self._put_nvme([keys[j] for j in rest], [rows[j] for j in rest], ttl_s)
        return n

    def _put_nvme(self, keys: list[bytes], rows: list[np.ndarray], ttl: float | None = None) -> int:
        h = StoreHandle(keys, self._reserve_nvme_admitted(keys, ttl), [], self.nvme, ttl=ttl)
        h.views = [r if e is not None else None for e, r in zip(h.entries, rows)]
        return self.end_store(h, True)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("KVStore is closed")

    def begin_store(self, keys: Sequence[bytes], *, ttl_s: float | None = None) -> StoreHandle:
        """Reserve room for the keys not yet stored; returns writable views (None = skip: the key
        is stored or being written, or no DRAM slot is free). Never waits on I/O. ``ttl_s``: the
        request's retention hint, the idle TTL of these blocks in every tier (None: the config's)."""
        self._check_open()
        keys = _check_keys(keys)
        ttl_s = check_ttl(ttl_s)
        if self.dram is not None:
            nv = self.nvme
            want = [k for k in keys if placement.admit(nv is not None and nv.present_or_writing(k))]
            # a repeated key is reserved once (its later copies get None): keep that entry,
            # never overwrite it with a later None (it would stay WRITING and pinned forever)
            got = {k: e for k, e in zip(want, self._reserve_dram(want, stored=True, ttl=ttl_s))
                   if e is not None} if want else {}
            entries = [got.pop(k, None) for k in keys]
            views = [self.dram.view(e) if e is not None else None for e in entries]
            return StoreHandle(keys, entries, views, self.dram, ttl=ttl_s)
        if self.nvme is not None:
            # NVMe-only store: stage in private buffers, written at end_store
            entries = self._reserve_nvme_admitted(keys, ttl_s)
            views = [np.empty(self.block_bytes, np.uint8) if e is not None else None for e in entries]
            return StoreHandle(keys, entries, views, self.nvme, ttl=ttl_s)
        h = StoreHandle(keys, [None] * len(keys), [None] * len(keys), None, ttl=ttl_s)
        if self.remote is not None:
            # remote-only store: stage in private buffers, written at end_store (one pipeline);
            # blocks the remote tier already holds (one pipeline to ask) and repeats are skipped
            seen = set()
            for i, (k, there) in enumerate(zip(keys, self.remote.exists(keys))):
                if not there and k not in seen:
                    seen.add(k)
                    h.views[i] = np.empty(self.block_bytes, np.uint8)
            h.remote_only = True
        return h

    def end_store(self, h: StoreHandle, ok: bool | Sequence[bool] = True) -> int:
        """Phase 2: publish what was written (``ok`` may be per key). Returns blocks stored."""
        if h.done:
            raise RuntimeError("end_store called twice for one handle")
        h.done = True
        oks = [ok] * len(h.keys) if isinstance(ok, (bool, np.bool_)) else list(ok)
        if len(oks) != len(h.keys):
            if h.tier is not None:
                h.tier.abort(h.entries)
            raise ValueError(f"end_store: {len(oks)} results for {len(h.keys)} keys (nothing was stored)")
        if h.remote_only:
            return self._end_store_remote(h, oks)
        oks = [bool(o) and e is not None for o, e in zip(oks, h.entries)]
        tier = h.tier
        if tier is None:
            return 0
        if tier is self.nvme:
            jobs = [(i, e, v) for i, (e, v) in enumerate(zip(h.entries, h.views)) if e is not None and oks[i]]
            res = self._run_io([lambda e=e, v=v: self.nvme.write(e, v) for _, e, v in jobs])
            for (i, _, _), r in zip(jobs, res):
                oks[i] = r
            fails = len(jobs) - sum(res)
            if fails:
                self.metrics.failed.labels("nvme", "write").inc(fails)
        tier.commit(h.entries, oks)
        n = sum(oks)
        stored = [k for k, o in zip(h.keys, oks) if o]
        self._forget_gone(stored)
        self.metrics.bytes_in.labels(tier.name).inc(n * self.block_bytes)
        self.metrics.put_latency.labels(tier.name).observe(time.perf_counter() - h.started)
        if n and self.write_through and tier is self.dram and self.nvme is not None:
            adm = self._admission  # blocks short of their asks: written at eviction if they get them
            wt = [e.key for e, o in zip(h.entries, oks) if o and adm.admits(e.asks)] if adm.active else stored
            h.background = self._write_through(wt, h.ttl) if wt else []
        if n and self.remote is not None:  # shared as soon as stored (write-through)
            if tier is self.dram:
                self._remote_write_through(stored, ttl=h.ttl)
            else:
                self._remote_write_through(stored, views=[v for v, o in zip(h.views, oks) if o], ttl=h.ttl)
        self._update_gauges()
        return n

    def _write_through(self, keys: list[bytes], ttl: float | None = None) -> list[Future]:
        """Copy freshly stored DRAM blocks to NVMe in the background (DRAM slots pinned meanwhile)."""
        dram, nv = self.dram, self.nvme
        dentries = dram.acquire(keys, touch=False)
        nentries = self._reserve_nvme(keys, ttl=ttl)

        def job(de: Entry | None, ne: Entry | None) -> bool:
            try:
                ok = False
                try:
                    ok = ne is not None and de is not None and nv.write(ne, dram.slot_view(de))
                finally:
                    if ne is not None:
                        nv.commit([ne], [ok])
                if ok:
                    self.metrics.bytes_in.labels("nvme").inc(self.block_bytes)
                elif ne is not None:
                    self.metrics.failed.labels("nvme", "write").inc()
                return ok
            finally:
                if de is not None:
                    dram.release([de])

        futures = []
        for de, ne in zip(dentries, nentries):
            if de is None and ne is None:
                continue
            f = self._submit(job, de, ne)
            if f is not None:
                futures.append(f)
        return futures

