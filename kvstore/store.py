"""KVStore: the batched, thread-safe, two-tier block store (DRAM slab pool over NVMe files).

Blocks are fixed-size byte buffers (``block_bytes`` of uint8, numpy or anything with the
buffer protocol). Keys are 16-byte chain keys (:mod:`kvstore.keys`); because key *i* hashes
the whole prefix, a store answers "how many *leading* keys do you hold".

* ``contains_prefix(keys)`` -> PrefixMatch(num_blocks, tiers, miss_reason)
* ``put(keys, blocks)``      -> number of blocks newly stored
* ``get(keys, out)``         -> number of leading blocks copied into ``out``
* ``prefetch(keys)``         -> Future: promotes the leading NVMe blocks into DRAM
* ``begin_store/end_store``, ``begin_load/end_load``: zero-copy two-phase moves for the
  connector (the DRAM slots are pinned while in flight and cannot be evicted)

The rules between tiers are :mod:`kvstore.placement`'s; the pieces: this file (set-up,
lookups, maintenance), :mod:`kvstore.storepath` (put, begin/end_store, reservations),
:mod:`kvstore.loadpath` (get, loads, promotion, prefetch), :mod:`kvstore.demote` (DRAM victims
written down on the I/O pool, never on the caller), :mod:`kvstore.handles` (the value types), :mod:`kvstore.metricsglue`.
"""

from __future__ import annotations

import logging
import math
import shutil
import tempfile
import threading
import time
from collections import OrderedDict
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import Callable, Sequence

import xxhash

from kvstore import placement
from kvstore.codecs import DTYPES, Geometry, make_codec, normalize_dtype
from kvstore.config import ConfigError, StoreConfig
from kvstore.demote import Demoter
from kvstore.codecs.registry import CODEC_IDS
from kvstore.rates import Rates
from kvstore.handles import LoadHandle, PrefixMatch, StoreHandle, _check_keys, _rows  # noqa: F401 (re-exported)
from kvstore.index import Entry
from kvstore.keys import ModelFingerprint, root_of
from kvstore.loadpath import LoadPath
from kvstore.machine import check_dram
from kvstore.metrics import StoreMetrics
from kvstore.metricsglue import MetricsGlue
from kvstore.remotepath import RemotePath
from kvstore.storepath import StorePath
from kvstore.tiers import DramTier, NvmeTier, Tier

log = logging.getLogger(__name__)

__all__ = ["KVStore", "PrefixMatch", "StoreHandle", "LoadHandle"]


