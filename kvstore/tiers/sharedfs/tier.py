"""The shared file-system tier: one folder on a file system every host mounts (CephFS, Lustre,
NFS, Weka), written and read by many engines on many hosts at once.

    <path>/kvstore-<namespace[:16]>/<k0k1>/<key hex>.kvb     (0600 files, 0700 folders)
    <path>/kvstore-<namespace[:16]>/tmp/<key hex>.<writer>.<n>.tmp
    <path>/kvstore-<namespace[:16]>/.sweeper                  (the sweeper's lease, :mod:`.sweeper`)

What the folder holds is the truth: a block is present when its file is, whoever wrote it; no
process keeps an index of it (as with Redis, the tier is asked in batches, reserves nothing and
pins nothing). Its victims are the sweeper's: removed, or, when the chain has a tier below that
takes them (``keeps_victims``), moved into ``tmp/`` as ``<key hex>.<writer>.victim`` (out of every
reader's sight at once) and handed to the store (:meth:`expire`), which writes them down and
then removes them (:meth:`free`); a holder that dies leaves them to any sweeper's ``tmp/`` rule.

A write goes to a temporary file, then is renamed into place (atomic on every POSIX file system
these run on), so a reader sees a whole file or none; no
O_DIRECT (network file systems differ on it). A file is the NVMe tier's block format (a 4 KiB
header: namespace, key, codec, payload length and checksum, :mod:`kvstore.tiers.fileformat`,
then the payload): every read checks the owner, the mode, the size, the header and the payload's
checksum, and a file that fails is a counted miss, removed; a file gone between the lookup and
the read (another host's sweeper, or an overwrite) is a miss. A hit refreshes the file's time:
the sweeper keeps the least recent files out (LRU by access time) and the ones idle past
``ttl_s``; a file past its TTL and not swept yet is not served.

Every path below the folder is resolved from folder descriptors without following a symlink
(:mod:`kvstore.tiers.nvme.folder`), as the NVMe tier's are.

A network file system can stall (a hard NFS mount whose server is gone): every call runs on the
tier's own threads and ends for its caller within ``timeout_ms`` (plus 50 ms per MiB it moves);
one that does not is a miss, counted, and the tier is skipped for ``BACKOFF_S`` (as Redis is). A
stalled thread keeps only its own buffers: a write is copied out of the caller's slot first, a
read lands in a buffer of its own and is copied into the caller's only when it came in time, so a
late one can neither write a slot reused meanwhile nor publish bytes that changed under it.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import re
import socket
import stat
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from itertools import count
from typing import Sequence

import numpy as np

from kvstore import failpoints
from kvstore.tiers import fileformat as ff
from kvstore.tiers.index import READY, Entry
from kvstore.tiers.memory import as_bytes
from kvstore.tiers.nvme.folder import O_CLOEXEC, O_NOFOLLOW, O_NONBLOCK, NotOurs, check_folder, discard, open_subdir
from kvstore.tiers.shared import SharedTier
from kvstore.tiers.sharedfs.sweeper import Sweeper

log = logging.getLogger(__name__)

KEY = "tiers.sharedfs.path"
BACKOFF_S = 5.0  # after a call past its deadline, the tier is skipped this long (then asked again)
ASIDE = 1  # Entry.slot of a victim set aside in tmp/ for the tier below
VICTIMS_MAX = 1024  # victims set aside and not yet removed (queued or being written down); past it, removed
MIB_S = 0.05  # a call's deadline grows by this much per MiB it moves (as the Redis tier's)


class Down(Exception):
    """The file system did not answer in time, or the tier is in its backoff: a miss."""


def writer_id() -> str:
    """This process among every host's: ``host-pid-random`` (a file-name-safe host name)."""
    host = re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname())[:64] or "host"
    return f"{host}-{os.getpid()}-{os.urandom(4).hex()}"


