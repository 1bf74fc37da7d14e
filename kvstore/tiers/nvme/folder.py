"""The NVMe tier's folder, safe in an untrusted place: private folders (0700, this user's) made
and opened without following a symlink, the checks on the configured path and its parents, the
removal of what does not belong (:func:`discard`), the probes of what its file system can do
(O_DIRECT, user xattrs, writable now, free space), and a block file's header read without its
payload.

Every path below the namespace folder is resolved one component at a time from a folder
descriptor with O_NOFOLLOW (``openat``), so a planted symlink (file or folder) is neither read,
written nor deleted through; a FIFO planted where a file was does not block an open.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
import stat
import tempfile
import threading
import time
from itertools import count
from pathlib import Path
from typing import Callable

from kvstore.tiers import fileformat as ff
from kvstore.tiers.memory import alloc_aligned

O_DIRECT = getattr(os, "O_DIRECT", 0)
O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)  # a FIFO planted where a file was must not block open()
DIR_FLAGS = os.O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC
PROBE_PREFIX = ".odirect-probe."
DISCARD_PREFIX = ".discard."  # a folder found where a block file or fan-out folder belongs, moved aside
_discards = count()
log = logging.getLogger(__name__)


def _probe(folder: str | os.PathLike, tag: str, flags: int, check: Callable[[int], bool]) -> bool:
    """Create a private probe file in ``folder`` with ``flags``, run ``check(fd)``, remove it;
    False on any OSError. Its name carries the pid, so a scan removes one a killed process left."""
    p = os.path.join(folder, f"{PROBE_PREFIX}{tag}{os.getpid()}.{threading.get_ident()}")
    try:
        fd = os.open(p, os.O_CREAT | os.O_EXCL | os.O_RDWR | O_NOFOLLOW | flags, 0o600)
        try:
            return check(fd)
        finally:
            os.close(fd)
    except OSError:
        return False
    finally:
        try:
            os.unlink(p)
        except OSError:
            pass


def probe_o_direct(folder: str | os.PathLike) -> bool:
    """Can this folder's file system do an aligned O_DIRECT write and read?"""
    if not O_DIRECT:
        return False
    m, buf = alloc_aligned(ff.ALIGN)

    def check(fd: int) -> bool:
        os.pwritev(fd, [buf], 0)
        return os.preadv(fd, [buf], 0) == ff.ALIGN

    try:
        return _probe(folder, "", O_DIRECT, check)
    finally:
        del check, buf
        m.close()


def probe_xattr(folder: str | os.PathLike) -> bool:
    """Does this folder's file system keep user extended attributes?"""
    if not hasattr(os, "setxattr"):
        return False
    mark = b"\x01" * ff.HEADER_CORE

    def check(fd: int) -> bool:
        os.setxattr(fd, ff.XATTR, mark)
        return os.getxattr(fd, ff.XATTR) == mark

    return _probe(folder, "x.", 0, check)


def read_header(path: str | os.PathLike) -> ff.Header:
    """The header of one block file, read without following a symlink and without the payload.

    Raises OSError (e.g. ELOOP for a symlink) or :class:`~kvstore.tiers.fileformat.BadBlockFile`.
    """
    fd = os.open(path, os.O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK)
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


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def mkdir_private(p: Path) -> None:
    """mkdir with 0700, refusing symlinks and non-folders."""
    try:
        os.mkdir(p, 0o700)
    except FileExistsError:
        st = os.lstat(p)
        if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
            raise OSError(errno.ENOTDIR, f"refusing non-folder or symlink in the cache: {p}") from None


def _make_folders(base: Path) -> None:
    """Create ``base`` and its missing parents, each 0700 whatever the umask (an existing one is
    left as it is: it is the operator's)."""
    missing = []
    p = Path(os.path.abspath(base))
    while not os.path.lexists(p) and p != p.parent:
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            continue
        fd = os.open(d, DIR_FLAGS)
        try:
            os.chmod(fd, 0o700)
        finally:
            os.close(fd)


