"""Where the store's RPC socket lives, and who is on its other end (issue 29).

The socket lives in ``$XDG_RUNTIME_DIR/kvstore-<uid>`` (when that variable names a folder of this
uid, mode 0700, as the XDG spec requires), else in ``<temp dir>/kvstore-<uid>``. The folder is
created 0700; one that is already there is used only if this uid owns it, its mode gives nothing
to group or others, and it is not a symbolic link. Anything else is refused with
:class:`SocketTrustError` naming the folder: another local user who made it first could replace
the socket and answer the scheduler as the store.

Race-free as far as Linux allows: the folder is opened ``O_DIRECTORY|O_NOFOLLOW`` and checked on
that file descriptor (``fstat``), and the socket is bound or reached through
``/proc/self/fd/<fd>/<name>``, so a folder renamed or replaced after the check is never used. In
the sticky temp dir nobody else can rename ours anyway. Both ends then check the peer's uid
(``SO_PEERCRED``): a folder opened by mistake still lets no other user in or pose as the store.
"""

from __future__ import annotations

import errno
import os
import pwd
import socket
import stat
import struct
import tempfile

_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
_PROC_FD = os.path.isdir("/proc/self/fd")


class SocketTrustError(RuntimeError):
    """The socket's folder or its peer is not this user's: refused, never used."""


def who(uid: int) -> str:
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def _private(st: os.stat_result) -> bool:
    return st.st_uid == os.getuid() and not st.st_mode & 0o077


def base_dir() -> str:
    """``$XDG_RUNTIME_DIR`` when it names a folder of this uid with mode 0700, else the temp dir."""
    x = os.environ.get("XDG_RUNTIME_DIR", "")
    if x and os.path.isabs(x):
        try:
            st = os.stat(x)
        except OSError:
            st = None
        if st is not None and stat.S_ISDIR(st.st_mode) and _private(st) and os.access(x, os.W_OK | os.X_OK):
            return x
    return tempfile.gettempdir()


def folder_path() -> str:
    return os.path.join(base_dir(), f"kvstore-{os.getuid()}")


def _refuse(path: str, why: str, fix: str) -> SocketTrustError:
    return SocketTrustError(f"kvstore: refusing the RPC socket folder {path}: {why}. {fix} "
                            f"(or set XDG_RUNTIME_DIR to a folder of yours with mode 0700)")


def open_folder() -> tuple[int, str]:
    """The socket folder, created 0700 if missing, checked: (an O_DIRECTORY fd the caller closes,
    its path). Raises SocketTrustError for a folder of another user, a looser mode, a symlink
    or a non-folder; OSError if the base folder itself cannot be written."""
    path = folder_path()
    created = False
    try:
        os.mkdir(path, 0o700)
        created = True
    except FileExistsError:
        pass
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:  # a symlink gives ENOTDIR (O_DIRECTORY) or ELOOP (O_NOFOLLOW)
        if e.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        what = "a symbolic link" if os.path.islink(path) else "not a folder"
        raise _refuse(path, f"it is {what}", "Remove it; the store creates the folder itself") from None
    try:
        st = os.fstat(fd)
        if st.st_uid != os.getuid():
            raise _refuse(path, f"it is owned by {who(st.st_uid)}, not by this user, {who(os.getuid())}; another "
                          "local user may have made it to take over the store's socket",
                          "Remove it (it holds nothing worth keeping)")
        if created and st.st_mode & 0o777 != 0o700:  # ours, just made: the umask narrowed it
            os.fchmod(fd, 0o700)
        elif st.st_mode & 0o077:  # ours, but open to others for who knows how long: not ours to trust
            raise _refuse(path, f"its mode is {st.st_mode & 0o777:04o}; the socket needs a folder only this user "
                          "can enter (0700)", f"Run `chmod 700 {path}` or remove it")
    except BaseException:
        os.close(fd)
        raise
    return fd, path


def path_in(fd: int, folder: str, name: str) -> str:
    """A path to ``name`` in the folder opened as ``fd``: through /proc (the checked folder
    itself, whatever its path names now; short, under AF_UNIX's 108 bytes), else its path."""
    return f"/proc/self/fd/{fd}/{name}" if _PROC_FD else os.path.join(folder, name)


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of a connected Unix socket (as of its connect)."""
    _pid, uid, _gid = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
    return uid
