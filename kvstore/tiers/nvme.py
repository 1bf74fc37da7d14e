"""NVMe tier: one file per block, in fan-out folders, under a per-namespace folder.

    <path>/kvstore-<namespace[:16]>/<k0k1>/<k2k3>/<key hex>.kvb     (0600 files, 0700 folders)
    <path>/kvstore-<namespace[:16]>/tmp/<key hex>.<pid>.<n>.tmp      (writes in flight)

A write goes to a temporary name, then is renamed into place (atomic on POSIX), so a reader
sees a whole file or none. Every read verifies size, header and payload checksum; a file that
fails is a miss, is counted and removed. Durability against power loss is not promised (no
fsync), but a half-written file can never be served: its checksum fails. The index is rebuilt
at start-up from the headers only, oldest first (file mtime = the entry's last access, in the
tier's clock), within capacity. O_DIRECT is used where the file system takes it (buffers are
page aligned: DRAM slots directly, else a bounce buffer).

Symlinks are never followed inside the folder: every path below the namespace folder is
resolved one component at a time from a folder descriptor with O_NOFOLLOW (``openat``), so a
planted symlink (file or folder) is neither read, written nor deleted through.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import threading
import time
from itertools import count
from pathlib import Path
from typing import Callable


from kvstore import failpoints, fileformat as ff
from kvstore.codecs import Codec, CodecError
from kvstore.index import Entry
from kvstore.memory import alloc_aligned, as_bytes as _as_bytes, is_aligned
from kvstore.tiers.base import Tier

log = logging.getLogger(__name__)

_O_DIRECT = getattr(os, "O_DIRECT", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)  # a FIFO planted where a file was must not block open()
_DIR_FLAGS = os.O_RDONLY | _O_DIRECTORY | _O_NOFOLLOW | _O_CLOEXEC
PROBE_PREFIX = ".odirect-probe."


def probe_o_direct(folder: str | os.PathLike) -> bool:
    """Can this folder's file system do an aligned O_DIRECT write and read?"""
    if not _O_DIRECT:
        return False
    p = os.path.join(folder, f"{PROBE_PREFIX}{os.getpid()}.{threading.get_ident()}")
    m, buf = alloc_aligned(ff.ALIGN)
    try:
        fd = os.open(p, os.O_CREAT | os.O_EXCL | os.O_RDWR | _O_DIRECT | _O_NOFOLLOW, 0o600)
        try:
            os.pwritev(fd, [buf], 0)
            return os.preadv(fd, [buf], 0) == ff.ALIGN
        finally:
            os.close(fd)
    except OSError:
        return False
    finally:
        try:
            os.unlink(p)
        except OSError:
            pass
        del buf
        m.close()


