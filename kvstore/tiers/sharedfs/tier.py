"""The shared file-system tier: one folder on a file system every host mounts (CephFS, Lustre,
NFS, Weka), written and read by many engines on many hosts at once.

    <path>/kvstore-<namespace[:16]>/<k0k1>/<key hex>.kvb     (0600 files, 0700 folders)
    <path>/kvstore-<namespace[:16]>/tmp/<key hex>.<writer>.<n>.tmp
    <path>/kvstore-<namespace[:16]>/.sweeper                  (the sweeper's lease, :mod:`.sweeper`)

What the folder holds is the truth: a block is present when its file is, whoever wrote it; no
process keeps an index of it (as with Redis, the tier is asked in batches, reserves nothing,
pins nothing and has no victims). A write goes to a temporary file, then is renamed into place
(atomic on every POSIX file system these run on), so a reader sees a whole file or none; no
O_DIRECT (network file systems differ on it). A file is the NVMe tier's block format (a 4 KiB
header: namespace, key, codec, payload length and checksum, :mod:`kvstore.tiers.fileformat`,
then the payload): every read checks the owner, the mode, the size, the header and the payload's
checksum, and a file that fails is a counted miss, removed; a file gone between the lookup and
the read (another host's sweeper, or an overwrite) is a miss. A hit refreshes the file's time:
the sweeper keeps the least recent files out (LRU by access time) and the ones idle past
``ttl_s``; a file past its TTL and not swept yet is not served.

Every path below the folder is resolved from folder descriptors without following a symlink
(:mod:`kvstore.tiers.nvme.folder`), as the NVMe tier's are.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import re
import socket
import stat
import threading
import time
from itertools import count
from typing import Sequence

import numpy as np

from kvstore.tiers import fileformat as ff
from kvstore.tiers.base import Reservation, Tier
from kvstore.tiers.index import READY, Entry
from kvstore.tiers.memory import as_bytes
from kvstore.tiers.nvme.folder import O_CLOEXEC, O_NOFOLLOW, O_NONBLOCK, NotOurs, check_folder, discard, open_subdir
from kvstore.tiers.sharedfs.sweeper import Sweeper

log = logging.getLogger(__name__)

KEY = "tiers.sharedfs.path"


def writer_id() -> str:
    """This process among every host's: ``host-pid-random`` (a file-name-safe host name)."""
    host = re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname())[:64] or "host"
    return f"{host}-{os.getpid()}-{os.urandom(4).hex()}"