def _swappable_parents(base: Path) -> tuple[list[str], list[str]]:
    """The parents of ``base`` (as written and as resolved) that let others swap it for another
    folder: (world-writable without the sticky bit, writable by a group without it or owned by
    another user than this one or root)."""
    me, loose, shared = os.geteuid(), [], []
    seen = set()
    for p in (Path(os.path.abspath(base)), Path(os.path.realpath(base))):
        for d in p.parents:
            if d in seen:
                continue
            seen.add(d)
            try:
                st = os.lstat(d)
            except OSError:
                continue
            if not stat.S_ISDIR(st.st_mode) or st.st_mode & stat.S_ISVTX:
                continue  # a symlink (its target is in the resolved chain), or sticky like /tmp
            if st.st_mode & stat.S_IWOTH:
                loose.append(f"{d} (mode {stat.S_IMODE(st.st_mode):04o})")
            elif st.st_mode & stat.S_IWGRP or st.st_uid not in (me, 0):
                shared.append(f"{d} (mode {stat.S_IMODE(st.st_mode):04o}, uid {st.st_uid})")
    return loose, shared


def swappable_error(path: str | os.PathLike, loose: list[str] | None = None, key: str = "tiers.nvme.path"):
    """The error for a folder with a world-writable parent without the sticky bit (anyone could
    swap the cache folder for another), or None; looks, creates nothing (``kvstore config`` asks
    it of a folder that does not exist yet, :func:`check_folder` of every one)."""
    from kvstore.config import ConfigError

    loose = _swappable_parents(Path(path))[0] if loose is None else loose
    if not loose:
        return None
    return ConfigError(key, str(path), "a folder whose parents others cannot write", why=(
        f"{', '.join(loose)} is world-writable without the sticky bit, so anyone could swap the cache "
        f"folder for another; chmod o-w (or +t) that parent, or use another path"))


def check_folder(path: str | os.PathLike, key: str = "tiers.nvme.path") -> Path:
    """Create the tier's folder (0700, and 0700 parents) if missing; refuse one that is unsafe or
    unusable.

    Refused with a :class:`~kvstore.config.ConfigError` naming ``key`` (the medium's path key): a path that
    cannot be created or written, that is not a folder, that another user owns, that others can
    write (group- or world-writable: they could plant, swap or delete block files), or that sits
    in a world-writable parent without the sticky bit (anyone could swap the folder itself). Only
    the folder the store owns must be private: a 0755 parent such as /var/cache is fine; a parent
    that a group can write, or another user owns, is logged (they could swap the folder, though
    not for one of this user's: the owner check refuses theirs).
    """
    from kvstore.config import ConfigError

    if "\x00" in str(path):
        raise ConfigError(key, str(path), "a folder path without NUL bytes")
    base = Path(path)
    loose, shared = _swappable_parents(base)
    if loose:
        raise swappable_error(path, loose, key)
    try:
        _make_folders(base)
        st = os.stat(base)  # a configured symlink to a folder is the operator's choice
    except OSError as e:
        raise ConfigError(key, str(path), f"a folder this process can create and write ({e.strerror or e})") from None
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(key, str(path), "a folder (this path is not one)")
    me = os.geteuid()
    if st.st_uid != me:
        raise ConfigError(key, str(path), f"a folder owned by this user (uid {me}); it is owned by uid "
                          f"{st.st_uid}, who could plant, swap or delete block files")
    if st.st_mode & (stat.S_IWOTH | stat.S_IWGRP):
        who = "world-writable: anyone" if st.st_mode & stat.S_IWOTH else "group-writable: its group"
        sub = f"a private subfolder, e.g. {os.path.join(str(path), 'kvstore')}"  # (in a sticky or group one: fine)
        fix = (f"use {sub} (a shared folder like /tmp stays shared)" if st.st_mode & stat.S_ISVTX else
               f"run chmod 700 {path}, or use another path" + ("" if st.st_mode & stat.S_IWOTH else f" or {sub}"))
        raise ConfigError(key, str(path), f"a folder only its owner can write (its mode is "
                          f"{stat.S_IMODE(st.st_mode):04o}, {who} could plant, swap or delete block files); {fix}")
    if not os.access(base, os.W_OK | os.X_OK):
        raise ConfigError(key, str(path), "a writable folder (this one is not writable: permissions or a "
                          "read-only file system)")
    if shared:
        log.warning("kvstore nvme: %s can be swapped by others through %s (group-writable or another user's); "
                    "its content stays private (0700, owner checked)", base, ", ".join(shared))
    return base


