"""Worker side: execute a step's plans against the engine's paged KV cache. Bytes only.

Loads read the pinned store blocks (NVMe reads happen here, on the worker, never on the
scheduler) and scatter them into the engine blocks before the forward pass; a block the store
could not supply is reported to vLLM (``get_block_ids_with_load_errors``), which recomputes
from the first bad block. Stores gather newly full blocks straight into DRAM slots after the
forward pass, in one call, except what was computed over a failed load: in a step where a
load fails, a request's blocks from the first failed block of its table on are not stored
(that KV was computed over garbage; the planner stores it again once recomputed).

With ``async_saves`` (the default) ``save`` only reserves the DRAM slots and enqueues the gather
on the store thread of :class:`~kvstore.offload.jobs.CopyJobs` (on CUDA, on a side stream ordered
after the compute stream by an event, in chunks of ``GATHER_CHUNK`` blocks so a load never waits
long for the copy module): the forward thread moves no bytes. A gather error stores nothing.
With ``async_loads``, ``LoadPlan`` s in ``StepPlan.async_loads`` (requests vLLM keeps in
``WAITING_FOR_REMOTE_KVS``) are read and scattered on the load thread; ``get_finished`` reports
them, with their failed blocks, to vLLM.

Hybrid models: one copier per KV cache group (its layers; every group's block fits a store slot,
a group with fewer layers filling its head, the rest zeroed); plans name each block's group. A
hybrid model's loads are all or nothing per request (``LoadPlan.groups``): a block that fails
fails the request (``get_transfer``'s third set; vLLM recomputes it). Before the forward pass and
before an asynchronous load, the worker waits for the gathers still reading the blocks being
given out (``StepPlan.fresh``; :meth:`~kvstore.offload.jobs.CopyJobs.wait_sources`).

Nothing here raises into vLLM: a store-side error is a failed load (recomputed) or a skipped
store (a later miss), logged and counted.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Any

from kvstore import failpoints, kvcopy
from kvstore.offload.jobs import CopyJobs
from kvstore.offload.planner import LoadPlan, StepPlan, StorePlan
from kvstore.offload.shared import SharedStore

log = logging.getLogger(__name__)

GATHER_CHUNK = 64  # blocks per gather call of an async store (a sync load waits at most one)
# The grid of an async store's gather, which runs on a side stream beside the forward pass: the
# copy is bound by the PCIe link, and its default grid (8 blocks per SM) takes SMs from the engine's
# kernels. On an H200 (bench/copy/gpu_tax.py, 2 MiB blocks, 2,048-token prefills, 8 rounds): the engine
# kept 0.925 of its speed (median; worst round 0.892) with the default grid, 0.947 (0.929) with 16
# blocks, 0.928 (0.814) with 64, saving after the step's host read (bench/results/gpu_box_h200.md).
SIDE_GATHER_CTAS = 16
# An engine with nothing to run but requests waiting for their loads steps again at once, in a
# loop that holds the GIL and starves the load thread (the same effect measured on the first
# design's prefetch: 290 ms instead of 6 ms for 31 NVMe blocks on 2 cores). Such an idle step
# waits this long, without the GIL, for a load to complete.
IDLE_LOAD_WAIT_S = 0.002


class StepRunner:
    def __init__(self, shared: SharedStore, *, async_saves: bool = False, async_loads: bool = False,
                 rank: int = 0, save_ctas: int | None = SIDE_GATHER_CTAS):
        self.shared = shared
        self.rank = rank  # tensor-parallel rank: which handle of a plan's per-rank tuple is ours
        self.store = shared.store
        self.metrics = shared.metrics
        self.copier: kvcopy.KVCopier | None = None
        self.layout: kvcopy.KVLayout | None = None
        self.copiers: list[kvcopy.KVCopier] = []  # one per KV cache group (hybrid models)
        self.load_errors: set[int] = set()
        self._failed_step: tuple[int, set[int]] = (-1, set())  # (the plan's step number, failed block ids)
        self.async_saves, self.async_loads = async_saves, async_loads
        self.jobs: CopyJobs | None = None
        if async_saves or async_loads:
            self.jobs = shared.jobs = CopyJobs()
        self._streams: dict[str, object] = {}
        self._inline_loaded: set[str] = set()  # async_loads planned but loaded inline (no load thread)
        self._inline_failed: set[str] = set()  # of those, all-or-nothing loads that failed
        self.save_ctas = save_ctas  # a side-stream gather's grid (KVCopier.gather ctas; None: 8 per SM)
        self._registration: tuple | None = None  # what register or register_groups was given (restore)

    def register(self, kv_caches: Any, layout: kvcopy.KVLayout) -> None:
        if layout.block_bytes != self.store.block_bytes:
            raise ValueError(f"kvstore: KV layout has {layout.block_bytes} bytes per block but the store was "
                             f"sized for {self.store.block_bytes}; {layout.describe()}")
        self.copier = kvcopy.KVCopier(kv_caches, layout)  # validates the cache once
        self.layout = layout
        self.copiers = [self.copier]
        self._registration = (kv_caches, layout)

    def register_groups(self, groups: list[tuple[Any, kvcopy.KVLayout]]) -> None:
        """A hybrid model's caches: (per-layer tensors, layout) for each KV cache group, in
        vLLM's group order. Each group's block is at most a store slot."""
        for i, (_, layout) in enumerate(groups):
            if layout.block_bytes > self.store.block_bytes:
                raise ValueError(f"kvstore: KV cache group {i} has {layout.block_bytes} bytes per block, more "
                                 f"than the store's {self.store.block_bytes}; {layout.describe()}")
        self.copiers = [kvcopy.KVCopier(t, layout) for t, layout in groups]
        self.copier, self.layout = self.copiers[0], groups[0][1]
        self._registration = (groups,)

    def unregister(self) -> None:
        """vLLM's sleep (``unregister_kv_caches``, vLLM 0.33): the KV cache's memory is about to be
        freed or unmapped. The copies queued or running on the copy threads end first (a save's
        gather reads those blocks, a load writes them), then every table that holds a pointer into
        the cache goes (the copiers, with their streams). Idempotent."""
        if self.jobs is not None:
            self.jobs.wait_idle()
        self.copier, self.copiers, self.layout = None, [], None
        self._streams = {}

    def restore(self) -> None:
        """vLLM's wake-up (``restore_kv_caches``): the tables built again from the tensors vLLM
        registered, their pointers read again (the memory under them may be new). Idempotent."""
        if self.copiers or self._registration is None:
            return
        if len(self._registration) == 1:
            self.register_groups(*self._registration)
        else:
            self.register(*self._registration)

    def _slots(self, g: int, views: list) -> list:
        """Group ``g``'s part of store slots (its block bytes, at their head)."""
        n = self.copiers[g].block_bytes
        return views if n == self.store.block_bytes else [v[:n] for v in views]

    def _handle(self, lp: LoadPlan):
        hid = lp.handle_id[self.rank] if isinstance(lp.handle_id, (tuple, list)) else lp.handle_id
        return self.shared.take_handle(hid) if hid else None

    def _error(self, op: str, e: BaseException) -> None:
        self.metrics.store_errors.labels(op).inc()
        log.warning("kvstore: %s failed (%s: %s); the engine recomputes, nothing wrong is stored",
                    op, type(e).__name__, e)

    def _drain(self, stream) -> None:
        """After a copy that raised: wait for whatever it had enqueued on the GPU before its slots
        or the engine's blocks are given back. A copy can fail after part of its work was queued
        (a chunk's DMA, then an error on the next); that part would otherwise land in a DRAM slot
        another store has taken, or in blocks vLLM recomputes. No-op on CPU (copies are done on
        return)."""
        if self.copier is None or self.copier.device != "cuda":
            return
        try:
            import torch

            (stream if stream is not None else torch.cuda.current_stream(self.copier.device_index)).synchronize()
        except Exception as e:  # the context itself failed: nothing more can land
            log.warning("kvstore: waiting for the GPU after a failed copy failed too: %s", e)

    def _stream(self, kind: str):
        """The CUDA stream for async ``kind`` ("load", "store") copies; None on CPU. Loads get the
        higher priority: their requests wait for them."""
        if self.copier is None or self.copier.device != "cuda":
            return None
        st = self._streams.get(kind)
        if st is None:
            import torch

            with torch.cuda.device(self.copier.device_index):
                st = self._streams[kind] = torch.cuda.Stream(priority=-1 if kind == "load" else 0)
        return st

    def load(self, plan: StepPlan) -> None:
        """This step's loads: ``plan.loads`` now (the forward pass reads them), and
        ``plan.async_loads`` handed to the load thread (or, without it, now as well)."""
        if plan.async_loads:
            if self.jobs is not None and self.async_loads and self.copier is not None:
                for lp in plan.async_loads:
                    self.jobs.submit_load(lp.req_id, lambda lp=lp: self._fenced_load(lp), lp.block_ids,
                                          whole=bool(lp.groups))
            else:  # no load thread: load inline, report as vLLM expects (get_finished)
                for lp in plan.async_loads:
                    failed = self._load([lp], None)
                    self._inline_loaded.add(lp.req_id)
                    if lp.groups and failed:
                        self._inline_failed.add(lp.req_id)
                    else:
                        self.load_errors |= failed
        if not plan.loads:
            self._failed_step = (plan.step, set())
            return
        failed = self._load(plan.loads, None)
        self.load_errors |= failed
        self._failed_step = (plan.step, failed)

    def _fenced_load(self, lp: LoadPlan) -> set[int]:
        """An asynchronous load, once no gather still reads its target blocks."""
        self.jobs.wait_sources(lp.block_ids)
        return self._load([lp], self._stream("load"))

    def _load(self, loads: list[LoadPlan], stream) -> set[int]:
        """Read (NVMe) and scatter ``loads`` into the engine's blocks; the copy is complete on
        return. Returns the engine block ids that could not be filled."""
        assert self.copier is not None, "register_kv_caches was not called"
        if any(lp.groups for lp in loads):
            return set().union(*(self._load_whole(lp, stream) for lp in loads))
        t0 = time.perf_counter()
        failed: set[int] = set()
        lost = 0  # pinned blocks that failed here (read errors)
        srcs, dst_ids, handles, served = [], [], [], []  # served: (load, tier, kind) of each block copied
        for j, lp in enumerate(loads):
            h = self._handle(lp)
            n = 0
            if h is not None:
                handles.append((j, h))
                pinned = min(h.num_blocks, len(lp.block_ids))  # promised beyond that: counted at the pin
                try:
                    n = min(self.store.read_load(h), len(lp.block_ids))  # NVMe reads: here, not on the scheduler
                except Exception as e:
                    self._error("read", e)
                    n = 0
                srcs.extend(h.views[:n])
                dst_ids.extend(lp.block_ids[:n])
                served.extend((j, t, lp.kind) for t in (lp.tiers[:n] if len(lp.tiers) >= n else h.tier_of[:n]))
                lost += pinned - n
            failed.update(lp.block_ids[n:])
        try:
            if dst_ids:
                failpoints.fire("mover.scatter")
                ev = self.copier.scatter(srcs, dst_ids, stream=stream)
                if ev is not None:
                    ev.synchronize()  # complete (and its errors raised) before the pins go
        except Exception as e:
            self._drain(stream)
            self._error("scatter", e)
            failed.update(dst_ids)
            lost += len(dst_ids)
            served = []
        finally:
            for j, h in handles:
                try:
                    held = self.store.end_load(h)
                except Exception as e:
                    self._error("end_load", e)
                    held = None
                if held is False:  # its pins may have gone while it was copied (a node daemon lost): what
                    copied = [x for x in served if x[0] == j]  # it copied is not served, vLLM recomputes it
                    failed.update(loads[j].block_ids[:len(copied)])
                    lost += len(copied)
                    served = [x for x in served if x[0] != j]
        bt, by_kind = self.store.block_tokens, self.store.metrics.served_by_kind
        for (_, t, kind), blocks in Counter(served).items():  # what reached the engine, by tier (and replay / genuine)
            n = blocks * bt
            self.metrics.served_tokens.labels(t).inc(n)
            if kind:
                by_kind.labels(t, kind).inc(n)
        if failed:
            self.metrics.unsupplied_tokens.labels("load_failed").inc(len(failed) * bt)
            log.warning("kvstore: %d blocks failed to load (%d pinned but unreadable); vLLM recomputes them",
                        len(failed), lost)
        self.metrics.load_seconds.observe(time.perf_counter() - t0)
        return failed

    def _load_whole(self, lp: LoadPlan, stream) -> set[int]:
        """A hybrid model's load: every block of every group, or none (all its block ids are
        returned as failed, and vLLM recomputes the request)."""
        t0 = time.perf_counter()
        h = self._handle(lp)
        ok = False
        try:
            n = self.store.read_load(h) if h is not None else 0  # NVMe reads: here, not on the scheduler
            if n >= len(lp.block_ids):
                failpoints.fire("mover.scatter")
                for g in sorted(set(lp.groups)):
                    sel = [i for i, x in enumerate(lp.groups) if x == g]
                    ev = self.copiers[g].scatter(self._slots(g, [h.views[i] for i in sel]),
                                                 [lp.block_ids[i] for i in sel], stream=stream)
                    if ev is not None:
                        ev.synchronize()
                ok = True
        except Exception as e:
            self._drain(stream)
            self._error("load", e)
        finally:
            if h is not None:
                try:
                    if self.store.end_load(h) is False:  # pins lost while copying (a node daemon): recomputed
                        ok = False
                except Exception as e:
                    self._error("end_load", e)
        bt = self.store.block_tokens
        if ok:
            for t, blocks in Counter(lp.tiers).items():  # per token block, not per group block
                self.metrics.served_tokens.labels(t).inc(blocks * bt)
                if lp.kind:
                    self.store.metrics.served_by_kind.labels(t, lp.kind).inc(blocks * bt)
        else:
            self.metrics.unsupplied_tokens.labels("load_failed").inc(lp.num_tokens)
            log.warning("kvstore: the load of request %s (%d blocks in %d groups) failed; vLLM recomputes it",
                        lp.req_id, len(lp.block_ids), len(set(lp.groups)))
        self.metrics.load_seconds.observe(time.perf_counter() - t0)
        return set() if ok else set(lp.block_ids) or {-1}

    def _good_part(self, sp: StorePlan, failed: set[int]) -> int:
        """How many leading blocks of a store plan were not computed over a failed load."""
        for i, b in enumerate(sp.prior_ids):
            if b in failed:
                return 0
        for i, b in enumerate(sp.block_ids):
            if b in failed:
                return i
        return len(sp.block_ids)

    def _to_store(self, plan: StepPlan) -> dict[float | None, tuple[list[bytes], list[int], list[str], list[int]]]:
        """The step's good blocks to store, grouped by retention hint: ttl -> (keys, ids,
        requests, the KV cache group of each block)."""
        pid, failed = self._failed_step
        if pid != plan.step:  # start_load_kv did not run for this plan
            failed = set()
        groups: dict[float | None, tuple[list[bytes], list[int], list[str], list[int]]] = {}
        skipped = 0
        events = self.store.events
        for sp in plan.stores:
            n = self._good_part(sp, failed) if failed else len(sp.block_ids)
            if sp.meta and events is not None:  # their names on the KV-event stream (kvstore.store.events)
                events.remember(sp.keys[:n], sp.meta[:n])
            skipped += len(sp.block_ids) - n
            keys, ids, reqs, gs = groups.setdefault(sp.ttl, ([], [], [], []))
            keys.extend(sp.keys[:n])
            ids.extend(sp.block_ids[:n])
            gs.extend(sp.groups[:n] if sp.groups else [0] * n)
            reqs.append(sp.req_id)
        if skipped:
            self.metrics.skipped_blocks.labels("failed_load").inc(skipped)
        return groups

    def save(self, plan: StepPlan) -> None:
        """Store this step's newly full blocks: gathered now, or (``async_saves``) enqueued; one
        reservation per retention hint in the step (usually one)."""
        if not plan.stores:
            return
        assert self.copier is not None, "register_kv_caches was not called"
        for ttl, (keys, ids, reqs, gs) in self._to_store(plan).items():
            self._save(keys, ids, reqs, ttl, gs)

    def _save(self, keys: list[bytes], ids: list[int], reqs: list[str], ttl: float | None,
              gs: list[int] | None = None) -> None:
        t0 = time.perf_counter()
        if not keys:
            if self.jobs is not None and self.async_saves:
                self.jobs.mark_stored(reqs)
            return
        try:
            h = self.store.begin_store(keys, ttl_s=ttl)  # reserves slots; no I/O on this thread
        except Exception as e:
            self._error("begin_store", e)
            if self.jobs is not None and self.async_saves:
                self.jobs.mark_stored(reqs)
            return
        sel = [i for i, v in enumerate(h.views) if v is not None]
        ids, views = [ids[i] for i in sel], [h.views[i] for i in sel]
        gs = [gs[i] for i in sel] if gs and len(self.copiers) > 1 else None
        if self.jobs is None or not self.async_saves:
            self._gather_commit(h, ids, views, None, None, t0, gs)
            return
        ready = None
        stream = self._stream("store")
        if stream is not None:  # the side stream starts after everything the forward pass queued
            import torch

            ready = torch.cuda.current_stream(self.copier.device_index).record_event()
        self.jobs.submit_store(reqs, lambda: self._gather_commit(h, ids, views, stream, ready, t0, gs), ids)

    def _gather_commit(self, h, ids: list[int], views: list, stream, ready, t0: float,
                       gs: list[int] | None = None) -> None:
        ok = True
        try:
            if ready is not None:
                stream.wait_event(ready)
            parts = [(0, ids, views)] if gs is None else [
                (g, [ids[i] for i, x in enumerate(gs) if x == g], [views[i] for i, x in enumerate(gs) if x == g])
                for g in sorted(set(gs))]
            for g, g_ids, g_views in parts:
                copier, slots = self.copiers[g], self._slots(g, g_views)
                if slots is not g_views:  # a group smaller than the slot: its tail holds nothing
                    for v in g_views:
                        v[copier.block_bytes:] = 0
                for i in range(0, len(g_ids), GATHER_CHUNK):
                    failpoints.fire("mover.gather")
                    ev = copier.gather(g_ids[i:i + GATHER_CHUNK], slots[i:i + GATHER_CHUNK], stream=stream,
                                       ctas=self.save_ctas if stream is not None else None)
                    if ev is not None:
                        ev.synchronize()  # a copy error is raised here, and the store is abandoned
        except Exception as e:
            self._drain(stream)
            self._error("gather", e)
            ok = False
        try:
            n = self.store.end_store(h, ok)
        except Exception as e:
            self._error("end_store", e)
            n = 0
        self.metrics.stored_blocks.inc(n)
        self.metrics.save_seconds.observe(time.perf_counter() - t0)

    # -- completion (vLLM's get_finished, handle_preemptions) -----------------------------------
    def get_finished(self, finished_req_ids: set[str], plan: StepPlan | None = None
                     ) -> tuple[set[str] | None, set[str] | None]:
        """(requests whose stores completed and whose blocks vLLM kept for them, requests whose
        async loads completed). The loads' failed blocks join ``take_load_errors`` in the same call."""
        sending, recving, _ = self.get_transfer(finished_req_ids, plan)  # a single group: none fail whole
        return sending, recving

    def get_transfer(self, finished_req_ids: set[str], plan: StepPlan | None = None
                     ) -> tuple[set[str] | None, set[str] | None, set[str]]:
        """:meth:`get_finished`, and the requests whose all-or-nothing loads failed (among the
        completed ones: vLLM recomputes them whole)."""
        sending: set[str] = set()
        recving, self._inline_loaded = self._inline_loaded, set()
        failed, self._inline_failed = self._inline_failed, set()
        if self.jobs is not None:
            if plan is not None and plan.idle:
                self.jobs.wait_load(IDLE_LOAD_WAIT_S)
            sending = self.jobs.finished_sending(finished_req_ids)
            done, bad, whole = self.jobs.take_loads()
            recving |= done
            failed |= whole
            self.load_errors |= bad
        return (sending or None), (recving or None), failed

    def handle_preemptions(self, plan: StepPlan) -> None:
        """Before the forward pass. Preempted requests' blocks are freed and may be overwritten in
        this step: their in-flight gathers finish first; so do those reading a block given out
        in this step (a hybrid model frees blocks while their requests run)."""
        if self.jobs is not None and plan.preempted:
            self.jobs.wait_saves(plan.preempted)
        if self.jobs is not None and plan.fresh:
            self.jobs.wait_sources(plan.fresh)

    def close(self) -> None:
        if self.jobs is not None:
            self.jobs.close()

    def take_load_errors(self) -> set[int]:
        out, self.load_errors = self.load_errors, set()
        return out
