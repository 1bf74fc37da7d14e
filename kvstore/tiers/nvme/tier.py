"""NVMe tier: one file per block, in 256 fan-out folders, under a per-namespace folder.

    <path>/kvstore-<namespace[:16]>/<k0k1>/<key hex>.kvb            (0600 files, 0700 folders)
    <path>/kvstore-<namespace[:16]>/tmp/<key hex>.<pid>.<n>.tmp      (writes in flight)

A write goes to a temporary name, then is renamed into place (atomic on POSIX), so a reader
sees a whole file or none. Every read verifies size, header and payload checksum; a file that
fails is a miss, is counted and removed. Durability against power loss is not promised (no
fsync), but a half-written file can never be served: its checksum fails. The index is rebuilt
at start-up from the headers only, oldest first (file mtime = the entry's last access, in the
tier's clock), within capacity. O_DIRECT is used where the file system takes it (buffers are
page aligned: DRAM slots directly, else a bounce buffer).

The folder's safety (no symlink followed, private modes, the probes) is :mod:`.folder`; this
class is the medium: write, read, free, a capacity lowered by a full disk or a read-only file
system (probed again later), and what it finds on disk. The start-up scan (:mod:`.scan`) rebuilds the index from
the block files' headers (payloads are not read), oldest first (file mtime = the entry's last
access), within capacity and TTL. Files a killed writer left in ``tmp/`` and probe files are
removed; every file is checked (name, place, type, owner, mode, size, header, namespace, key,
codec) and a bad one is counted by reason and removed. Nothing is followed: a symlink is unlinked
(the link, never its target); a non-file where a block file belongs (a folder, a FIFO) or a
non-folder where a fan-out folder belongs is counted once and removed, so its keys stay storable.
One level of 256 folders (4,000 files each at a million blocks), made at start: the two levels of 65,536 leaves
before made a new folder for nearly every block written into a fresh cache and opened two folders
per block (``python -m kvstore.bench.tiers.nvme_profile --block-mib 2``: folder work 420 us of thread
time per 2 MiB put, 190-270 after, 19 in a full cache where the 256 exist; 120 per get, 56-59 after). A fresh put's
wall time did not move (820-880 us a block before, 880-920 after, against an O_DIRECT limit of
600-630): the write of a new file is what costs there. The scan moves the block files of the
two-level layout up into their folder.
Modes: this user's folders are set to 0700 and files readable by others to 0600 (counted in
``modes_fixed``); a file another user owns is never read (``foreign_owner``), nor is one that
others could write (``loose_mode``: its bytes cannot be trusted), both dropped; another user's
folder is removed or moved aside (``foreign_owner``). The batched native engine for the common
case of reads and writes is :mod:`.blockio` (``write_many``/``read_many``, ``tiers.nvme.engine``).
An evicted file is not unlinked but recycled: renamed into a bounded pool in ``tmp/`` and
overwritten in place by a later write, then renamed into place (:mod:`.pool`).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import threading
import time
from itertools import count
from pathlib import Path
from typing import Callable

from kvstore import failpoints
from kvstore.tiers import fileformat as ff
from kvstore.codecs import Codec
from kvstore.tiers.index import Entry
from kvstore.tiers.memory import alloc_aligned, as_bytes as _as_bytes, is_aligned
from kvstore.tiers.base import Reservation
from kvstore.tiers.local import LocalTier
from kvstore.tiers.nvme.folder import (DIR_FLAGS, O_CLOEXEC, O_DIRECT, O_NOFOLLOW, O_NONBLOCK, NotOurs, check_folder, discard,
                                       free_bytes, mkdir_private, open_subdir, probe_o_direct, probe_writable,
                                       probe_xattr)
from kvstore.tiers.nvme.pool import FilePool, default_max_files
from kvstore.tiers.nvme.scan import FolderScan

log = logging.getLogger(__name__)

PROBE_AFTER_S = 60.0  # a capacity lowered by a full disk or a read-only file system is probed again after this
DISK_FULL, READ_ONLY = "disk_full", "read_only"


class NvmeTier(LocalTier):
    name = "nvme"
    fan_out = True  # a file per block: each block's I/O on a thread of the pool

    def __init__(self, *, path: str | os.PathLike, namespace: bytes, capacity_bytes: int, ttl_s: float | None,
                 policy: str, block_bytes: int, codec_id: int = 0, o_direct: bool | str = "auto",
                 header: str = "auto", clock: Callable[[], float] = time.time, scan: bool = True,
                 codec: Codec | None = None, pool_files: int | None = None, engine: str = "off",
                 engine_depth: int | str = "auto", io_threads: int = 4, keep_meta: bool = False,
                 ttl_shared_s: float | None = None, write_through: bool = False, admit_after: int = 0):
        super().__init__(capacity_bytes=capacity_bytes, ttl_s=ttl_s, policy=policy, block_bytes=block_bytes,
                         clock=clock, entry_bytes=ff.file_bytes(block_bytes), ttl_shared_s=ttl_shared_s,
                         write_through=write_through, admit_after=admit_after)
        self.namespace = bytes(namespace)
        # codec: files hold encoded bytes (payload_len of them); None or "none" = the raw block
        self.codec = codec if codec is not None and codec.name != "none" else None
        self.codec_id = self.codec.id if self.codec is not None else codec_id
        # the most payload bytes a file holds (exact unless the codec's size varies, e.g. zstd)
        self.payload_max = self.codec.encoded_bytes if self.codec is not None else block_bytes
        self.fixed_size = self.codec is None or self.codec.fixed_size
        self._root_fd = self._tmp_fd = -1
        base = check_folder(path)
        if header not in ("auto", "xattr", "inline"):
            raise ValueError(f"header must be auto, xattr or inline, got {header!r}")
        self.header = "inline"
        if header != "inline":
            if probe_xattr(base):
                self.header = "xattr"
            elif header == "xattr":
                log.warning("kvstore nvme: %s keeps no user xattrs; block headers go inline", base)
        # one layout per folder: files of the other layout are never mixed in
        self.root = base / (f"kvstore-{self.namespace.hex()[:16]}" + ("-x" if self.header == "xattr" else ""))
        mkdir_private(self.root)
        self._root_fd = os.open(self.root, DIR_FLAGS)
        self.uid = os.geteuid()
        st = os.fstat(self._root_fd)
        if st.st_uid != self.uid:
            self.close()
            raise OSError(errno.EPERM, f"refusing a cache folder owned by uid {st.st_uid}: {self.root}")
        os.chmod(self._root_fd, 0o700)
        self.stats.update({"scanned": 0, "dropped_at_scan": 0, "tmp_removed": 0, "missing": 0,
                           "modes_fixed": int(stat.S_IMODE(st.st_mode) != 0o700), "read_only": 0})
        self.corrupt_reasons: dict[str, int] = {}
        self.tmp = self.root / "tmp"
        self._tmp_fd = self._subdir(self._root_fd, "tmp", True)
        self.o_direct = bool(o_direct) and probe_o_direct(self.root)  # "auto" or True: where it works
        if o_direct and o_direct != "auto" and not self.o_direct:
            log.warning("kvstore nvme: o_direct requested but %s does not support it; using buffered I/O", self.root)
        self.padded = ff.round_up(self.payload_max)
        self.file_bytes = self.file_bytes_for(self.payload_max)  # the largest file (exact if fixed_size)
        self.entry_bytes = self.file_bytes  # reserved per write; a smaller (zstd) file gives the rest back
        self._tls = threading.local()
        self._seq = count()
        self.configured_capacity = self.index.capacity
        self.fault: str | None = None  # DISK_FULL or READ_ONLY while the capacity is lowered (_lower_capacity)
        self._probe_at = float("inf")
        self._unremoved: set[bytes] = set()  # files a read-only file system kept (removed once writable)
        # evicted files kept for reuse (fixed-size files only; :mod:`.pool`)
        if pool_files is None:
            pool_files = default_max_files(self.file_bytes, capacity_bytes)
        self.pool = FilePool(self._tmp_fd, self.file_bytes, pool_files if self.fixed_size else 0)
        # batches of the common case (write_many/read_many)
        self.engine = _engine(engine, engine_depth, self.file_bytes, io_threads)
        # KV events (kvstore.store.events): key -> the event metadata a block file keeps (None: none
        # kept), and what the scan found in the files (taken by the store's events)
        self.meta_of: Callable[[bytes], bytes | None] | None = None
        self.scanned_meta: dict[bytes, bytes] | None = {} if keep_meta else None
        if scan:
            self.scan()
        self._make_leaves()

    def _make_leaves(self) -> None:
        """The 256 fan-out folders, made at start (each write made its own before: in a fresh
        cache most of the first blocks paid a mkdir, 220 of 840 us of thread time per 2 MiB put in
        ``python -m bench.tiers.nvme_profile --block-mib 2 --callers 1``). Where a folder cannot
        be made (a read-only or full file system), the writes make it later, as before."""
        for i in range(256):
            try:
                os.close(self._subdir(self._root_fd, f"{i:02x}", True))
            except OSError as e:
                log.debug("kvstore nvme: fan-out folders not made at start: %s", e)
                return

    def file_bytes_for(self, payload_len: int) -> int:
        """Size of a block file whose payload is ``payload_len`` bytes (this folder's layout)."""
        return ff.round_up(payload_len) if self.header == "xattr" else ff.file_bytes(payload_len)

    def _resize(self, entry: Entry, nbytes: int) -> None:
        """Account an entry at its real file size (a variable-size codec wrote less than reserved)."""
        with self.lock:
            if self.index.entries.get(entry.key) is entry and entry.nbytes != nbytes:
                self.index.used += nbytes - entry.nbytes
                entry.nbytes = nbytes

    # -- paths ---------------------------------------------------------------------------------
    def path_of(self, key: bytes) -> Path:
        h = key.hex()
        return self.root / h[:2] / (h + ff.SUFFIX)

    @staticmethod
    def _name(key: bytes) -> str:
        return key.hex() + ff.SUFFIX

    def _leaf_fd(self, key: bytes, create: bool) -> int:
        """Descriptor of the fan-out folder of ``key``; FileNotFoundError if missing and not create."""
        if self._root_fd < 0:
            raise OSError(errno.EBADF, "nvme tier is closed")
        return self._subdir(self._root_fd, key.hex()[:2], create)

    # -- per-thread aligned buffers --------------------------------------------------------------
    def _bufs(self):
        b = getattr(self._tls, "bufs", None)
        if b is None:
            hm, hdr = alloc_aligned(ff.HEADER_BYTES, prefault=True)
            bm, bounce = alloc_aligned(self.padded, prefault=True)
            b = self._tls.bufs = (hm, hdr, bm, bounce)
        return b[1], b[3]

    def _flags(self) -> int:
        return O_NOFOLLOW | O_CLOEXEC | (O_DIRECT if self.o_direct else 0)

    # -- medium --------------------------------------------------------------------------------
    def write(self, entry: Entry, src) -> bool:
        """Write a reserved entry's file. Its mtime is ``entry.last_access`` (the tier's clock)."""
        hdr, bounce = self._bufs()
        src = _as_bytes(src)
        if src.nbytes < self.block_bytes:
            raise ValueError(f"block of {src.nbytes} bytes, need {self.block_bytes}")
        plen, fbytes = self.block_bytes, self.file_bytes
        if self.codec is not None:
            try:
                plen = self.codec.encode(src[: self.block_bytes], bounce)
            except Exception as e:  # never an exception to the caller: the block is just not stored
                self.count("write_failed")
                log.warning("kvstore nvme: %s encode failed: %s", self.codec.name, e)
                return False
            fbytes = self.file_bytes_for(plen)
            bounce[plen: ff.round_up(plen)] = 0  # never leak another block's bytes into the padding
            payload = bounce[: ff.round_up(plen)]
        elif is_aligned(src) and src.nbytes >= self.padded:
            payload = src[: self.padded]
        else:
            bounce[: self.block_bytes] = src[: self.block_bytes]
            bounce[self.block_bytes:] = 0  # never leak another block's bytes into the padding
            payload = bounce
        header = ff.Header(self.codec_id, plen, ff.checksum(payload[:plen]),
                           time.time(), self.namespace, entry.key)
        meta = self._meta(entry.key)
        if self.header == "inline":
            ff.pack_header(header, hdr)
            if meta:
                memoryview(hdr).cast("B")[ff.META_OFFSET: ff.META_OFFSET + len(meta)] = meta
        name = self._name(entry.key)
        tmp = ""
        leaf = -1
        try:
            failpoints.fire("nvme.write", key=entry.key, path=name)
            leaf = self._leaf_fd(entry.key, create=True)
            fd, tmp = self._open_tmp(entry.key, fbytes)
            try:
                if self.header == "xattr":
                    _pwrite_all(fd, [payload], fbytes)
                    os.setxattr(fd, ff.XATTR, ff.header_bytes(header))
                    self._set_meta(fd, meta)
                else:
                    _pwrite_all(fd, [hdr, payload], fbytes)
                t = entry.last_access
                os.utime(fd, (t, t))
            finally:
                os.close(fd)
            try:
                os.rename(tmp, name, src_dir_fd=self._tmp_fd, dst_dir_fd=leaf)
            except IsADirectoryError:  # a folder planted at the block path: counted, moved aside
                self._bad(leaf, name, "not_a_file", "a folder at a block path")
                os.rename(tmp, name, src_dir_fd=self._tmp_fd, dst_dir_fd=leaf)
            if fbytes != entry.nbytes:
                self._resize(entry, fbytes)
            return True
        except OSError as e:
            self.count("write_failed")
            if tmp:
                try:
                    os.unlink(tmp, dir_fd=self._tmp_fd)
                except OSError:
                    pass
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                self._lower_capacity(entry, DISK_FULL)
            elif e.errno == errno.EROFS:
                self._lower_capacity(entry, READ_ONLY)
            else:
                log.warning("kvstore nvme write failed for %s: %s", name, e)
            return False
        finally:
            if leaf >= 0:
                os.close(leaf)

    def _meta(self, key: bytes) -> bytes:
        """The framed event metadata to keep in ``key``'s file (b"": none)."""
        body = self.meta_of(key) if self.meta_of is not None else None
        return ff.pack_meta(body, key) if body else b""

    def _set_meta(self, fd_or_path, meta: bytes) -> None:
        """An xattr file's event metadata (a recycled file's old one removed). Advisory: a failure
        leaves a file that is served but not announced after a restart."""
        kw = {} if isinstance(fd_or_path, int) else {"follow_symlinks": False}
        try:
            if meta:
                os.setxattr(fd_or_path, ff.XATTR_META, meta, **kw)
            elif self.meta_of is not None:
                os.removexattr(fd_or_path, ff.XATTR_META, **kw)
        except OSError:
            pass

    def _open_tmp(self, key: bytes, fbytes: int) -> tuple[int, str]:
        """A file in ``tmp/`` to write a block file of ``fbytes`` into: a pooled one (overwritten in
        place: its blocks are allocated already, see :mod:`.pool`), else a new temporary file."""
        if fbytes == self.pool.file_bytes:
            while (pooled := self.pool.take()) is not None:
                fd = self.pool.open(pooled, O_DIRECT if self.o_direct else 0)
                if fd >= 0:
                    return fd, pooled
        tmp = f"{key.hex()}.{os.getpid()}.{next(self._seq)}.tmp"
        return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | self._flags(), 0o600, dir_fd=self._tmp_fd), tmp

    def write_many(self, entries, srcs) -> list[bool]:
        """:meth:`write` for each, through the batched native engine when it is on (:mod:`.blockio`:
        the same files; what it does not take goes through :meth:`write`)."""
        engine = self.engine  # (None once closed)
        if engine is None or len(entries) < 2:
            return [self.write(e, s) for e, s in zip(entries, srcs)]
        return engine.write(self, entries, srcs)

    @property
    def spreads(self) -> bool:
        """Does one ``write_many``/``read_many`` call spread its batch over threads (the io_uring
        engine with helpers, raw blocks)? Then the mover makes one call a batch, not one per I/O
        thread (:mod:`kvstore.store.transfers`)."""
        e = self.engine
        return e is not None and e.threads > 1 and self.codec is None and not failpoints.active

    def read_many(self, entries, outs) -> list[bool]:
        """:meth:`read` for each, through the engine when it is on (what it does not find whole
        and good goes through :meth:`read`, which decides)."""
        engine = self.engine  # (None once closed)
        if engine is None or len(entries) < 2:
            return [self.read(e, o) for e, o in zip(entries, outs)]
        return engine.read(self, entries, outs)

    # -- a full disk or a read-only file system: a smaller cache, probed again later ----------------
    def _lower_capacity(self, failed: Entry | None, why: str) -> None:
        """Cap capacity at what is held now (without the entry that failed, which its caller
        aborts; writes in flight stay counted); read-only: no reservation either (no eviction can
        make room). One warning an episode; probed again ``PROBE_AFTER_S`` later (tier's clock)."""
        with self.lock:
            mine = failed.nbytes if failed is not None and self.index.entries.get(failed.key) is failed else 0
            new_cap = min(self.index.capacity, max(0, self.index.used - mine))
            first = self.fault != why
            if first:
                self.fault, self._probe_at = why, self.clock() + PROBE_AFTER_S
                log.warning("kvstore nvme: %s; capacity lowered from %d to %d bytes (probed again every %.0f s)",
                            "disk full" if why == DISK_FULL else "read-only file system", self.index.capacity,
                            new_cap, PROBE_AFTER_S)
            self.index.capacity = new_cap
        if why == DISK_FULL:
            self.pool.drain()  # the pooled files' space goes back to the file system
        self.count(why)

    def _probe(self) -> None:
        """Past the probe time: grow back to the configured capacity as far as the file system now
        takes (a file can be created; 90 % of its free space), else probe again later."""
        with self.lock:
            if self.fault is None or self.clock() < self._probe_at:
                return
            self._probe_at = self.clock() + PROBE_AFTER_S  # one prober at a time
        if not probe_writable(self._tmp_fd):
            return
        room = free_bytes(self._root_fd) * 9 // 10
        with self.lock:
            cap = max(self.index.capacity, min(self.configured_capacity, self.index.used + room))
            if cap > self.index.capacity:
                log.info("kvstore nvme: writable again; capacity raised from %d to %d bytes",
                            self.index.capacity, cap)
                self.index.capacity = cap
            self.fault = None if cap >= self.configured_capacity else DISK_FULL
            gone, self._unremoved = self._unremoved, set()
        for key in gone:  # files a read-only file system kept (removed now, unless stored again)
            self._free(Entry(key=key, nbytes=0, last_access=0.0, expire_at=0.0))

    def begin_reserve(self, keys, ttl: float | None = None) -> Reservation:
        """:meth:`Tier.begin_reserve`, nothing while the file system is read-only (probed again
        now and then, see :meth:`_lower_capacity`)."""
        if self.fault is not None:
            self._probe()
            if self.fault == READ_ONLY:  # capacity: what it holds (writes that failed are aborted by now)
                with self.lock:
                    self.index.capacity = min(self.index.capacity, self.index.used)
                self.count("skipped_read_only", len(keys))
                return Reservation([None] * len(keys))
        return super().begin_reserve(keys, ttl)

    def read(self, entry: Entry, out) -> bool:
        hdr, bounce = self._bufs()
        out = _as_bytes(out)
        if out.nbytes < self.block_bytes:
            raise ValueError(f"output of {out.nbytes} bytes, need {self.block_bytes}")
        direct = self.codec is None and is_aligned(out) and out.nbytes >= self.padded
        dst = out[: self.padded] if direct else bounce  # a codec reads the encoded bytes, then decodes
        name = self._name(entry.key)
        try:
            leaf = self._leaf_fd(entry.key, create=False)
        except FileNotFoundError:
            self.count("missing")
            return False
        except OSError as e:  # a planted symlink or non-folder, another user's folder
            self._bad_count("foreign_owner" if isinstance(e, NotOurs) else "open_failed", f"{name}: {e}")
            return False
        try:
            try:
                fd = os.open(name, os.O_RDONLY | self._flags() | O_NONBLOCK, dir_fd=leaf)
            except FileNotFoundError:
                self.count("missing")
                return False
            except OSError as e:
                self._bad(leaf, name, "open_failed", str(e))
                return False
            try:
                failpoints.fire("nvme.read", path=name)
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    raise ff.BadBlockFile("not_a_file")
                if self._check_owner(fd, st):
                    self.count("modes_fixed")
                if st.st_size > self.file_bytes or (self.fixed_size and st.st_size != self.file_bytes):
                    raise ff.BadBlockFile("truncated" if st.st_size < self.file_bytes else "bad_size",
                                          f"{st.st_size} bytes")
                h = self._header_of(fd)
                n = os.preadv(fd, [dst] if self.header == "xattr" else [hdr, dst], 0)
                if n != st.st_size:
                    raise ff.BadBlockFile("truncated", f"read {n} bytes")
                if self.header == "inline":
                    h = ff.unpack_header(hdr)
                self._check(h, entry.key)
                if st.st_size != self.file_bytes_for(h.payload_len):
                    raise ff.BadBlockFile("truncated", f"{st.st_size} bytes for a {h.payload_len}-byte payload")
                if ff.checksum(dst[: h.payload_len]) != h.checksum:
                    raise ff.BadBlockFile("bad_checksum")
                if self.codec is not None:
                    try:
                        self.codec.decode(dst, h.payload_len, out[: self.block_bytes])
                    except Exception as e:  # noqa: BLE001 - CodecError, MemoryError: a payload that does not decode
                        raise ff.BadBlockFile("bad_payload", f"{type(e).__name__}: {e}") from None
                try:
                    t = entry.last_access  # the hit's time (acquire touched it): recency survives a restart
                    os.utime(fd, (t, t))
                except OSError:
                    pass
            except (ff.BadBlockFile, OSError) as e:
                if _moved(fd, leaf, name):  # another process evicted (and reused) it as we read: a miss
                    self.count("missing")
                elif isinstance(e, ff.BadBlockFile):
                    self._bad(leaf, name, e.reason, str(e))
                else:
                    self._bad(leaf, name, "read_failed", str(e))
                return False
            finally:
                os.close(fd)
        finally:
            os.close(leaf)
        if not direct and self.codec is None:
            out[: self.block_bytes] = bounce[: self.block_bytes]
        return True

    def _free(self, entry: Entry) -> None:
        # Under the lock, and only if the key has not been reserved again meanwhile: otherwise a
        # late free of an evicted entry could delete the file of a fresh write of the same key.
        with self.lock:
            if entry.key in self.index.entries:
                return
            try:
                leaf = self._leaf_fd(entry.key, create=False)
            except FileNotFoundError:
                return
            except OSError as e:
                log.warning("kvstore nvme: could not remove %s: %s", entry.key.hex(), e)
                return
            try:
                if not self.pool.put(leaf, self._name(entry.key)):  # full: removed, as before recycling
                    os.unlink(self._name(entry.key), dir_fd=leaf)
            except FileNotFoundError:
                pass
            except OSError as e:
                if e.errno != errno.EROFS:
                    log.warning("kvstore nvme: could not remove %s: %s", entry.key.hex(), e)
                    return
                if len(self._unremoved) < 1 << 16:  # beyond: the next start-up scan
                    self._unremoved.add(entry.key)
                self._lower_capacity(None, READ_ONLY)
            finally:
                os.close(leaf)

    def keep_meta(self, body_of) -> dict[bytes, bytes]:
        """Each file keeps its block's event metadata (``body_of(key)`` at its write), so a restart
        announces it; what the start-up scan found, given once."""
        self.meta_of = body_of
        found, self.scanned_meta = self.scanned_meta or {}, None
        return found

    def close(self) -> None:
        engine, self.engine = getattr(self, "engine", None), None
        if engine is not None:
            engine.close()
        pool = getattr(self, "pool", None)
        if pool is not None and self._tmp_fd >= 0:
            pool.drain()  # no space held past the capacity while closed
        lock = getattr(self, "lock", None)
        for attr in ("_tmp_fd", "_root_fd"):
            with lock if lock is not None else contextlib.nullcontext():  # taken once: never closed twice
                fd = getattr(self, attr, -1)
                setattr(self, attr, -1)
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    # -- what it finds on disk: the start-up scan, a block file's checks (shared with reads) -------
    def scan(self) -> None:
        """Rebuild the index from file headers (payloads are not read), oldest first: what
        :class:`~.scan.FolderScan` found good, within capacity and TTL."""
        found, fixed = FolderScan(self).run()
        now = self.clock()
        dropped: list[Entry] = []
        with self.lock:
            for mtime, key, nbytes in found:
                e, ev = self.index.add_ready(key, nbytes, min(mtime, now), now)
                dropped.extend(ev)
                if e is None:
                    dropped.append(Entry(key=key, nbytes=nbytes, last_access=mtime, expire_at=0.0))
            # entries already past their TTL
            dropped.extend(self.index.expire(now, limit=len(self.index) + 1))
        for e in dropped:
            self._free(e)
        self.stats["scanned"] = len(found)
        self.stats["dropped_at_scan"] += len(dropped)
        self.count("modes_fixed", len(fixed))

    def _check_owner(self, fd: int, st: os.stat_result) -> bool:
        """Raise BadBlockFile for a file another user owns or others could write (before a byte
        is read); a file of ours that others could read is set to 0600 (True: fixed)."""
        if st.st_uid != self.uid:
            raise ff.BadBlockFile("foreign_owner", f"owned by uid {st.st_uid}, never read")
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise ff.BadBlockFile("loose_mode", f"mode {stat.S_IMODE(st.st_mode):04o}: others could have written it")
        if stat.S_IMODE(st.st_mode) == 0o600:
            return False
        try:
            os.chmod(fd, 0o600)
        except OSError:
            return False
        return True

    def _header_of(self, fd: int) -> ff.Header | None:
        """An "xattr" file's header (None for inline files, read with the payload)."""
        if self.header != "xattr":
            return None
        try:
            return ff.unpack_header(os.getxattr(fd, ff.XATTR))
        except OSError as e:
            raise ff.BadBlockFile("bad_header", f"no header attribute ({e.strerror})") from None

    def _check(self, h: ff.Header, key: bytes) -> None:
        if h.fingerprint != self.namespace:
            raise ff.BadBlockFile("foreign")
        if h.key != key:
            raise ff.BadBlockFile("wrong_key")
        if h.codec_id != self.codec_id:
            raise ff.BadBlockFile("foreign", "codec differs")
        ok_len = h.payload_len == self.payload_max if self.fixed_size else 0 < h.payload_len <= self.payload_max
        if not ok_len:
            raise ff.BadBlockFile("foreign", f"payload of {h.payload_len} bytes")

    def _bad_count(self, reason: str, detail: str) -> None:
        with self.lock:
            self.stats["corrupt"] += 1
            self.corrupt_reasons[reason] = self.corrupt_reasons.get(reason, 0) + 1
        log.warning("kvstore nvme: dropping a block file (%s)", detail)

    def _bad(self, dir_fd: int, name: str, reason: str, detail: str) -> None:
        """Count a bad file and remove it (the name itself: a symlink is unlinked, never followed;
        a folder moved aside)."""
        self._bad_count(reason, f"{name}: {detail}")
        discard(dir_fd, name, whole=False)

    def _subdir(self, parent: int, name: str, create: bool) -> int:
        """:func:`open_subdir`; a writer (``create``) clears what blocks the way (a non-folder,
        another user's folder): counted once, removed or moved aside, never followed."""
        try:
            return open_subdir(parent, name, create)
        except OSError as e:
            if not create or not (isinstance(e, NotOurs) or e.errno in (errno.ELOOP, errno.ENOTDIR)):
                raise
            self._bad_count("foreign_owner" if isinstance(e, NotOurs) else "not_a_folder", f"{name}: {e}")
            discard(parent, name, whole=False)
            return open_subdir(parent, name, create)