class SharedFsTier(SharedTier):
    name = "sharedfs"
    fan_out = True  # each block's file I/O is worth a thread of the store's pool

    def __init__(self, *, path: str, namespace: bytes, block_bytes: int, codec=None, codec_id: int = 0,
                 capacity_bytes: int, ttl_s: float | None, sweep_s: float = 10.0, lease_s: float = 60.0,
                 timeout_ms: int = 1000, io_threads: int = 4, clock=time.time, sweep: bool = True,
                 write_through: bool = True):
        """``sweep``: run the sweeper's thread (a test drives its rounds itself). ``write_through``
        False: only what the tiers above let go is written here (``write_mode: write_back``)."""
        base = check_folder(path, KEY)
        super().__init__(block_bytes, write_through)
        self.namespace = namespace
        self.codec, self.codec_id = codec, int(codec_id)
        self.payload_max = codec.encoded_bytes if codec is not None else self.block_bytes
        self.fixed_size = codec is None or codec.fixed_size
        self.capacity = int(capacity_bytes)
        self.ttl = ttl_s
        self.clock = clock
        self.uid = os.geteuid()
        self.id = writer_id()
        self._n = count()
        self.stats = {"corrupt": 0, "missing": 0, "write_failed": 0, "expired": 0, "evicted": 0, "tmp_removed": 0,
                      "set_aside": 0, "sweeps": 0, "leases_taken": 0, "timeouts": 0, "skipped_down": 0}
        self.timeout_s = timeout_ms / 1000
        self._threads = max(1, int(io_threads))
        self._pool = ThreadPoolExecutor(max_workers=self._threads, thread_name_prefix="kvstore-sharedfs")
        self._in_flight = 0  # calls submitted and not ended (stalled ones included): at most 2 per thread
        self._down_until = 0.0
        self.corrupt_reasons: dict[str, int] = {}
        self._held = (0, 0)  # (files, bytes) the last sweep counted
        self.folder = base / f"kvstore-{namespace.hex()[:16]}"
        bfd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | O_CLOEXEC)  # the configured path: the operator's choice
        try:
            self.root_fd = open_subdir(bfd, self.folder.name, True)
        finally:
            os.close(bfd)
        self.tmp_fd = open_subdir(self.root_fd, "tmp", True)
        self._leaves: dict[str, int] = {}
        self._aside: deque[Entry] = deque()  # victims set aside, for expire
        self._aside_n = 0  # victims set aside and not yet freed (at most VICTIMS_MAX): not in the capacity
        self.sweeper = Sweeper(self, sweep_s, lease_s, clock)
        if sweep:
            self.sweeper.start()

    def __repr__(self) -> str:
        return f"<SharedFsTier {self.namespace.hex()[:16]} {self.id}>"

    # -- the folder -------------------------------------------------------------------------------
    @staticmethod
    def file_name(key: bytes) -> str:
        return key.hex() + ff.SUFFIX

    def path_of(self, key: bytes):
        """Where ``key``'s file is (for operators and tests; the tier itself never opens a path)."""
        return self.folder / key.hex()[:2] / self.file_name(key)

    def leaf(self, name: str, create: bool) -> int:
        """A descriptor of the fan-out folder ``name`` (two hex digits), kept open (256 at most);
        -1 where it does not exist and ``create`` is false."""
        fd = self._leaves.get(name)
        if fd is not None:
            return fd
        try:
            fd = open_subdir(self.root_fd, name, create)
        except FileNotFoundError:
            return -1
        except NotOurs as e:  # another user's folder inside ours: never used, moved aside
            self.bad_count("foreign_owner", f"{name}: {e}")
            discard(self.root_fd, name, whole=False)
            if not create:
                return -1
            fd = open_subdir(self.root_fd, name, True)
        with self.lock:
            old = self._leaves.setdefault(name, fd)
        if old != fd:
            os.close(fd)
        return old

    def _stat(self, key: bytes) -> os.stat_result | None:
        fd = self.leaf(key.hex()[:2], False)
        if fd < 0:
            return None
        try:
            st = os.stat(self.file_name(key), dir_fd=fd, follow_symlinks=False)
        except OSError:
            return None
        return st if stat.S_ISREG(st.st_mode) else None

    def _live(self, st: os.stat_result | None, now: float) -> bool:
        return st is not None and (self.ttl is None or st.st_mtime >= now - self.ttl)

    # -- the deadline ---------------------------------------------------------------------------------
    def _call(self, fn, *args, nbytes: int = 0):
        """``fn(*args)`` on the tier's threads, within the deadline; else :class:`Down` (counted,
        and the backoff begins). ``fn`` touches only buffers of its own."""
        if time.monotonic() < self._down_until or self._in_flight >= 2 * self._threads:
            self.count("skipped_down")
            raise Down
        with self.lock:
            self._in_flight += 1
        try:
            fut = self._pool.submit(self._run, fn, args)
        except RuntimeError:  # closed
            with self.lock:
                self._in_flight -= 1
            raise Down from None
        try:
            return fut.result(timeout=self.timeout_s + MIB_S * nbytes / (1 << 20))
        except FutureTimeout:
            self.count("timeouts")
            if time.monotonic() >= self._down_until:
                log.warning("kvstore sharedfs: %s did not answer within %.0f ms; a miss, and the tier is skipped "
                            "for %.0f s", self.folder, self.timeout_s * 1000, BACKOFF_S)
            self._down_until = time.monotonic() + BACKOFF_S
            raise Down from None

    def _run(self, fn, args):
        try:
            failpoints.fire("sharedfs.io")
            return fn(*args)
        finally:
            with self.lock:
                self._in_flight -= 1

    @property
    def up(self) -> bool:
        return time.monotonic() >= self._down_until

    # -- lookups (the files themselves) -------------------------------------------------------------
    def _leading(self, keys: Sequence[bytes]) -> int:
        now, n = self.clock(), 0
        for k in keys:
            if not self._live(self._stat(k), now):
                break
            n += 1
        return n

    def leading(self, keys: Sequence[bytes]) -> int:
        if not keys:
            return 0
        try:
            return self._call(self._leading, list(keys))
        except Down:
            return 0

    def holds(self, keys: Sequence[bytes]) -> list[bool]:
        now = self.clock()
        try:
            return self._call(lambda ks: [self._live(self._stat(k), now) for k in ks], list(keys))
        except Down:
            return [False] * len(keys)

    def is_expired(self, key: bytes) -> bool:
        try:
            st = self._call(self._stat, key)
        except Down:
            return False
        return st is not None and not self._live(st, self.clock())

    # -- the medium (a file is published whole by its rename) ------------------------------------------
    def write_many(self, entries: Sequence[Entry], srcs: Sequence[np.ndarray]) -> list[bool]:
        """One deadline for the batch; each block copied out of the caller's buffer first (a
        stalled write may outlive the caller's slot)."""
        if not entries:
            return []
        own = [np.array(as_bytes(x)[: self.block_bytes], copy=True) for x in srcs]
        try:
            return self._call(lambda: [self._write(e.key, b) for e, b in zip(entries, own)],
                              nbytes=len(entries) * self.block_bytes)
        except Down:
            return [False] * len(entries)

    def _write(self, key: bytes, src: np.ndarray) -> bool:
        if self.codec is not None:
            buf = np.empty(self.payload_max, np.uint8)
            payload = buf[: self.codec.encode(src, buf)]
        else:
            payload = src
        hdr = bytearray(ff.HEADER_BYTES)
        ff.pack_header(ff.Header(self.codec_id, len(payload), ff.checksum(payload), time.time(), self.namespace, key),
                       hdr)
        tmp = f"{key.hex()}.{self.id}.{next(self._n)}.tmp"
        try:
            leaf = self.leaf(key.hex()[:2], True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0o600, dir_fd=self.tmp_fd)
            try:
                _write_all(fd, [hdr, memoryview(payload)])
            finally:
                os.close(fd)
            os.rename(tmp, self.file_name(key), src_dir_fd=self.tmp_fd, dst_dir_fd=leaf)
            return True
        except OSError as e:
            try:
                os.unlink(tmp, dir_fd=self.tmp_fd)
            except OSError:
                pass
            with self.lock:
                self.stats["write_failed"] += 1
            if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                log.warning("kvstore sharedfs: writing a block failed: %s", e)
            return False

    def read_many(self, entries: Sequence[Entry], outs) -> list[bool]:
        """One deadline for the batch; each block read into a buffer of its own, copied into the
        caller's only once the batch came in time (a victim set aside: from ``tmp/``)."""
        if not entries:
            return []
        try:
            got = self._call(lambda: [self._read(e.key, e.slot == ASIDE) for e in entries],
                             nbytes=len(entries) * self.block_bytes)
        except Down:
            return [False] * len(entries)
        for b, out in zip(got, outs):
            if b is not None:
                np.copyto(as_bytes(out)[: self.block_bytes], b, casting="no")
        return [b is not None for b in got]

    def _read(self, key: bytes, aside: bool = False) -> np.ndarray | None:
        """The block of ``key``'s file, in a buffer of its own, or None (a miss: counted, and a bad
        file removed). ``aside``: the victim set aside in ``tmp/`` (read whatever its age: the
        chain decides whether it is worth writing down)."""
        out = np.empty(self.block_bytes, np.uint8)
        name = self.aside_name(key) if aside else self.file_name(key)
        leaf = self.tmp_fd if aside else self.leaf(key.hex()[:2], False)
        if leaf < 0:
            return self._missing()
        try:
            fd = os.open(name, os.O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC, dir_fd=leaf)
        except FileNotFoundError:
            return self._missing()
        except OSError as e:  # a symlink (ELOOP), a folder: never followed, removed
            self.bad(leaf, name, "not_a_file", str(e))
            return None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ff.BadBlockFile("not_a_file")
            if st.st_uid != self.uid:
                raise ff.BadBlockFile("foreign_owner", f"owned by uid {st.st_uid}, never read")
            if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
                raise ff.BadBlockFile("loose_mode", f"mode {stat.S_IMODE(st.st_mode):04o}")
            if not aside and self.ttl is not None and st.st_mtime < self.clock() - self.ttl:
                return self._missing()  # past its TTL: the sweeper's
            hdr = bytearray(ff.HEADER_BYTES)
            if os.preadv(fd, [hdr], 0) != ff.HEADER_BYTES:
                raise ff.BadBlockFile("truncated", "short header")
            h = ff.unpack_header(hdr)
            if h.fingerprint != self.namespace or h.key != key or h.codec_id != self.codec_id:
                raise ff.BadBlockFile("foreign")
            ok_len = h.payload_len == self.payload_max if self.fixed_size else 0 < h.payload_len <= self.payload_max
            if not ok_len or st.st_size != ff.HEADER_BYTES + h.payload_len:
                raise ff.BadBlockFile("truncated" if st.st_size < ff.HEADER_BYTES + h.payload_len else "bad_size",
                                      f"{st.st_size} bytes for a {h.payload_len}-byte payload")
            dst = out if self.codec is None else np.empty(h.payload_len, np.uint8)
            if os.preadv(fd, [dst[: h.payload_len]], ff.HEADER_BYTES) != h.payload_len:
                raise ff.BadBlockFile("truncated", "short payload")
            if ff.checksum(dst[: h.payload_len]) != h.checksum:
                raise ff.BadBlockFile("bad_checksum")
            if self.codec is not None:
                try:
                    self.codec.decode(dst, h.payload_len, out)
                except Exception as e:  # noqa: BLE001 - a payload that does not decode
                    raise ff.BadBlockFile("bad_payload", f"{type(e).__name__}: {e}") from None
            if not aside:
                try:
                    os.utime(fd)  # a hit: the least recent files go first (the sweeper)
                except OSError:
                    pass
            return out
        except ff.BadBlockFile as e:
            self.bad(leaf, name, e.reason, str(e))
            return None
        except OSError as e:
            self.bad(leaf, name, "read_failed", str(e))
            return None
        finally:
            os.close(fd)

    def _missing(self) -> None:
        with self.lock:
            self.stats["missing"] += 1
        return None

    # -- victims (a tier below takes them) -----------------------------------------------------------
    def aside_name(self, key: bytes) -> str:
        return f"{key.hex()}.{self.id}.victim"

    def set_aside(self, leaf: int, name: str, mtime: float, reason: str) -> bool:
        """The sweeper's victim ``name`` (in ``leaf``), moved into ``tmp/`` for the tier below and
        queued for :meth:`expire`; False: not kept (no tier below, the queue full, a name that is
        not a key's, the rename failed): the sweeper removes it."""
        if not self.keeps_victims or self._aside_n >= VICTIMS_MAX or not name.endswith(ff.SUFFIX):
            return False
        try:
            key = bytes.fromhex(name[: -len(ff.SUFFIX)])
            os.rename(name, self.aside_name(key), src_dir_fd=leaf, dst_dir_fd=self.tmp_fd)
        except (ValueError, OSError):
            return False
        try:  # its time is now: tmp/'s age rule counts from the move (a rename need not touch ctime)
            os.utime(self.aside_name(key), dir_fd=self.tmp_fd, follow_symlinks=False)
        except OSError:
            pass
        e = Entry(key=key, nbytes=self.block_bytes, last_access=mtime, expire_at=math.inf, state=READY, slot=ASIDE,
                  reason=reason)
        with self.lock:
            self._aside.append(e)
            self._aside_n += 1
        return True

    def victims_waiting(self) -> bool:
        return bool(self._aside)

    def expire(self, limit: int | None = None) -> list[Entry]:
        """The victims set aside (at most ``limit``, 256 by default), for the chain to write down;
        each keeps its file until :meth:`free`."""
        with self.lock:
            return [self._aside.popleft() for _ in range(min(256 if limit is None else limit, len(self._aside)))]

    def free(self, victims: Sequence[Entry]) -> None:
        """Remove the files of victims set aside (written down, or dropped); a stalled file system
        leaves them to the sweeper's ``tmp/`` rule."""
        names = [self.aside_name(e.key) for e in victims if e.slot == ASIDE]
        if names:
            with self.lock:
                self._aside_n -= len(names)
            try:
                self._call(lambda: [_remove(self.tmp_fd, n) for n in names])
            except Down:
                pass

    # -- bad files ------------------------------------------------------------------------------------
    def bad_count(self, reason: str, detail: str) -> None:
        with self.lock:
            self.stats["corrupt"] += 1
            self.corrupt_reasons[reason] = self.corrupt_reasons.get(reason, 0) + 1
        log.warning("kvstore sharedfs: dropping a block file (%s: %s)", reason, detail)

    def bad(self, dir_fd: int, name: str, reason: str, detail: str) -> None:
        """Count a bad file and remove it (the name: a symlink is unlinked, never followed)."""
        self.bad_count(reason, f"{name}: {detail}")
        discard(dir_fd, name, whole=False)

    # -- accounting ---------------------------------------------------------------------------------
    def count(self, what: str, n: int = 1) -> None:
        with self.lock:
            self.stats[what] = self.stats.get(what, 0) + n

    def measured(self, files: int, nbytes: int) -> None:
        """What the last sweep found (by this process, or the last one it held the lease for)."""
        self._held = (files, nbytes)

    def error_counts(self) -> dict[str, int]:
        return {"write": self.stats["write_failed"], "timeout": self.stats["timeouts"],
                "down": self.stats["skipped_down"]}

    @property
    def used_bytes(self) -> int:
        return self._held[1]

    @property
    def capacity_bytes(self) -> int:
        return self.capacity

    def __len__(self) -> int:
        return self._held[0]

    def close(self) -> None:
        """Stop the sweeper and the calls' threads. The folder descriptors are closed only when
        no call or round is stalled in the file system: a stalled one still uses them, and a number
        closed under it and reused could put its file in another folder (left to the exit)."""
        quiet = self.sweeper.stop()
        self._pool.shutdown(wait=False, cancel_futures=True)
        if not quiet or self._in_flight:
            log.warning("kvstore sharedfs: %s closed with a call stalled in the file system; its folder "
                        "descriptors are left to the process's exit", self.folder)
            return
        with self.lock:
            fds, self._leaves = list(self._leaves.values()), {}
        for fd in fds + [self.tmp_fd, self.root_fd]:
            try:
                os.close(fd)
            except OSError:
                pass
        self.tmp_fd = self.root_fd = -1


def _remove(dir_fd: int, name: str) -> None:
    try:
        os.unlink(name, dir_fd=dir_fd)
    except OSError:  # gone already (the tmp/ rule of some host's sweeper)
        pass


def _write_all(fd: int, bufs: list) -> None:
    views = [memoryview(b).cast("B") for b in bufs]
    while views:
        n = os.writev(fd, views)
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]
