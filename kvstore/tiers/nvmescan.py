"""The NVMe tier's start-up scan: rebuild the index from the block files' headers (payloads are
not read), oldest first (file mtime = the entry's last access), within capacity and TTL.

Files a killed writer left in ``tmp/`` and probe files are removed; every file is checked
(name, place, type, size, header, namespace, key, codec) and a bad one is counted by reason and
removed, except a symlink or a non-file, which is counted and left alone (never followed).
"""

from __future__ import annotations

import os
import stat

from kvstore import fileformat as ff
from kvstore.index import Entry
from kvstore.tiers.folder import DIR_FLAGS, O_CLOEXEC, O_NOFOLLOW, O_NONBLOCK, PROBE_PREFIX, pid_alive


class NvmeScan:
    """Mixed into :class:`kvstore.tiers.nvme.NvmeTier` (its folder descriptors, index and checks)."""

    def scan(self) -> None:
        """Rebuild the index from file headers (payloads are not read), oldest first."""
        me = os.getpid()
        for f in os.scandir(self._tmp_fd):
            parts = f.name.split(".")
            try:
                pid = int(parts[1])
            except (IndexError, ValueError):
                pid = -1
            if pid == me or pid < 0 or not pid_alive(pid):
                try:
                    os.unlink(f.name, dir_fd=self._tmp_fd)
                    self.stats["tmp_removed"] += 1
                except OSError:
                    pass
        found: list[tuple[float, bytes, int]] = []
        hbuf = bytearray(ff.HEADER_BYTES)
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
            if d1.name == "tmp" or not d1.is_dir(follow_symlinks=False):
                continue
            try:
                fd1 = os.open(d1.name, DIR_FLAGS, dir_fd=self._root_fd)
            except OSError:
                continue
            try:
                for d2 in os.scandir(fd1):
                    if not d2.is_dir(follow_symlinks=False):
                        continue
                    try:
                        fd2 = os.open(d2.name, DIR_FLAGS, dir_fd=fd1)
                    except OSError:
                        continue
                    try:
                        for f in os.scandir(fd2):
                            item = self._scan_one(fd2, d1.name, d2.name, f, hbuf)
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

    def _scan_one(self, dir_fd: int, d1: str, d2: str, f: os.DirEntry,
                  hbuf: bytearray) -> tuple[float, bytes, int] | None:
        if f.is_symlink():
            self._bad_count("symlink", f"{d1}/{d2}/{f.name}: a symlink (not followed)")
            return None  # never followed, never deleted through
        if not f.is_file(follow_symlinks=False):
            self._bad_count("not_a_file", f"{d1}/{d2}/{f.name}: not a regular file (left alone)")
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
