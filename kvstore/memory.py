"""Page-aligned, pre-faulted host memory: the DRAM slab pool and bounce buffers.

Memory comes from anonymous ``mmap`` (page aligned, so O_DIRECT can read and write it in
place), is asked for huge pages and pre-faulted once at start-up (a first touch runs at page-
fault speed, ~0.45 GB/s here, versus ~2 GB/s populated up front). When CUDA is available it is
pinned through torch (``cudaHostRegister``), chunk by chunk, never as one giant pin.
"""

from __future__ import annotations

import logging
import mmap
import sys
import threading

import numpy as np

log = logging.getLogger(__name__)

PAGE = mmap.PAGESIZE
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux >= 5.14
CHUNK_BYTES = 256 << 20


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


def alloc_aligned(nbytes: int, *, prefault: bool = True) -> tuple[mmap.mmap, np.ndarray]:
    """An anonymous, page-aligned mapping of at least ``nbytes`` and a uint8 view of it."""
    size = max(PAGE, (nbytes + PAGE - 1) // PAGE * PAGE)
    if prefault:
        m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        try:
            m.madvise(mmap.MADV_HUGEPAGE)
        except (OSError, AttributeError):
            pass
        try:
            m.madvise(MADV_POPULATE_WRITE)
        except OSError:
            m.close()
            m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0))
    else:
        m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
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


class SlabPool:
    """``n_slots`` fixed-size slots in a few big chunks. Slot ``i`` is ``view(i)``.

    No allocation after start-up: ``alloc``/``free`` move integers on a free list. Thread-safe.
    """

    def __init__(self, n_slots: int, slot_bytes: int, *, pin: bool | str = "auto", chunk_bytes: int = CHUNK_BYTES):
        assert slot_bytes > 0 and n_slots >= 0
        self.slot_bytes = slot_bytes
        self.n_slots = n_slots
        per_chunk = max(1, chunk_bytes // slot_bytes)
        self._maps: list[mmap.mmap] = []
        self._views: list[np.ndarray] = []
        self._registered: list[int] = []
        self.pinned = False
        want_pin = cuda_available() if pin == "auto" else bool(pin)
        left = n_slots
        while left > 0:
            k = min(per_chunk, left)
            m, arr = alloc_aligned(k * slot_bytes)
            if want_pin:
                self.pinned = self._pin(arr) or self.pinned
            self._maps.append(m)
            self._views.extend(arr[i * slot_bytes:(i + 1) * slot_bytes] for i in range(k))
            left -= k
        self._free = list(range(n_slots - 1, -1, -1))
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)

    def _pin(self, arr: np.ndarray) -> bool:
        try:
            import torch

            ptr = arr.ctypes.data
            rc = torch.cuda.cudart().cudaHostRegister(ptr, arr.nbytes, 0)
            if int(rc) != 0:
                log.warning("cudaHostRegister failed (%s); DRAM tier is unpinned", rc)
                return False
            self._registered.append(ptr)
            return True
        except Exception as e:  # pragma: no cover - only with CUDA
            log.warning("pinning the DRAM tier failed: %s", e)
            return False

    def view(self, slot: int) -> np.ndarray:
        return self._views[slot]

    def alloc(self, timeout: float = 0.0) -> int | None:
        """A free slot, or None. ``timeout`` > 0 waits that long for one to be freed."""
        with self._cond:
            if not self._free and timeout > 0:
                self._cond.wait_for(lambda: bool(self._free), timeout)
            return self._free.pop() if self._free else None

    def free(self, slot: int) -> None:
        assert 0 <= slot < self.n_slots
        with self._cond:
            self._free.append(slot)
            self._cond.notify()

    @property
    def n_free(self) -> int:
        return len(self._free)

    def close(self) -> None:
        if self._registered:
            try:
                import torch

                for ptr in self._registered:
                    torch.cuda.cudart().cudaHostUnregister(ptr)
            except Exception:  # pragma: no cover
                pass
            self._registered.clear()
        self._views.clear()
        for m in self._maps:
            try:
                m.close()
            except BufferError:  # a view is still alive somewhere; the GC will unmap it
                pass
        self._maps.clear()
