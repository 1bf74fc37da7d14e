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
# An engine with nothing to run but requests waiting for their loads steps again at once, in a
# loop that holds the GIL and starves the load thread (the same effect measured on the first
# design's prefetch: 290 ms instead of 6 ms for 31 NVMe blocks on 2 cores). Such an idle step
# waits this long, without the GIL, for a load to complete.
IDLE_LOAD_WAIT_S = 0.002


class Mover:
    def __init__(self, shared: SharedStore, *, async_saves: bool = False, async_loads: bool = False):
        self.shared = shared
        self.store = shared.store
        self.metrics = shared.metrics
        self.copier: kvcopy.KVCopier | None = None
        self.layout: kvcopy.KVLayout | None = None
        self.load_errors: set[int] = set()
        self._failed_step: tuple[int, set[int]] = (-1, set())  # (the plan's step number, failed block ids)
        self.async_saves, self.async_loads = async_saves, async_loads
        self.jobs: CopyJobs | None = None
        if async_saves or async_loads:
            self.jobs = shared.jobs = CopyJobs()
        self._streams: dict[str, object] = {}
        self._inline_loaded: set[str] = set()  # async_loads planned but loaded inline (no load thread)

    def register(self, kv_caches: Any, layout: kvcopy.KVLayout) -> None:
        if layout.block_bytes != self.store.block_bytes:
            raise ValueError(f"kvstore: KV layout has {layout.block_bytes} bytes per block but the store was "
                             f"sized for {self.store.block_bytes}; {layout.describe()}")
        self.copier = kvcopy.KVCopier(kv_caches, layout)  # validates the cache once
        self.layout = layout

    def _error(self, op: str, e: BaseException) -> None:
        self.metrics.store_errors.labels(op).inc()
        log.warning("kvstore: %s failed (%s: %s); the engine recomputes, nothing wrong is stored",
                    op, type(e).__name__, e)

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
                    self.jobs.submit_load(lp.req_id, lambda lp=lp: self._load([lp], self._stream("load")),
                                          lp.block_ids)
            else:  # no load thread: load inline, report as vLLM expects (get_finished)
                failed = self._load(plan.async_loads, None)
                self._inline_loaded |= {lp.req_id for lp in plan.async_loads}
                self.load_errors |= failed
        if not plan.loads:
            self._failed_step = (plan.step, set())
            return
        failed = self._load(plan.loads, None)
        self.load_errors |= failed
        self._failed_step = (plan.step, failed)

    def _load(self, loads: list[LoadPlan], stream) -> set[int]:
        """Read (NVMe) and scatter ``loads`` into the engine's blocks; the copy is complete on
        return. Returns the engine block ids that could not be filled."""
        assert self.copier is not None, "register_kv_caches was not called"
        t0 = time.perf_counter()
        failed: set[int] = set()
        lost = 0  # pinned blocks that failed here (read errors)
        srcs, dst_ids, handles, served = [], [], [], []
        for lp in loads:
            h = self.shared.take_handle(lp.handle_id) if lp.handle_id else None
            n = 0
            if h is not None:
                handles.append(h)
                pinned = min(h.num_blocks, len(lp.block_ids))  # promised beyond that: counted at the pin
                try:
                    n = min(self.store.read_load(h), len(lp.block_ids))  # NVMe reads: here, not on the scheduler
                except Exception as e:
                    self._error("read", e)
                    n = 0
                srcs.extend(h.views[:n])
                dst_ids.extend(lp.block_ids[:n])
                served.extend((t, lp.kind) for t in (lp.tiers[:n] if len(lp.tiers) >= n else h.tier_of[:n]))
                lost += pinned - n
            failed.update(lp.block_ids[n:])
        try:
            if dst_ids:
                failpoints.fire("mover.scatter")
                ev = self.copier.scatter(srcs, dst_ids, stream=stream)
                if ev is not None:
                    ev.synchronize()  # complete (and its errors raised) before the pins go
        except Exception as e:
            self._error("scatter", e)
            failed.update(dst_ids)
            lost += len(dst_ids)
            served = []
        finally:
            for h in handles:
                try:
                    self.store.end_load(h)
                except Exception as e:
                    self._error("end_load", e)
        bt, by_kind = self.store.block_tokens, self.store.metrics.served_by_kind
        for (t, kind), blocks in Counter(served).items():  # what reached the engine, by tier (and replay / genuine)
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

    def _good_part(self, sp: StorePlan, failed: set[int]) -> int:
        """How many leading blocks of a store plan were not computed over a failed load."""
        for i, b in enumerate(sp.prior_ids):
            if b in failed:
                return 0
        for i, b in enumerate(sp.block_ids):
            if b in failed:
                return i
        return len(sp.block_ids)

    def _to_store(self, plan: StepPlan) -> dict[float | None, tuple[list[bytes], list[int], list[str]]]:
        """The step's good blocks to store, grouped by retention hint: ttl -> (keys, ids, requests)."""
        pid, failed = self._failed_step
        if pid != plan.step:  # start_load_kv did not run for this plan
            failed = set()
        groups: dict[float | None, tuple[list[bytes], list[int], list[str]]] = {}
        skipped = 0
        for sp in plan.stores:
            n = self._good_part(sp, failed) if failed else len(sp.block_ids)
            skipped += len(sp.block_ids) - n
            keys, ids, reqs = groups.setdefault(sp.ttl, ([], [], []))
            keys.extend(sp.keys[:n])
            ids.extend(sp.block_ids[:n])
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
        for ttl, (keys, ids, reqs) in self._to_store(plan).items():
            self._save(keys, ids, reqs, ttl)

    def _save(self, keys: list[bytes], ids: list[int], reqs: list[str], ttl: float | None) -> None:
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
        if self.jobs is None or not self.async_saves:
            self._gather_commit(h, [ids[i] for i in sel], [h.views[i] for i in sel], None, None, t0)
            return
        ready = None
        stream = self._stream("store")
        if stream is not None:  # the side stream starts after everything the forward pass queued
            import torch

            ready = torch.cuda.current_stream(self.copier.device_index).record_event()
        self.jobs.submit_store(reqs, lambda: self._gather_commit(h, [ids[i] for i in sel], [h.views[i] for i in sel],
                                                                 stream, ready, t0))

    def _gather_commit(self, h, ids: list[int], views: list, stream, ready, t0: float) -> None:
        ok = True
        try:
            if ready is not None:
                stream.wait_event(ready)
            for i in range(0, len(ids), GATHER_CHUNK):
                failpoints.fire("mover.gather")
                ev = self.copier.gather(ids[i:i + GATHER_CHUNK], views[i:i + GATHER_CHUNK], stream=stream)
                if ev is not None:
                    ev.synchronize()  # a copy error is raised here, and the store is abandoned
        except Exception as e:
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
        sending: set[str] = set()
        recving, self._inline_loaded = self._inline_loaded, set()
        if self.jobs is not None:
            if plan is not None and plan.idle:
                self.jobs.wait_load(IDLE_LOAD_WAIT_S)
            sending = self.jobs.finished_sending(finished_req_ids)
            done, bad = self.jobs.take_loads()
            recving |= done
            self.load_errors |= bad
        return (sending or None), (recving or None)

    def handle_preemptions(self, plan: StepPlan) -> None:
        """Preempted requests' blocks are freed and may be overwritten in this step: their
        in-flight gathers finish first."""
        if self.jobs is not None and plan.preempted:
            self.jobs.wait_saves(plan.preempted)

    def close(self) -> None:
        if self.jobs is not None:
            self.jobs.close()

    def take_load_errors(self) -> set[int]:
        out, self.load_errors = self.load_errors, set()
        return out
