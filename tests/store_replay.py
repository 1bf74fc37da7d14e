"""Replay a trace through a real :class:`kvstore.store.KVStore` (virtual clock, real DRAM pool and
NVMe files), request by request as the connector drives it: ``contains_prefix``, ``get`` of the
matched prefix, ``put`` of the prompt's full blocks it did not load (the
connector never offers a loaded block to the store again). Besides hits and miss reasons it reports
what was written to NVMe and what admission (``tiers.nvme.admit_after``) turned away. The
reference the simulator is checked against (tests/test_tune.py, tests/test_admission.py).

Both are a :class:`KVStore`; what this checks is the rest: that each medium's stand-in (the
simulator's tiers, which hold no bytes) counts as the medium does, and that bytes change nothing.
The store's background writes (demotions, write-through copies) run on the simulator's deferred
executor (:class:`kvstore.tune.deferred.Deferred`): they complete at the end of each call, in the
order they started, which is the simulator's model of them (on a live store they complete
whenever the disk is done)."""

from __future__ import annotations

import tempfile
from collections import Counter

import numpy as np

from kvstore.config import StoreConfig
from kvstore.tune.deferred import Deferred
from kvstore.tune.simulate import NAMES
from kvstore.tune.trace_memory import Trace


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def replay_store(trace: Trace, cfg: StoreConfig, block_bytes: int, nvme_path: str | None = None) -> dict:
    """Hit rates and miss reasons (tokens) measured on a real store with ``cfg``."""
    from kvstore.keys import ModelFingerprint
    from kvstore.store.metrics import StoreMetrics
    from kvstore.store import KVStore

    clock = _Clock()
    clock.t = trace.t[0] if len(trace) else 0.0
    fp = ModelFingerprint(model="kvstore-tune-verify", dtype="uint8", block_size=1, num_layers=1,
                          num_kv_heads=1, head_size=1)
    with tempfile.TemporaryDirectory(prefix="kvstore-verify-") as tmp:
        over = {"tiers": {"nvme": {"path": nvme_path or tmp}}, "metrics": {"port": None}}
        from kvstore.config import from_dict, merge

        cfg = from_dict(merge(cfg.to_dict(), over))
        most = max((len(k) for k in trace.keys), default=0)
        rows = np.zeros((max(1, most), block_bytes), np.uint8)
        hits = Counter()
        miss = Counter()
        prompt = replay_hits = 0
        io = Deferred()
        with KVStore(cfg, block_bytes=block_bytes, fingerprint=fp, clock=clock,
                     metrics=StoreMetrics(port=None), io_executor=io) as store:
            store.wait_ready()  # the simulator has the whole DRAM capacity from the start
            for t, s, ks, pt, bt, rep in trace.requests():
                clock.t = t
                keys = [k.to_bytes(16, "little") for k in ks]
                prompt += pt
                m = store.contains_prefix(keys, num_tokens=pt)
                for tier in m.tiers:
                    hits[tier] += bt
                if rep:
                    replay_hits += m.num_blocks * bt
                if m.miss_reason is not None:
                    miss[m.miss_reason] += (len(keys) - m.num_blocks) * bt if keys else pt
                if m.num_blocks:
                    store.get(keys[: m.num_blocks], rows, session=f"s{s}")
                    io.run()
                if m.num_blocks < len(keys):  # the blocks it computed (the connector never offers a loaded one again)
                    store.put(keys[m.num_blocks:], rows)
                    io.run()
            used = {t.name: t.used_bytes for t in store.tiers}
            m = store.metrics  # before close (it writes DRAM-only blocks down)
            written = int(m.value("kvstore_tier_written_bytes_total", tier="nvme"))
            away = int(m.value("kvstore_tier_skipped_blocks_total", tier="nvme", reason="not_admitted"))
    p = prompt or 1
    return {"hit_rate": sum(hits.values()) / p,
            "hit_rate_by_tier": {t: hits[t] / p for t in (*NAMES, *hits)},
            "replay_hit_tokens": replay_hits, "misses_by_reason": dict(miss), "bytes_held_end": used,
            "nvme_written_bytes": written, "nvme_not_admitted": away}