def folder_errors(key: str, path: str | None) -> list:
    """What :func:`check_folder` would refuse of ``path`` (``key``: its config key), creating
    nothing: an existing folder checked as it is; a missing one, its parents (none others can
    write) and its nearest existing parent (a folder this process can create in). For
    ``kvstore config`` and the vLLM plugin, before any model loads."""
    from kvstore.config import ConfigError

    if path is None:
        return []
    allowed = "a folder this process can create and write"
    p = Path(path)
    try:
        if p.exists():
            check_folder(p, key)  # exists: it creates nothing
            return []
        e = swappable_error(p, key=key)  # what check_folder refuses before it creates the folder
        if e is not None:
            return [e]
        parent = next(a for a in p.parents if a.exists())
    except ConfigError as e:
        return [e]
    except OSError as e:
        return [ConfigError(key, path, allowed, str(e))]
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        return [ConfigError(key, path, allowed, f"{parent} is not a folder this process can write in")]
    return []


class NotOurs(OSError):
    """A folder of the cache owned by another user (never used: its files could be theirs)."""


def open_subdir(parent_fd: int, name: str, create: bool, fixed: list | None = None) -> int:
    """A descriptor of the real folder ``name`` in ``parent_fd`` (never through a symlink), owned
    by this user (else :class:`NotOurs`), mode 0700 (set if it was not; ``name`` then goes into
    ``fixed``)."""
    try:
        fd = os.open(name, DIR_FLAGS, dir_fd=parent_fd)
    except FileNotFoundError:
        if not create:
            raise
        try:
            os.mkdir(name, 0o700, dir_fd=parent_fd)
        except FileExistsError:
            pass
        fd = os.open(name, DIR_FLAGS, dir_fd=parent_fd)
    st = os.fstat(fd)  # the fstat and checks: about 2 us over the open (5 to 7 us), measured on tmpfs
    if st.st_uid == os.geteuid() and st.st_mode & 0o7777 == 0o700:
        return fd
    try:
        if st.st_uid != os.geteuid():
            raise NotOurs(errno.EPERM, f"a cache folder owned by uid {st.st_uid}", name)
        os.chmod(fd, 0o700)  # whatever the umask, or a mode loosened behind the store
        if fixed is not None:
            fixed.append(name)
    except BaseException:
        os.close(fd)
        raise
    return fd


