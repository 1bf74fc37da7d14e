"""The DRAM tier's slab pool: slots of host memory (:mod:`kvstore.tiers.memory`), pre-faulted
and, when CUDA is available, pinned through torch (``cudaHostRegister``) chunk by chunk, never as
one giant pin; all but the first chunk prepared in the background (see SlabPool).
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import time
import weakref
from typing import Callable

import numpy as np

from kvstore.tiers.memory import (PAGE, alloc_aligned, cuda_available, cuda_register, cuda_unregister, map_shared, release,
                                  resident, shared_memory)

log = logging.getLogger(__name__)

CHUNK_BYTES = 256 << 20
GiB = 1 << 30


class PinError(RuntimeError):
    """The DRAM tier could not be registered with CUDA (raised at start-up)."""


_preparing: weakref.WeakSet = weakref.WeakSet()  # this process's pools still preparing in the background


def unprepared_bytes() -> int:
    """Bytes this process's pools will still take as their background preparation goes on: the
    machine's MemAvailable does not count them yet (a second store's DRAM check subtracts them)."""
    return sum(p.unprepared_bytes for p in list(_preparing))


class SlabPool:
    """``n_slots`` fixed-size slots in a few big chunks. Slot ``i`` is ``view(i)``.

    No allocation after start-up: ``alloc``/``free`` move integers on a free list. Thread-safe.

    Preparing the memory (mapping, pre-faulting, pinning) runs at ~2 GB/s, so a pool of many
    GiB would hold up whoever builds it for seconds. The first chunk (up to ``chunk_bytes``) is
    prepared in ``__init__``; the rest, if any, on one daemon thread, chunk by chunk and in slot
    order. A chunk's slots become usable (views published, then put on the free list) as soon
    as it is ready: ``ready_slots`` grows from ``initial_slots`` to ``n_slots``, and ``alloc``,
    ``n_free`` only ever see ready slots. A pool that fits one chunk (or ``background=False``,
    or a pinned pool: CUDA registration stays on the constructing thread) is fully ready when
    ``__init__`` returns, as before.

    ``on_ready(n_new_slots)`` is called from the background thread after each background chunk
    is published (never for the ``initial_slots`` prepared in ``__init__``, never under the
    pool's lock), so ``initial_slots`` + the sum of the calls == ``ready_slots``. The pool counts
    as ``ready`` only once the last call has returned. One log line says when a background
    preparation starts, one (logger ``kvstore.tiers.dram.pool``) when the whole pool is ready: size,
    chunks, seconds, pinned or not.
    """

    def __init__(self, n_slots: int, slot_bytes: int, *, pin: bool | str = "auto", chunk_bytes: int = CHUNK_BYTES,
                 on_ready: Callable[[int], None] | None = None, background: bool = True, shared: bool = False,
                 prefault_slots: int | None = None):
        """``shared``: the slots live in one memfd (:attr:`memfd`, slot ``i`` at byte ``i *
        slot_bytes``), which a node daemon hands to the engines it serves (kvstore.node); never
        pinned here: each engine registers its own mapping with CUDA. ``prefault_slots``: chunks
        from that slot on are mapped, not pre-faulted (a node daemon's model that may grow into
        memory another model holds now: its pages come on first touch)."""
        assert slot_bytes > 0 and n_slots >= 0
        assert not shared or slot_bytes % PAGE == 0, "a shared pool's slots are whole pages (mapped at offsets)"
        self.slot_bytes = slot_bytes
        self.n_slots = n_slots
        self._per_chunk = max(1, chunk_bytes // slot_bytes)
        self.n_chunks = -(-n_slots // self._per_chunk)
        self._prefault_slots = n_slots if prefault_slots is None else prefault_slots
        self._maps: list[mmap.mmap] = []
        self._views: list[np.ndarray] = []  # appended chunk by chunk, before the slots are freed
        self._registered: list[int] = []
        self.pinned = False
        self._want_pin = False if shared else cuda_available() if pin == "auto" else bool(pin)
        self.memfd = shared_memory(n_slots * slot_bytes) if shared and n_slots else -1
        self._on_ready = on_ready
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._free: list[int] = []  # ready, free slots; popped from the end (lowest slot first)
        self._ready_slots = 0
        self._stop = threading.Event()
        self._done = threading.Event()  # set when preparation ended (complete, stopped or failed)
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None  # why a background preparation stopped short
        self.prepare_s: float | None = None  # seconds from __init__ to fully ready
        self._t0 = time.perf_counter()
        try:
            if n_slots:
                self._add_chunk()
            # Pinned pools are prepared here, whole: cudaHostRegister from another thread would
            # run on device 0 (not this worker's GPU) and can break a CUDA-graph capture running
            # meanwhile (vLLM reverted its own async pinning for that, vllm#46933).
            while (background is False or self._want_pin) and self._ready_slots < n_slots:
                self._add_chunk()
        except BaseException:
            self._unmap()
            raise
        self.initial_slots = self._ready_slots
        if self._ready_slots == n_slots:
            self._finish()
        else:
            log.info("kvstore: DRAM pool: preparing %.2f GiB (%d chunks) in the background; "
                     "%.2f GiB (%d of %d slots) ready now",
                     n_slots * slot_bytes / GiB, self.n_chunks, self._ready_slots * slot_bytes / GiB,
                     self._ready_slots, n_slots)
            self._thread = threading.Thread(target=self._prepare_rest, name="kvstore-dram-prefault", daemon=True)
            _preparing.add(self)
            self._thread.start()

    # -- preparation -----------------------------------------------------------------------------
    def _add_chunk(self) -> int:
        """Map, pre-fault and pin the next chunk, then publish its slots. Returns how many."""
        first = self._ready_slots
        k = min(self._per_chunk, self.n_slots - first)
        if self.memfd >= 0:
            m, arr = map_shared(self.memfd, first * self.slot_bytes, k * self.slot_bytes,
                                prefault=first < self._prefault_slots)
        else:
            m, arr = alloc_aligned(k * self.slot_bytes)
        self._maps.append(m)
        if self._want_pin:
            self._pin(arr)  # raises: a pool asked to be pinned is pinned whole, or not made
            self.pinned = True
        sb = self.slot_bytes
        views = [arr[i * sb:(i + 1) * sb] for i in range(k)]
        with self._cond:
            self._views.extend(views)  # views first: a slot on the free list always has one
            # below the free slots already there, so alloc keeps handing out the lowest first
            self._free[:0] = range(first + k - 1, first - 1, -1)
            self._ready_slots = first + k
            self._cond.notify_all()
        return k

    def _prepare_rest(self) -> None:
        try:  # lowest CPU priority for this thread alone (Linux): the engine starting up comes first
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except (OSError, AttributeError):  # pragma: no cover
            pass
        try:
            while self._ready_slots < self.n_slots and not self._stop.is_set():
                k = self._add_chunk()
                if self._on_ready is not None:
                    try:
                        self._on_ready(k)
                    except Exception:
                        log.exception("kvstore: DRAM pool on_ready callback failed")
        except BaseException as e:  # out of memory, mmap failure: keep what is ready
            self.error = e
            log.error("kvstore: DRAM pool preparation stopped at %.2f of %.2f GiB (%d of %d slots): %s",
                      self._ready_slots * self.slot_bytes / GiB, self.n_slots * self.slot_bytes / GiB,
                      self._ready_slots, self.n_slots, e)
        finally:
            if self._ready_slots == self.n_slots:
                self._finish()
            else:
                self._done.set()

    def _finish(self) -> None:
        self.prepare_s = time.perf_counter() - self._t0
        if self.n_slots:
            log.info("kvstore: DRAM pool ready: %.2f GiB in %d chunks, %.1f s (%s)",
                     self.n_slots * self.slot_bytes / GiB, self.n_chunks, self.prepare_s,
                     "pinned" if self.pinned else "not pinned")
        self._done.set()

    @property
    def unprepared_bytes(self) -> int:
        """Bytes still to be mapped and pre-faulted (0 once preparation ended, however it ended)."""
        return 0 if self._done.is_set() else (self.n_slots - self._ready_slots) * self.slot_bytes

    @property
    def ready_slots(self) -> int:
        """Slots usable now (``0..ready_slots-1``); grows to ``n_slots`` while preparing."""
        return self._ready_slots

    @property
    def ready(self) -> bool:
        """Every slot is usable (and every ``on_ready`` call has returned)."""
        return self._done.is_set() and self._ready_slots == self.n_slots

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait until the whole pool is ready. False on timeout, or if preparation stopped
        short (``close`` while preparing, or an allocation failure: see ``error``)."""
        return self._done.wait(timeout) and self.ready

    def _pin(self, arr: np.ndarray) -> None:
        """Register one chunk with CUDA (``cudaHostRegister``): copies from it then run at pinned
        speed (H200, measured: 51 GB/s from slab slots against 55 GB/s for one big memcpy), and RSS
        stays at the capacity (PyTorch's own pinned allocator rounds 4.5 GiB up to 8 GiB). A failure
        is an error at start-up, never a silently slower tier."""
        ptr, rc = arr.ctypes.data, cuda_register(arr)
        if rc != 0:
            raise PinError(f"kvstore: tiers.dram.pin_memory: registering {arr.nbytes / GiB:.2f} GiB of the DRAM "
                           f"tier with CUDA failed ({rc}); lower tiers.dram.capacity_gb, raise the locked-memory "
                           f"limit (ulimit -l), or set tiers.dram.pin_memory: false for an unpinned tier")
        self._registered.append(ptr)

    # -- slots -----------------------------------------------------------------------------------
    def view(self, slot: int) -> np.ndarray:
        return self._views[slot]

    def alloc(self, timeout: float = 0.0) -> int | None:
        """A free ready slot, or None. ``timeout`` > 0 waits that long for one to be freed (or
        to become ready)."""
        with self._cond:
            if not self._free and timeout > 0:
                self._cond.wait_for(lambda: bool(self._free), timeout)
            return self._free.pop() if self._free else None

    def free(self, slot: int) -> None:
        assert 0 <= slot < self._ready_slots
        with self._cond:
            self._free.append(slot)
            self._cond.notify()

    def trim(self) -> int:
        """Give the memory behind every free slot back to the host (a shared slab: holes in the
        memfd, for every engine's mapping too; an anonymous one: its pages dropped); a slot used
        again is zero-filled on first touch. Under the pool's lock, so no slot is handed out
        while its pages go. Not for a pinned pool (its pages stay locked). Returns the bytes."""
        if self.pinned:
            return 0
        sb, done = self.slot_bytes, 0
        with self._cond:
            run: list[int] = []  # consecutive free slots of one chunk: one call
            for slot in sorted(self._free) + [-2]:
                if run and (slot != run[-1] + 1 or slot % self._per_chunk == 0):
                    if release(self._views[run[0]].ctypes.data, len(run) * sb, shared=self.memfd >= 0):
                        done += len(run) * sb
                    run = []
                run.append(slot)
        return done

    @property
    def n_free(self) -> int:
        """Free slots among the ready ones."""
        return len(self._free)

    def resident_bytes(self) -> int:
        """Bytes of the pool's mappings resident in RAM now (``mincore``; Linux), to report against
        its capacity: pre-faulted (and pinned) memory is resident as a whole, so this equals the
        prepared bytes unless the kernel dropped pages. -1 where mincore is unavailable."""
        total = 0
        for m in list(self._maps):
            n = resident(m)
            if n < 0:
                return -1
            total += n
        return total

    def close(self) -> None:
        """Stop a background preparation (it finishes the chunk in hand), then unmap."""
        self._stop.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join()
        self._unmap()

    def _unmap(self) -> None:
        for ptr in self._registered:
            cuda_unregister(ptr)
        self._registered.clear()
        with self._cond:
            self._free.clear()
        self._views.clear()
        for m in self._maps:
            try:
                m.close()
            except BufferError:  # a view is still alive somewhere; the GC will unmap it
                pass
        self._maps.clear()
        if self.memfd >= 0:  # the engines' mappings keep the memory until they unmap it
            os.close(self.memfd)
            self.memfd = -1
