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

DRAM evictions are demoted to NVMe (write-back; ``write_through`` writes NVMe at put time),
an NVMe hit is promoted to DRAM. Expired entries go first, then the policy's victims.
"""

from __future__ import annotations

import logging
import math
import shutil
import tempfile
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Sequence

import numpy as np
import xxhash

from kvstore import failpoints
from kvstore.codecs import DTYPES, Geometry, make_codec, normalize_dtype
from kvstore.config import ConfigError, StoreConfig
from kvstore.fileformat import CODEC_IDS
from kvstore.index import Entry
from kvstore.keys import ModelFingerprint, root_of
from kvstore.metrics import TIERS, StoreMetrics
from kvstore.tiers import DramTier, NvmeTier, Tier

log = logging.getLogger(__name__)


class PrefixMatch(NamedTuple):
    num_blocks: int
    tiers: tuple[str, ...]  # where each matched block is ("dram" or "nvme")
    miss_reason: str | None  # why block ``num_blocks`` is missing; None if all matched


@dataclass
class StoreHandle:
    """Phase 1 of a zero-copy store: write each ``views[i]`` (None = already stored), then end."""

    keys: list[bytes]
    entries: list[Entry | None]
    views: list[np.ndarray | None]
    tier: Tier | None
    started: float = field(default_factory=time.perf_counter)
    done: bool = False
    background: list = field(default_factory=list)  # write-through futures (see flush)


@dataclass
class LoadHandle:
    """Phase 1 of a zero-copy load: ``views[:num_blocks]`` hold the blocks (read-only use) once
    the NVMe ones are read (``unread``: block index -> pinned NVMe entry, see ``read_load``)."""

    keys: list[bytes]
    num_blocks: int
    views: list[np.ndarray | None]
    entries: list[Entry | None]  # pinned DRAM entries (None for a block read into a private buffer)
    tier_of: list[str]
    unread: dict[int, Entry] = field(default_factory=dict)
    read: bool = False
    started: float = field(default_factory=time.perf_counter)
    done: bool = False


def _rows(buf, n: int, block_bytes: int, *, writable: bool, name: str) -> list[np.ndarray]:
    """``buf`` as ``n`` contiguous 1-D uint8 views of at least ``block_bytes``; clear errors otherwise."""
    if isinstance(buf, (list, tuple)):
        if len(buf) < n:
            raise ValueError(f"{name}: {len(buf)} buffers for {n} keys")
        rows = []
        for i, b in enumerate(buf[:n]):
            a = np.asarray(b)
            if a.dtype != np.uint8 or not a.flags.c_contiguous or a.nbytes < block_bytes:
                raise ValueError(f"{name}[{i}]: need a contiguous uint8 buffer of >= {block_bytes} bytes, "
                                 f"got {a.dtype} {a.shape}")
            if writable and not a.flags.writeable:
                raise ValueError(f"{name}[{i}] is read-only")
            rows.append(a.reshape(-1).view(np.uint8)[:block_bytes])
        return rows
    a = np.asarray(buf)
    if a.dtype != np.uint8 or a.ndim != 2 or not a.flags.c_contiguous:
        raise ValueError(f"{name}: need a C-contiguous uint8 array [n, block_bytes] or a list of buffers, "
                         f"got {a.dtype} {a.shape}")
    if a.shape[0] < n or a.shape[1] < block_bytes:
        raise ValueError(f"{name}: shape {a.shape} is too small for {n} blocks of {block_bytes} bytes")
    if writable and not a.flags.writeable:
        raise ValueError(f"{name} is read-only")
    return [a[i, :block_bytes] for i in range(n)]


def _check_keys(keys: Sequence[bytes]) -> list[bytes]:
    keys = list(keys)
    for k in keys:
        if not isinstance(k, (bytes, bytearray)) or len(k) != 16:
            raise ValueError(f"keys must be 16-byte digests (kvstore.keys.chain_keys), got {k!r:.40}")
    return [bytes(k) for k in keys]


class KVStore:
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
        self.metrics = metrics or StoreMetrics(port=self.config.metrics.port)
        self.metrics.info.labels(fingerprint.model if isinstance(fingerprint, ModelFingerprint) else "",
                                 self.root.hex(), self.namespace.hex()).set(1)
        self._tmpdir: str | None = None
        self.dram: DramTier | None = None
        self.nvme: NvmeTier | None = None
        if dcfg.enabled:
            self.dram = DramTier(capacity_bytes=dcfg.capacity_bytes, ttl_s=dcfg.ttl_s, policy=dcfg.policy,
                                 block_bytes=self.block_bytes, clock=clock, pin=dcfg.pin_memory)
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
        self._io = ThreadPoolExecutor(max_workers=ncfg.io_threads, thread_name_prefix="kvstore-io")
        self._bg = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvstore-prefetch")
        self._ghosts: OrderedDict[bytes, str] = OrderedDict()
        self._ghost_cap = ghost_capacity
        self._ghost_lock = threading.Lock()
        self._pending: set[Future] = set()
        self._corrupt_synced: dict[str, int] = {}
        self._closed = False
        if self.dram is not None:
            self.dram.on_evict = self._on_dram_evict
        if self.nvme is not None:
            self.nvme.on_evict = self._on_nvme_evict
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
    def contains_prefix(self, keys: Sequence[bytes], *, record: bool = True, num_tokens: int | None = None) -> PrefixMatch:
        """How many leading ``keys`` are stored, and in which tier each one is."""
        self._check_open()
        keys = _check_keys(keys)
        tiers: list[str] = []
        for k in keys:
            t = self._where(k)
            if t is None:
                break
            tiers.append(t)
        n = len(tiers)
        reason = None
        if not keys:
            reason = "below_min"
        elif n < len(keys):
            reason = self._miss_reason(keys[n], n)
        if record:
            self._record_lookup(len(keys), tiers, reason, num_tokens)
        return PrefixMatch(n, tuple(tiers), reason)

    def _where(self, key: bytes) -> str | None:
        for t in self.tiers:
            if t.contains(key):
                return t.name
        return None

    def _miss_reason(self, key: bytes, at: int) -> str:
        if any(t.is_expired(key) for t in self.tiers):  # past its TTL, not swept yet
            return "expired"
        with self._ghost_lock:
            why = self._ghosts.get(key)
        if why is not None:
            return why
        return "diverged" if at > 0 else "never_stored"

    def _record_lookup(self, n_keys: int, tiers: list[str], reason: str | None, num_tokens: int | None) -> None:
        m, bt = self.metrics, self.block_tokens
        m.lookup_blocks.inc(n_keys)
        m.lookup_tokens.inc(n_keys * bt)
        for name in TIERS:
            c = tiers.count(name)
            if c:
                m.hit_blocks.labels(name).inc(c)
                m.hit_tokens.labels(name).inc(c * bt)
        if reason is not None:
            missed = n_keys - len(tiers)
            m.miss_blocks.labels(reason).inc(missed)
            m.miss_tokens.labels(reason).inc(missed * bt if n_keys else (num_tokens or 0))

    def _remember_gone(self, entries: list[Entry], reason: str | None = None) -> None:
        with self._ghost_lock:
            for e in entries:
                why = reason or e.reason
                self._ghosts[e.key] = why if why in ("expired", "corrupt") else "evicted"
                self._ghosts.move_to_end(e.key)
            while len(self._ghosts) > self._ghost_cap:
                self._ghosts.popitem(last=False)

    def _forget_gone(self, keys: Sequence[bytes]) -> None:
        with self._ghost_lock:
            for k in keys:
                self._ghosts.pop(k, None)

    # -- eviction hooks ------------------------------------------------------------------------
    def _count_evictions(self, tier: Tier, entries: list[Entry]) -> None:
        exp = sum(1 for e in entries if e.reason == "expired")
        if exp:
            self.metrics.expirations.labels(tier.name).inc(exp)
        if len(entries) - exp:
            self.metrics.evictions.labels(tier.name).inc(len(entries) - exp)

    def _on_dram_evict(self, tier: Tier, entries: list[Entry]) -> None:
        """DRAM victims (slots still intact) are written to NVMe before their slots are reused."""
        self._count_evictions(tier, entries)
        self._on_dram_evict_copy(entries)

    def _on_dram_evict_copy(self, entries: list[Entry]) -> None:
        nv = self.nvme
        if nv is None:
            self._remember_gone(entries)
            return
        todo = [e for e in entries if not nv.holds(e.key)]
        if nv.index.ttl is not None:
            # already past the NVMe TTL (counted from the last real access): not worth a write
            now = self.clock()
            stale = [e for e in todo if e.last_access + nv.index.ttl <= now]
            if stale:
                self._remember_gone(stale, "expired")
                todo = [e for e in todo if e.last_access + nv.index.ttl > now]
        if not todo:
            return
        nentries = nv.reserve([e.key for e in todo])
        dram = self.dram
        assert dram is not None
        for ne, e in zip(nentries, todo):
            if ne is not None:
                ne.last_access = e.last_access  # the file's mtime: recency survives a restart
        jobs = [(ne, dram.slot_view(e)) for ne, e in zip(nentries, todo) if ne is not None]
        try:
            oks = self._run_io([lambda ne=ne, v=v: nv.write(ne, v) for ne, v in jobs])
        except BaseException:
            nv.commit([ne for ne, _ in jobs], [False] * len(jobs))
            raise
        done = [ne for ne, _ in jobs]
        # the NVMe copy keeps the DRAM recency, so its TTL counts from the last real access
        for (ne, _), ok, e in zip(jobs, oks, [e for ne, e in zip(nentries, todo) if ne is not None]):
            nv.commit([ne], [ok], at=e.last_access)
        n_ok = sum(oks)
        self.metrics.demotions.inc(n_ok)
        self.metrics.bytes_in.labels("nvme").inc(n_ok * self.block_bytes)
        if len(oks) - n_ok:
            self.metrics.failed.labels("nvme", "write").inc(len(oks) - n_ok)
        lost = [e for ne, e in zip(nentries, todo) if ne is None]
        lost += [ne for ne, ok in zip(done, oks) if not ok]
        if lost:
            self._remember_gone(lost)

    def _on_nvme_evict(self, tier: Tier, entries: list[Entry]) -> None:
        self._count_evictions(tier, entries)
        gone = [e for e in entries if self.dram is None or not self.dram.contains(e.key)]
        self._remember_gone(gone)

    def _run_io(self, fns: list[Callable[[], bool]]) -> list[bool]:
        if not fns:
            return []
        if len(fns) == 1:
            return [fns[0]()]
        try:
            return list(self._io.map(lambda f: f(), fns))
        except RuntimeError:  # the pool is shut down (interpreter exit): do it here
            return [f() for f in fns]

    # -- put -----------------------------------------------------------------------------------
    def put(self, keys: Sequence[bytes], blocks) -> int:
        """Store blocks under keys. Returns how many were newly stored (present keys are skipped)."""
        self._check_open()
        keys = _check_keys(keys)
        rows = _rows(blocks, len(keys), self.block_bytes, writable=False, name="blocks")
        if self.dram is None:
            return self._put_nvme(keys, rows) if self.nvme is not None else 0
        # chunks of at most half the DRAM slots, so a batch larger than DRAM still goes
        # through (each chunk's commit lets the next one evict, i.e. demote, the previous).
        # Last chunk first: the head of a chain ends most recent, so it is demoted last.
        step = max(1, self.dram.pool.ready_slots // 2)  # while the pool is prepared: what is ready
        n = 0
        for i in reversed(range(0, len(keys), step)):
            h = self.begin_store(keys[i:i + step])
            try:
                for v, r in zip(h.views, rows[i:i + step]):
                    if v is not None:
                        np.copyto(v, r[: self.block_bytes], casting="no")
            except BaseException:
                self.end_store(h, False)
                raise
            n += self.end_store(h, True)
            for f in h.background:  # put() returns once write-through copies are on NVMe
                f.result()
            if self.nvme is not None:
                # DRAM had no room (every slot pinned by loads in flight): straight to NVMe
                rest = [j for j, e in enumerate(h.entries) if e is None and not self.dram.holds(h.keys[j])]
                if rest:
                    n += self._put_nvme([h.keys[j] for j in rest], [rows[i + j] for j in rest])
        return n

    def _put_nvme(self, keys: list[bytes], rows: list[np.ndarray]) -> int:
        h = StoreHandle(keys, self.nvme.reserve(keys), [], self.nvme)
        h.views = [r if e is not None else None for e, r in zip(h.entries, rows)]
        return self.end_store(h, True)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("KVStore is closed")

    def begin_store(self, keys: Sequence[bytes]) -> StoreHandle:
        """Reserve room for the keys not yet stored; returns writable views (None = skip).

        Keys held by any tier (or being written) are skipped.
        """
        self._check_open()
        keys = _check_keys(keys)
        if self.dram is not None:
            if self.nvme is not None:
                want = [k for k in keys if not self.nvme.holds(k)]
                # a repeated key is reserved once (its later copies get None): keep that entry,
                # never overwrite it with a later None (it would stay WRITING and pinned forever)
                got = {k: e for k, e in zip(want, self.dram.reserve(want)) if e is not None} if want else {}
                entries = [got.pop(k, None) for k in keys]
            else:
                entries = self.dram.reserve(keys)
            views = [self.dram.view(e) if e is not None else None for e in entries]
            return StoreHandle(keys, entries, views, self.dram)
        if self.nvme is not None:
            # NVMe-only store: stage in private buffers, written at end_store
            entries = self.nvme.reserve(keys)
            views = [np.empty(self.block_bytes, np.uint8) if e is not None else None for e in entries]
            return StoreHandle(keys, entries, views, self.nvme)
        return StoreHandle(keys, [None] * len(keys), [None] * len(keys), None)

    def end_store(self, h: StoreHandle, ok: bool | Sequence[bool] = True) -> int:
        """Phase 2: publish what was written (``ok`` may be per key). Returns blocks stored."""
        if h.done:
            raise RuntimeError("end_store called twice for one handle")
        h.done = True
        oks = [ok] * len(h.keys) if isinstance(ok, (bool, np.bool_)) else list(ok)
        if len(oks) != len(h.keys):
            if h.tier is not None:
                h.tier.commit(h.entries, [False] * len(h.entries))
            raise ValueError(f"end_store: {len(oks)} results for {len(h.keys)} keys (nothing was stored)")
        oks = [bool(o) and e is not None for o, e in zip(oks, h.entries)]
        tier = h.tier
        if tier is None:
            return 0
        if tier is self.nvme:
            jobs = [(i, e, v) for i, (e, v) in enumerate(zip(h.entries, h.views)) if e is not None and oks[i]]
            res = self._run_io([lambda e=e, v=v: self.nvme.write(e, v) for _, e, v in jobs])
            for (i, _, _), r in zip(jobs, res):
                oks[i] = r
            fails = len(jobs) - sum(res)
            if fails:
                self.metrics.failed.labels("nvme", "write").inc(fails)
        tier.commit(h.entries, oks)
        n = sum(oks)
        stored = [k for k, o in zip(h.keys, oks) if o]
        self._forget_gone(stored)
        self.metrics.bytes_in.labels(tier.name).inc(n * self.block_bytes)
        self.metrics.put_latency.labels(tier.name).observe(time.perf_counter() - h.started)
        if n and self.write_through and tier is self.dram and self.nvme is not None:
            h.background = self._write_through(stored)
        self._update_gauges()
        return n

    def _write_through(self, keys: list[bytes]) -> list[Future]:
        """Copy freshly stored DRAM blocks to NVMe in the background (DRAM slots pinned meanwhile)."""
        dram, nv = self.dram, self.nvme
        assert dram is not None and nv is not None
        dentries = dram.acquire(keys, touch=False)
        nentries = nv.reserve(keys)

        def job(de: Entry | None, ne: Entry | None) -> bool:
            try:
                ok = ne is not None and de is not None and nv.write(ne, dram.slot_view(de))
                if ne is not None:
                    nv.commit([ne], [ok])
                if ok:
                    self.metrics.bytes_in.labels("nvme").inc(self.block_bytes)
                return ok
            finally:
                if de is not None:
                    dram.release([de])

        futures = []
        for de, ne in zip(dentries, nentries):
            if de is None and ne is None:
                continue
            f = self._io.submit(job, de, ne)
            self._track(f)
            futures.append(f)
        return futures

    def _track(self, f: Future) -> None:
        self._pending.add(f)
        f.add_done_callback(self._pending.discard)

    def flush(self) -> None:
        """Wait for background writes and prefetches."""
        for f in list(self._pending):
            f.result()

    # -- get -----------------------------------------------------------------------------------
    def get(self, keys: Sequence[bytes], out, *, session: str | None = None) -> int:
        """Copy the leading stored blocks into ``out`` (rows). Returns how many were copied."""
        self._check_open()
        keys = _check_keys(keys)
        rows = _rows(out, len(keys), self.block_bytes, writable=True, name="out")
        h = self.begin_load(keys, outs=rows, session=session)
        try:
            for i in range(h.num_blocks):
                if h.views[i] is not rows[i]:
                    np.copyto(rows[i][: self.block_bytes], h.views[i][: self.block_bytes], casting="no")
        finally:
            self.end_load(h)
        return h.num_blocks

    def begin_load(self, keys: Sequence[bytes], *, outs: list[np.ndarray] | None = None,
                   session: str | None = None) -> LoadHandle:
        """Pin the leading stored blocks and read the NVMe ones (:meth:`pin_load` then
        :meth:`read_load`). ``views[i]`` holds block i; call ``end_load`` to unpin."""
        self._check_open()
        h = self._pin(_check_keys(keys), session)
        try:
            self._read_pinned(h, outs)
        except BaseException:
            self.end_load(h)
            raise
        return h

    def pin_load(self, keys: Sequence[bytes], *, session: str | None = None) -> LoadHandle:
        """Phase 1 of a load, without I/O (the scheduler side): pin the leading stored blocks in
        whichever tier holds them. DRAM blocks get their views now; NVMe blocks are read later
        by :meth:`read_load` (the worker side), where a failed read is the worker's to report."""
        self._check_open()
        return self._pin(_check_keys(keys), session)

    def read_load(self, h: LoadHandle, outs: list[np.ndarray] | None = None) -> int:
        """Read a pinned load's NVMe blocks (into fresh DRAM slots when there is room, else into
        ``outs[i]`` or a private buffer). A failed or corrupt read ends the prefix there: returns
        the number of leading blocks now readable through ``views``."""
        if h.done:
            raise RuntimeError("read_load after end_load")
        self._read_pinned(h, outs)
        return h.num_blocks

    def _pin(self, keys: list[bytes], session: str | None, failpoint: bool = True) -> LoadHandle:
        if failpoint:
            failpoints.fire("store.pin", store=self, keys=keys)
            self._check_open()  # the failpoint may have closed it
        dram, nv = self.dram, self.nvme
        n_keys = len(keys)
        # pin without counting hits, find the prefix, then count only the blocks that are used
        dentries = dram.acquire(keys, touch=False) if dram is not None else [None] * n_keys
        nentries: list[Entry | None] = [None] * n_keys
        miss = [i for i, e in enumerate(dentries) if e is None]
        if miss and nv is not None:
            got = nv.acquire([keys[i] for i in miss], touch=False)
            for i, ne in zip(miss, got):
                nentries[i] = ne
        n = next((i for i in range(n_keys) if dentries[i] is None and nentries[i] is None), n_keys)
        if dram is not None:
            dram.release(dentries[n:])
            dram.touch(dentries[:n], session)
        if nv is not None:
            nv.release(nentries[n:])
            nv.touch(nentries[:n], session)
        h = LoadHandle(keys, n, [None] * n, list(dentries[:n]),
                       ["dram" if dentries[i] is not None else "nvme" for i in range(n)])
        for i in range(n):
            if dentries[i] is not None:
                h.views[i] = dram.view(dentries[i])
            else:
                h.unread[i] = nentries[i]
        return h

    def _read_pinned(self, h: LoadHandle, outs: list[np.ndarray] | None) -> None:
        if h.read:
            return
        h.read = True
        if not h.unread:
            self.metrics.bytes_out.labels("dram").inc(h.num_blocks * self.block_bytes)
            return
        t0 = time.perf_counter()
        dram = self.dram
        nv_idx = sorted(h.unread)
        nentries = [h.unread.pop(i) for i in nv_idx]
        try:
            failpoints.fire("store.read", store=self, keys=[h.keys[i] for i in nv_idx])
            got = self._promote(nentries, [outs[i] for i in nv_idx] if outs is not None else None)
        except BaseException:
            self.nvme.release(nentries)
            self._cut(h, nv_idx[0])
            raise
        bad = next((j for j, (_, _, ok) in enumerate(got) if not ok), None)
        for i, (v, de, ok) in zip(nv_idx, got):
            h.views[i] = v
            h.entries[i] = de
        if bad is not None:
            self.metrics.failed.labels("nvme", "read").inc(1)
            self._cut(h, nv_idx[bad])
        self.metrics.bytes_out.labels("nvme").inc(sum(1 for t in h.tier_of if t == "nvme") * self.block_bytes)
        self.metrics.bytes_out.labels("dram").inc(sum(1 for t in h.tier_of if t == "dram") * self.block_bytes)
        self.metrics.get_latency.labels("nvme").observe(time.perf_counter() - t0)

    def _cut(self, h: LoadHandle, cut: int) -> None:
        """End a load's prefix at block ``cut`` (a read failed there): unpin what lies beyond."""
        if self.dram is not None:
            self.dram.release([e for e in h.entries[cut:] if e is not None])
        if h.unread and self.nvme is not None:
            self.nvme.release([h.unread.pop(i) for i in sorted(h.unread) if i >= cut])
        h.views, h.entries, h.tier_of, h.num_blocks = h.views[:cut], h.entries[:cut], h.tier_of[:cut], cut

    def end_load(self, h: LoadHandle) -> None:
        if h.done:
            raise RuntimeError("end_load called twice for one handle")
        h.done = True
        if self.dram is not None:
            self.dram.release([e for e in h.entries if e is not None])
        if h.unread and self.nvme is not None:  # pinned, never read (the load was dropped)
            self.nvme.release(list(h.unread.values()))
            h.unread.clear()
        self._update_gauges()

    def _promote(self, nentries: list[Entry], outs: list[np.ndarray] | None):
        """Read pinned NVMe entries; into fresh DRAM slots when there is room (then pinned)."""
        dram, nv = self.dram, self.nvme
        assert nv is not None
        dres = dram.reserve([e.key for e in nentries]) if dram is not None else [None] * len(nentries)

        def one(i: int):
            ne, de = nentries[i], dres[i]
            if de is not None:
                dst = dram.slot_view(de)
            elif outs is not None and i < len(outs):
                dst = outs[i]
            else:
                dst = np.empty(self.block_bytes, np.uint8)
            return nv.read(ne, dst), dst

        res = self._run_io([lambda i=i: one(i) for i in range(len(nentries))])
        oks = [ok for ok, _ in res]
        nv.release(nentries, oks)
        out = []
        for (ok, dst), de in zip(res, dres):
            if de is not None:
                dram.commit([de], [ok], keep_pinned=True)  # pinned for the caller until end_load
            out.append((dst[: self.block_bytes] if ok else None, de if ok else None, ok))
        n_ok = sum(1 for _, de, _ in out if de is not None)
        self.metrics.promotions.inc(n_ok)
        self.metrics.bytes_in.labels("dram").inc(n_ok * self.block_bytes)
        bad = [ne for ne, ok in zip(nentries, oks) if not ok]
        if bad:
            self._remember_gone([_as_corrupt(e) for e in bad])
            self._sync_corrupt_metrics()
        return out

    def _sync_corrupt_metrics(self) -> None:
        """Bring the corrupt-file counter up to the NVMe tier's own counts (cheap when unchanged)."""
        if self.nvme is None or not self.nvme.corrupt_reasons:
            return
        with self._ghost_lock:
            for reason, c in list(self.nvme.corrupt_reasons.items()):
                cur = self._corrupt_synced.get(reason, 0)
                if c > cur:
                    self.metrics.corrupt.labels("nvme", reason).inc(c - cur)
                    self._corrupt_synced[reason] = c

    def prefetch(self, keys: Sequence[bytes]) -> Future:
        """Start promoting the leading NVMe blocks of ``keys`` into DRAM; resolves to the count."""
        self._check_open()
        keys = _check_keys(keys)
        if self.dram is None or self.nvme is None:  # nowhere to promote into (or from): nothing to do
            f: Future = Future()
            f.set_result(0)
            return f

        def job() -> int:
            h = self._pin(keys, None, failpoint=False)
            try:
                self._read_pinned(h, None)
                return sum(1 for t in h.tier_of if t == "nvme")
            finally:
                self.end_load(h)

        f = self._bg.submit(job)
        self._track(f)
        return f

    # -- maintenance ---------------------------------------------------------------------------
    def sweep(self) -> int:
        """Expire what is due in every tier (bounded work)."""
        n = sum(t.sweep() for t in self.tiers)
        self._update_gauges()
        return n

    def _update_gauges(self) -> None:
        for t in self.tiers:
            self.metrics.blocks.labels(t.name).set(len(t))
            self.metrics.bytes_held.labels(t.name).set(t.used_bytes)
        self._sync_corrupt_metrics()

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
            todo = [e for e in entries if not nv.holds(e.key)]
            before = self.metrics.value("kvstore_demoted_blocks_total")
            for i in range(0, len(todo), 64):
                batch = todo[i:i + 64]
                for e in batch:
                    e.reason = ""
                self._on_dram_evict_copy(batch)
            return int(self.metrics.value("kvstore_demoted_blocks_total") - before)
        finally:
            dram.release(entries)

    def close(self, persist: bool = True) -> None:
        """Finish background work, write DRAM-only blocks to NVMe (``persist``), free everything."""
        if self._closed:
            return
        self._closed = True  # new calls are refused; queued prefetches still run (internally)
        try:
            self._bg.shutdown(wait=True)
            for f in list(self._pending):
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
            self.metrics.close()
            if self._tmpdir is not None:
                shutil.rmtree(self._tmpdir, ignore_errors=True)

    def __enter__(self) -> "KVStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _as_corrupt(e: Entry) -> Entry:
    e.reason = "corrupt"
    return e
