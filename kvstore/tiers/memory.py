"""Host memory for blocks: page-aligned mappings (O_DIRECT reads and writes them in place),
memfds a node daemon hands to its engines, pre-faulting without the GIL, and CUDA registration.

Any medium and the store use these (NVMe's bounce buffers, the store's scratch, the DRAM slab
pool, a node engine's map of its daemon's slab): they belong to no medium.

Memory comes from anonymous ``mmap`` (page aligned), is asked for huge pages and pre-faulted once
(a first touch runs at page-fault speed, ~0.45 GB/s here, versus ~2 GB/s populated up front).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys

import numpy as np

from kvstore import failpoints

PAGE = mmap.PAGESIZE
_LOW_BIT = bytes(i & 1 for i in range(256))  # a byte -> its bit 0 (bytes.translate)
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux >= 5.14
MADV_REMOVE = getattr(mmap, "MADV_REMOVE", 9)  # a shared mapping's pages freed in the file (a hole)
MADV_DONTNEED = getattr(mmap, "MADV_DONTNEED", 4)


def cuda_available() -> bool:
    """True when torch is already imported and sees a CUDA device.

    Never imports torch itself: a process that has not imported torch moves no CUDA tensors, so
    pinning would buy nothing, and importing torch costs seconds and hundreds of MiB of RSS.
    """
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    try:
        return bool(torch.cuda.is_available())
    except Exception:
        return False


def _libc_madvise():
    try:
        f = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):  # pragma: no cover - not glibc/musl Linux
        return None
    f.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    f.restype = ctypes.c_int
    return f


_madvise = _libc_madvise()


def _libc():
    """libc with ``mincore`` typed, or None (not Linux)."""
    try:
        lib = ctypes.CDLL(None, use_errno=True)
        f = lib.mincore
    except (OSError, AttributeError):  # pragma: no cover
        return None
    f.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
    f.restype = ctypes.c_int
    return lib


# One pre-fault call holds the process's mmap lock for its whole range, and every mmap/munmap of
# the process (the engine's large mallocs too) waits for it: with 256 MiB per call, a 4 KiB
# mmap+munmap on the main thread took 1.8 s while the pool was prepared in the background.
# 8 MiB steps let them in between. Measured on this 2-core VM, 8 GiB pool: a 1 MiB mmap, pre-
# fault and munmap on another thread waited at most 1,950 ms with 256 MiB steps, 118 ms with
# 8 MiB; the pool's own time did not change beyond the VM's noise (1 to 9 s either way).
POPULATE_STEP = 8 << 20


def _populate(m: mmap.mmap, size: int) -> None:
    """Pre-fault a whole mapping for writing. Raises OSError where the kernel cannot.

    Through libc (ctypes drops the GIL for the call): ``mmap.madvise`` holds the GIL for the
    whole pre-fault, a tenth of a second per 256 MiB, and would stall every other Python thread
    while a pool is prepared in the background.
    """
    if _madvise is None:  # pragma: no cover
        m.madvise(MADV_POPULATE_WRITE)
        return
    c = ctypes.c_char.from_buffer(m)
    addr = ctypes.addressof(c)
    del c  # no buffer export may outlive this call: the caller may close ``m``
    for off in range(0, size, POPULATE_STEP):
        if _madvise(addr + off, min(POPULATE_STEP, size - off), MADV_POPULATE_WRITE) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))


populate = _populate  # for the node daemon's engines, which map its slab (kvstore.node.slab)


def alloc_aligned(nbytes: int, *, prefault: bool = True) -> tuple[mmap.mmap, np.ndarray]:
    """An anonymous, page-aligned mapping of at least ``nbytes`` and a uint8 view of it.

    The pre-fault runs without the GIL, so it can run on a background thread.
    """
    size = max(PAGE, (nbytes + PAGE - 1) // PAGE * PAGE)
    if prefault:
        m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        try:
            m.madvise(mmap.MADV_HUGEPAGE)
        except (OSError, AttributeError):
            pass
        try:
            _populate(m, size)
        except OSError:
            m.close()
            m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0))
    else:
        m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return m, np.frombuffer(m, dtype=np.uint8, count=nbytes)


def shared_memory(nbytes: int) -> int:
    """A memfd of ``nbytes`` (sparse until touched): mode 0600, its size sealed (a peer it is
    handed to can neither shrink it under another's mapping, a SIGBUS there, nor grow it), close-
    on-exec. It has no name in any folder: only a process handed the fd (SCM_RIGHTS) maps it."""
    fd = os.memfd_create("kvstore-dram", os.MFD_CLOEXEC | getattr(os, "MFD_ALLOW_SEALING", 2))
    try:
        os.fchmod(fd, 0o600)
        os.ftruncate(fd, nbytes)
        import fcntl

        seals = getattr(fcntl, "F_SEAL_SHRINK", 2) | getattr(fcntl, "F_SEAL_GROW", 4) | getattr(fcntl, "F_SEAL_SEAL", 1)
        fcntl.fcntl(fd, getattr(fcntl, "F_ADD_SEALS", 1033), seals)
    except BaseException:
        os.close(fd)
        raise
    return fd


def map_shared(fd: int, offset: int, nbytes: int, *, prefault: bool = True) -> tuple[mmap.mmap, np.ndarray]:
    """``nbytes`` of a memfd from ``offset`` (page aligned), mapped shared, and a uint8 view;
    pre-faulted (without the GIL) unless asked not to."""
    m = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=offset)
    if prefault:
        try:
            _populate(m, nbytes)
        except OSError:  # an old kernel: first touches fault instead
            pass
    return m, np.frombuffer(m, dtype=np.uint8, count=nbytes)


def as_bytes(a) -> np.ndarray:
    """A 1-D uint8 view of a C-contiguous buffer (never a copy: writes land in ``a``)."""
    a = np.asarray(a)
    if not a.flags.c_contiguous:
        raise ValueError("block buffers must be C-contiguous")
    a = a.reshape(-1)
    return a if a.dtype == np.uint8 else a.view(np.uint8)


def is_aligned(arr, align: int = PAGE) -> bool:
    a = np.asarray(arr)
    return a.ctypes.data % align == 0


def cuda_register(arr: np.ndarray) -> int | str:
    """``cudaHostRegister`` a page-aligned buffer: 0, or the error (a CUDA code or an exception)."""
    try:
        failpoints.fire("memory.pin")
        import torch

        return int(torch.cuda.cudart().cudaHostRegister(arr.ctypes.data, arr.nbytes, 0))
    except Exception as e:
        return f"{type(e).__name__}: {e}"


def cuda_unregister(ptr: int) -> None:
    try:
        import torch

        torch.cuda.cudart().cudaHostUnregister(ptr)
    except Exception:  # pragma: no cover
        pass


def release(addr: int, nbytes: int, *, shared: bool) -> bool:
    """Give the pages of ``[addr, addr + nbytes)`` back to the host: a shared mapping's become a
    hole in its memfd (for every process that maps it), an anonymous one's are dropped; either
    reads zeros at its next touch. False where the kernel refused (nothing changed)."""
    if _madvise is None:
        return False
    return _madvise(addr, nbytes, MADV_REMOVE if shared else MADV_DONTNEED) == 0


def resident(m: mmap.mmap) -> int:
    """Bytes of a mapping resident in RAM now (``mincore``), -1 where it cannot be asked; 0 for a
    mapping closed meanwhile."""
    lib = _libc()
    if lib is None:
        return -1
    try:
        n = len(m)
        addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
    except (ValueError, TypeError, BufferError):  # closed meanwhile
        return 0
    pages = -(-n // PAGE)
    vec = (ctypes.c_ubyte * pages)()
    if lib.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(n), vec) != 0:
        return -1
    # bit 0 of each byte: the page is resident (the others are reserved). Counted in C: a Python
    # loop over the bytes took 10-38 ms for a 2 GiB pool, on the engine's thread once a second (the
    # gauge is read when vLLM's stats are taken): 1.2-3.7 % of a no-reuse batch (prefill-heavy,
    # 2-core VM, 2026-11-25); now 0.3 ms
    return bytes(vec).translate(_LOW_BIT).count(1) * PAGE
