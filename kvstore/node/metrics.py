"""A node daemon's Prometheus endpoint (``metrics.port`` of its config): the host's cache, and each
engine's hit rate.

* Every model store's samples, labelled ``model`` and ``root`` (the first 8 bytes of its key-chain
  root, hex): the tiers, lookups, evictions of the whole host.
* Each engine's own counters (``kvstore_engine_*``: prompt, engine-local, served and unsupplied
  tokens, :mod:`kvstore.offload.metrics`), labelled ``engine`` (its name: vLLM's engine id and
  rank) and ``model``. They are counted in the engine's process, which reports them here every
  ``REPORT_S`` while it works and once when it closes (:meth:`NodeStore.close`); an engine that
  detached keeps its last figures under its name (the last ``MAX_RETIRED`` names, the last
  ``MAX_RETIRED_SERIES_PER_NAME`` label sets of each, ``MAX_RETIRED_SERIES`` in all), so the host's
  totals do not drop when engines restart. A sample of a report that is not an engine counter's
  is skipped and counted (``kvstore_node_report_skipped_samples_total``), the rest kept.
* ``kvstore_node_engines``: engines attached now (a readout knows a daemon by it).

``kvstore stats --url http://127.0.0.1:PORT/metrics`` prints the host's readout (summed over
``engine``, ``model`` and ``root``), then one line per engine (:mod:`kvstore.offload.readout`).
"""

from __future__ import annotations

import logging
import math
import re
import threading
from collections import OrderedDict

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.metrics_core import Metric

from kvstore.offload.hints import MAX_WORD

log = logging.getLogger(__name__)

REPORT_S = 2.0  # an engine reports its counters at most this often
MAX_RETIRED = 256  # detached engines whose figures are kept by name
MAX_SAMPLES = 512  # samples in one report (an engine's: ~150, its 20 request tags included)
# Label sets a detached engine's name keeps (its last report's, and those of its reports before
# that a later one no longer has: request tags age out of their labels), and all names together.
# Unbounded, names that restart with new tags would grow them for the daemon's life; 1,024 is two
# full reports, 65,536 the last 256 names' ~150 series each with room to spare (18 MiB here, 33
# MiB with 256-character tags). The oldest go first: the host's sums drop by what they held (a
# counter reset, to Prometheus).
MAX_RETIRED_SERIES_PER_NAME = 2 * MAX_SAMPLES
MAX_RETIRED_SERIES = 1 << 16
_NAME = re.compile(r"kvstore_engine_[a-z_]{1,64}_total")
_LABEL = re.compile(r"[a-z_]{1,16}")


def _sample_ok(s) -> bool:
    return (isinstance(s, list) and len(s) == 3 and isinstance(s[0], str) and _NAME.fullmatch(s[0]) is not None
            and isinstance(s[1], dict) and len(s[1]) <= 2
            and all(isinstance(k, str) and _LABEL.fullmatch(k) and k not in ("engine", "model", "root")
                    and isinstance(v, str) and len(v) <= MAX_WORD for k, v in s[1].items())
            and type(s[2]) in (int, float) and math.isfinite(s[2]) and s[2] >= 0)


def check_report(samples) -> tuple[dict, list[str]]:
    """An engine's report, ``[[name, {label: value}, number], ...]``: ({(name, labels): value},
    what each sample skipped was). A sample that is not ``[kvstore_engine_..._total, {label: str}
    (at most 2, values of at most MAX_WORD characters, a request tag's), number >= 0]`` is skipped
    (one long tag must not cost the engine its whole report); a report that is not a list of at
    most MAX_SAMPLES is refused, ValueError (a same-uid client may send anything)."""
    if not isinstance(samples, list) or len(samples) > MAX_SAMPLES:
        raise ValueError(f"report: a list of at most {MAX_SAMPLES} samples")
    out, bad = {}, []
    for s in samples:
        if _sample_ok(s):
            out[(s[0], tuple(sorted(s[1].items())))] = float(s[2])
        else:
            name = s[0] if isinstance(s, list) and s and isinstance(s[0], str) else type(s).__name__
            bad.append(f"{name[:80]!r}: not [kvstore_engine_..._total, {{label: at most {MAX_WORD} characters}} "
                       f"(at most 2), number >= 0]")
    return out, bad


