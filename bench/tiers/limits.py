"""Physical limits, measured in the same run as the figures they are compared with."""

from __future__ import annotations

import os
import statistics
import time

import numpy as np

from kvstore.tiers.memory import alloc_aligned

_O_DIRECT = getattr(os, "O_DIRECT", 0)


def settle() -> None:
    """Let the disk finish what the bench's earlier phases left it before the next timed phase.
    Removing a phase's files (0.5-1 GB: a store path's tree, a limit's file) leaves the filesystem
    work that otherwise ran during whatever came next, a limit or kvstore's rows: writing back the
    freed inodes and bitmaps, and on a ``discard`` mount (this VM's ext4 root) freeing the blocks
    in the device. The limit's files are removed right before each store path, so its fresh put
    paid most. Measured on this VM (2 cores, virtio disk, ext4 without a journal, mounted
    ``discard``), 2026-11-27, 16- and 32-token blocks, 1 and 4 callers, 3 runs each way: fresh
    puts 0.71-0.95 of their limit without it and 0.81-0.98 with it, their CPU 860-1,880 us a block
    against 600-770; gets and full-cache puts moved within their noise. Every timed NVMe phase,
    limit or store, starts after it."""
    os.sync()


def _create(path: str, mode: int, direct: bool) -> tuple[int, bool]:
    """A new file opened ``mode`` (``os.O_WRONLY``/``os.O_RDWR``), with O_DIRECT if ``direct`` and
    the filesystem takes it (tmpfs refuses it). Returns (fd, O_DIRECT used)."""
    if direct and _O_DIRECT:
        try:
            return os.open(path, os.O_CREAT | os.O_TRUNC | mode | _O_DIRECT, 0o600), True
        except OSError:
            pass
    return os.open(path, os.O_CREAT | os.O_TRUNC | mode, 0o600), False


def memcpy_gbps(nbytes: int, repeats: int = 3) -> float:
    """One-thread numpy copy of ``nbytes`` between two pre-faulted buffers (median of repeats)."""
    _, src = alloc_aligned(nbytes)
    _, dst = alloc_aligned(nbytes)
    src[:] = 1
    np.copyto(dst, src)  # warm
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t)
    return nbytes / statistics.median(times) / 1e9


