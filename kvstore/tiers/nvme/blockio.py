"""Batched block-file I/O for the NVMe tier (issue 34): a batch of block files written or read at
depth by the native engine ``kvstore._blockio`` (csrc/blockio/), file for file what
:class:`~kvstore.tiers.nvme.NvmeTier` writes and reads one at a time.

    bio = BlockIO(depth=8)                  # io_uring where the kernel allows it, else a thread pool
    oks = bio.write(tier, entries, srcs)    # == [tier.write(e, s) for e, s in ...]: the same files
    oks = bio.read(tier, entries, outs)     # == [tier.read(e, o) for e, o in ...]: the same checks

The engine does the syscalls of each block (temp file, payload, header, mtime, atomic rename; or
open, size, header, payload, mtime) and the payload's xxh3-64 while other blocks' I/O is in
flight. It serves only the common case: folders and files of this user with modes 0700 / 0600,
whole, with a header and checksum the tier accepts (Python checks: fileformat.unpack_header, the
tier's ``_check``). Everything else goes through the tier's own ``write``/``read``, which decides
by its rules (counts, removes, fixes, lowers the capacity): a failed or refused block, a block the
engine does not take (a codec; a buffer not page aligned or too short for the padded payload:
the tier's bounce buffer, zero padding), and every block while a failpoint is armed. Crash safety, the file format, the
restart scan and per-block eviction are the tier's, unchanged.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from typing import Sequence

import numpy as np

from kvstore import failpoints
from kvstore.tiers import fileformat as ff
from kvstore.tiers.index import Entry
from kvstore.tiers.memory import alloc_aligned, as_bytes, is_aligned
from kvstore.tiers.nvme.folder import discard

try:
    from kvstore import _blockio as _native  # type: ignore[attr-defined]

    _error = ""
except ImportError as e:  # no build of csrc/blockio (the tier's per-block path still works)
    _native = None
    _error = str(e)

R_OK = 0  # csrc/blockio/blockio.hpp ReadStatus: the rest (missing, damaged, not ours...) go to the tier


def available() -> bool:
    return _native is not None


def native_error() -> str:
    """Why the native module is missing ("" when it loaded)."""
    return _error


def checksum_native() -> bool:
    """Does the engine compute checksums itself (built with libxxhash)?"""
    return _native is not None and bool(_native.HAVE_XXHASH)


class _Arena(threading.local):
    """Per-thread page-aligned header rows (4 KiB each), grown to the largest batch seen."""

    def rows(self, n: int) -> np.ndarray:
        have = getattr(self, "arr", None)
        if have is None or have.shape[0] < n:
            self.mm, flat = alloc_aligned(max(n, 32) * ff.HEADER_BYTES)
            self.arr = flat.reshape(-1, ff.HEADER_BYTES)
        return self.arr


class BlockIO:
    """One engine: ``backend`` "auto" (io_uring, else threads), "io_uring" or "threads"; ``depth``
    block files in flight per thread (io_uring) or in all (threads). io_uring: ``threads`` - 1
    helper threads join a caller's batch, each on its own ring, while fewer than ``threads`` rings
    are busy (one call moves a batch at ``threads`` x ``depth``)."""

    def __init__(self, backend: str = "auto", depth: int = 8, threads: int = 1):
        if _native is None:
            raise RuntimeError(f"kvstore._blockio is not built ({_error})")
        self._e = _native.Engine(backend, int(depth), int(threads))
        self._arena = _Arena()
        self._lock = threading.Lock()
        self._users = 0
        self._closed = False
        # blocks the engine wrote / read, and blocks that went through the tier's own path
        self.stats = {"engine_writes": 0, "engine_reads": 0, "tier_writes": 0, "tier_reads": 0}

    @property
    def backend(self) -> str:
        return self._e.backend

    @property
    def depth(self) -> int:
        """Block files in flight per thread (io_uring: the caller and each helper), or the pool's workers (threads)."""
        return self._e.depth

    @property
    def threads(self) -> int:
        """Threads that share one batch (io_uring: the caller and its helpers; the pool: 1)."""
        return self._e.threads

    @property
    def helped(self) -> int:
        """Blocks the helper threads took from callers' batches (io_uring with ``threads`` > 1)."""
        return self._e.helped

    @property
    def wait_errors(self) -> int:
        """io_uring waits for a completion that failed; each was waited again until the I/O in
        flight completed (its buffers are never given back before)."""
        return self._e.wait_errors

    @property
    def reason(self) -> str:
        """Why the backend is not io_uring ("" when it is)."""
        return self._e.reason

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("blockio engine is closed")

    def _enter(self):
        with self._lock:
            if self._closed:
                raise RuntimeError("blockio engine is closed")
            self._users += 1

    def _exit(self):
        with self._lock:
            self._users -= 1
            last = self._closed and self._users == 0
        if last:
            self._e.close()

    def close(self) -> None:
        """Stop the engine (at once, or when the last batch in flight ends)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            now = self._users == 0
        if now:
            self._e.close()

    # -- write ------------------------------------------------------------------------------------
    def write(self, tier, entries: Sequence[Entry], srcs: Sequence) -> list[bool]:
        """Write reserved entries' files, as ``tier.write`` does for each (its mtime is the entry's
        ``last_access``). Returns per entry whether its file is in place."""
        self._check_open()
        oks = [False] * len(entries)
        take: list[int] = []
        payloads: list[np.ndarray] = []
        for i, (entry, src) in enumerate(zip(entries, srcs)):
            src = as_bytes(src)
            if self._tiers_own(tier, src):
                oks[i] = tier.write(entry, src)  # encode, bounce, or a failpoint armed: the tier's path
            else:
                take.append(i)
                payloads.append(src[: tier.padded])
        if not take:
            self._count("writes", len(entries), 0)
            return oks
        hdrs = self._arena.rows(len(take))
        now = time.time()
        hash_here = checksum_native()  # else the header is whole here (a build without libxxhash)
        names, tmps, mtimes, reuse = [], [], [], []
        pool = tier.pool if tier.pool.file_bytes == tier.file_bytes else None
        for k, i in enumerate(take):
            key = entries[i].key
            chk = 0 if hash_here else ff.checksum(payloads[k][: tier.block_bytes])
            ff.pack_header(ff.Header(tier.codec_id, tier.block_bytes, chk, now, tier.namespace, key), hdrs[k])
            names.append(tier._name(key))
            pooled = pool.take() if pool is not None else None  # a recycled file, overwritten in place
            reuse.append(pooled is not None)
            tmps.append(pooled or f"{key.hex()}.{os.getpid()}.{next(tier._seq)}.tmp")
            mtimes.append(float(entries[i].last_access))
        try:
            res = self._run(tier, "write", tier._root_fd, tier._tmp_fd, names, tmps, payloads,
                            [tier.block_bytes] * len(take), [hdrs[k] for k in range(len(take))], mtimes,
                            tier.header == "inline", bool(tier.o_direct), hash_here, reuse)
        except BaseException:
            for t, r in zip(tmps, reuse):  # taken from the pool, never written: removed (a scan would)
                if r:
                    discard(tier._tmp_fd, t, whole=True)
            raise
        for k, (i, (err, stage)) in enumerate(zip(take, res)):
            if err and reuse[k] and stage <= 2:  # a pooled file that is not a fit: removed, never written through
                tier.pool.unfit(tmps[k])
            elif not err and reuse[k]:
                tier.pool.reused()
            # a failure (full disk, a folder planted in the way, another user's folder...) is the
            # tier's to handle: its own write runs once more, counts and degrades by its rules
            oks[i] = True if err == 0 else tier.write(entries[i], srcs[i])
            if err == 0 and tier.meta_of is not None:  # KV events: the file's metadata (advisory, after the rename)
                tier._set_meta(str(tier.path_of(entries[i].key)), tier._meta(entries[i].key))
        self._count("writes", len(entries), sum(1 for err, _s in res if err == 0))
        return oks

    # -- read -------------------------------------------------------------------------------------
    def read(self, tier, entries: Sequence[Entry], outs: Sequence) -> list[bool]:
        """Read pinned entries' files into ``outs``, as ``tier.read`` does for each. Returns per entry
        whether ``outs[i]`` holds the block. A block the engine does not find whole and good (missing,
        damaged, another user's, a loose mode) is read by the tier's own ``read``, which counts and
        removes or fixes it: the engine never decides a miss."""
        self._check_open()
        oks = [False] * len(entries)
        take: list[int] = []
        dsts: list[np.ndarray] = []
        for i, (entry, out) in enumerate(zip(entries, outs)):
            out = as_bytes(out)
            if out.nbytes < tier.block_bytes:
                raise ValueError(f"output of {out.nbytes} bytes, need {tier.block_bytes}")
            if self._tiers_own(tier, out):
                oks[i] = tier.read(entry, out)
            else:
                take.append(i)
                dsts.append(out[: tier.padded])
        if not take:
            self._count("reads", len(entries), 0)
            return oks
        hdrs = self._arena.rows(len(take))
        hashed_here = checksum_native()
        res = self._run(tier, "read", tier._root_fd, [tier._name(entries[i].key) for i in take], dsts,
                        [hdrs[k] for k in range(len(take))], [float(entries[i].last_access) for i in take],
                        tier.header == "inline", bool(tier.o_direct), hashed_here)
        served = 0
        for k, (i, r) in enumerate(zip(take, res)):
            good = r[0] == R_OK and self._good(tier, entries[i].key, r, hdrs[k], dsts[k], hashed_here)
            if not good:
                oks[i] = tier.read(entries[i], outs[i])
            else:
                oks[i] = True
                served += 1
        self._count("reads", len(entries), served)
        return oks

    # -- helpers ----------------------------------------------------------------------------------
    def _count(self, what: str, n: int, engine: int) -> None:
        with self._lock:
            self.stats["engine_" + what] += engine
            self.stats["tier_" + what] += n - engine

    def _tiers_own(self, tier, buf: np.ndarray) -> bool:
        """Does this block go through the tier's own per-block path?"""
        if buf.nbytes < tier.block_bytes:
            raise ValueError(f"block of {buf.nbytes} bytes, need {tier.block_bytes}")
        return failpoints.active or tier.codec is not None or buf.nbytes < tier.padded or not is_aligned(buf) \
            or (tier.meta_of is not None and tier.header == "inline")  # event metadata in the header: the tier's path

    def _run(self, tier, op: str, *args):
        if tier._root_fd < 0:
            raise OSError(errno.EBADF, "nvme tier is closed")
        self._enter()
        try:
            return getattr(self._e, op)(*args)
        finally:
            self._exit()

    @staticmethod
    def _good(tier, key: bytes, r, hdr: np.ndarray, dst: np.ndarray, hashed_here: bool) -> bool:
        """The tier's acceptance of a whole file (sizes, header, namespace, key, codec, checksum)."""
        _status, _err, size, _got, hdr_len, hashed, chk = r
        if size > tier.file_bytes or (tier.fixed_size and size != tier.file_bytes):
            return False
        try:
            h = ff.unpack_header(hdr[:hdr_len] if tier.header == "xattr" else hdr)
            tier._check(h, key)
        except ff.BadBlockFile:
            return False
        if size != tier.file_bytes_for(h.payload_len):
            return False
        if not hashed_here:
            chk, hashed = ff.checksum(dst[: h.payload_len]), h.payload_len
        return hashed == h.payload_len and chk == h.checksum