class SharedFsTier(Tier):
    name = "sharedfs"
    shared = True
    write_through = True  # every block stored in a local tier is shared at once (as Redis)
    fan_out = True  # each block's file I/O is worth a thread of the store's pool

    def __init__(self, *, path: str, namespace: bytes, block_bytes: int, codec=None, codec_id: int = 0,
                 capacity_bytes: int, ttl_s: float | None, sweep_s: float = 10.0, lease_s: float = 60.0,
                 clock=time.time, sweep: bool = True):
        """``sweep``: run the sweeper's thread (a test drives its rounds itself)."""
        base = check_folder(path, KEY)
        self.namespace, self.block_bytes = namespace, int(block_bytes)
        self.codec, self.codec_id = codec, int(codec_id)
        self.payload_max = codec.encoded_bytes if codec is not None else self.block_bytes
        self.fixed_size = codec is None or codec.fixed_size
        self.capacity = int(capacity_bytes)
        self.ttl = ttl_s
        self.clock = clock
        self.uid = os.geteuid()
        self.id = writer_id()
        self._n = count()
        self.lock = threading.Lock()
        self.journal: list | None = None  # KV events: what this engine wrote, and what a read found gone
        self.stats = {"corrupt": 0, "missing": 0, "write_failed": 0, "expired": 0, "evicted": 0, "tmp_removed": 0,
                      "sweeps": 0, "leases_taken": 0}
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

    # -- lookups (the files themselves) -------------------------------------------------------------
    def leading(self, keys: Sequence[bytes]) -> int:
        now, n = self.clock(), 0
        for k in keys:
            if not self._live(self._stat(k), now):
                break
            n += 1
        return n

    def contains(self, key: bytes) -> bool:
        return self.leading([key]) == 1

    def holds(self, keys: Sequence[bytes]) -> list[bool]:
        now = self.clock()
        return [self._live(self._stat(k), now) for k in keys]

    def present_or_writing(self, key: bytes) -> bool:
        return self.holds([key])[0]

    def is_expired(self, key: bytes) -> bool:
        st = self._stat(key)
        return st is not None and not self._live(st, self.clock())

    # -- writes: nothing to reserve (a file is published whole by its rename) ------------------------
    def _entry(self, key: bytes, ttl: float | None = None) -> Entry:
        return Entry(key=key, nbytes=self.block_bytes, last_access=0.0, expire_at=math.inf, state=READY, ttl=ttl,
                     hint=ttl)

    def begin_reserve(self, keys: Sequence[bytes], ttl: float | None = None) -> Reservation:
        seen: set[bytes] = set()
        out = Reservation()
        for k in keys:  # a repeated key is written once
            out.append(None if k in seen else self._entry(k, ttl))
            seen.add(k)
        return out

    def commit(self, entries, oks, at=None, session=None, keep_pinned=False) -> None:
        if self.journal is not None:  # KV events: what this engine wrote is servable here
            with self.lock:
                self.journal.extend((True, e.key) for e, ok in zip(entries, oks) if e is not None and ok)

    def write(self, entry: Entry, src: np.ndarray) -> bool:
        key = entry.key
        src = as_bytes(src)[: self.block_bytes]
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

    # -- reads: nothing to pin -----------------------------------------------------------------------
    def acquire(self, keys: Sequence[bytes], session: str | None = None, touch: bool = True) -> list[Entry | None]:
        return [self._entry(k) for k in keys]

    def release(self, entries, oks=None) -> None:
        if oks is not None and self.journal is not None:  # KV events: the only removals this engine sees
            bad = [e.key for e, ok in zip(entries, oks) if e is not None and not ok]
            if bad:
                with self.lock:
                    self.journal.extend((False, k) for k in bad)

    def read(self, entry: Entry, out) -> bool:
        key, name = entry.key, self.file_name(entry.key)
        leaf = self.leaf(key.hex()[:2], False)
        if leaf < 0:
            return self._missing()
        try:
            fd = os.open(name, os.O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC, dir_fd=leaf)
        except FileNotFoundError:
            return self._missing()
        except OSError as e:  # a symlink (ELOOP), a folder: never followed, removed
            self.bad(leaf, name, "not_a_file", str(e))
            return False
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ff.BadBlockFile("not_a_file")
            if st.st_uid != self.uid:
                raise ff.BadBlockFile("foreign_owner", f"owned by uid {st.st_uid}, never read")
            if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
                raise ff.BadBlockFile("loose_mode", f"mode {stat.S_IMODE(st.st_mode):04o}")
            if self.ttl is not None and st.st_mtime < self.clock() - self.ttl:
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
            dst = as_bytes(out)[: self.block_bytes] if self.codec is None else np.empty(h.payload_len, np.uint8)
            if os.preadv(fd, [dst[: h.payload_len]], ff.HEADER_BYTES) != h.payload_len:
                raise ff.BadBlockFile("truncated", "short payload")
            if ff.checksum(dst[: h.payload_len]) != h.checksum:
                raise ff.BadBlockFile("bad_checksum")
            if self.codec is not None:
                try:
                    self.codec.decode(dst, h.payload_len, as_bytes(out)[: self.block_bytes])
                except Exception as e:  # noqa: BLE001 - a payload that does not decode
                    raise ff.BadBlockFile("bad_payload", f"{type(e).__name__}: {e}") from None
            try:
                os.utime(fd)  # a hit: the least recent files go first (the sweeper)
            except OSError:
                pass
            return True
        except ff.BadBlockFile as e:
            self.bad(leaf, name, e.reason, str(e))
            return False
        except OSError as e:
            self.bad(leaf, name, "read_failed", str(e))
            return False
        finally:
            os.close(fd)

    def _missing(self) -> bool:
        with self.lock:
            self.stats["missing"] += 1
        return False

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

    # -- KV events --------------------------------------------------------------------------------
    def journal_on(self) -> list[bytes]:
        with self.lock:
            self.journal = []
        return []

    def journal_take(self) -> list[tuple[bool, bytes]]:
        with self.lock:
            j = self.journal
            if j is None:
                return []
            self.journal = []
        return j

    # -- accounting ---------------------------------------------------------------------------------
    def count(self, what: str, n: int = 1) -> None:
        with self.lock:
            self.stats[what] = self.stats.get(what, 0) + n

    def measured(self, files: int, nbytes: int) -> None:
        """What the last sweep found (by this process, or the last one it held the lease for)."""
        self._held = (files, nbytes)

    def error_counts(self) -> dict[str, int]:
        return {"write": self.stats["write_failed"]}

    @property
    def used_bytes(self) -> int:
        return self._held[1]

    @property
    def capacity_bytes(self) -> int:
        return self.capacity

    def __len__(self) -> int:
        return self._held[0]

    def close(self) -> None:
        self.sweeper.stop()
        with self.lock:
            fds, self._leaves = list(self._leaves.values()), {}
        for fd in fds + [self.tmp_fd, self.root_fd]:
            try:
                os.close(fd)
            except OSError:
                pass
        self.tmp_fd = self.root_fd = -1


def _write_all(fd: int, bufs: list) -> None:
    views = [memoryview(b).cast("B") for b in bufs]
    while views:
        n = os.writev(fd, views)
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]
