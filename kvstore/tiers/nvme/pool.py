"""Recycled block files: a bounded pool of evicted files in the tier's ``tmp/``, overwritten in
place by later writes instead of a new file per write and an unlink per eviction (issue 34).

    tmp/pool.<pid>.<n>       a file an eviction moved here (rename, atomic), whatever it holds

On this machine (ext4 mounted with ``discard``, a virtio disk), a new file per block and an
unlink per victim cost the kernel more than the data: inode allocation, block allocation, and on
unlink the truncate and the discard of every block (~60 % of a write's time, bench/tiers/nvme_profile.py).
An overwrite of a file whose blocks are already allocated and written needs none of it.

Safety: a pooled file lives in ``tmp/`` under a name no reader looks up, so it is never served;
a write overwrites it whole (header and payload, the size unchanged) under that name and only
then renames it into place, atomically, exactly as a new file: a reader sees the whole new file
or none. Killed mid-way, a pooled or half-overwritten file is left in ``tmp/`` under a name that
carries the pid, which the restart scan removes as it removes a killed writer's temporary files.
After a power loss (no fsync, as before) a renamed file may hold the old block's bytes under the
new header: its checksum (or its key) fails, a counted miss, as a half-written new file would.
Before it is reused a file is opened without following a link, non-blocking, and checked: a
regular file of this user, mode 0600, one link, the exact size of a block file. Anything else is
removed (never written through). Only fixed-size files are pooled (a variable-size codec's files
are removed as before: their sizes differ), at most ``max_files`` at a time (the rest removed as
before); a full disk empties the pool (its space goes back to the file system).
"""

from __future__ import annotations

import errno
import os
import stat
import threading
from itertools import count

from kvstore.tiers.nvme.folder import O_CLOEXEC, O_NOFOLLOW, O_NONBLOCK, discard

PREFIX = "pool."
POOL_BYTES = 1 << 30  # the most a pool holds (default): files beyond the capacity, bounded
POOL_FILES = 256


def default_max_files(file_bytes: int, capacity_bytes: int) -> int:
    """The pool's bound: 256 files, at most 1 GiB and never more than the tier's capacity. In a
    full cache each write's reservation evicts about one victim just before the write, so the
    pool mostly holds the files of writes about to start (the victims of a batch of 32 blocks
    from each of a few callers); pooled files beyond those are disk space over the capacity."""
    fb = max(1, file_bytes)
    return max(0, min(POOL_FILES, POOL_BYTES // fb, capacity_bytes // fb))


class FilePool:
    """The pooled files of one tier (names in ``tmp/``); thread-safe."""

    def __init__(self, tmp_fd: int, file_bytes: int, max_files: int):
        self.tmp_fd = tmp_fd
        self.file_bytes = int(file_bytes)
        self.max_files = max(0, int(max_files))
        self._names: list[str] = []
        self._moving = 0  # renames into the pool under way
        self._lock = threading.Lock()
        self._seq = count()
        self.uid = os.geteuid()
        self.stats = {"pooled": 0, "reused": 0, "unfit": 0, "full": 0}

    def __len__(self) -> int:
        return len(self._names)

    def put(self, dir_fd: int, name: str) -> bool:
        """Move ``dir_fd/name`` into the pool (a rename, atomic). False when the pool is full;
        FileNotFoundError when the name is gone (the caller tells the two apart)."""
        with self._lock:
            if len(self._names) + self._moving >= self.max_files:
                self.stats["full"] += 1
                return False
            pname = f"{PREFIX}{os.getpid()}.{next(self._seq)}"
            self._moving += 1  # its room held; takeable once it is there
        ok = False
        try:
            os.rename(name, pname, src_dir_fd=dir_fd, dst_dir_fd=self.tmp_fd)
            ok = True
        finally:
            with self._lock:
                self._moving -= 1
                if ok:
                    self._names.append(pname)
                    self.stats["pooled"] += 1
        return True

    def take(self) -> str | None:
        """A pooled name, the caller's alone now (None: the pool is empty)."""
        with self._lock:
            return self._names.pop() if self._names else None

    def open(self, name: str, flags: int) -> int:
        """Open a taken file to overwrite it (``flags``: O_DIRECT or not). Returns -1 after
        removing a file that is not a fit (never written through: a link, a folder, a FIFO,
        another user's, another mode, more than one link, another size)."""
        fd = -1
        try:
            fd = os.open(name, os.O_WRONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK | flags, dir_fd=self.tmp_fd)
            st = os.fstat(fd)
            if (stat.S_ISREG(st.st_mode) and st.st_uid == self.uid and stat.S_IMODE(st.st_mode) == 0o600
                    and st.st_nlink == 1 and st.st_size == self.file_bytes):
                self.reused()
                return fd
        except OSError as e:
            if e.errno == errno.EROFS:
                raise
        if fd >= 0:
            os.close(fd)
        self.unfit(name)
        return -1

    def reused(self) -> None:
        with self._lock:
            self.stats["reused"] += 1

    def unfit(self, name: str) -> None:
        """A taken file that is not a fit (the checks of :meth:`open`): counted and removed."""
        with self._lock:
            self.stats["unfit"] += 1
        discard(self.tmp_fd, name, whole=True)

    def drain(self) -> int:
        """Remove every pooled file (a full disk: their space goes back). Returns how many."""
        with self._lock:
            names, self._names = self._names, []
        for n in names:
            discard(self.tmp_fd, n, whole=True)
        return len(names)