def odirect_gbps(folder: str, nbytes: int, chunk: int = 4 << 20, repeats: int = 2) -> tuple[float, float, bool]:
    """Sequential write then read of one ``nbytes`` file with O_DIRECT, ``chunk`` at a time
    (what ``dd oflag=direct bs=4M`` does). Returns (write GB/s, read GB/s, o_direct used)."""
    _, buf = alloc_aligned(chunk)
    buf[:] = 7
    path = os.path.join(folder, f".kvstore-limit-{os.getpid()}")
    nchunks = max(1, nbytes // chunk)
    direct = bool(_O_DIRECT)
    wt, rt = [], []
    for _ in range(repeats):
        settle()
        fd, direct = _create(path, os.O_WRONLY, direct)
        t = time.perf_counter()
        for i in range(nchunks):
            os.pwrite(fd, buf, i * chunk)
        if not direct:
            os.fsync(fd)
        wt.append(time.perf_counter() - t)
        os.close(fd)
        fd = os.open(path, os.O_RDONLY | (_O_DIRECT if direct else 0))
        t = time.perf_counter()
        for i in range(nchunks):
            os.preadv(fd, [buf], i * chunk)
        rt.append(time.perf_counter() - t)
        os.close(fd)
        os.unlink(path)
    total = nchunks * chunk
    return total / statistics.median(wt) / 1e9, total / statistics.median(rt) / 1e9, direct


def odirect_seq_rows_gbps(folder: str, src: np.ndarray, dst: np.ndarray, chunk: int = 4 << 20) -> tuple[float, float]:
    """:func:`odirect_gbps` on the bench's own rows: ``src`` written to one new file ``chunk`` at a
    time at queue depth 1 (dd-style), then read back into ``dst``, the same bytes from and to the
    same memory a store moves (both contiguous, page aligned). One reused buffer reads faster than
    a store ever can, which must fill each caller's rows: here 6.4-6.7 GB/s into one 4 MiB buffer,
    4.5-5.0 GB/s into distinct memory (512 MiB file, QD1, busy 2-core VM). Returns (write GB/s,
    read GB/s); buffered with an fsync where O_DIRECT is refused."""
    s, d = src.reshape(-1), dst.reshape(-1)
    total = (min(s.nbytes, d.nbytes) // 4096) * 4096
    chunk = max(4096, min(chunk, total))
    nchunks = max(1, total // chunk)
    path = os.path.join(folder, f".kvstore-limit-seq-{os.getpid()}-{time.perf_counter_ns()}")
    direct = bool(_O_DIRECT) and s.ctypes.data % 4096 == 0 and d.ctypes.data % 4096 == 0
    settle()
    fd, direct = _create(path, os.O_WRONLY, direct)
    try:
        t = time.perf_counter()
        for i in range(nchunks):
            os.pwrite(fd, s[i * chunk:(i + 1) * chunk], i * chunk)
        if not direct:
            os.fsync(fd)
        wt = time.perf_counter() - t
        os.close(fd)
        fd = os.open(path, os.O_RDONLY | (_O_DIRECT if direct else 0))
        t = time.perf_counter()
        for i in range(nchunks):
            os.preadv(fd, [d[i * chunk:(i + 1) * chunk]], i * chunk)
        rt = time.perf_counter() - t
    finally:
        os.close(fd)
        os.unlink(path)
    return nchunks * chunk / wt / 1e9, nchunks * chunk / rt / 1e9


def _split(n: int, parts: int) -> list[range]:
    """``range(n)`` cut into ``parts`` interleaved stripes (what the bench's callers do)."""
    parts = max(1, min(parts, n)) if n else 1
    return [range(i, n, parts) for i in range(parts)]


def run_threads(fn, stripes: list) -> float:
    """Run ``fn(stripe)`` on one thread per stripe (one stripe: inline); wall seconds."""
    import threading

    if len(stripes) == 1:
        t = time.perf_counter()
        fn(stripes[0])
        return time.perf_counter() - t
    ths = [threading.Thread(target=fn, args=(s,)) for s in stripes]
    t = time.perf_counter()
    for th in ths:
        th.start()
    for th in ths:
        th.join()
    return time.perf_counter() - t


def memcpy_rows_s(src: np.ndarray, dst: np.ndarray, threads: int = 1) -> float:
    """Seconds to copy every row ``src[i] -> dst[i]`` (one block per copy, as a store does),
    from ``threads`` threads (numpy releases the GIL while copying). Both pre-faulted by the caller."""
    def work(rows):
        for i in rows:
            np.copyto(dst[i], src[i])

    return run_threads(work, _split(len(src), threads))


def odirect_rows_s(folder: str, src: np.ndarray, dst: np.ndarray, qd: int = 1,
                   overwrite: list | None = None) -> tuple[float, float, bool]:
    """O_DIRECT write then read of the same rows (one block per I/O) at queue depth ``qd``
    (``qd`` threads, interleaved rows of one fresh file). Rows must be page aligned and a multiple
    of 4 KiB for O_DIRECT; otherwise buffered I/O with an fsync. Returns (write s, read s, direct).
    ``overwrite``: a list that gets the seconds of a second write of the same rows over the
    first, in place (blocks allocated and written already: what a recycled block file costs the
    disk, kvstore/tiers/nvme/pool.py)."""
    n, bb = src.shape
    path = os.path.join(folder, f".kvstore-limit-rows-{os.getpid()}-{time.perf_counter_ns()}")
    direct = bool(_O_DIRECT) and bb % 4096 == 0 and src.ctypes.data % 4096 == 0 and dst.ctypes.data % 4096 == 0
    settle()
    fd, direct = _create(path, os.O_RDWR, direct)
    try:
        def w(rows):
            for i in rows:
                os.pwrite(fd, src[i], i * bb)

        stripes = _split(n, qd)
        t = time.perf_counter()
        run_threads(w, stripes)
        if not direct:
            os.fsync(fd)
        wt = time.perf_counter() - t
        if overwrite is not None:
            t = time.perf_counter()
            run_threads(w, stripes)
            if not direct:
                os.fsync(fd)
            overwrite.append(time.perf_counter() - t)
        os.close(fd)
        fd = os.open(path, os.O_RDONLY | (_O_DIRECT if direct else 0))

        def r(rows):
            for i in rows:
                os.preadv(fd, [dst[i]], i * bb)

        rt = run_threads(r, stripes)
    finally:
        os.close(fd)
        os.unlink(path)
    return wt, rt, direct


def buffered_files_s(folder: str, src: np.ndarray, dst: np.ndarray, threads: int = 1) -> tuple[float, float]:
    """A file per row written (create, write, close: buffered, no fsync) then read back whole, from
    ``threads`` threads: what a tier of one buffered file per block can do at best on this folder
    (the shared-folder tier writes each block so, then renames it into place). Returns (write s,
    read s); the reads come from wherever the file system keeps the bytes, as the tier's do."""
    n, _bb = src.shape
    sub = os.path.join(folder, f".kvstore-limit-files-{os.getpid()}-{time.perf_counter_ns()}")
    os.mkdir(sub, 0o700)
    stripes = _split(n, threads)
    settle()
    try:
        def w(rows):
            for i in rows:
                fd = os.open(os.path.join(sub, str(i)), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                try:
                    os.write(fd, src[i])
                finally:
                    os.close(fd)

        def r(rows):
            for i in rows:
                fd = os.open(os.path.join(sub, str(i)), os.O_RDONLY)
                try:
                    os.preadv(fd, [dst[i]], 0)
                finally:
                    os.close(fd)

        wt = run_threads(w, stripes)
        rt = run_threads(r, stripes)
    finally:
        for name in os.listdir(sub):
            os.unlink(os.path.join(sub, name))
        os.rmdir(sub)
    return wt, rt
