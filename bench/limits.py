"""Physical limits, measured in the same run as the figures they are compared with."""

from __future__ import annotations

import os
import statistics
import time

import numpy as np

from kvstore.memory import alloc_aligned

_O_DIRECT = getattr(os, "O_DIRECT", 0)


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
        try:
            fd = os.open(path, os.O_CREAT | os.O_TRUNC | os.O_WRONLY | (_O_DIRECT if direct else 0), 0o600)
        except OSError:
            direct = False
            fd = os.open(path, os.O_CREAT | os.O_TRUNC | os.O_WRONLY, 0o600)
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