def discard(dir_fd: int, name: str, whole: bool) -> bool:
    """Free the name ``name`` in the folder ``dir_fd`` without following anything: a non-folder
    is unlinked; a folder is removed if empty, else removed whole (``whole``: shutil.rmtree with
    ``dir_fd``, which never follows a symlink) or moved aside to a ``.discard.`` name in the same
    folder (one rename, for a writer; the next start-up scan removes it). True if the name is free."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if not stat.S_ISDIR(st.st_mode):
            os.unlink(name, dir_fd=dir_fd)
            return True
        try:
            os.rmdir(name, dir_fd=dir_fd)
            return True
        except OSError:
            pass
        if whole:
            shutil.rmtree(name, dir_fd=dir_fd, ignore_errors=True)
            if not _exists(dir_fd, name):
                return True
        if name.startswith(DISCARD_PREFIX):
            return False  # aside already (another user's, say): left for whoever can remove it
        os.rename(name, f"{DISCARD_PREFIX}{name}.{os.getpid()}.{next(_discards)}", src_dir_fd=dir_fd,
                  dst_dir_fd=dir_fd)
        return True
    except FileNotFoundError:
        return True
    except OSError:
        return False


def _exists(dir_fd: int, name: str) -> bool:
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        return True
    except FileNotFoundError:
        return False


def probe_writable(dir_fd: int) -> bool:
    """Can a file be created in ``dir_fd`` now (e.g. a read-only file system remounted rw)?"""
    name = f"probe.{os.getpid()}.w{next(_discards)}.tmp"  # a temporary name: a scan removes a leftover
    try:
        os.close(os.open(name, os.O_CREAT | os.O_EXCL | os.O_WRONLY | O_NOFOLLOW | O_CLOEXEC, 0o600,
                         dir_fd=dir_fd))
        os.unlink(name, dir_fd=dir_fd)
        return True
    except OSError:
        return False


TEMP_PREFIX = "kvstore-tmp-"  # a tier with no path: its folder in the system's temp folder
LOCK_NAME = ".owner.lock"  # flocked by the live store that owns a temp folder
YOUNG_S = 30.0  # a lock file younger than this is left alone (created, then locked a moment later)


def make_temp_folder() -> tuple[str, int]:
    """A private (0700) folder for an NVMe tier with no configured path, and the descriptor of the
    lock its owner holds until it closes (or dies: the kernel drops a dead process's flock). First,
    removes the temp folders that crashed owners left behind (:func:`sweep_temp_folders`): up to a
    tier's capacity each, one per unclean exit."""
    sweep_temp_folders()
    path = tempfile.mkdtemp(prefix=TEMP_PREFIX)
    try:
        fd = os.open(os.path.join(path, LOCK_NAME), os.O_RDWR | os.O_CREAT | os.O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BaseException:
        shutil.rmtree(path, ignore_errors=True)
        raise
    return path, fd


def sweep_temp_folders(where: str | None = None) -> int:
    """Remove ``kvstore-tmp-*`` folders in the temp folder whose owner is gone: this user's own
    0700 folders (not a symlink) whose lock file this process can flock (nobody holds it). A live
    store holds its lock, in this process or another (another PID namespace too); another user's
    folder is never touched. Returns how many were removed."""
    where = where or tempfile.gettempdir()
    try:
        names = [n for n in os.listdir(where) if n.startswith(TEMP_PREFIX)]
    except OSError:
        return 0
    removed = 0
    for name in names:
        path = os.path.join(where, name)
        try:
            st = os.lstat(path)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) != 0o700:
                continue
            fd = os.open(os.path.join(path, LOCK_NAME), os.O_RDWR | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK)
        except OSError:
            continue  # gone, not ours, or no lock file yet (being made: mkdtemp, then the lock)
        try:
            young = time.time() - os.fstat(fd).st_ctime < YOUNG_S
        except OSError:
            young = True
        if young:  # its lock file was just made: its owner may not have locked it yet
            os.close(fd)
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue  # its owner is alive
        try:
            shutil.rmtree(path, ignore_errors=True)  # fd-based on Linux: no symlink inside is followed
            removed += 1
        finally:
            os.close(fd)
    if removed:
        log.warning("kvstore: removed %d temporary NVMe folder(s) of stores that ended without closing, in %s",
                    removed, where)
    return removed


def free_bytes(fd: int) -> int:
    """Bytes this user may still write on the file system of ``fd`` (0 if it cannot be told)."""
    try:
        v = os.fstatvfs(fd)
    except OSError:
        return 0
    return 0 if v.f_flag & os.ST_RDONLY else v.f_bavail * v.f_frsize
