"""Worker side: execute a step's plans against the engine's paged KV cache. Bytes only.

Loads read the pinned store blocks (NVMe reads happen here, on the worker, never on the
scheduler) and scatter them into the engine blocks before the forward pass; a block the store
could not supply is reported to vLLM (``get_block_ids_with_load_errors``), which recomputes
from the first bad block. Stores gather newly full blocks straight into DRAM slots after the
forward pass, in one call, except what was computed over a failed load: in a step where a
load fails, a request's blocks from the first failed block of its table on are not stored
(that KV was computed over garbage; the planner stores it again once recomputed).

Nothing here raises into vLLM: a store-side error is a failed load (recomputed) or a skipped
store (a later miss), logged and counted.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from kvstore import failpoints, kvcopy
from kvstore.offload.planner import StepPlan, StorePlan
from kvstore.offload.shared import SharedStore

log = logging.getLogger(__name__)


class Mover:
    def __init__(self, shared: SharedStore):
        self.shared = shared
        self.store = shared.store
        self.metrics = shared.metrics
        self.copier: kvcopy.KVCopier | None = None
        self.layout: kvcopy.KVLayout | None = None
        self.load_errors: set[int] = set()
        self._failed_step: tuple[int, set[int]] = (-1, set())  # (the plan's step number, failed block ids)

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

    def load(self, plan: StepPlan) -> None:
        if not plan.loads:
            self._failed_step = (plan.step, set())
            return
        assert self.copier is not None, "register_kv_caches was not called"
        t0 = time.perf_counter()
        failed: set[int] = set()
        lost = 0  # pinned blocks that failed here (read errors)
        srcs, dst_ids, handles, served = [], [], [], []
        for lp in plan.loads:
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
                served.extend(lp.tiers[:n] if len(lp.tiers) >= n else h.tier_of[:n])
                lost += pinned - n
            failed.update(lp.block_ids[n:])
        try:
            if dst_ids:
                failpoints.fire("mover.scatter")
                self.copier.scatter(srcs, dst_ids)
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
        bt = self.store.block_tokens
        for t in set(served):
            self.metrics.served_tokens.labels(t).inc(served.count(t) * bt)
        if failed:
            self.metrics.unsupplied_tokens.labels("load_failed").inc(len(failed) * bt)
            log.warning("kvstore: %d blocks failed to load (%d pinned but unreadable); vLLM recomputes them",
                        len(failed), lost)
        self.load_errors |= failed
        self._failed_step = (plan.step, failed)
        self.metrics.load_seconds.observe(time.perf_counter() - t0)

    def _good_part(self, sp: StorePlan, failed: set[int]) -> int:
        """How many leading blocks of a store plan were not computed over a failed load."""
        for i, b in enumerate(sp.prior_ids):
            if b in failed:
                return 0
        for i, b in enumerate(sp.block_ids):
            if b in failed:
                return i
        return len(sp.block_ids)

    def save(self, plan: StepPlan) -> None:
        if not plan.stores:
            return
        assert self.copier is not None, "register_kv_caches was not called"
        t0 = time.perf_counter()
        pid, failed = self._failed_step
        if pid != plan.step:  # start_load_kv did not run for this plan
            failed = set()
        keys, ids = [], []
        skipped = 0
        for sp in plan.stores:
            n = self._good_part(sp, failed) if failed else len(sp.block_ids)
            skipped += len(sp.block_ids) - n
            keys.extend(sp.keys[:n])
            ids.extend(sp.block_ids[:n])
        if skipped:
            self.metrics.skipped_blocks.labels("failed_load").inc(skipped)
        if not keys:
            return
        try:
            h = self.store.begin_store(keys)
        except Exception as e:
            self._error("begin_store", e)
            return
        sel = [i for i, v in enumerate(h.views) if v is not None]
        ok = True
        try:
            if sel:
                self.copier.gather([ids[i] for i in sel], [h.views[i] for i in sel])
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

    def take_load_errors(self) -> set[int]:
        out, self.load_errors = self.load_errors, set()
        return out
