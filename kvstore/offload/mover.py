"""Worker side: execute a step's plans against the engine's paged KV cache. Bytes only.

Loads scatter pinned store blocks into the engine blocks before the forward pass; a block the
store could not supply is reported (the engine recomputes it, never reads garbage). Stores
gather newly full blocks straight into DRAM slots after the forward pass, in one call.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from kvstore import kvcopy
from kvstore.offload.planner import StepPlan
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

    def register(self, kv_caches: Any, layout: kvcopy.KVLayout) -> None:
        if layout.block_bytes != self.store.block_bytes:
            raise ValueError(f"kvstore: KV layout has {layout.block_bytes} bytes per block but the store was "
                             f"sized for {self.store.block_bytes}; {layout.describe()}")
        self.copier = kvcopy.KVCopier(kv_caches, layout)  # validates the cache once
        self.layout = layout

    def load(self, plan: StepPlan) -> None:
        if not plan.loads:
            return
        assert self.copier is not None, "register_kv_caches was not called"
        t0 = time.perf_counter()
        srcs, dst_ids, handles = [], [], []
        for lp in plan.loads:
            h = self.shared.take_handle(lp.handle_id)
            n = 0 if h is None else min(h.num_blocks, len(lp.block_ids))
            if h is not None:
                handles.append(h)
                srcs.extend(h.views[:n])
                dst_ids.extend(lp.block_ids[:n])
            self.load_errors.update(lp.block_ids[n:])
        try:
            if dst_ids:
                self.copier.scatter(srcs, dst_ids)
        except Exception:
            log.exception("kvstore: scatter failed; %d blocks will be recomputed", len(dst_ids))
            self.load_errors.update(dst_ids)
        finally:
            for h in handles:
                self.store.end_load(h)
        self.metrics.load_seconds.observe(time.perf_counter() - t0)

    def save(self, plan: StepPlan) -> None:
        if not plan.stores:
            return
        assert self.copier is not None, "register_kv_caches was not called"
        t0 = time.perf_counter()
        keys = [k for sp in plan.stores for k in sp.keys]
        ids = [b for sp in plan.stores for b in sp.block_ids]
        h = self.store.begin_store(keys)
        sel = [i for i, v in enumerate(h.views) if v is not None]
        ok = True
        try:
            if sel:
                self.copier.gather([ids[i] for i in sel], [h.views[i] for i in sel])
        except Exception:
            log.exception("kvstore: gather failed; %d blocks not stored", len(sel))
            ok = False
        n = self.store.end_store(h, ok)
        self.metrics.stored_blocks.inc(n)
        self.metrics.save_seconds.observe(time.perf_counter() - t0)

    def take_load_errors(self) -> set[int]:
        out, self.load_errors = self.load_errors, set()
        return out
