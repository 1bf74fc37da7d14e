"""The NVMe tier's checks of what it finds on disk: the start-up scan, a block file's checks
(shared with reads), and what a writer clears from its way.

The scan rebuilds the index from the block files' headers (payloads are not read), oldest
first (file mtime = the entry's last access), within capacity and TTL.

Files a killed writer left in ``tmp/`` and probe files are removed; every file is checked
(name, place, type, owner, mode, size, header, namespace, key, codec) and a bad one is counted
by reason and removed. Nothing is followed: a symlink is unlinked (the link, never its target);
a non-file where a block file belongs (a folder, a FIFO) or a non-folder where a fan-out folder
belongs is counted once and removed, so its keys stay storable. Modes: this user's folders are
set to 0700 and files readable by others to 0600 (counted in ``modes_fixed``); a file another
user owns is never read (``foreign_owner``), nor is one that others could write
(``loose_mode``: its bytes cannot be trusted), both dropped; another user's folder is removed
or moved aside (``foreign_owner``).
"""

from __future__ import annotations

import errno
import logging
import os
import stat

from kvstore import fileformat as ff
from kvstore.index import Entry
from kvstore.tiers.folder import (DISCARD_PREFIX, O_CLOEXEC, O_NOFOLLOW, O_NONBLOCK, PROBE_PREFIX, NotOurs, discard,
                                  open_subdir, pid_alive)

_HEX = frozenset("0123456789abcdef")
log = logging.getLogger("kvstore.tiers.nvme")


class NvmeScan:
    """Mixed into :class:`kvstore.tiers.nvme.NvmeTier` (its folder descriptors, index and stats)."""

    def scan(self) -> None:
        """Rebuild the index from file headers (payloads are not read), oldest first."""
        self._scan_tmp()
        found: list[tuple[float, bytes, int]] = []
        hbuf = bytearray(ff.HEADER_BYTES)
        fixed: list[str] = []
        for d1 in os.scandir(self._root_fd):
            if d1.name.startswith(PROBE_PREFIX) and not d1.is_dir(follow_symlinks=False):
                # an O_DIRECT probe left by a killed process
                try:
                    pid = int(d1.name[len(PROBE_PREFIX):].split(".")[0])
                except ValueError:
                    pid = -1
                if pid < 0 or not pid_alive(pid):
                    try:
                        os.unlink(d1.name, dir_fd=self._root_fd)
                    except OSError:
                        pass
                continue
            if d1.name == "tmp":
                continue
            fd1 = self._scan_folder(self._root_fd, d1, "", fixed)
            if fd1 < 0:
                continue
            try:
                for d2 in os.scandir(fd1):
                    fd2 = self._scan_folder(fd1, d2, d1.name + "/", fixed)
                    if fd2 < 0:
                        continue
                    try:
                        for f in os.scandir(fd2):
                            item = self._scan_one(fd2, d1.name, d2.name, f, hbuf, fixed)
                            if item is not None:
                                found.append(item)
                    finally:
                        os.close(fd2)
            finally:
                os.close(fd1)
        found.sort()
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

    def _scan_tmp(self) -> None:
        """Remove what killed writers left in ``tmp/`` (whatever it is: nothing is followed)."""
        me = os.getpid()
        for f in os.scandir(self._tmp_fd):
            parts = f.name.split(".")
            try:
                pid = int(parts[1])
            except (IndexError, ValueError):
                pid = -1
            if (pid == me or pid < 0 or not pid_alive(pid)) and discard(self._tmp_fd, f.name, whole=True):
                self.stats["tmp_removed"] += 1

    def _scan_folder(self, parent_fd: int, d: os.DirEntry, where: str, fixed: list[str]) -> int:
        """A descriptor of the folder ``d`` to scan, or -1: a non-folder where a fan-out folder
        belongs (two hex digits) or another user's folder is counted and removed; a folder
        moved aside (``.discard.``) is removed; other names are left alone."""
        name = d.name
        if name.startswith(DISCARD_PREFIX):
            discard(parent_fd, name, whole=True)
            return -1
        if not d.is_dir(follow_symlinks=False):
            if len(name) == 2 and set(name) <= _HEX:  # it would block every write of its keys
                self._bad_count("not_a_folder", f"{where}{name}: not a folder (removed, never followed)")
                discard(parent_fd, name, whole=True)
            return -1
        try:
            return open_subdir(parent_fd, name, False, fixed)
        except NotOurs as e:
            self._bad_count("foreign_owner", f"{where}{name}: {e.strerror} (removed, never read)")
            discard(parent_fd, name, whole=True)
        except OSError:
            pass
        return -1

    def _scan_one(self, dir_fd: int, d1: str, d2: str, f: os.DirEntry, hbuf: bytearray,
                  fixed: list[str]) -> tuple[float, bytes, int] | None:
        if f.name.startswith(DISCARD_PREFIX):
            discard(dir_fd, f.name, whole=True)
            return None
        if f.is_symlink() or not f.is_file(follow_symlinks=False):
            # counted once, then removed (a link is unlinked, never followed): the key stays storable
            what = "symlink" if f.is_symlink() else "not_a_file"
            self._bad_count(what, f"{d1}/{d2}/{f.name}: a {what.replace('_', ' ')} (removed, never followed)")
            discard(dir_fd, f.name, whole=True)
            return None
        stem = f.name[: -len(ff.SUFFIX)] if f.name.endswith(ff.SUFFIX) else ""
        try:
            key = bytes.fromhex(stem)
            if len(key) != 16 or stem != key.hex():
                raise ValueError
        except ValueError:
            self._bad(dir_fd, f.name, "bad_name", "not a block file name")
            return None
        if stem[:2] != d1 or stem[2:4] != d2:
            self._bad(dir_fd, f.name, "misplaced", f"in {d1}/{d2}")
            return None
        try:
            fd = os.open(f.name, os.O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK, dir_fd=dir_fd)
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    raise ff.BadBlockFile("not_a_file")
                if self._check_owner(fd, st):
                    fixed.append(f.name)
                if st.st_size > self.file_bytes or (self.fixed_size and st.st_size != self.file_bytes):
                    raise ff.BadBlockFile("truncated" if st.st_size < self.file_bytes else "bad_size")
                if self.header == "xattr":
                    h = self._header_of(fd)
                else:
                    if os.preadv(fd, [hbuf], 0) != ff.HEADER_BYTES:
                        raise ff.BadBlockFile("truncated")
                    h = ff.unpack_header(hbuf)
            finally:
                os.close(fd)
            self._check(h, key)
            if st.st_size != self.file_bytes_for(h.payload_len):
                raise ff.BadBlockFile("truncated", f"{st.st_size} bytes for a {h.payload_len}-byte payload")
        except ff.BadBlockFile as e:
            self._bad(dir_fd, f.name, e.reason, str(e))
            return None
        except OSError as e:
            self._bad(dir_fd, f.name, "read_failed", str(e))
            return None
        return st.st_mtime, key, st.st_size

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