class NodeMetrics:
    """A prometheus-client collector over a :class:`~kvstore.node.daemon.NodeDaemon`, served on ``port``."""

    def __init__(self, daemon, port: int | None, host: str):
        self.daemon = daemon
        self.retired: OrderedDict[str, tuple[str, dict]] = OrderedDict()  # name -> (model, figures)
        self.series = 0  # label sets in retired, all names together
        self.skipped_samples = 0  # of engines' reports (check_report)
        self.lock = threading.Lock()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)
        self._server = None
        if port:
            try:
                self._server = start_http_server(port, addr=host, registry=self.registry)
            except OSError as e:
                from kvstore.store.machine import port_refused

                raise port_refused(port, e, host) from None
            log.info("kvstore serve: metrics on http://%s:%d/metrics", host, port)

    def skipped(self, n: int) -> None:
        with self.lock:
            self.skipped_samples += n

    def retire(self, a) -> None:
        """An engine detached: its last figures are added to what its name had (those it
        reported last, last: the oldest label sets go first past the bounds)."""
        if not a.report:
            return
        with self.lock:
            model, old = self.retired.pop(a.name, (self.daemon.models.get(id(a.store), ""), {}))
            self.series -= len(old)
            for k, v in a.report.items():
                old[k] = old.pop(k, 0.0) + v
            for k in list(old)[:max(0, len(old) - MAX_RETIRED_SERIES_PER_NAME)]:
                del old[k]
            self.retired[a.name] = (model, old)
            self.series += len(old)
            while len(self.retired) > MAX_RETIRED or self.series > MAX_RETIRED_SERIES:
                _, (_, gone) = self.retired.popitem(last=False)
                self.series -= len(gone)

    def collect(self):
        fams: dict[str, Metric] = {}

        def family(name: str, doc: str, typ: str) -> Metric:
            f = fams.get(name)
            if f is None:
                f = fams[name] = Metric(name, doc, typ)
            return f

        with self.daemon.lock:
            stores = list(self.daemon.stores.values())
            engines = list(self.daemon.engines.values())
        for s in stores:
            s.update_gauges()
            extra = {"model": self.daemon.models.get(id(s), ""), "root": s.root[:8].hex()}
            for fam in s.metrics.registry.collect():
                f = family(fam.name, fam.documentation, fam.type)
                for x in fam.samples:
                    f.add_sample(x.name, {**x.labels, **extra}, x.value)
        with self.lock:
            figures = {name: (model, dict(v)) for name, (model, v) in self.retired.items()}
        for a in engines:
            model, v = figures.setdefault(a.name, (self.daemon.models.get(id(a.store), ""), {}))
            for k, x in (a.report or {}).items():
                v[k] = v.get(k, 0.0) + x
        for name, (model, v) in figures.items():
            for (sname, labels), x in v.items():
                f = family(sname[:-len("_total")], "Reported by the engine (kvstore.offload.metrics)", "counter")
                f.add_sample(sname, {**dict(labels), "engine": name, "model": model}, x)
        g = family("kvstore_node_engines", "Engines attached to this node daemon now", "gauge")
        g.add_sample("kvstore_node_engines", {}, float(len(engines)))
        c = family("kvstore_node_report_skipped_samples", "Samples of engines' reports skipped: not an engine "
                   "counter's (a name, a label or a value out of bounds); the rest of each report is kept", "counter")
        c.add_sample("kvstore_node_report_skipped_samples_total", {}, float(self.skipped_samples))
        return list(fams.values())

    def close(self) -> None:
        if self._server is not None:
            server, thread = self._server
            server.shutdown()
            server.server_close()
            thread.join()
            self._server = None
