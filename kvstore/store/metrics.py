"""Store metrics, exported through prometheus-client (one registry per store).

Names follow Prometheus conventions: ``kvstore_`` then what is measured, base units
(``_bytes``, ``_seconds``), ``_total`` on counters (prometheus-client adds it). docs/metrics.md
lists every metric (tests/test_engine_metrics.py keeps the list complete).

Per tier: bytes written and read, evictions, expirations, corrupt files dropped, errors, put/get
latency, blocks and bytes held, capacity. Store lookups (``kvstore_lookup_*``) count what a
direct caller asked for, with misses by reason: never stored, evicted for capacity, expired by
TTL, prefix diverged, below the minimum length, corrupt.
"""

from __future__ import annotations

import errno
import logging
import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.exposition import generate_latest

from kvstore.tiers.registry import NAMES
from kvstore.store.placement import MISS_REASONS  # noqa: F401 (re-exported; the rules module owns them)

LATENCY_BUCKETS = (1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
TIERS = NAMES  # the tier label's values: every registered medium
KINDS = ("replay", "genuine")  # the kind label's values (kvstore.offload.replay)

log = logging.getLogger(__name__)
_serving: dict[int, "StoreMetrics"] = {}  # metrics.port -> the store metrics of this process served there
_serving_lock = threading.Lock()


class StoreMetrics:
    def __init__(self, registry: CollectorRegistry | None = None, port: int | None = None, host: str = "127.0.0.1"):
        """``port``, ``host``: metrics.port and metrics.host (None: not exported over HTTP). Loopback
        by default: the labels name the model, the chain root, the namespace and request tags."""
        self.registry = registry or CollectorRegistry(auto_describe=True)
        r = self.registry
        # Store lookups, as any caller of KVStore.contains_prefix(record=True) makes them (the
        # benchmarks, tests/store_replay.py). The vLLM connector does not record here: what it
        # served is counted by the kvstore_engine_* metrics (kvstore/offload/metrics.py).
        self.lookup_blocks = Counter("kvstore_lookup_blocks", "Full blocks looked up in the store", registry=r)
        self.lookup_tokens = Counter("kvstore_lookup_tokens", "Tokens in the full blocks looked up in the store",
                                     registry=r)
        self.hit_blocks = Counter("kvstore_lookup_hit_blocks", "Looked-up blocks found (the stored prefix), by tier",
                                  ["tier"], registry=r)
        self.hit_tokens = Counter("kvstore_lookup_hit_tokens", "Looked-up tokens found (the stored prefix), by tier",
                                  ["tier"], registry=r)
        self.miss_blocks = Counter("kvstore_lookup_miss_blocks",
                                   "Looked-up blocks not found, by the reason of the first missing block",
                                   ["reason"], registry=r)
        self.miss_tokens = Counter("kvstore_lookup_miss_tokens",
                                   "Looked-up tokens not found, by the reason of the first missing block",
                                   ["reason"], registry=r)
        # The connector's served tokens split by kind (kvstore.offload.replay): replay, the exact
        # prompt was seen before; genuine, a new prompt sharing a stored prefix. Counted by the
        # worker (kvstore.offload.runner) beside kvstore_engine_served_tokens_total{tier}, which
        # it sums to over kind; defined here so every store's registry carries it.
        self.served_by_kind = Counter("kvstore_engine_served_tokens_by_kind",
                                      "Prompt tokens kvstore loaded into the engine, by tier and kind (replay: the "
                                      "exact prompt was seen before; genuine: a new prompt sharing a stored prefix)",
                                      ["tier", "kind"], registry=r)
        # Tiers
        self.bytes_in = Counter("kvstore_tier_written_bytes", "Block bytes written into a tier (before a codec)",
                                ["tier"], registry=r)
        self.bytes_out = Counter("kvstore_tier_read_bytes", "Block bytes read out of a tier (after a codec)",
                                 ["tier"], registry=r)
        self.evictions = Counter("kvstore_tier_evicted_blocks", "Blocks evicted from a tier for capacity",
                                 ["tier"], registry=r)
        self.expirations = Counter("kvstore_tier_expired_blocks", "Blocks expired from a tier by idle TTL",
                                   ["tier"], registry=r)
        self.corrupt = Counter("kvstore_corrupt_files", "Bad block files dropped, by reason (a miss, never served)",
                               ["tier", "reason"], registry=r)
        self.demotions = Counter("kvstore_demoted_blocks", "Blocks written down to a lower tier (victims)", registry=r)
        self.promotions = Counter("kvstore_promoted_blocks", "Blocks copied up from NVMe to DRAM", registry=r)
        self.skipped = Counter("kvstore_tier_skipped_blocks", "Blocks not stored in a tier, by reason (no_slot: "
                               "every free DRAM slot held by a demotion in flight or a pin; pinned: every index "
                               "entry held by a write or a pin; backlog: a write-through copy from staged "
                               "buffers while 512 MiB of them are in flight; never waited for)",
                               ["tier", "reason"], registry=r)
        self.remote_up = Gauge("kvstore_remote_up", "1 while the remote tier (Redis / Valkey) answers, 0 from a "
                               "failure until a call succeeds again (its lookups and loads miss during the "
                               "backoff that follows a failure)", registry=r)
        self.demoting = Gauge("kvstore_demoting_blocks", "DRAM blocks being written down to NVMe (each still "
                              "holds its slot and is served from it)", registry=r)
        self.failed = Counter("kvstore_tier_errors", "Block writes or reads that failed, by tier and op",
                              ["tier", "op"], registry=r)
        self.put_latency = Histogram("kvstore_put_seconds", "Time to store one batch of blocks, by tier",
                                     ["tier"], buckets=LATENCY_BUCKETS, registry=r)
        self.get_latency = Histogram("kvstore_get_seconds", "Time to read one batch of blocks, by tier",
                                     ["tier"], buckets=LATENCY_BUCKETS, registry=r)
        self.blocks = Gauge("kvstore_tier_blocks", "Blocks held, by tier", ["tier"], registry=r)
        self.bytes_held = Gauge("kvstore_tier_used_bytes", "Bytes held, by tier (what capacity is charged)",
                                ["tier"], registry=r)
        self.resident = Gauge("kvstore_tier_resident_bytes", "DRAM pool bytes resident in RAM (mincore), to read "
                              "against kvstore_tier_capacity_bytes: pre-faulted memory is resident whole", ["tier"],
                              registry=r)
        self.capacity = Gauge("kvstore_tier_capacity_bytes", "Capacity, by tier (a full disk lowers NVMe's; "
                              "DRAM's grows while its pool is prepared; its index holds all but tiers.dram.headroom_blocks "
                              "slots, kept for victims being written down)", ["tier"], registry=r)
        self.info = Gauge("kvstore_store_info", "The store's identity (value 1): model, key-chain root and NVMe "
                          "namespace, so a tool can find a prompt's blocks (keys = chain_keys(root, tokens))",
                          ["model", "root", "namespace"], registry=r)
        self.block_bytes = 0  # set by attach
        self._synced: dict = {}  # the tiers' own counts already added (sync)
        self._server = None
        self._port = port
        self._host = host
        self._lock = threading.Lock()
        if port:
            self._serve(port)

    def _serve(self, port: int) -> None:
        """Export on ``port`` at metrics.host only (0.0.0.0: every interface). Held by another program:
        a ConfigError naming metrics.port; an address not of this machine: one naming metrics.host.
        Held by another store of this process, or of another process of this host (tensor-parallel
        ranks, engines sharing a config): one warning, and this store's metrics stay unexported there
        (one registry per port; every engine's rank 0 shows on vLLM's /metrics as vllm:kvstore_*)."""
        with _serving_lock:
            other = _serving.get(port)
            if other is not None:
                log.warning("kvstore: metrics.port %d already exports another store of this process; this "
                            "store's metrics are not exported (give each store its own port)", port)
                return
            try:
                self._server = start_http_server(port, addr=self._host, registry=self.registry)
            except OSError as e:
                from kvstore.store.machine import kvstore_exports, port_refused

                if e.errno == errno.EADDRINUSE and kvstore_exports(port, host=self._host):
                    log.warning("kvstore: metrics.port %d exports another kvstore store of this host (another rank "
                                "or engine); this store's metrics are not exported there: rank 0's show on vLLM's "
                                "/metrics as vllm:kvstore_*", port)
                    return
                raise port_refused(port, e, self._host) from None
            _serving[port] = self

    # -- the sink: what the store, its chain's plans and its moves report ----------------------------
    def attach(self, store, fingerprint) -> None:
        """Gauges read at scrape time from ``store``'s tiers; the store's identity."""
        self.block_bytes = store.block_bytes
        self.info.labels(getattr(fingerprint, "model", ""), store.root.hex(),
                         (store.namespace or b"").hex()).set(1)
        self.demoting.set_function(lambda: len(store.chain.demotions))
        for t in store.chain.local:
            # read at scrape time: a full disk lowers NVMe's, DRAM's grows as its pool is prepared
            self.capacity.labels(t.name).set_function(lambda t=t: t.capacity_bytes)
            if t.addressable:
                self.resident.labels(t.name).set_function(t.resident_bytes)
        for t in store.chain.shared:
            self.remote_up.set_function(lambda t=t: 1.0 if t.up else 0.0)
        self.gauges(store.chain.local)

    def plan(self, plan) -> None:
        """What a chain call counted (kvstore.store.chain.Plan)."""
        for event, tier, n in plan.counts:
            if event == "evicted":
                self.evictions.labels(tier).inc(n)
            elif event == "expired":
                self.expirations.labels(tier).inc(n)
            else:  # no_slot, pinned, not_admitted, backlog
                self.skipped.labels(tier, event).inc(n)

    def wrote(self, tier: str, ok: int, failed: int = 0, seconds: float | None = None) -> None:
        if ok:
            self.bytes_in.labels(tier).inc(ok * self.block_bytes)
        if failed:
            self.failed.labels(tier, "write").inc(failed)
        if seconds is not None:
            self.put_latency.labels(tier).observe(seconds)

    def read(self, tier: str, n: int, seconds: float | None = None) -> None:
        if n:
            self.bytes_out.labels(tier).inc(n * self.block_bytes)
        if seconds is not None:
            self.get_latency.labels(tier).observe(seconds)

    def failed_read(self, tier: str, n: int = 1) -> None:
        self.failed.labels(tier, "read").inc(n)

    def moved(self, demoted: int = 0, promoted: int = 0) -> None:
        if demoted:
            self.demotions.inc(demoted)
        if promoted:
            self.promotions.inc(promoted)

    def lookup(self, n_keys: int, tiers: list[str], reason: str | None, num_tokens: int | None,
               block_tokens: int) -> None:
        bt = block_tokens
        self.lookup_blocks.inc(n_keys)
        self.lookup_tokens.inc(n_keys * bt)
        for name in dict.fromkeys(tiers):
            c = tiers.count(name)
            self.hit_blocks.labels(name).inc(c)
            self.hit_tokens.labels(name).inc(c * bt)
        if reason is not None:
            missed = n_keys - len(tiers)
            self.miss_blocks.labels(reason).inc(missed)
            self.miss_tokens.labels(reason).inc(missed * bt if n_keys else (num_tokens or 0))

    def gauges(self, tiers) -> None:
        for t in tiers:
            self.blocks.labels(t.name).set(len(t))
            self.bytes_held.labels(t.name).set(t.used_bytes)
            self.sync(t)

    def sync(self, t) -> None:
        """Bring the counters up to a tier's own counts of bad data and failures (cheap when unchanged)."""
        if not t.corrupt_reasons and not t.error_counts():
            return
        with self._lock:
            for reason, c in list(t.corrupt_reasons.items()):
                self._bump((t.name, "corrupt", reason), c, self.corrupt.labels(t.name, reason))
            for op, c in t.error_counts().items():
                self._bump((t.name, "failed", op), c, self.failed.labels(t.name, op))

    def _bump(self, name, value: float, counter) -> None:
        cur = self._synced.get(name, 0)
        if value > cur:
            counter.inc(value - cur)
            self._synced[name] = value

    def text(self) -> str:
        """The Prometheus exposition text."""
        return generate_latest(self.registry).decode()

    def snapshot(self) -> dict:
        """All samples as {"name{label=v}": value} (for ``KVStore.stats()`` and tests; ``kvstore stats`` reads
        the HTTP text)."""
        out = {}
        for fam in self.registry.collect():
            for s in fam.samples:
                if s.name.endswith("_created"):
                    continue
                lab = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{lab}}}" if lab else s.name] = s.value
        return out

    def value(self, name: str, **labels) -> float:
        v = self.registry.get_sample_value(name, labels or None)
        return 0.0 if v is None else v

    def close(self) -> None:
        if self._server is not None:
            try:
                srv, thread = self._server
                srv.shutdown()
                srv.server_close()
            except Exception:
                pass
            self._server = None
        with _serving_lock:  # after the socket closed: the next store of this process may bind it
            if self._port and _serving.get(self._port) is self:
                del _serving[self._port]
