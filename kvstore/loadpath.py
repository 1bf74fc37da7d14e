"""The load path of :class:`kvstore.store.KVStore`: ``get``, ``begin_load``/``pin_load``/
``read_load``/``end_load``, promotion of NVMe hits into DRAM, and ``prefetch``.

A block whose demotion to NVMe is still in flight is found in its DRAM slot (pinned there
through :class:`kvstore.demote.Demoter`), a DRAM hit.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from typing import Sequence

import numpy as np

from kvstore import failpoints, placement
from kvstore.handles import LoadHandle, _check_keys, check_ttl, _rows
from kvstore.index import Entry


class LoadPath:
    # -- get -----------------------------------------------------------------------------------
    def get(self, keys: Sequence[bytes], out, *, session: str | None = None) -> int:
        """Copy the leading stored blocks into ``out`` (rows). Returns how many were copied."""
        self._check_open()
        keys = _check_keys(keys)
        rows = _rows(out, len(keys), self.block_bytes, writable=True, name="out")
        h = self.begin_load(keys, outs=rows, session=session)
        try:
            for i in range(h.num_blocks):
                if h.views[i] is not rows[i]:
                    np.copyto(rows[i][: self.block_bytes], h.views[i][: self.block_bytes], casting="no")
        finally:
            self.end_load(h)
        return h.num_blocks

    def begin_load(self, keys: Sequence[bytes], *, outs: list[np.ndarray] | None = None,
                   session: str | None = None) -> LoadHandle:
        """Pin the leading stored blocks and read the NVMe ones (:meth:`pin_load` then
        :meth:`read_load`). ``views[i]`` holds block i; call ``end_load`` to unpin."""
        self._check_open()
        h = self._pin(_check_keys(keys), session)
        try:
            self._read_pinned(h, outs)
        except BaseException:
            self.end_load(h)
            raise
        return h

    def pin_load(self, keys: Sequence[bytes], *, session: str | None = None, ttl_s: float | None = None) -> LoadHandle:
        """Phase 1 of a load, without I/O (the scheduler side): pin the leading stored blocks in
        whichever tier holds them. DRAM blocks get their views now; NVMe blocks are read later
        by :meth:`read_load` (the worker side), where a failed read is the worker's to report.
        ``ttl_s``: the request's retention hint; the blocks it hits keep at least that idle TTL."""
        self._check_open()
        return self._pin(_check_keys(keys), session, ttl=check_ttl(ttl_s))

    def read_load(self, h: LoadHandle, outs: list[np.ndarray] | None = None) -> int:
        """Read a pinned load's NVMe blocks (into fresh DRAM slots when there is room, else into
        ``outs[i]`` or a private buffer). A failed or corrupt read ends the prefix there: returns
        the number of leading blocks now readable through ``views``."""
        if h.done:
            raise RuntimeError("read_load after end_load")
        self._read_pinned(h, outs)
        return h.num_blocks

    def _pin(self, keys: list[bytes], session: str | None, failpoint: bool = True, ttl: float | None = None) -> LoadHandle:
        if failpoint:
            failpoints.fire("store.pin", store=self, keys=keys)
            self._check_open()  # the failpoint may have closed it
        dram, nv = self.dram, self.nvme
        n_keys = len(keys)
        # pin without counting hits, find the prefix, then count only the blocks that are used
        dentries = dram.acquire(keys, touch=False) if dram is not None else [None] * n_keys
        nentries: list[Entry | None] = [None] * n_keys
        miss = [i for i, e in enumerate(dentries) if e is None]
        if miss and dram is not None and len(self._demoter):  # still in DRAM while written down
            for i, de in zip(miss, self._demoter.pin([keys[i] for i in miss])):
                dentries[i] = de
            miss = [i for i in miss if dentries[i] is None]
        if miss and nv is not None:
            got = nv.acquire([keys[i] for i in miss], touch=False)
            for i, ne in zip(miss, got):
                nentries[i] = ne
        n = next((i for i in range(n_keys) if dentries[i] is None and nentries[i] is None), n_keys)
        if dram is not None:
            self._release_dram(dentries[n:])
            dram.touch(dentries[:n], session, ttl)
        if nv is not None:
            nv.release(nentries[n:])
            nv.touch(nentries[:n], session, ttl)
        m = self._remote_extend(keys, n)  # the shared tier, past the local prefix (not pinned)
        h = LoadHandle(keys, n + m, [None] * (n + m), list(dentries[:n]) + [None] * m,
                       ["dram" if dentries[i] is not None else "nvme" for i in range(n)] + ["remote"] * m)
        for i in range(n):
            if dentries[i] is not None:
                h.views[i] = dram.view(dentries[i])
            else:
                h.unread[i] = nentries[i]
        h.unread_remote = list(range(n, n + m))
        return h

    def _read_pinned(self, h: LoadHandle, outs: list[np.ndarray] | None) -> None:
        if h.read:
            return
        h.read = True
        if h.unread:
            self._read_nvme(h, outs)
        else:
            self.metrics.bytes_out.labels("dram").inc(sum(1 for t in h.tier_of if t == "dram") * self.block_bytes)
        idx = [i for i in h.unread_remote if i < h.num_blocks]  # past a failed NVMe read: not needed
        h.unread_remote = []
        if idx:
            got = self._read_remote([h.keys[i] for i in idx], [outs[i] for i in idx] if outs is not None else None)
            for i, (v, de, _) in zip(idx, got):
                h.views[i], h.entries[i] = v, de
            bad = next((j for j, (_, _, ok) in enumerate(got) if not ok), None)
            if bad is not None:  # gone (Redis evicted it), corrupt, or the server failed: a miss
                self.metrics.failed.labels("remote", "read").inc(1)
                self._cut(h, idx[bad])

    def _read_nvme(self, h: LoadHandle, outs: list[np.ndarray] | None) -> None:
        t0 = time.perf_counter()
        dram = self.dram
        nv_idx = sorted(h.unread)
        nentries = [h.unread.pop(i) for i in nv_idx]
        try:
            failpoints.fire("store.read", store=self, keys=[h.keys[i] for i in nv_idx])
            got = self._promote(nentries, [outs[i] for i in nv_idx] if outs is not None else None)
        except BaseException:
            self.nvme.release(nentries)
            self._cut(h, nv_idx[0])
            raise
        bad = next((j for j, (_, _, ok) in enumerate(got) if not ok), None)
        for i, (v, de, ok) in zip(nv_idx, got):
            h.views[i] = v
            h.entries[i] = de
        if bad is not None:
            self.metrics.failed.labels("nvme", "read").inc(1)
            self._cut(h, nv_idx[bad])
        self.metrics.bytes_out.labels("nvme").inc(sum(1 for t in h.tier_of if t == "nvme") * self.block_bytes)
        self.metrics.bytes_out.labels("dram").inc(sum(1 for t in h.tier_of if t == "dram") * self.block_bytes)
        dt = time.perf_counter() - t0
        self.metrics.get_latency.labels("nvme").observe(dt)
        self.rates.observe_read("nvme", len(nv_idx) * self.block_bytes, dt)  # failed reads cost time too

    def _cut(self, h: LoadHandle, cut: int) -> None:
        """End a load's prefix at block ``cut`` (a read failed there): unpin what lies beyond."""
        if self.dram is not None:
            self._release_dram([e for e in h.entries[cut:] if e is not None])
        if h.unread and self.nvme is not None:
            self.nvme.release([h.unread.pop(i) for i in sorted(h.unread) if i >= cut])
        h.views, h.entries, h.tier_of, h.num_blocks = h.views[:cut], h.entries[:cut], h.tier_of[:cut], cut
        h.unread_remote = [i for i in h.unread_remote if i < cut]

    def _release_dram(self, entries) -> None:
        """Unpin DRAM entries: those of blocks being demoted through the demoter, the rest here."""
        if self.dram is not None:
            self.dram.release(self._demoter.release(entries) if self._demoter.held else entries)

    def end_load(self, h: LoadHandle) -> None:
        if h.done:
            raise RuntimeError("end_load called twice for one handle")
        h.done = True
        if self.dram is not None:
            self._release_dram([e for e in h.entries if e is not None])
        if h.unread and self.nvme is not None:  # pinned, never read (the load was dropped)
            self.nvme.release(list(h.unread.values()))
            h.unread.clear()
        self._update_gauges()

    def _promote(self, nentries: list[Entry], outs: list[np.ndarray] | None):
        """Read pinned NVMe entries; into fresh DRAM slots when there is room (then pinned)."""
        dram, nv = self.dram, self.nvme
        assert nv is not None
        up = dram is not None and placement.promote(True)
        dres = self._reserve_dram([e.key for e in nentries]) if up else [None] * len(nentries)

        def one(i: int):
            ne, de = nentries[i], dres[i]
            if de is not None:
                dst = dram.slot_view(de)
            elif outs is not None and i < len(outs):
                dst = outs[i]
            else:
                dst = np.empty(self.block_bytes, np.uint8)
            return nv.read(ne, dst), dst

        res = self._run_io([lambda i=i: one(i) for i in range(len(nentries))])
        oks = [ok for ok, _ in res]
        nv.release(nentries, oks)
        out = []
        for (ok, dst), de, ne in zip(res, dres, nentries):
            if de is not None:
                if ne.hint is not None:  # a retention hint follows the block up
                    de.ttl = de.hint = ne.hint
                dram.commit([de], [ok], keep_pinned=True)  # pinned for the caller until end_load
            out.append((dst[: self.block_bytes] if ok else None, de if ok else None, ok))
        n_ok = sum(1 for _, de, _ in out if de is not None)
        self.metrics.promotions.inc(n_ok)
        self.metrics.bytes_in.labels("dram").inc(n_ok * self.block_bytes)
        bad = [ne for ne, ok in zip(nentries, oks) if not ok]
        if bad:
            self._remember_gone([_as_corrupt(e) for e in bad])
            self._sync_corrupt_metrics()
        return out

    def prefetch(self, keys: Sequence[bytes]) -> Future:
        """Start promoting the leading NVMe blocks of ``keys`` into DRAM; resolves to the count."""
        self._check_open()
        keys = _check_keys(keys)
        if self.dram is None or (self.nvme is None and self.remote is None):  # nowhere to promote into or from
            f: Future = Future()
            f.set_result(0)
            return f

        def job() -> int:
            h = self._pin(keys, None, failpoint=False)
            try:
                self._read_pinned(h, None)
                return sum(1 for t in h.tier_of if t != "dram")
            finally:
                self.end_load(h)

        f = self._bg.submit(job)
        self._track(f)
        return f


def _as_corrupt(e: Entry) -> Entry:
    e.reason = "corrupt"
    return e