def read_header(path: str | os.PathLike) -> ff.Header:
    """The header of one block file, read without following a symlink and without the payload.

    Raises OSError (e.g. ELOOP for a symlink) or :class:`~kvstore.fileformat.BadBlockFile`.
    """
    fd = os.open(path, os.O_RDONLY | _O_NOFOLLOW | _O_CLOEXEC | _O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ff.BadBlockFile("not_a_file")
        try:
            return ff.unpack_header(os.getxattr(fd, ff.XATTR))  # an "xattr" file
        except OSError:
            pass
        buf = bytearray(ff.HEADER_BYTES)
        n = os.preadv(fd, [buf], 0)
    finally:
        os.close(fd)
    if n != ff.HEADER_BYTES:
        raise ff.BadBlockFile("truncated", f"{n} header bytes")
    return ff.unpack_header(buf)


def probe_xattr(folder: str | os.PathLike) -> bool:
    """Does this folder's file system keep user extended attributes?"""
    if not hasattr(os, "setxattr"):
        return False
    p = os.path.join(folder, f"{PROBE_PREFIX}x.{os.getpid()}.{threading.get_ident()}")
    try:
        fd = os.open(p, os.O_CREAT | os.O_EXCL | os.O_RDWR | _O_NOFOLLOW, 0o600)
        try:
            os.setxattr(fd, ff.XATTR, b"\x01" * ff.HEADER_CORE)
            return os.getxattr(fd, ff.XATTR) == b"\x01" * ff.HEADER_CORE
        finally:
            os.close(fd)
    except OSError:
        return False
    finally:
        try:
            os.unlink(p)
        except OSError:
            pass


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _mkdir_private(p: Path) -> None:
    """mkdir with 0700, refusing symlinks and non-folders."""
    try:
        os.mkdir(p, 0o700)
    except FileExistsError:
        st = os.lstat(p)
        if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
            raise OSError(errno.ENOTDIR, f"refusing non-folder or symlink in the cache: {p}") from None


def check_folder(path: str | os.PathLike) -> Path:
    """Create the tier's folder (0700) if missing; refuse one that is unsafe or unusable.

    Refused with a :class:`~kvstore.config.ConfigError` naming ``tiers.nvme.path``: a path that
    cannot be created or written, that is not a folder, that another user owns, or that is
    world-writable (anyone could plant, swap or delete block files there).
    """
    from kvstore.config import ConfigError

    key = "tiers.nvme.path"
    base = Path(path)
    try:
        base.mkdir(parents=True, exist_ok=True, mode=0o700)
        st = os.stat(base)  # a configured symlink to a folder is the operator's choice
    except OSError as e:
        raise ConfigError(key, str(path), f"a folder this process can create and write ({e.strerror or e})") from None
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(key, str(path), "a folder (this path is not one)")
    me = os.geteuid()
    if st.st_uid != me:
        raise ConfigError(key, str(path), f"a folder owned by this user (uid {me}); it is owned by uid "
                          f"{st.st_uid}, who could plant, swap or delete block files")
    if st.st_mode & stat.S_IWOTH:
        raise ConfigError(key, str(path), f"a folder that is not world-writable (its mode is "
                          f"{stat.S_IMODE(st.st_mode):04o}: anyone could plant, swap or delete block files); "
                          f"use a private subfolder, e.g. {os.path.join(str(path), 'kvstore')}")
    if not os.access(base, os.W_OK | os.X_OK):
        raise ConfigError(key, str(path), "a writable folder (this one is not writable: permissions or a "
                          "read-only file system)")
    return base


def _open_subdir(parent_fd: int, name: str, create: bool) -> int:
    """A descriptor of the real folder ``name`` in ``parent_fd`` (never through a symlink)."""
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
    except FileNotFoundError:
        if not create:
            raise
        try:
            os.mkdir(name, 0o700, dir_fd=parent_fd)
        except FileExistsError:
            return os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
        os.chmod(fd, 0o700)  # whatever the umask
        return fd


class NvmeTier(Tier):
    name = "nvme"

    def __init__(self, *, path: str | os.PathLike, namespace: bytes, capacity_bytes: int, ttl_s: float | None,
                 policy: str, block_bytes: int, codec_id: int = 0, o_direct: bool | str = "auto",
                 header: str = "auto", clock: Callable[[], float] = time.time, scan: bool = True,
                 codec: Codec | None = None):
        super().__init__(capacity_bytes=capacity_bytes, ttl_s=ttl_s, policy=policy, block_bytes=block_bytes,
                         clock=clock, entry_bytes=ff.file_bytes(block_bytes))
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
        _mkdir_private(self.root)
        self._root_fd = os.open(self.root, _DIR_FLAGS)
        owner = os.fstat(self._root_fd).st_uid
        if owner != os.geteuid():
            self.close()
            raise OSError(errno.EPERM, f"refusing a cache folder owned by uid {owner}: {self.root}")
        os.chmod(self._root_fd, 0o700)
        self.tmp = self.root / "tmp"
        self._tmp_fd = _open_subdir(self._root_fd, "tmp", create=True)
        os.chmod(self._tmp_fd, 0o700)
        if o_direct == "auto":
            self.o_direct = probe_o_direct(self.root)
        elif o_direct:
            self.o_direct = probe_o_direct(self.root)
            if not self.o_direct:
                log.warning("kvstore nvme: o_direct requested but %s does not support it; using buffered I/O",
                            self.root)
        else:
            self.o_direct = False
        self.padded = ff.round_up(self.payload_max)
        self.file_bytes = self.file_bytes_for(self.payload_max)  # the largest file (exact if fixed_size)
        self.entry_bytes = self.file_bytes  # reserved per write; a smaller (zstd) file gives the rest back
        self._tls = threading.local()
        self._seq = count()
        self.stats.update({"scanned": 0, "dropped_at_scan": 0, "tmp_removed": 0, "missing": 0})
        self.corrupt_reasons: dict[str, int] = {}
        if scan:
            self.scan()

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
        return self.root / h[:2] / h[2:4] / (h + ff.SUFFIX)

    @staticmethod
    def _name(key: bytes) -> str:
        return key.hex() + ff.SUFFIX

    def _leaf_fd(self, key: bytes, create: bool) -> int:
        """Descriptor of the fan-out folder of ``key``; FileNotFoundError if missing and not create."""
        if self._root_fd < 0:
            raise OSError(errno.EBADF, "nvme tier is closed")
        h = key.hex()
        d1 = _open_subdir(self._root_fd, h[:2], create)
        try:
            return _open_subdir(d1, h[2:4], create)
        finally:
            os.close(d1)

    # -- per-thread aligned buffers --------------------------------------------------------------
    def _bufs(self):
        b = getattr(self._tls, "bufs", None)
        if b is None:
            hm, hdr = alloc_aligned(ff.HEADER_BYTES, prefault=True)
            bm, bounce = alloc_aligned(self.padded, prefault=True)
            b = self._tls.bufs = (hm, hdr, bm, bounce)
        return b[1], b[3]

    def _flags(self) -> int:
        return _O_NOFOLLOW | _O_CLOEXEC | (_O_DIRECT if self.o_direct else 0)

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
        if self.header == "inline":
            ff.pack_header(header, hdr)
        name = self._name(entry.key)
        tmp = f"{entry.key.hex()}.{os.getpid()}.{next(self._seq)}.tmp"
        leaf = -1
        try:
            failpoints.fire("nvme.write", key=entry.key, path=name)
            leaf = self._leaf_fd(entry.key, create=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | self._flags(), 0o600, dir_fd=self._tmp_fd)
            try:
                if self.header == "xattr":
                    _pwrite_all(fd, [payload], fbytes)
                    os.setxattr(fd, ff.XATTR, ff.header_bytes(header))
                else:
                    _pwrite_all(fd, [hdr, payload], fbytes)
                t = entry.last_access
                os.utime(fd, (t, t))
            finally:
                os.close(fd)
            os.rename(tmp, name, src_dir_fd=self._tmp_fd, dst_dir_fd=leaf)
            if fbytes != entry.nbytes:
                self._resize(entry, fbytes)
            return True
        except OSError as e:
            self.count("write_failed")
            try:
                os.unlink(tmp, dir_fd=self._tmp_fd)
            except OSError:
                pass
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                self._shrink_after_full_disk(entry)
            else:
                log.warning("kvstore nvme write failed for %s: %s", name, e)
            return False
        finally:
            if leaf >= 0:
                os.close(leaf)

    def _shrink_after_full_disk(self, failed: Entry) -> None:
        """A full disk degrades to a smaller cache: cap capacity at what is held now (without the
        entry that failed, which its caller aborts; other writes in flight stay counted)."""
        with self.lock:
            mine = failed.nbytes if self.index.entries.get(failed.key) is failed else 0
            new_cap = max(0, self.index.used - mine)
            if new_cap < self.index.capacity:
                log.warning("kvstore nvme: disk full; capacity lowered from %d to %d bytes", self.index.capacity, new_cap)
                self.index.capacity = new_cap
        self.count("disk_full")

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
        except OSError as e:  # a planted symlink or non-folder
            self._bad_count("open_failed", f"{name}: {e}")
            return False
        try:
            try:
                fd = os.open(name, os.O_RDONLY | self._flags() | _O_NONBLOCK, dir_fd=leaf)
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
                if st.st_size > self.file_bytes or (self.fixed_size and st.st_size != self.file_bytes):
                    raise ff.BadBlockFile("truncated" if st.st_size < self.file_bytes else "bad_size",
                                          f"{st.st_size} bytes")
                h = self._header_of(fd)
                n = _pread_all(fd, [dst] if self.header == "xattr" else [hdr, dst], st.st_size)
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
                    except CodecError as e:
                        raise ff.BadBlockFile("bad_payload", str(e)) from None
                try:
                    t = entry.last_access  # the hit's time (acquire touched it): recency survives a restart
                    os.utime(fd, (t, t))
                except OSError:
                    pass
            except ff.BadBlockFile as e:
                self._bad(leaf, name, e.reason, str(e))
                return False
            except OSError as e:
                self._bad(leaf, name, "read_failed", str(e))
                return False
            finally:
                os.close(fd)
        finally:
            os.close(leaf)
        if not direct and self.codec is None:
            out[: self.block_bytes] = bounce[: self.block_bytes]
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
        """Count a bad file and remove it (the name itself: a symlink is unlinked, never followed)."""
        self._bad_count(reason, f"{name}: {detail}")
        try:
            os.unlink(name, dir_fd=dir_fd)
        except OSError:
            pass

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
                os.unlink(self._name(entry.key), dir_fd=leaf)
            except FileNotFoundError:
                pass
            except OSError as e:
                log.warning("kvstore nvme: could not remove %s: %s", entry.key.hex(), e)
            finally:
                os.close(leaf)

    def close(self) -> None:
        for attr in ("_tmp_fd", "_root_fd"):
            fd = getattr(self, attr, -1)
            if fd >= 0:
                setattr(self, attr, -1)
                try:
                    os.close(fd)
                except OSError:
                    pass

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    # -- start-up ------------------------------------------------------------------------------
    def scan(self) -> None:
        """Rebuild the index from file headers (payloads are not read), oldest first."""
        me = os.getpid()
        for f in os.scandir(self._tmp_fd):
            parts = f.name.split(".")
            try:
                pid = int(parts[1])
            except (IndexError, ValueError):
                pid = -1
            if pid == me or pid < 0 or not _pid_alive(pid):
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
                if pid < 0 or not _pid_alive(pid):
                    try:
                        os.unlink(d1.name, dir_fd=self._root_fd)
                    except OSError:
                        pass
                continue
            if d1.name == "tmp" or not d1.is_dir(follow_symlinks=False):
                continue
            try:
                fd1 = os.open(d1.name, _DIR_FLAGS, dir_fd=self._root_fd)
            except OSError:
                continue
            try:
                for d2 in os.scandir(fd1):
                    if not d2.is_dir(follow_symlinks=False):
                        continue
                    try:
                        fd2 = os.open(d2.name, _DIR_FLAGS, dir_fd=fd1)
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
            fd = os.open(f.name, os.O_RDONLY | _O_NOFOLLOW | _O_CLOEXEC | _O_NONBLOCK, dir_fd=dir_fd)
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


def _pread_all(fd: int, bufs: list, total: int) -> int:
    return os.preadv(fd, bufs, 0)
