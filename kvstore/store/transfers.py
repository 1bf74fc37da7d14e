"""Transfers: the bytes the chain's decisions move between tiers, on the store's I/O pool. The only
place in the store that reads or writes a medium.

A :class:`kvstore.store.chain.Transfer` names a source tier (or the caller's staged buffers) and a
destination tier; it is routed by the pair's media, as vLLM's offloading routes transfers by
(source medium, destination medium): a tier whose blocks are files (``fan_out``) gets a job per
part of the move, one part per thread of the pool (the disk wants depth; each part one
``write_many``/``read_many`` call), or the whole move as one part where the tier ``spreads`` a call
over threads itself (the NVMe engine on io_uring, its helper threads); a batched medium (Redis
pipelines) one call for the move; memory is copied in place. Background moves (demotions, write-through copies,
files of victims) never run on the caller's thread; the caller's own writes and reads (a store
into a tier without slots, a load's reads) run on the pool while the caller waits.

Every result goes back to the chain (what to publish, unpin, free) and to the metrics sink.
A failed or refused transfer is False, never an exception to the caller: it is counted, and
the block is a later miss.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import Callable, Sequence
import threading

import numpy as np

from kvstore import failpoints
from kvstore.store.chain import COPY, DEMOTE, FREE, Transfer, Plan, TierChain
from kvstore.store.metrics import StoreMetrics
from kvstore.tiers.base import Tier
from kvstore.tiers.index import Entry
from kvstore.tiers.memory import PAGE, alloc_aligned

log = logging.getLogger(__name__)

# Write-through copies from staged buffers (a store whose top tier has no slots: DRAM off, or a
# put's blocks written straight to NVMe) hold their buffers until the copy ends. A remote tier
# slower than the stores (yet under its deadline) would queue them without end; past this many
# bytes in flight a copy is skipped and counted (kvstore_tier_skipped_blocks{reason="backlog"});
# a single move larger than that goes when nothing else is in flight (a long prefill's step).
# Copies from DRAM slots need no cap: they pin slots, which DRAM's size bounds.
STAGED_MAX_BYTES = 512 << 20
# A victim without a slot (a file) is read into a buffer of the mover's before it is written
# down: at most this many bytes of blocks at a time per job (one page-aligned buffer per I/O
# thread that did such work, kept for the next: 8 blocks of 2 MiB).
DOWN_CHUNK_BYTES = 16 << 20
# Such victims left their tier's index (and its capacity) when evicted, and hold only their files
# until written down: nothing else bounds them. A shared folder slower than NVMe's evictions would
# queue them without end, and its jobs would delay DRAM's write-downs behind them. Past this many
# bytes of them in flight, a move is dropped (its files removed) and counted
# (kvstore_tier_skipped_blocks{reason="backlog"}); one move larger than that goes when nothing else is.
DOWN_MAX_BYTES = 512 << 20


class Transfers:
    def __init__(self, chain: TierChain, sink: StoreMetrics, *, block_bytes: int, io_threads: int = 4,
                 executor: Executor | None = None):
        self.chain = chain
        self.sink = sink
        self.block_bytes = int(block_bytes)
        # background writes (demotions, write-through) and batched reads; a replay may pass its own
        self._io = executor or ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="kvstore-io")
        self.io_threads = max(1, int(io_threads))
        self._bg = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvstore-prefetch")
        self._pending: set[Future] = set()
        self._lock = threading.Lock()
        self._staged = 0  # bytes of staged buffers held by write-through copies in flight
        self._down = 0  # bytes of victims without a slot being written down (DOWN_MAX_BYTES)
        self._bufs = threading.local()  # each I/O thread's buffer for those

    # -- the pool ----------------------------------------------------------------------------------
    def submit(self, fn: Callable, *args) -> Future | None:
        try:
            f = self._io.submit(fn, *args)
        except RuntimeError:  # the pool is shut down (close, interpreter exit): do it here
            fn(*args)
            return None
        self.track(f)
        return f

    def background(self, fn: Callable) -> Future:
        """A job of the single prefetch thread (loads the engine asked to start early, the TTL
        sweep behind the KV events)."""
        f = self._bg.submit(fn)
        self.track(f)
        return f

    def track(self, f: Future) -> None:
        with self._lock:
            self._pending.add(f)
        f.add_done_callback(self._untrack)

    def _untrack(self, f: Future) -> None:
        with self._lock:
            self._pending.discard(f)

    def pending(self) -> list[Future]:
        with self._lock:
            return list(self._pending)

    def __len__(self) -> int:
        return len(self._pending)

    def flush(self) -> None:
        """Wait for background work: demotions, write-through copies, file removals, prefetches."""
        while todo := self.pending():
            for f in todo:
                f.result()

    def _map(self, fns: list[Callable[[], object]]) -> list:
        """Run on the pool while the caller waits (a single job runs here). Returns, or raises the
        first error, only once every part has ended: a part still running after its call is over
        would read the caller's rows or write into its buffers (or into slots given back) later.
        A part the pool refuses (shut down: interpreter exit) runs here; no part runs twice (this
        re-ran every part here on any RuntimeError, a part's own included, while the others still
        ran on the pool)."""
        if not fns:
            return []
        if len(fns) == 1:
            return [fns[0]()]
        futs: list[Future | None] = []
        for f in fns:
            try:
                futs.append(self._io.submit(f))
            except RuntimeError:  # the pool is shut down
                futs.append(None)
        out, err = [], None
        for f, fn in zip(futs, fns):
            try:
                out.append(fn() if f is None else f.result())
            except BaseException as e:  # the others are still waited for
                err = err or e
                out.append(None)
        if err is not None:
            raise err
        return out

    @staticmethod
    def _part(t: Tier, op: str, fn: Callable[[], Sequence], n: int) -> Sequence:
        """One part of the caller's writes or reads: an exception (not a medium's own failure,
        which is False) fails that part's blocks, counted by the caller, never the whole call."""
        try:
            return fn()
        except Exception as ex:
            log.warning("kvstore: %s of %d blocks in %s failed: %s", op, n, t.name, ex)
            return [False] * n

    def shutdown(self) -> None:
        self._bg.shutdown(wait=True)
        self._io.shutdown(wait=True)

    # -- the chain's moves -------------------------------------------------------------------------
    def run(self, plan: Plan, *, borrowed: bool = False) -> int:
        """Count what the plan counted; start its moves (background ones on the pool). Returns
        the blocks its foreground moves wrote. ``borrowed``: the copies' staged buffers are the
        caller's (``put``'s rows), so those copies end before this returns: nothing reads a
        caller's buffer once its call is over."""
        self.sink.plan(plan)
        moves, plan.transfers, plan.counts = plan.transfers, [], []
        n = 0
        for m in moves:
            if m.kind == FREE:
                if m.background:
                    self.submit(m.src.free, m.pairs)
                else:
                    m.src.free(m.pairs)
            elif m.kind == DEMOTE:
                n += self._demote(m)
            elif m.kind == COPY:
                if borrowed and m.views is not None:
                    self._copy_now(m)
                else:
                    self._copy(m)
        return n

    def _parts(self, t: Tier, n: int) -> list[range]:
        """Blocks of a move into (or out of) a ``fan_out`` tier, cut into one part per I/O thread
        (interleaved): each part one job, one ``write_many``/``read_many`` call (without the NVMe
        engine, the tier's own write per block). A tier that ``spreads`` a call over threads
        itself (the io_uring engine) gets the whole batch in one part."""
        k = 1 if t.spreads else max(1, min(n, self.io_threads))
        return [range(i, n, k) for i in range(k)]

    def _demote(self, m: Transfer) -> int:
        """Victims written down from their slots: a job per part (each slot freed when its part is
        done), or, for a write-back of the caller's (``background`` False), all of them now.
        Victims without a slot (files) go within ``DOWN_MAX_BYTES`` in flight."""
        jobs = [lambda p=[m.pairs[i] for i in part]: self._write_down(m, p) for part in self._parts(m.dst, len(m.pairs))]
        if not m.background:
            return sum(self._map(jobs))
        if not m.src.addressable:
            nbytes = len(m.pairs) * self.block_bytes
            with self._lock:
                room = self._down == 0 or self._down + nbytes <= DOWN_MAX_BYTES
                if room:
                    self._down += nbytes
            if not room:  # dropped: remembered as gone, counted, their files removed on the pool
                m.dst.abort([ne for _, ne in m.pairs])
                self.chain.remember_gone([e for e, _ in m.pairs])
                self.sink.plan(Plan(counts=[("backlog", m.dst.name, len(m.pairs))]))
                self.submit(m.src.free, [e for e, _ in m.pairs])
                return 0
            left = [len(jobs)]

            def done(job):
                try:
                    return job()
                finally:
                    with self._lock:
                        left[0] -= 1
                        if left[0] == 0:
                            self._down -= nbytes

            jobs = [lambda j=j: done(j) for j in jobs]
        for job in jobs:
            self.submit(job)
        return 0

    def _write_down(self, m: Transfer, pairs: list[tuple[Entry, Entry]]) -> int:
        oks = [False] * len(pairs)
        skip = [False] * len(pairs)  # not written, and no write failed: unread, or there already
        up = m.dst.up  # a tier in its backoff skips the writes and counts them (down): no write failed
        try:
            for e, _ in pairs:
                failpoints.fire("demote.write", key=e.key)
            if m.dst.shared:  # asked here, on the I/O pool, not where the victims arose: one batch
                there = m.dst.holds([ne.key for _, ne in pairs])
                oks = list(there)
                skip = list(there)
            todo = [i for i, s in enumerate(skip) if not s]
            if m.src.addressable:  # from the slots, in place
                res = m.dst.write_many([pairs[i][1] for i in todo], [m.src.slot_view(pairs[i][0]) for i in todo])
                for i, ok in zip(todo, res):
                    oks[i] = bool(ok)
            else:
                self._read_down(m, pairs, todo, oks, skip)
        except Exception as ex:  # never lost silently: counted below as failed writes
            log.warning("kvstore: writing %d blocks down to %s failed: %s", len(pairs), m.dst.name, ex)
        self.chain.demoted(Transfer(DEMOTE, m.src, m.dst, pairs, moving=m.moving, victims=m.victims), oks)
        n = sum(oks)
        if n:
            self.sink.moved(demoted=n)
        self.sink.wrote(m.dst.name, n, (len(oks) - n - sum(s and not o for s, o in zip(skip, oks))) if up else 0)
        return n

    def _read_down(self, m: Transfer, pairs: list[tuple[Entry, Entry]], todo: list[int], oks: list[bool],
                   skip: list[bool]) -> None:
        """Victims of a tier without slots (the last local tier's files, or a shared folder's own,
        written down to the shared tier below): read into this I/O thread's page-aligned buffer,
        ``DOWN_CHUNK_BYTES`` at a time, then written; a block that does not read back (gone,
        corrupt: its tier counted it) is not written, and counted as a failed read of its tier."""
        buf = getattr(self._bufs, "rows", None)
        if buf is None:
            row = -(-self.block_bytes // PAGE) * PAGE
            k = max(1, DOWN_CHUNK_BYTES // row)
            buf = self._bufs.rows = alloc_aligned(k * row, prefault=False)[1].reshape(k, row)
        unread, k = 0, len(buf)
        for c in range(0, len(todo), k):
            part = todo[c:c + k]
            got = m.src.read_many([pairs[i][0] for i in part], list(buf[: len(part)]))
            go = [i for i, g in zip(part, got) if g]
            for i, g in zip(part, got):
                if not g:
                    skip[i] = True
                    unread += 1
            res = m.dst.write_many([pairs[i][1] for i in go], [buf[j] for j, g in enumerate(got) if g])
            for i, ok in zip(go, res):
                oks[i] = bool(ok)
        if unread:
            self.sink.failed_read(m.src.name, unread)

    def _copy(self, m: Transfer) -> None:
        """Write-through: a job per part into files, one batch into a batched medium."""
        parts = ([(self._copy_part, m, list(p)) for p in self._parts(m.dst, len(m.pairs))] if m.dst.fan_out
                 else [(self._copy_batch, m)] if m.pairs else [])
        staged = sum(v.nbytes for v in m.views if v is not None) if m.views is not None else 0
        if staged:  # private staged buffers: bounded bytes in flight
            with self._lock:
                room = self._staged == 0 or self._staged + staged <= STAGED_MAX_BYTES  # one big move passes
                if room:
                    self._staged += staged
            if not room:
                self.chain.copied(m, [False] * len(m.pairs))  # reservations released, nothing published
                self.sink.plan(Plan(counts=[("backlog", m.dst.name, len(m.pairs))]))
                return
            left = [len(parts)]

            def job(fn, *args):
                try:
                    return fn(*args)
                finally:
                    with self._lock:  # the buffers go once the move's last part has ended
                        left[0] -= 1
                        if left[0] == 0:
                            self._staged -= staged

            parts = [(job, *p) for p in parts]
        for fn, *args in parts:
            self.submit(fn, *args)

    def _copy_now(self, m: Transfer) -> None:
        """A copy from the caller's buffers, while the caller waits."""
        if m.dst.fan_out:
            self._map([lambda p=list(part): self._copy_part(m, p) for part in self._parts(m.dst, len(m.pairs))])
        elif m.pairs:
            self._copy_batch(m)

    def _source(self, m: Transfer, i: int) -> np.ndarray | None:
        """Block ``i`` of a copy: the caller's staged buffer, or the source slot (the whole padded,
        page-aligned slot for a file: written in place with O_DIRECT)."""
        if m.views is not None:
            return m.views[i]
        se = m.pairs[i][0]
        if se is None:
            return None
        return m.src.slot_view(se) if m.dst.fan_out else m.src.view(se)

    def _copy_part(self, m: Transfer, idx: list[int]) -> int:
        oks = [False] * len(idx)
        up = m.dst.up  # a tier in its backoff skips the writes and counts them (down): no write failed
        try:
            srcs = [self._source(m, i) if m.pairs[i][1] is not None else None for i in idx]
            go = [k for k, src in enumerate(srcs) if src is not None]
            res = m.dst.write_many([m.pairs[idx[k]][1] for k in go], [srcs[k] for k in go])
            for k, ok in zip(go, res):
                oks[k] = bool(ok)
        except Exception as ex:  # counted below as failed writes
            log.warning("kvstore: copying %d blocks to %s failed: %s", len(idx), m.dst.name, ex)
        finally:
            self.chain.copied(Transfer(COPY, m.src, m.dst, [m.pairs[i] for i in idx]), oks)
        n = sum(1 for i in idx if m.pairs[i][1] is not None)
        self.sink.wrote(m.dst.name, sum(oks), (n - sum(oks)) if up else 0)
        return sum(oks)

    def _copy_batch(self, m: Transfer) -> int:
        t0, up = time.perf_counter(), m.dst.up
        try:
            srcs = [self._source(m, i) for i in range(len(m.pairs))]
            oks = m.dst.write_many([de for _, de in m.pairs], srcs)
        except Exception as ex:  # a medium's own failures are False; anything else is one too
            log.warning("kvstore: copying %d blocks to %s failed: %s", len(m.pairs), m.dst.name, ex)
            oks = [False] * len(m.pairs)
        self.chain.copied(m, oks)
        self.sink.wrote(m.dst.name, sum(oks), (len(oks) - sum(oks)) if up else 0, time.perf_counter() - t0)
        self.sink.sync(m.dst)
        return sum(oks)

    # -- the caller's own writes and reads ---------------------------------------------------------
    def store(self, t: Tier, entries: Sequence[Entry | None], views: Sequence, oks: list[bool]) -> list[bool]:
        """Write the caller's staged blocks into ``t`` (a tier without slots), while it waits."""
        idx = [i for i, (e, o) in enumerate(zip(entries, oks)) if e is not None and o]
        if not idx:
            return oks
        up = t.up  # (see _copy_part)
        if t.fan_out:
            parts = [[idx[k] for k in part] for part in self._parts(t, len(idx))]
            done = self._map([lambda p=p: self._part(t, "writing", lambda: t.write_many(
                [entries[i] for i in p], [views[i] for i in p]), len(p)) for p in parts])
            got = {i: r for p, rs in zip(parts, done) for i, r in zip(p, rs)}
            res = [got[i] for i in idx]
        else:
            res = self._part(t, "writing", lambda: t.write_many([entries[i] for i in idx], [views[i] for i in idx]),
                             len(idx))
        out = list(oks)
        for i, r in zip(idx, res):
            out[i] = bool(r)
        fails = len(idx) - sum(map(bool, res)) if up else 0
        self.sink.wrote(t.name, 0, fails)
        self.sink.sync(t)
        return out

    def read(self, t: Tier, entries: Sequence[Entry], dsts: Sequence[np.ndarray]) -> list[bool]:
        """Read pinned blocks of ``t`` into ``dsts`` while the caller waits; whatever a read raises
        fails its blocks (a batched medium's too: a MemoryError out of Redis's decode once escaped
        every ``KVStore.get`` of a block, issue 45)."""
        if t.fan_out:
            parts = self._parts(t, len(entries))
            done = self._map([lambda p=p: self._part(t, "reading", lambda: t.read_many(
                [entries[i] for i in p], [dsts[i] for i in p]), len(p)) for p in parts])
            out = [False] * len(entries)
            for p, rs in zip(parts, done):
                for i, r in zip(p, rs):
                    out[i] = bool(r)
            return out
        return [bool(r) for r in self._part(t, "reading", lambda: t.read_many(entries, dsts), len(entries))]
