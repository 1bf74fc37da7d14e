"""Failpoints: named places in the data path where a test makes a real failure happen.

Some failures cannot be produced from outside a running engine at the right moment: a block
file deleted by another process *between* the scheduler's lookup and the worker's read, a read
error, a DRAM slot lost before the load, a copy kernel that fails, the store's socket closing
mid-call. The code calls :func:`fire` at those places; when a failpoint is armed, its action
runs there (deleting real files, raising the error the medium would raise, closing the real
socket), and the code's own failure handling takes it from there. Nothing is simulated after
the failure: the rest of the path is the production path.

Arming: ``arm("name=action*count;...")`` in this process, or the environment variable
``KVSTORE_FAILPOINTS`` with the same text, or ``KVSTORE_FAILPOINTS=@/path/file`` naming a file
that holds it (re-read when it changes, so a test can arm a failpoint inside a running vLLM
engine process). ``*count`` fires that many times, then the failpoint disarms itself (default:
every time). Unarmed, :func:`fire` costs one attribute test. Never arm one in production.

Places (the context each passes) and the actions that make sense there:

* ``store.pin`` (store, keys): ``drop_blocks``: the blocks leave every tier between the lookup
  and the pin (a DRAM slot lost, its demotion failed); ``close_store``: the store shuts down
  under the engine.
* ``store.read`` (store, keys): ``unlink``: the files vanish (another process deleted them);
  ``rewrite``: each file is replaced by another key's valid file (another process rewrote it).
* ``nvme.read`` (path): ``eio``: the read fails with EIO (an unreadable file); ``slow``: it
  takes :data:`SLOW_S` longer (a throttled, or slower than advertised, disk).
* ``mover.scatter``: ``raise``: the copy into the engine's blocks fails; ``hold``: it waits until
  :func:`open_gate` (or :func:`clear`; at most 60 s): a load still in flight.
* ``mover.gather``: ``raise``: an (async) gather fails, nothing is stored; ``hold``: a save still
  in flight.
* ``nvme.write`` (key, path): ``eio``: the write fails with EIO; ``enospc``: the disk is full;
  ``hold``: the write waits until :func:`open_gate` (or :func:`clear`; at most 60 s), e.g. a
  demotion still in flight.
* ``demote.write`` (key): ``hold``: a demotion (DRAM victim -> NVMe) waits before its write,
  its block still in its DRAM slot; with ``nvme.write=enospc`` after it, a demotion that fails.
* ``memory.pin``: ``raise``: registering a DRAM chunk with CUDA fails (start-up must fail).
* ``rpc.serve`` (sock): ``close``: the worker closes the store socket mid-call.
* ``sharedfs.io``: ``hold``: every call of the shared file-system tier waits (a stalled mount).
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import threading
import time

log = logging.getLogger(__name__)

ENV = "KVSTORE_FAILPOINTS"


class FailpointError(RuntimeError):
    """Raised by the ``raise`` action."""


class _State:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.armed: dict[str, list] = {}  # name -> [action, remaining (None = always)]
        self.source: str | None = os.environ.get(ENV) or None
        self.file_sig: tuple | None = None
        self.fired: dict[str, int] = {}
        if self.source and not self.source.startswith("@"):
            self.armed = parse(self.source)


def parse(spec: str) -> dict[str, list]:
    out: dict[str, list] = {}
    for part in spec.replace("\n", ";").split(";"):
        part = part.strip()
        if not part or part.startswith("#"):
            continue
        name, _, act = part.partition("=")
        act, _, n = act.partition("*")
        if not name or act not in ACTIONS:
            raise ValueError(f"{ENV}: bad failpoint {part!r}; actions: {', '.join(sorted(ACTIONS))}")
        out[name.strip()] = [act.strip(), int(n) if n else None]
    return out


def arm(spec: str) -> None:
    """Arm failpoints in this process (replaces what was armed)."""
    global active
    with _s.lock:
        _s.armed = parse(spec)
        _s.source = _s.source if (_s.source or "").startswith("@") else None
        active = True


def clear() -> None:
    global active
    with _s.lock:
        _s.armed.clear()
        active = bool(_s.source)
    _gate.set()


def close_gate() -> None:
    """``hold`` actions wait from now on (until :func:`open_gate`)."""
    _gate.clear()


def open_gate() -> None:
    """Let every waiting (and later) ``hold`` action go on."""
    _gate.set()


def fired(name: str) -> int:
    """How many times ``name`` fired in this process."""
    return _s.fired.get(name, 0)


def _reload_file() -> None:
    path = _s.source[1:]  # type: ignore[index]
    try:
        st = os.stat(path)
        sig = (st.st_mtime_ns, st.st_size, st.st_ino)
    except OSError:
        sig = None
    if sig == _s.file_sig:
        return
    _s.file_sig = sig
    try:
        with open(path) as f:
            _s.armed = parse(f.read()) if sig else {}
    except (OSError, ValueError) as e:
        log.warning("kvstore failpoints: %s: %s", path, e)
        _s.armed = {}


def fire(name: str, **ctx) -> None:
    """Run the action armed at ``name``, if any (it may raise, as the failure it stands for)."""
    if not active:
        return
    with _s.lock:
        if _s.source and _s.source.startswith("@"):
            _reload_file()
        slot = _s.armed.get(name)
        if slot is None:
            return
        act, left = slot
        if left is not None:
            if left <= 0:
                return
            slot[1] = left - 1
        _s.fired[name] = _s.fired.get(name, 0) + 1
    log.warning("kvstore failpoint %s: %s", name, act)
    ACTIONS[act](**ctx)


# -- actions ---------------------------------------------------------------------------------------
def _raise(**ctx) -> None:
    raise FailpointError("failpoint")


def _eio(**ctx) -> None:
    raise OSError(errno.EIO, "Input/output error (failpoint)")


def _enospc(**ctx) -> None:
    raise OSError(errno.ENOSPC, "No space left on device (failpoint)")


_gate = threading.Event()
_gate.set()
HOLD_MAX_S = 60.0


_holding: set[int] = set()  # the threads a ``hold`` is keeping now


def holding() -> set[int]:
    """The idents of the threads a ``hold`` action keeps waiting now (a test waits for its own
    thread to be there: another test's leftover thread may have fired the same failpoint)."""
    with _s.lock:
        return set(_holding)


def _hold(**ctx) -> None:
    me = threading.get_ident()
    with _s.lock:
        _holding.add(me)
    try:
        if not _gate.wait(HOLD_MAX_S):
            log.warning("kvstore failpoint hold: gate not opened in %.0f s; going on", HOLD_MAX_S)
    finally:
        with _s.lock:
            _holding.discard(me)


SLOW_S = 0.02  # what the ``slow`` action adds to a call (a test may set it)


def _slow(**ctx) -> None:
    time.sleep(SLOW_S)


def _drop_blocks(store, keys, **ctx) -> None:
    for t in store.tiers:
        t.remove(keys)


def _close_store(store, **ctx) -> None:
    # the call that fired this is in flight on the store (its own thread's, which the close
    # passes); wait for nothing else: a worker's open handle would hold it for the whole 30 s
    store.close(persist=False, wait_s=0)


def _files(store, keys):
    nv = store.nvme
    if nv is None:
        return []
    return [p for p in (nv.path_of(k) for k in keys) if os.path.exists(p)]


def _unlink(store, keys, **ctx) -> None:
    for p in _files(store, keys):
        os.unlink(p)


def _rewrite(store, keys, **ctx) -> None:
    """Each file is replaced (by rename, as a writer would) with a copy of another key's file."""
    files = _files(store, keys)
    if len(files) < 2:
        _unlink(store, keys)
        return
    for i, p in enumerate(files):
        other = files[(i + 1) % len(files)]
        tmp = f"{p}.fp-tmp"
        shutil.copyfile(other, tmp)
        try:
            for a in os.listxattr(other):
                os.setxattr(tmp, a, os.getxattr(other, a))
        except OSError:
            pass
        os.chmod(tmp, 0o600)
    for p in files:
        os.replace(f"{p}.fp-tmp", p)


def _close(sock=None, **ctx) -> None:
    if sock is not None:
        try:
            sock.shutdown(2)
        except OSError:
            pass
        sock.close()
    raise ConnectionError("failpoint: store socket closed")


ACTIONS = {"raise": _raise, "eio": _eio, "enospc": _enospc, "hold": _hold, "slow": _slow, "drop_blocks": _drop_blocks,
           "close_store": _close_store, "unlink": _unlink, "rewrite": _rewrite, "close": _close}


_s = _State()
active = bool(_s.source)  # the fast path: fire() returns at once while nothing can be armed
