"""The NVMe tier's start-up scan: what a folder holds, each file checked, as data.

:meth:`FolderScan.run` walks the tier's folder once: files a killed writer left in ``tmp/`` and
O_DIRECT probes of dead processes are removed; every block file is checked (name, place, type,
owner, mode, size, header, namespace, key, codec), a bad one counted by reason and removed (the
tier's own checks, the ones its reads make); the block files of the old two-level layout are moved
up into their folder. It returns the good blocks, ``(mtime, key, bytes)`` sorted oldest first, and
the files whose mode it fixed; the tier rebuilds its index from them (:meth:`NvmeTier.scan`).
"""

from __future__ import annotations

import os
import stat

from kvstore.tiers import fileformat as ff
from kvstore.tiers.nvme.folder import (DISCARD_PREFIX, O_CLOEXEC, O_NOFOLLOW, O_NONBLOCK, PROBE_PREFIX, NotOurs, discard,
                                       open_subdir, pid_alive)

_HEX = frozenset("0123456789abcdef")


class FolderScan:
    def __init__(self, tier):
        self.t = tier  # the NvmeTier being opened: its folder, its checks, its counters

    def run(self) -> tuple[list[tuple[float, bytes, int]], list[str]]:
        t = self.t
        self._tmp()
        found: list[tuple[float, bytes, int]] = []
        seen: set[bytes] = set()
        hbuf = bytearray(ff.HEADER_BYTES)
        fixed: list[str] = []
        for d1 in os.scandir(t._root_fd):
            if d1.name.startswith(PROBE_PREFIX) and not d1.is_dir(follow_symlinks=False):
                # an O_DIRECT probe left by a killed process
                try:
                    pid = int(d1.name[len(PROBE_PREFIX):].split(".")[0])
                except ValueError:
                    pid = -1
                if pid < 0 or not pid_alive(pid):
                    try:
                        os.unlink(d1.name, dir_fd=t._root_fd)
                    except OSError:
                        pass
                continue
            if d1.name == "tmp":
                continue
            fd1 = self._folder(t._root_fd, d1, "", fixed)
            if fd1 < 0:
                continue
            try:
                for f in os.scandir(fd1):
                    if f.is_dir(follow_symlinks=False) and len(f.name) == 2 and set(f.name) <= _HEX:
                        found.extend(self._old_leaf(fd1, d1.name, f, hbuf, fixed, seen))
                        continue
                    item = self._one(fd1, d1.name, f, hbuf, fixed)
                    if item is not None and item[1] not in seen:
                        seen.add(item[1])
                        found.append(item)
            finally:
                os.close(fd1)
        found.sort()
        return found, fixed

    def _tmp(self) -> None:
        """Remove what killed writers left in ``tmp/`` (whatever it is: nothing is followed), the
        pooled files of a process gone included (``pool.<pid>.<n>``, :mod:`.pool`)."""
        me = os.getpid()
        for f in os.scandir(self.t._tmp_fd):
            parts = f.name.split(".")
            try:
                pid = int(parts[1])
            except (IndexError, ValueError):
                pid = -1
            if (pid == me or pid < 0 or not pid_alive(pid)) and discard(self.t._tmp_fd, f.name, whole=True):
                self.t.stats["tmp_removed"] += 1

    def _folder(self, parent_fd: int, d: os.DirEntry, where: str, fixed: list[str]) -> int:
        """A descriptor of the folder ``d`` to scan, or -1: a non-folder where a fan-out folder
        belongs (two hex digits) or another user's folder is counted and removed; a folder
        moved aside (``.discard.``) is removed; other names are left alone."""
        name = d.name
        if name.startswith(DISCARD_PREFIX):
            discard(parent_fd, name, whole=True)
            return -1
        if not d.is_dir(follow_symlinks=False):
            if len(name) == 2 and set(name) <= _HEX:  # it would block every write of its keys
                self.t._bad_count("not_a_folder", f"{where}{name}: not a folder (removed, never followed)")
                discard(parent_fd, name, whole=True)
            return -1
        try:
            return open_subdir(parent_fd, name, False, fixed)
        except NotOurs as e:
            self.t._bad_count("foreign_owner", f"{where}{name}: {e.strerror} (removed, never read)")
            discard(parent_fd, name, whole=True)
        except OSError:
            pass
        return -1

    def _old_leaf(self, fd1: int, d1: str, d2: os.DirEntry, hbuf: bytearray, fixed: list[str],
                       seen: set[bytes]) -> list[tuple[float, bytes, int]]:
        """A leaf folder of the two-level layout (``<k0k1>/<k2k3>/``): its good block files are moved
        up into ``d1`` (checked first, like any file), the rest dropped; the folder is removed."""
        fd2 = self._folder(fd1, d2, d1 + "/", fixed)
        if fd2 < 0:
            return []
        out = []
        try:
            for f in os.scandir(fd2):
                item = self._one(fd2, d1 + "/" + d2.name, f, hbuf, fixed)
                if item is None:
                    continue
                if item[1] in seen:  # already in its new place: the old copy goes
                    discard(fd2, f.name, whole=False)
                    continue
                try:
                    os.rename(f.name, f.name, src_dir_fd=fd2, dst_dir_fd=fd1)
                except OSError as e:
                    self.t._bad(fd2, f.name, "read_failed", f"not moved to the one-level layout: {e}")
                    continue
                seen.add(item[1])
                out.append(item)
        finally:
            os.close(fd2)
        discard(fd1, d2.name, whole=True)
        return out

    def _one(self, dir_fd: int, where: str, f: os.DirEntry, hbuf: bytearray,
                  fixed: list[str]) -> tuple[float, bytes, int] | None:
        """A block file found in the folder ``where`` (``k0k1``, or ``k0k1/k2k3`` in the old layout)."""
        if f.name.startswith(DISCARD_PREFIX):
            discard(dir_fd, f.name, whole=True)
            return None
        if f.is_symlink() or not f.is_file(follow_symlinks=False):
            # counted once, then removed (a link is unlinked, never followed): the key stays storable
            what = "symlink" if f.is_symlink() else "not_a_file"
            self.t._bad_count(what, f"{where}/{f.name}: a {what.replace('_', ' ')} (removed, never followed)")
            discard(dir_fd, f.name, whole=True)
            return None
        stem = f.name[: -len(ff.SUFFIX)] if f.name.endswith(ff.SUFFIX) else ""
        try:
            key = bytes.fromhex(stem)
            if len(key) != 16 or stem != key.hex():
                raise ValueError
        except ValueError:
            self.t._bad(dir_fd, f.name, "bad_name", "not a block file name")
            return None
        if not stem.startswith(where.replace("/", "")):
            self.t._bad(dir_fd, f.name, "misplaced", f"in {where}")
            return None
        try:
            fd = os.open(f.name, os.O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK, dir_fd=dir_fd)
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    raise ff.BadBlockFile("not_a_file")
                if self.t._check_owner(fd, st):
                    fixed.append(f.name)
                if st.st_size > self.t.file_bytes or (self.t.fixed_size and st.st_size != self.t.file_bytes):
                    raise ff.BadBlockFile("truncated" if st.st_size < self.t.file_bytes else "bad_size")
                meta = None
                if self.t.header == "xattr":
                    h = self.t._header_of(fd)
                    if self.t.scanned_meta is not None:
                        try:
                            meta = ff.unpack_meta(os.getxattr(fd, ff.XATTR_META), key)
                        except OSError:
                            pass
                else:
                    if os.preadv(fd, [hbuf], 0) != ff.HEADER_BYTES:
                        raise ff.BadBlockFile("truncated")
                    h = ff.unpack_header(hbuf)
                    if self.t.scanned_meta is not None:
                        meta = ff.unpack_meta(memoryview(hbuf)[ff.META_OFFSET:], key)
            finally:
                os.close(fd)
            self.t._check(h, key)
            if meta is not None:
                self.t.scanned_meta[key] = meta
            if st.st_size != self.t.file_bytes_for(h.payload_len):
                raise ff.BadBlockFile("truncated", f"{st.st_size} bytes for a {h.payload_len}-byte payload")
        except ff.BadBlockFile as e:
            self.t._bad(dir_fd, f.name, e.reason, str(e))
            return None
        except OSError as e:
            self.t._bad(dir_fd, f.name, "read_failed", str(e))
            return None
        return st.st_mtime, key, st.st_size