IN_FLIGHT_BYTES = 16 << 20  # the engine's bytes in flight in all, at auto depth (auto_depth)
THREADS_DEPTH = 8  # the engine's thread pool (no io_uring): its workers, shared by every caller, at auto


def auto_depth(file_bytes: int, io_threads: int) -> int:
    """The engine's depth per I/O thread (each moves blocks of a batch on its own ring) for about
    ``IN_FLIGHT_BYTES`` in flight in all, between 2 and 8. A device streams as fast with 16 MiB in
    flight as with more; past that, requests only wait longer, complete in a bunch, and leave their
    checksums for the end of the call.

    Measured here (virtio disk, ext4, O_DIRECT 1.6-2.2 GB/s; a store's 32-block get and fresh put,
    4 I/O threads, the depth per thread swapped in one process, rounds rotated, median of 4-6),
    depth 2 against the former fixed 8: gets 1.04-1.05x at 2 MiB, 1.03-1.05x at 4 MiB, 1.02x at
    16 MiB, 1.01x with 4 callers; fresh puts 1.02-1.03x at 2 MiB, 0.99-1.04x at 4 MiB, 1.00-1.01x
    at 16 MiB. One thread at depth 8 read as fast as 4 at depth 2, one at depth 32 0.96x: what
    counts is what is in flight in all. Depth 1 was no better than 2 (a thread then opens and hashes
    with nothing in flight). At 256 KiB blocks (auto: 8) every depth from 2 to 16 was within 2 %.
    ``python -m kvstore.bench.tiers.nvme_profile --depths 8,1,2,4`` repeats it."""
    return max(2, min(8, IN_FLIGHT_BYTES // max(1, io_threads * file_bytes)))


def _engine(kind: str, depth: int | str, file_bytes: int, io_threads: int):
    """The batched engine ``kind`` (auto: io_uring, else its thread pool), or None: off, or not
    built (one warning: the tier's own path serves every block). ``depth`` auto: io_uring's
    :func:`auto_depth`; the thread pool's ``THREADS_DEPTH`` workers (shared by every caller)."""
    if kind in ("off", False):  # (YAML reads an unquoted off as False)
        return None
    from kvstore.tiers.nvme import blockio

    if not blockio.available():
        if kind != "auto":
            log.warning("kvstore nvme: engine %s asked for, but %s; blocks go one by one", kind, blockio.native_error())
        return None
    threads = THREADS_DEPTH if depth == "auto" else depth
    try:
        bio = blockio.BlockIO(kind, auto_depth(file_bytes, io_threads) if depth == "auto" else depth, io_threads)
    except RuntimeError as e:  # io_uring asked for and refused here: its thread pool instead
        log.warning("kvstore nvme: %s; the engine's thread pool runs instead", e)
        return blockio.BlockIO("threads", threads)
    if bio.backend == "threads" and bio.depth != threads:  # auto without io_uring: the pool's own size
        bio.close()
        bio = blockio.BlockIO("threads", threads)
    return bio


def _moved(fd: int, dir_fd: int, name: str) -> bool:
    """Is the file open as ``fd`` no longer the one at ``dir_fd/name`` (renamed away, replaced)?
    A file that failed a read is then not removed: the name is another file's, or nobody's."""
    try:
        a = os.fstat(fd)
        b = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino)


def _pwrite_all(fd: int, bufs: list, total: int) -> None:
    done = os.pwritev(fd, bufs, 0)
    if done == total:
        return
    # partial write (rare): finish with plain writes of what is left
    flat = b"".join(bytes(memoryview(b).cast("B")) for b in bufs)
    while done < total:
        n = os.pwrite(fd, flat[done:], done)
        if n <= 0:
            raise OSError(errno.EIO, "short write")
        done += n