class KVStore(StorePath, LoadPath, RemotePath, MetricsGlue):
    def __init__(
        self,
        config: StoreConfig | None = None,
        *,
        block_bytes: int,
        fingerprint: ModelFingerprint | bytes,
        block_tokens: int = 1,
        clock: Callable[[], float] = time.time,
        metrics: StoreMetrics | None = None,
        ghost_capacity: int = 1 << 17,
        kv_dtype: str | None = None,
        group_elems: int | None = None,
        io_executor: Executor | None = None,
    ):
        if block_bytes <= 0:
            raise ValueError(f"block_bytes must be positive, got {block_bytes}")
        self.config = config or StoreConfig()
        self.block_bytes = int(block_bytes)
        self.block_tokens = int(block_tokens)
        self.clock = clock
        dcfg, ncfg = self.config.tiers.dram, self.config.tiers.nvme
        self.root = root_of(fingerprint)
        # the NVMe namespace: model fingerprint + the codec of that tier
        self.namespace = xxhash.xxh3_128_digest(self.root + f"codec={ncfg.codec}".encode()
                                                + self._codec_geometry_tag(ncfg.codec, fingerprint, kv_dtype, group_elems))
        self.nvme_codec = None
        if dcfg.enabled and dcfg.codec != "none":
            raise ConfigError("tiers.dram.codec", dcfg.codec,
                              "none (DRAM codecs are not implemented yet; set int8/fp8/zstd on tiers.nvme.codec)")
        if ncfg.enabled and ncfg.codec != "none":
            self.nvme_codec = make_codec(ncfg.codec, self.geometry, ncfg.zstd_level)
        check_dram(self.config)  # a pool above this machine's free memory: ConfigError (tiers.dram.capacity_gb)
        self.metrics = metrics or StoreMetrics(port=self.config.metrics.port)
        self.rates = Rates(use=self.config.io.load_only_if_faster)  # tier reads (measured here), the engine's prefill
        self.metrics.info.labels(fingerprint.model if isinstance(fingerprint, ModelFingerprint) else "",
                                 self.root.hex(), self.namespace.hex()).set(1)
        self._tmpdir: str | None = None
        self.dram: DramTier | None = None
        self.nvme: NvmeTier | None = None
        if dcfg.enabled:
            self.dram = DramTier(capacity_bytes=dcfg.capacity_bytes, ttl_s=dcfg.ttl_s, policy=dcfg.policy,
                                 block_bytes=self.block_bytes, clock=clock, pin=dcfg.pin_memory,
                                 headroom=dcfg.headroom_blocks if ncfg.enabled else 0)
            if self.dram.pool.n_slots == 0:
                self.dram.close()
                self.dram = None
        if ncfg.enabled:
            path = ncfg.path
            try:
                if path is None:
                    path = self._tmpdir = tempfile.mkdtemp(prefix="kvstore-")
                self.nvme = NvmeTier(path=path, namespace=self.namespace, capacity_bytes=ncfg.capacity_bytes,
                                     ttl_s=ncfg.ttl_s, policy=ncfg.policy, block_bytes=self.block_bytes,
                                     codec_id=CODEC_IDS[ncfg.codec], o_direct=ncfg.o_direct, header=ncfg.header,
                                     clock=clock, codec=self.nvme_codec)
            except BaseException:
                if self.dram is not None:
                    self.dram.close()
                self.metrics.close()
                if self._tmpdir is not None:
                    shutil.rmtree(self._tmpdir, ignore_errors=True)
                raise
        self.tiers: list[Tier] = [t for t in (self.dram, self.nvme) if t is not None]
        for t, tcfg in ((self.dram, dcfg), (self.nvme, ncfg)):  # TTL class of blocks shared by sessions
            if t is not None:
                t.index.ttl_shared = tcfg.ttl_shared_s
        self.write_through = ncfg.write_mode == "write_through"
        # background writes (demotions, write-through) and batched reads; a replay may pass its own
        self._io = io_executor or ThreadPoolExecutor(max_workers=ncfg.io_threads, thread_name_prefix="kvstore-io")
        self._bg = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvstore-prefetch")
        self._ghosts: OrderedDict[bytes, str] = OrderedDict()
        self._ghost_cap = ghost_capacity
        self._admission = placement.Admission(ncfg.admit_after, ghost_capacity)  # tiers.nvme.admit_after
        self._ghost_lock = threading.Lock()
        self._pending: set[Future] = set()
        self._pending_lock = threading.Lock()
        self._corrupt_synced: dict[str, int] = {}
        self._closed = False
        self._demoter = Demoter(self)
        self._open_remote(fingerprint, kv_dtype, group_elems)  # self.remote: None unless configured
        self.metrics.demoting.set_function(lambda: len(self._demoter))
        for t in self.tiers:
            # read at scrape time: a full disk lowers NVMe's, DRAM's grows as its pool is prepared
            self.metrics.capacity.labels(t.name).set_function(lambda t=t: t.capacity_bytes)
        if self.dram is not None:
            self.metrics.resident.labels("dram").set_function(self.dram.pool.resident_bytes)
        self._update_gauges()

    def _codec_geometry_tag(self, codec: str, fingerprint, kv_dtype: str | None, group_elems: int | None) -> bytes:
        """Set ``self.geometry`` (what the codecs need: element dtype, scale group); the bytes that
        join the NVMe namespace (empty for codec none, so its folders never change)."""
        fp = fingerprint if isinstance(fingerprint, ModelFingerprint) else None
        dtype = normalize_dtype(kv_dtype if kv_dtype is not None else (fp.dtype if fp is not None else None))
        if group_elems is None:
            group_elems = fp.head_size if fp is not None and fp.head_size >= 8 else 128
            n = self.block_bytes // DTYPES.get(dtype, 1)
            if n % group_elems:  # an automatic choice must divide the block
                group_elems = math.gcd(n, group_elems) or 1
        self.geometry = Geometry(self.block_bytes, dtype, int(group_elems))
        if codec == "none":
            return b""
        return f",dtype={dtype},group={int(group_elems)}".encode()

    # -- lookups -------------------------------------------------------------------------------
    def contains_prefix(self, keys: Sequence[bytes], *, record: bool = True, num_tokens: int | None = None,
                        held: int = 0) -> PrefixMatch:
        """How many leading ``keys`` are worth loading, and in which tier each one is: the stored
        prefix, cut where loading is slower than recomputing (``held``: leading blocks the
        engine holds itself, never read)."""
        self._check_open()
        keys = _check_keys(keys)
        tiers: list[str] = []
        for k in keys:
            t = self._where(k)
            if t is None:
                break
            tiers.append(t)
        tiers += ["remote"] * self._remote_extend(keys, len(tiers))  # the shared tier, asked last
        n = placement.worth_loading(tiers, *self.rates.seconds_per_block(self.block_bytes, self.block_tokens), held)
        reason = "slower_than_recompute" if n < len(tiers) else None
        del tiers[n:]
        if not keys:
            reason = "below_min"
        elif n < len(keys) and reason is None:
            reason = self._miss_reason(keys[n], n)
        if record:
            self._record_lookup(len(keys), tiers, reason, num_tokens)
        return PrefixMatch(n, tuple(tiers), reason)

    def _where(self, key: bytes) -> str | None:
        for t in self.tiers:
            if t.contains(key):
                return t.name
            if t is self.dram and self._demoter.has(key):  # being written down: still in its slot
                return t.name
        return None

    def _miss_reason(self, key: bytes, at: int) -> str:
        expired = any(t.is_expired(key) for t in self.tiers)  # past its TTL, not swept yet
        with self._ghost_lock:
            why = self._ghosts.get(key)
        return placement.miss_reason(expired=expired, remembered=why, at=at)

    def _remember_gone(self, entries: list[Entry], reason: str | None = None) -> None:
        with self._ghost_lock:
            for e in entries:
                self._ghosts[e.key] = placement.gone_reason(reason or e.reason)
                self._ghosts.move_to_end(e.key)
            while len(self._ghosts) > self._ghost_cap:
                self._ghosts.popitem(last=False)

    def _forget_gone(self, keys: Sequence[bytes]) -> None:
        with self._ghost_lock:
            for k in keys:
                self._ghosts.pop(k, None)

    # -- maintenance ---------------------------------------------------------------------------
    def sweep(self) -> int:
        """Expire what is due in every tier (bounded work). DRAM victims are demoted as evicted
        ones are (in the background); NVMe files are removed here."""
        n = 0
        for t in self.tiers:
            ev = t.expire()
            n += len(ev)
            if t is self.dram:
                self._demoter.take(ev)
            elif ev:
                self._count_evictions(t, ev)
                self._remember_gone([e for e in ev if not self._where(e.key)])
                t.free(ev)
        self._update_gauges()
        return n

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait for the DRAM pool (prepared in the background after its first chunk) to be
        whole; for benchmarks and replays that need the configured capacity from the start."""
        return self.dram.wait_ready(timeout) if self.dram is not None else True

    def stats(self) -> dict:
        """Counts per tier plus every metric sample."""
        self._update_gauges()
        return {
            "tiers": {t.name: {"blocks": len(t), "bytes": t.used_bytes, "capacity_bytes": t.capacity_bytes,
                               **t.stats} for t in self.tiers},
            "metrics": self.metrics.snapshot(),
        }

    def persist(self) -> int:
        """Write DRAM-only blocks down to NVMe (write-back), oldest first. Returns how many."""
        dram, nv = self.dram, self.nvme
        if dram is None or nv is None:
            return 0
        with dram.lock:
            now = self.clock()
            entries = [e for k in list(dram.index.policy.victims())
                       if (e := dram.index.lookup(k, now)) is not None]
            for e in entries:
                dram.index.pin(e)
        try:
            now = self.clock()  # (a block without its asks, tiers.nvme.admit_after, is not written)
            todo = [e for e in entries if self._demoter.action(e, now) == placement.DEMOTE]
            n = 0
            for i in range(0, len(todo), 64):
                batch = todo[i:i + 64]
                jobs = [(ne, e) for ne, e in zip(self._reserve_nvme([e.key for e in batch]), batch) if ne is not None]
                for ne, e in jobs:
                    ne.last_access = e.last_access
                n += sum(self._run_io([lambda ne=ne, e=e: self._write_down(ne, e) for ne, e in jobs]))
            self.flush()  # NVMe victims' files
            return n
        finally:
            dram.release(entries)

    def close(self, persist: bool = True) -> None:
        """Finish background work, write DRAM-only blocks to NVMe (``persist``), free everything."""
        if self._closed:
            return
        self._closed = True  # new calls are refused; queued prefetches still run (internally)
        try:
            self._bg.shutdown(wait=True)
            with self._pending_lock:
                todo = list(self._pending)
            for f in todo:  # demotions, write-through copies, removals
                try:
                    f.result()
                except Exception as e:  # a failed background job must not stop the close
                    log.warning("kvstore: a background job failed: %s", e)
            if persist:
                self.persist()
        finally:
            self._bg.shutdown(wait=True)
            self._io.shutdown(wait=True)
            for t in self.tiers:
                t.close()
            if self.remote is not None:
                self.remote.close()
            self.metrics.close()
            if self._tmpdir is not None:
                shutil.rmtree(self._tmpdir, ignore_errors=True)

    def __enter__(self) -> "KVStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
