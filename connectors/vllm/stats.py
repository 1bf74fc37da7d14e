"""kvstore's metrics on vLLM's own ``/metrics`` (issue 32), through vLLM's connector stats hooks.

Every counter and gauge of a store's registry (``kvstore.store.metrics``, ``kvstore.offload.metrics``)
shows on vLLM's endpoint as ``vllm:<its name>`` with vLLM's ``model_name`` and ``engine`` labels
beside its own (``vllm:kvstore_engine_served_tokens_total{engine="0",tier="dram",...}``), so several
engines and tensor-parallel ranks on one host need no port of their own (``metrics.port`` stays for
the store's own exporter). Histograms and the hook-time collector stay on ``metrics.port`` only.

* Worker (rank 0's store, which counts the engine's requests; ranks store the same blocks):
  ``get_kv_connector_stats`` hands the counters' increments and the gauges' values at most once a
  second, at an engine step (:class:`StatsTaker`), in vLLM's ``KVConnectorOutput``.
* vLLM aggregates them (:class:`KVStoreStats`: increments add up, the latest gauge wins) and the
  stat logger's process records them (:class:`KVStorePromMetrics`, made by ``build_prom_metrics``).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

PREFIX = "vllm:"  # vLLM's own metrics are cleared by name ("vllm") when its loggers are made again
EVERY_S = 1.0


def families(registry: CollectorRegistry) -> list[tuple[str, str, str, tuple[str, ...]]]:
    """(name, "counter" | "gauge", documentation, label names) of a registry's counters and gauges."""
    out = []
    for c in list(registry._collector_to_names):  # prometheus-client keeps no public list of collectors
        if isinstance(c, (Counter, Gauge)):
            out.append((c._name, c._type, c._documentation, tuple(c._labelnames)))
    return sorted(out)


def store_families() -> list[tuple[str, str, str, tuple[str, ...]]]:
    """Every counter and gauge a connector's store registers (from a throwaway registry)."""
    from kvstore.offload.metrics import OffloadMetrics
    from kvstore.store.metrics import StoreMetrics

    m = StoreMetrics()
    OffloadMetrics(m.registry)
    return families(m.registry)


def _key(name: str, values: list[str]) -> str:
    return json.dumps([name, values], separators=(",", ":"))


class StatsTaker:
    """The worker's side: what changed in a store's registry since the last take."""

    def __init__(self, registry: CollectorRegistry, every_s: float = EVERY_S, refresh=None):
        self.registry = registry
        self.every_s = every_s
        self.refresh = refresh  # brings the gauges up to date, when a take is due (not every step)
        self._next = 0.0
        self._last: dict[str, float] = {}

    def take(self, now: float | None = None) -> dict | None:
        now = time.monotonic() if now is None else now
        if now < self._next:
            return None
        self._next = now + self.every_s
        if self.refresh is not None:
            self.refresh()
        counters, gauges, seen = {}, {}, set()
        for c in list(self.registry._collector_to_names):
            if not isinstance(c, (Counter, Gauge)):
                continue
            names = c._labelnames
            for mf in c.collect():
                for s in mf.samples:
                    if c._type == "counter" and not s.name.endswith("_total"):
                        continue  # _created
                    k = _key(c._name, [s.labels.get(n, "") for n in names])
                    if c._type == "gauge":
                        gauges[k] = s.value
                        continue
                    seen.add(k)
                    if s.value != self._last.get(k, 0.0):
                        counters[k] = s.value - self._last.get(k, 0.0)
                        self._last[k] = s.value
        # a series the registry removed (a request tag that aged out of its label slot,
        # kvstore.offload.metrics): forgotten here, and removed on vLLM's side too
        removed = [k for k in self._last if k not in seen]
        for k in removed:
            del self._last[k]
        out = {"counters": counters, "gauges": gauges} if counters or gauges else {}
        return {**out, "removed": removed} if removed else out or None


@dataclass
class KVStoreStats(KVConnectorStats):
    """Increments of kvstore's counters and its gauges' values (keys: ``[name, [label values]]``)."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> "KVStoreStats":
        c = dict(self.data.get("counters", {}))
        removed = list(self.data.get("removed", []))
        for k in other.data.get("removed") or ():  # its earlier increments went with the series
            c.pop(k, None)
            removed.append(k)
        for k, v in (other.data.get("counters") or {}).items():
            c[k] = c.get(k, 0.0) + v
        g = {**self.data.get("gauges", {}), **(other.data.get("gauges") or {})}
        self.data = {"counters": c, "gauges": g, **({"removed": removed} if removed else {})}
        return self

    def reduce(self) -> dict[str, int | float]:
        """For vLLM's log line: the tokens kvstore served and the blocks it stored in the interval."""
        served = stored = 0.0
        for k, v in self.data.get("counters", {}).items():
            name = json.loads(k)[0]
            if name == "kvstore_engine_served_tokens":
                served += v
            elif name == "kvstore_engine_stored_blocks":
                stored += v
        return {"kvstore served tokens": int(served), "kvstore stored blocks": int(stored)}

    def is_empty(self) -> bool:
        return not self.data.get("counters") and not self.data.get("gauges") and not self.data.get("removed")


class KVStorePromMetrics(KVConnectorPromMetrics):
    """vLLM's side: one ``vllm:kvstore_*`` metric per kvstore counter and gauge."""

    def __init__(self, vllm_config, metric_types, labelnames: list[str], per_engine_labelvalues: dict[int, list]):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.metrics: dict[str, Any] = {}
        for name, kind, doc, labels in store_families():
            if kind == "counter":
                self.metrics[name] = self._counter_cls(name=PREFIX + name, documentation=doc,
                                                       labelnames=labelnames + list(labels))
            else:
                self.metrics[name] = self._gauge_cls(name=PREFIX + name, documentation=doc,
                                                     labelnames=labelnames + list(labels), multiprocess_mode="mostrecent")

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        engine = list(self.per_engine_labelvalues.get(engine_idx, []))
        for k in transfer_stats_data.get("removed") or ():  # before the counters: a tag back after it aged out
            name, values = json.loads(k)
            m = self.metrics.get(name)
            try:
                m.remove(*engine, *values)
            except (AttributeError, KeyError, ValueError):  # never made here, or a metric type without remove
                pass
        for kind in ("counters", "gauges"):
            for k, v in (transfer_stats_data.get(kind) or {}).items():
                name, values = json.loads(k)
                m = self.metrics.get(name)
                if m is None:
                    continue
                child = m.labels(*engine, *values)
                if kind == "gauges":
                    child.set(v)
                elif v > 0:
                    child.inc(v)
