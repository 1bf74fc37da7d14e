"""The NVMe tier's folder, safe in an untrusted place: private folders (0700) made and opened
without following a symlink, the checks on the configured path, the probes of what its file
system can do (O_DIRECT, user xattrs), and a block file's header read without its payload.

Every path below the namespace folder is resolved one component at a time from a folder
descriptor with O_NOFOLLOW (``openat``), so a planted symlink (file or folder) is neither read,
written nor deleted through; a FIFO planted where a file was does not block an open.
"""

from __future__ import annotations

import errno
import os
import stat
import threading
from pathlib import Path
from typing import Callable

from kvstore import fileformat as ff
from kvstore.memory import alloc_aligned

O_DIRECT = getattr(os, "O_DIRECT", 0)
O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)  # a FIFO planted where a file was must not block open()
DIR_FLAGS = os.O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC
PROBE_PREFIX = ".odirect-probe."


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

    Raises OSError (e.g. ELOOP for a symlink) or :class:`~kvstore.fileformat.BadBlockFile`.
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


def open_subdir(parent_fd: int, name: str, create: bool) -> int:
    """A descriptor of the real folder ``name`` in ``parent_fd`` (never through a symlink)."""
    try:
        return os.open(name, DIR_FLAGS, dir_fd=parent_fd)
    except FileNotFoundError:
        if not create:
            raise
        try:
            os.mkdir(name, 0o700, dir_fd=parent_fd)
        except FileExistsError:
            return os.open(name, DIR_FLAGS, dir_fd=parent_fd)
        fd = os.open(name, DIR_FLAGS, dir_fd=parent_fd)
        os.chmod(fd, 0o700)  # whatever the umask
        return fd
