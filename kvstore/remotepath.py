"""The remote tier's part of :class:`kvstore.store.KVStore`: opening it, the lookup past the local
tiers, reading remote blocks of a load, and write-through.

The remote tier (:class:`kvstore.tiers.remote.RemoteTier`, Redis or Valkey) is shared by every
engine and has no local index: Redis keeps its own TTL and eviction. So it is consulted last and
in batches: one pipeline for the keys of a lookup that no local tier holds, one for the remote
blocks of a load (read into free DRAM slots when there are some, a promotion, else into the
caller's buffers), one per stored batch (write-through, on the I/O pool, reading the DRAM slots
pinned meanwhile). A remote failure is a miss (the load's prefix ends there, as for a failed NVMe
read), never an error of the caller; a dead server degrades the store to its local tiers.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Sequence

import numpy as np

import xxhash

from kvstore import placement
from kvstore.codecs import make_codec
from kvstore.codecs.registry import CODEC_IDS
from kvstore.index import Entry
from kvstore.tiers.presence import Presence

log = logging.getLogger(__name__)

ENV_USER, ENV_PASSWORD = "KVSTORE_REDIS_USERNAME", "KVSTORE_REDIS_PASSWORD"


class RemotePath:
    def _open_remote(self, fingerprint, kv_dtype, group_elems) -> None:
        """Set ``self.remote`` (None when ``tiers.remote.url`` is null). A refused password or an
        untrusted TLS certificate is an error now (a clear one, naming the variable to set; the
        store is closed); an unreachable
        server is a warning: the store starts on its local tiers and the tier retries (with
        backoff) on later calls."""
        self.remote = None
        rcfg = self.config.tiers.remote
        if not rcfg.enabled:
            return
        try:
            self._connect_remote(rcfg, fingerprint, kv_dtype, group_elems)
        except BaseException:
            self.close(persist=False)
            raise

    def _connect_remote(self, rcfg, fingerprint, kv_dtype, group_elems) -> None:
        from kvstore.tiers.remote import RemoteAuthError, RemoteTier, RemoteTLSError, RemoteUnavailable
        from kvstore.tiers.remotevalue import secrets_from_env

        # its namespace, as NVMe's: the model fingerprint + this tier's codec (the same bytes as
        # NVMe's when the codecs match); every engine of one model and codec shares it
        self.remote_namespace = xxhash.xxh3_128_digest(
            self.root + f"codec={rcfg.codec}".encode()
            + self._codec_geometry_tag(rcfg.codec, fingerprint, kv_dtype, group_elems))
        codec = make_codec(rcfg.codec, self.geometry, rcfg.zstd_level) if rcfg.codec != "none" else None
        secret, previous = secrets_from_env(os.environ)  # MACs on every value (a ConfigError for a bad one)
        self.remote = RemoteTier(url=rcfg.url, cluster=rcfg.cluster, namespace=self.remote_namespace,
                                 block_bytes=self.block_bytes, ttl_s=rcfg.ttl_s, timeout_ms=rcfg.timeout_ms,
                                 io_threads=rcfg.io_threads, codec=codec, codec_id=CODEC_IDS[rcfg.codec],
                                 username=os.environ.get(ENV_USER) or None,
                                 password=os.environ.get(ENV_PASSWORD) or None, secret=secret,
                                 secret_previous=previous)
        try:
            self.remote.check()
        except (RemoteAuthError, RemoteTLSError):
            self.remote.close()
            self.remote = None
            raise
        except RemoteUnavailable as e:
            log.warning("kvstore: remote tier %s unreachable at start-up (%s); serving from the local tiers, "
                        "retrying later", self.remote.url, e)
        self._remote_synced: dict[str, float] = {}
        self._presence = Presence(time.monotonic)
        self.metrics.remote_up.set_function(lambda: 1.0 if self.remote.up else 0.0)

    # -- lookups ---------------------------------------------------------------------------------
    def _remote_extend(self, keys: Sequence[bytes], n: int) -> int:
        """How many of ``keys[n:]`` follow the local prefix in the remote tier (at most two
        pipelines, none when this request's lookup asked a moment ago)."""
        if self.remote is None or n >= len(keys):
            return 0
        with self.remote.deadline():  # the probe and the rest of the prompt: timeout_ms in all
            m = self._presence.walk(keys[n:], self.remote.exists)  # one ask per request (see .tiers.presence)
        self._sync_remote_metrics()
        return m

    # -- loads -----------------------------------------------------------------------------------
    def _read_remote(self, keys: list[bytes], outs: list[np.ndarray] | None):
        """Read remote blocks; into fresh DRAM slots when there is room (committed and pinned
        for the caller: a promotion), else into ``outs[i]`` or a private buffer. Returns
        ``(view or None, pinned DRAM entry or None, ok)`` per key."""
        t0 = time.perf_counter()
        dram = self.dram
        up = dram is not None and placement.promote(True)
        dres = self._reserve_dram(keys) if up else [None] * len(keys)
        dsts = []
        for i, de in enumerate(dres):
            if de is not None:
                dsts.append(dram.slot_view(de))
            elif outs is not None and i < len(outs):
                dsts.append(outs[i])
            else:
                dsts.append(np.empty(self.block_bytes, np.uint8))
        try:
            oks = self.remote.get(keys, dsts)
        except BaseException:
            if up:
                dram.abort(dres)
            raise
        out = []
        for ok, dst, de in zip(oks, dsts, dres):
            if de is not None:
                dram.commit([de], [ok], keep_pinned=True)  # pinned for the caller until end_load
            out.append((dst[: self.block_bytes] if ok else None, de if ok else None, ok))
        n_ok = sum(oks)
        self._presence.forget([k for k, ok in zip(keys, oks) if not ok])
        self.metrics.bytes_out.labels("remote").inc(n_ok * self.block_bytes)
        promoted = sum(1 for _, de, _ in out if de is not None)
        self.metrics.promotions.inc(promoted)
        self.metrics.bytes_in.labels("dram").inc(promoted * self.block_bytes)
        dt = time.perf_counter() - t0
        self.metrics.get_latency.labels("remote").observe(dt)
        self.rates.observe_read("remote", len(keys) * self.block_bytes, dt)
        self._sync_remote_metrics()
        return out

    # -- stores ----------------------------------------------------------------------------------
    def _remote_write_through(self, keys: list[bytes], entries: list[Entry | None] | None = None,
                              views: list[np.ndarray] | None = None, ttl: float | None = None) -> None:
        """Copy freshly stored blocks to the remote tier on the I/O pool: from DRAM (``keys``
        pinned there meanwhile) or from an NVMe-only store's private buffers (``views``)."""
        if self.remote is None or not keys:
            return
        dram = self.dram
        if views is None:
            pinned = dram.acquire(keys, touch=False)
            keys = [k for k, e in zip(keys, pinned) if e is not None]
            pinned = [e for e in pinned if e is not None]
            views = [dram.view(e) for e in pinned]
        else:
            pinned = []

        def job() -> None:
            t0 = time.perf_counter()
            try:
                self._count_remote_put(keys, self.remote.put(keys, views, ttl_s=ttl), t0)
            finally:
                if pinned:
                    dram.release(pinned)

        if keys:
            self._submit(job)

    def _put_remote_only(self, keys: list[bytes], rows: list[np.ndarray], ttl: float | None = None) -> int:
        """``put`` on a store whose only tier is the remote one: the caller's rows are sent as
        they are (blocks Redis holds already, and repeats, are skipped)."""
        seen, idx = set(), []
        for i, (k, there) in enumerate(zip(keys, self.remote.exists(keys))):
            if not there and k not in seen:
                seen.add(k)
                idx.append(i)
        if not idx:
            return 0
        t0 = time.perf_counter()
        res = self.remote.put([keys[i] for i in idx], [rows[i] for i in idx], ttl_s=ttl)
        return self._count_remote_put([keys[i] for i in idx], res, t0)

    def _count_remote_put(self, keys: list[bytes], res: list[bool], t0: float) -> int:
        n = sum(res)
        self.metrics.bytes_in.labels("remote").inc(n * self.block_bytes)
        if len(res) - n:
            self.metrics.failed.labels("remote", "write").inc(len(res) - n)
        self.metrics.put_latency.labels("remote").observe(time.perf_counter() - t0)
        self._forget_gone([k for k, r in zip(keys, res) if r])
        self._presence.stored([k for k, r in zip(keys, res) if r])
        self._sync_remote_metrics()
        return n

    def _end_store_remote(self, h, oks: list) -> int:
        """End a remote-only store: write its staged blocks (one pipeline). Returns blocks stored."""
        idx = [i for i, (v, o) in enumerate(zip(h.views, oks)) if v is not None and o]
        if not idx:
            return 0
        t0 = time.perf_counter()
        res = self.remote.put([h.keys[i] for i in idx], [h.views[i] for i in idx], ttl_s=h.ttl)
        return self._count_remote_put([h.keys[i] for i in idx], res, t0)

    # -- metrics ---------------------------------------------------------------------------------
    def _sync_remote_metrics(self) -> None:
        """Bring the Prometheus counters up to the remote tier's own counts (cheap when unchanged)."""
        r = self.remote
        if r is None:
            return
        with self._ghost_lock:
            for reason, c in list(r.corrupt_reasons.items()):
                self._bump(("corrupt", reason), c, lambda d, reason=reason: self.metrics.corrupt.labels(
                    "remote", reason).inc(d))
            for stat, op in (("errors_get", "read"), ("errors_exists", "lookup"), ("timeouts", "timeout"),
                             ("skipped_down", "down")):
                self._bump(("err", stat), r.stats.get(stat, 0),
                           lambda d, op=op: self.metrics.failed.labels("remote", op).inc(d))

    def _bump(self, name, value: float, inc) -> None:
        cur = self._remote_synced.get(name, 0)
        if value > cur:
            inc(value - cur)
            self._remote_synced[name] = value
