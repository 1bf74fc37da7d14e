"""An engine's mapping of its node daemon's DRAM slab (the memfd the daemon handed over).

Slot ``i`` is bytes ``[i * slot_bytes, (i + 1) * slot_bytes)`` of the memfd, as in the daemon's
pool (:class:`~kvstore.tiers.dram.pool.SlabPool` with ``shared=True``). With CUDA the whole
mapping is registered (``cudaHostRegister``), so the copy kernels read and write the slots at
pinned speed, as they do an embedded engine's own pool. The mapping lives as long as a view of it
does: a daemon that restarts hands over a new memfd, and copies still in flight into the old one
land in memory nobody will read again, never in the new daemon's slots.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading

import numpy as np

from kvstore.tiers.memory import cuda_available, cuda_register, cuda_unregister, map_shared, populate

log = logging.getLogger(__name__)


class SharedSlab:
    def __init__(self, fd: int, n_slots: int, slot_bytes: int, populate: bool = True):
        """``populate``: map every page up front (the daemon's slab is all this model's); False
        for a slab a node budget shares with other models (a page mapped is a page the host
        gives: only the slots used take memory)."""
        if n_slots <= 0 or slot_bytes <= 0 or slot_bytes % mmap.PAGESIZE:
            raise ValueError(f"a slab of {n_slots} slots of {slot_bytes} bytes")
        size = n_slots * slot_bytes
        if os.fstat(fd).st_size < size:
            raise ValueError(f"the daemon's slab holds {os.fstat(fd).st_size} bytes, not {size}")
        self.n_slots, self.slot_bytes = n_slots, slot_bytes
        self._map, self.array = map_shared(fd, 0, size, prefault=False)
        self._ptr = 0
        if populate and not cuda_available():  # (the CUDA registration below maps every page itself)
            # The daemon's pages are in memory, but not in this process's page tables: a first
            # copy from a slot took a minor fault per 4 KiB page. Mapped in the background, at the
            # lowest priority, 8 MiB a step (the engine's own mmaps are never held up long)
            threading.Thread(target=self._populate, name="kvstore-node-slab", daemon=True).start()
        if cuda_available():
            rc = cuda_register(self.array)
            if rc == 0:
                self._ptr = self.array.ctypes.data
            else:
                log.error("kvstore node: registering the daemon's DRAM slab with CUDA failed (%s); copies to and "
                          "from it run unpinned (slower): raise the locked-memory limit (ulimit -l)", rc)

    def _populate(self) -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except (OSError, AttributeError):
            pass
        m = self._map
        try:
            populate(m, len(m))
        except (OSError, ValueError, BufferError):  # an old kernel, or closed meanwhile: first touches fault
            pass

    @property
    def pinned(self) -> bool:
        return self._ptr != 0

    def view(self, slot: int) -> np.ndarray:
        if not 0 <= slot < self.n_slots:
            raise ValueError(f"slot {slot} of {self.n_slots}")
        return self.array[slot * self.slot_bytes:(slot + 1) * self.slot_bytes]

    def close(self) -> None:
        """Unregister; the mapping goes with the last view of it (the GC unmaps it)."""
        if self._ptr:
            cuda_unregister(self._ptr)
            self._ptr = 0
        self.array = None
        try:
            self._map.close()
        except BufferError:  # views still held (a copy in flight): unmapped with the last of them
            pass
