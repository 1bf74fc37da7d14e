"""``KVStoreL2Adapter``: a :class:`kvstore.store.KVStore` behind LMCache's L2 adapter interface
(``lmcache/v1/distributed/l2_adapters/base.py`` of LMCache 0.5.6), so an LMCache multiprocess
server keeps its L2 chunks in kvstore's tiers (DRAM, NVMe files, Redis/Valkey) with their idle TTL,
admission, checksummed reloads and HMAC-authenticated Redis values.

How LMCache's objects become kvstore blocks:

* A key: ``xxh3_128(store root || encode(model_name, kv_rank, object_group_id, cache_salt,
  chunk_hash))``. The kv_rank packs world size and rank, so two models, two ranks, two groups or
  two salts never share a block; the store root (its NVMe namespace) adds ``namespace`` and
  ``chunk_bytes``.
* A block: a 4 KiB header, then the object's bytes, zero padded to ``chunk_bytes``. The header
  holds the object's length and a digest of its layout (shapes, dtypes). A lookup counts a block
  only if its header is whole and its layout is the one LMCache asks for; a load copies only
  into an object of the same layout and length. Everything else (a block kvstore could not read,
  a bad checksum, a forged Redis value) is already a miss in kvstore: nothing here reads around it.
* Lookup-and-lock reads the found blocks (``KVStore.begin_load``: pinned, checksum verified), a
  task's chunks in one call while they are stored one after another (the NVMe tier then reads them
  at depth; a call per chunk read one at a time), and keeps them pinned until ``submit_unlock``;
  the bitmap says only what was read intact.
* A store task is staged in page-aligned rows each worker thread keeps (at most ``STAGE_BYTES``,
  the task put in slices of that): a fresh array per task cost its first-touch page faults, and
  an O_DIRECT write from unaligned rows went through the tier's bounce buffer.

LMCache's own L2 eviction is left off (``max_capacity_bytes`` 0): kvstore evicts by its own
capacity, policy and TTL, and ``get_usage`` reports what its tiers hold.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Mapping

import numpy as np
import xxhash

from kvstore.config import load_config
from kvstore.configfields import UNKNOWN_KEY, ConfigError
from kvstore.keys import ModelFingerprint, encode
from kvstore.store import KVStore
from kvstore.tiers.memory import PAGE, alloc_aligned
from kvstore.tiers.registry import SPECS

from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import AdapterUsage, L2AdapterInterface
from lmcache.v1.platform import create_event_notifier

log = logging.getLogger(__name__)

HEADER = 4096  # one page, so the object's bytes stay page aligned in a DRAM slot and an O_DIRECT read
_MAGIC = b"KVLMC\x00\x00\x01"
_HEAD = struct.Struct("<8sQ16s")  # magic, the object's length, its layout digest
# kvstore's event vocabulary (events.<medium>.medium) -> LMCache's memory segments
_SEGMENT = {"CPU": "DRAM", "GPU": "VRAM", "STORAGE": "STORAGE"}
PARAMS = ("config", "chunk_bytes", "namespace", "workers")
STAGE_BYTES = 64 << 20  # a worker's staging rows for a store task (a larger task is put in slices)


def _param_error(key: str, value: Any, allowed: str) -> ConfigError:
    return ConfigError(f"adapter_params.{key}" if key else "adapter_params", value, allowed)


def _layout(shapes, dtypes) -> bytes:
    """A digest of a memory layout: LMCache's ``MemoryLayoutDesc`` and an allocated object's
    metadata give the same one (both from the layout the L1 allocator used)."""
    shp = [[int(d) for d in s] for s in shapes]
    return xxhash.xxh3_128_digest(encode([shp, [str(d) for d in dtypes]]))


def _obj_layout(obj) -> bytes:
    md = obj.metadata
    shapes = md.shapes if md.shapes is not None else [md.shape]
    dtypes = md.dtypes if md.dtypes is not None else [md.dtype]
    return _layout(shapes, dtypes)


class _Pinned:
    """One ``begin_load`` of a lookup: its handle holds the pins of several chunks, ended once
    the last of them is done (``left``: chunks still locked or being loaded)."""

    __slots__ = ("handle", "left")

    def __init__(self, handle):
        self.handle, self.left = handle, 0


class _Locked:
    """One lookup's lock on one chunk (block ``i`` of a :class:`_Pinned`): done at its unlock, or
    by the last load still copying out of it when the unlock came first."""

    __slots__ = ("pinned", "i", "users", "unlocked")

    def __init__(self, pinned: _Pinned, i: int):
        self.pinned, self.i, self.users, self.unlocked = pinned, i, 0, False

    @property
    def view(self) -> np.ndarray:
        return self.pinned.handle.views[self.i]


class KVStoreL2Adapter(L2AdapterInterface):
    """``adapter_params``: ``config`` (a kvstore config: a shipped name, a YAML path, or a dict of
    keys, with ``"config"`` inside naming a file to start from), ``chunk_bytes`` (the largest
    memory object the server stores: one chunk of one object group, in bytes; required),
    ``namespace`` (a string mixed into the store's root; default ""), ``workers`` (threads
    running the tasks; default 2)."""

    def __init__(self, params: Mapping | None = None, **_ignored):  # l1_memory_desc: not used
        super().__init__(max_capacity_bytes=0)
        cfg, self.chunk_bytes, namespace, workers = self._parse(params)
        self.block_bytes = HEADER + self.chunk_bytes
        fp = ModelFingerprint(model="lmcache-l2", layout="lmcache.l2.v1", extra=(namespace, self.chunk_bytes))
        self.store = KVStore(cfg, block_bytes=self.block_bytes, fingerprint=fp)
        self._root = self.store.root
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvstore-lmcache")
        self._lock = threading.Lock()  # the task results, the ids and the pins below
        self._next_id = 0
        self._stored: dict[int, L2StoreResult] = {}
        self._looked: dict[int, Bitmap] = {}
        self._loaded: dict[int, Bitmap] = {}
        self._pins: dict[bytes, list[_Locked]] = {}
        self._tls = threading.local()  # each worker's staging rows
        self._closed = False
        self._efd = {k: create_event_notifier() for k in ("store", "lookup", "load")}  # three distinct fds

    @staticmethod
    def _parse(params: Mapping | None):
        if params is None:
            params = {}
        if not isinstance(params, Mapping):
            raise _param_error("", params, f"a dict with the keys {', '.join(PARAMS)}")
        for k in params:
            if k not in PARAMS:
                raise _param_error(k, UNKNOWN_KEY, ", ".join(PARAMS))
        chunk = params.get("chunk_bytes")
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk <= 0:
            raise _param_error("chunk_bytes", chunk, "a positive integer: the largest memory object (one chunk "
                               "of one object group) in bytes, e.g. chunk_size x layers x 2 x kv_heads x head_size "
                               "x dtype bytes")
        namespace = params.get("namespace", "")
        if not isinstance(namespace, str):
            raise _param_error("namespace", namespace, "a string")
        workers = params.get("workers", 2)
        if isinstance(workers, bool) or not isinstance(workers, int) or not 1 <= workers <= 64:
            raise _param_error("workers", workers, "an integer from 1 to 64")
        raw = params.get("config")
        if raw is None or isinstance(raw, (str, os.PathLike)):
            cfg = load_config(raw)  # a shipped config's name or a YAML path (None: $KVSTORE_CONFIG or defaults)
        elif isinstance(raw, Mapping):
            cfg = load_config(overrides=raw)
        else:
            raise _param_error("config", raw, "a shipped config name, the path of a YAML file, or a dict of "
                               "kvstore config keys")
        return cfg, chunk, namespace, workers

    # -- keys ----------------------------------------------------------------------------------
    def _key(self, k) -> bytes:
        return xxhash.xxh3_128_digest(self._root + b"lmcache-object-v1" + encode(
            [k.model_name, int(k.kv_rank), int(k.object_group_id), k.cache_salt, bytes(k.chunk_hash)]))

    # -- event fds -----------------------------------------------------------------------------
    def get_store_event_fd(self) -> int:
        return self._efd["store"].fileno()

    def get_lookup_and_lock_event_fd(self) -> int:
        return self._efd["lookup"].fileno()

    def get_load_event_fd(self) -> int:
        return self._efd["load"].fileno()

    def _submit(self, fn, *args) -> int:
        with self._lock:  # held while queuing, so a close never shuts the pool between the check and the submit
            if self._closed:
                raise RuntimeError("KVStoreL2Adapter is closed")
            tid = self._next_id
            self._next_id += 1
            self._pool.submit(fn, tid, *args)
        return tid

    def _done(self, results: str, tid: int, value, fd: str) -> None:
        """A task's result into the dict named ``results``, looked up under the lock: a dict read
        before it may be the one ``pop_completed_store_tasks`` just swapped out, and the result
        written there was never returned (34 of 3,000 stores lost at 4 callers, found by the
        bench: LMCache keeps such a task's objects locked)."""
        with self._lock:
            getattr(self, results)[tid] = value
        self._efd[fd].notify()

    # -- store ---------------------------------------------------------------------------------
    def submit_store_task(self, keys, objects) -> int:
        return self._submit(self._store, list(keys), list(objects))

    def pop_completed_store_tasks(self) -> dict:
        with self._lock:
            out, self._stored = self._stored, {}
        return out

    def _stage(self) -> np.ndarray:
        """This worker's staging rows (page aligned, pre-faulted, kept for its next tasks)."""
        rows = getattr(self._tls, "rows", None)
        if rows is None:
            row = -(-self.block_bytes // PAGE) * PAGE
            n = max(1, STAGE_BYTES // row)
            rows = self._tls.rows = alloc_aligned(n * row)[1].reshape(n, row)
        return rows

    def _store(self, tid: int, keys, objects) -> None:
        ok, nbytes = True, 0
        try:
            if len(keys) != len(objects):
                raise ValueError(f"{len(keys)} keys for {len(objects)} objects")
            rows = self._stage()
            ks, sizes = [], []
            for k, obj in zip(keys, objects):
                src = np.frombuffer(obj.byte_array, np.uint8)
                if src.size > self.chunk_bytes:  # the task fails (LMCache reports tasks, not keys)
                    log.error("kvstore: an LMCache object of %d bytes is over adapter_params.chunk_bytes (%d): "
                              "not stored", src.size, self.chunk_bytes)
                    ok = False
                    continue
                row = rows[len(ks)]
                row[:HEADER] = 0
                _HEAD.pack_into(row, 0, _MAGIC, src.size, _obj_layout(obj))
                row[HEADER:HEADER + src.size] = src
                row[HEADER + src.size:] = 0  # the padding: zeros, never this process's old memory
                ks.append(self._key(k))
                sizes.append(src.size)
                if len(ks) == len(rows):
                    nbytes += self._put(ks, rows, sizes)
                    ks, sizes = [], []
            if ks:
                nbytes += self._put(ks, rows, sizes)
        except Exception:
            log.exception("kvstore: LMCache store task %d failed", tid)
            ok = False
        self._done("_stored", tid, L2StoreResult(ok, nbytes), "store")

    def _put(self, ks: list[bytes], rows: np.ndarray, sizes: list[int]) -> int:
        """Put staged rows (done with them on return); the bytes newly stored: put says how many
        blocks were new, not which, so in proportion."""
        n = self.store.put(ks, rows[: len(ks)])
        return sum(sizes) * n // len(ks)

    # -- lookup and lock -----------------------------------------------------------------------
    def submit_lookup_and_lock_task(self, keys, group_layout_descs=None) -> int:
        return self._submit(self._lookup, list(keys), dict(group_layout_descs or {}))

    def query_lookup_and_lock_result(self, task_id: int):
        with self._lock:
            return self._looked.pop(task_id, None)  # once

    def _lookup(self, tid: int, keys, descs) -> None:
        bits = Bitmap(len(keys))
        try:
            want = {g: _layout(d.shapes, d.dtypes) for g, d in descs.items()}
            kks = [self._key(k) for k in keys]
            i = 0
            while i < len(keys):
                # the stored run of chunks from i, pinned and read in one call (a bad checksum ends
                # the run there: a miss); the chunk after the run is a miss, the next call starts past it
                h = self.store.begin_load(kks[i:])
                pinned, found = _Pinned(h), []
                for j in range(h.num_blocks):
                    head = self._header(h.views[j])
                    g = keys[i + j].object_group_id
                    if head is not None and (g not in want or head[1] == want[g]):
                        found.append(j)
                pinned.left = len(found)
                with self._lock:
                    for j in found:
                        self._pins.setdefault(kks[i + j], []).append(_Locked(pinned, j))
                if not found:
                    self.store.end_load(h)
                for j in found:
                    bits.set(i + j)
                i += h.num_blocks + 1
        except Exception:
            log.exception("kvstore: LMCache lookup task %d failed (the keys after the failure are misses)", tid)
        self._done("_looked", tid, bits, "lookup")

    def _header(self, block: np.ndarray) -> tuple[int, bytes] | None:
        """(length, layout digest) of a block written by this adapter, or None."""
        magic, n, layout = _HEAD.unpack_from(block, 0)
        return (n, layout) if magic == _MAGIC and n <= self.chunk_bytes else None

    def submit_unlock(self, keys) -> None:
        """Synchronous: an unpin is a few index updates, and LMCache never retries an unlock."""
        ending = []
        with self._lock:
            for k in keys:
                kk = self._key(k)
                held = self._pins.get(kk)
                if not held:
                    continue
                lk = held.pop()
                if not held:
                    del self._pins[kk]
                lk.unlocked = True
                if lk.users == 0:
                    ending += self._done_with(lk)
        for h in ending:
            self._end(h)

    @staticmethod
    def _done_with(lk: _Locked) -> list:
        """(Under the lock.) A chunk's lock is over: its handle, to end, once it was the last one's."""
        p = lk.pinned
        p.left -= 1
        return [p.handle] if p.left == 0 else []

    def _end(self, h) -> None:
        try:
            self.store.end_load(h)
        except Exception:  # a store closing meanwhile: its close releases the pins itself
            log.exception("kvstore: unpinning an LMCache chunk failed")

    # -- load ----------------------------------------------------------------------------------
    def submit_load_task(self, keys, objects) -> int:
        return self._submit(self._load, list(keys), list(objects))

    def query_load_result(self, task_id: int):
        with self._lock:
            return self._loaded.pop(task_id, None)  # once

    def _load(self, tid: int, keys, objects) -> None:
        bits = Bitmap(len(keys))
        hit = []
        for i, (k, obj) in enumerate(zip(keys, objects)):
            try:
                if self._load_one(self._key(k), obj):
                    bits.set(i)
                    hit.append(k)
            except Exception:
                log.exception("kvstore: loading an LMCache chunk failed (a miss)")
        if hit:
            self._notify_keys_accessed(hit)
        self._done("_loaded", tid, bits, "load")

    def _load_one(self, kk: bytes, obj) -> bool:
        with self._lock:
            held = self._pins.get(kk)
            lk = held[-1] if held else None
            if lk is not None:
                lk.users += 1  # an unlock meanwhile leaves the unpin to us
        h = None if lk is not None else self.store.begin_load([kk])  # not locked first: read it now
        try:
            if h is not None and h.num_blocks != 1:
                return False
            block = lk.view if lk is not None else h.views[0]
            head = self._header(block)
            dst = np.frombuffer(obj.byte_array, np.uint8)
            if head is None or head[0] != dst.size or head[1] != _obj_layout(obj):
                return False  # another layout or length than the object LMCache gave: never copied
            np.copyto(dst, block[HEADER:HEADER + dst.size])
            return True
        finally:
            if lk is None:
                self._end(h)
            else:
                with self._lock:
                    lk.users -= 1
                    ending = self._done_with(lk) if lk.unlocked and lk.users == 0 else []
                for e in ending:
                    self._end(e)

    # -- what LMCache asks besides -------------------------------------------------------------
    def get_usage(self) -> AdapterUsage:
        """What kvstore's local tiers hold; capacity 0: LMCache runs no global eviction on it."""
        return AdapterUsage(total_bytes_used=sum(t.used_bytes for t in self.store.tiers), total_capacity_bytes=0)

    def get_memory_tags(self) -> list[tuple[str, str]]:
        """(segment, residency) of each tier of the chain, nearest first, from the config's
        ``events.<medium>`` (LMCache 0.5.7's abstract method; not called by 0.5.6)."""
        out = []
        names = {t.name for t in self.store.chain.tiers}
        for spec in SPECS:
            if spec.name in names:
                ev = getattr(self.store.config.events, spec.name)
                residency = ev.locality or ("LOCAL" if spec.local else "REMOTE")
                out.append((_SEGMENT.get(ev.medium, "DRAM" if residency == "REMOTE" else "STORAGE"), residency))
        return out

    def report_status(self) -> dict:
        with self._lock:
            pins = sum(len(v) for v in self._pins.values())
        tiers = {t.name: len(t) for t in self.store.tiers}
        return {"is_healthy": not self._closed, "type": type(self).__name__, "locked_chunks": pins,
                "blocks_per_tier": tiers}

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._pool.shutdown(wait=True)
        with self._lock:
            held = list({id(lk.pinned): lk.pinned.handle for v in self._pins.values() for lk in v}.values())
            self._pins.clear()
        for h in held:
            self._end(h)
        self.store.close()
        for e in self._efd.values():
            e.close()
