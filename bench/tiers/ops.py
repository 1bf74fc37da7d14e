"""What ``kvstore bench tiers`` times a store op with: the op over all blocks from N caller
threads, latency percentiles, the fingerprint of the bench's blocks, the check of what came back."""

from __future__ import annotations

import threading
import time

import numpy as np

from kvstore.bench.tiers.limits import run_threads
from kvstore.keys import ModelFingerprint


def fingerprint(a, model: str, tokens: int, codec: str) -> ModelFingerprint:
    """The blocks' model, with the geometry and element dtype a codec needs to know."""
    dtype = {2: "float16", 4: "float32"}.get(a.dtype_bytes, "uint8")
    return ModelFingerprint(model=model, dtype=dtype, block_size=tokens, num_layers=a.layers, num_kv_heads=a.kv_heads,
                            head_size=a.head_size, codec=codec)


def call_batch(n: int, batch: int, callers: int) -> int:
    """Blocks a call: ``batch``, or fewer where ``n`` blocks in calls of ``batch`` would leave a
    caller idle. (512 MB of 16 MiB blocks is 32 blocks: in calls of 32, "4 callers" was one caller
    and three idle, against a limit copying from 4 threads; now 4 calls of 8.)"""
    return max(1, min(batch, -(-n // max(1, callers))))


def run_op(fn, keys: list[bytes], rows: np.ndarray, batch: int, threads: int,
           counted: list[int] | None = None) -> tuple[float, list[float]]:
    """Call fn(keys[i:i+b], rows[i:i+b]) over all keys from ``threads`` callers, ``b`` the
    :func:`call_batch` of ``batch`` (every caller has a call); the sum of fn's results is
    appended to ``counted``."""
    batch = call_batch(len(keys), batch, threads)
    starts = list(range(0, len(keys), batch))
    per = [starts[t::threads] for t in range(threads)]
    lat: list[float] = []
    total = [0]
    lock = threading.Lock()

    def worker(my):
        mine, got = [], 0
        for s in my:
            t = time.perf_counter()
            got += int(fn(keys[s:s + batch], rows[s:s + batch]) or 0)
            mine.append(time.perf_counter() - t)
        with lock:
            lat.extend(mine)
            total[0] += got

    wall = run_threads(worker, per)
    if counted is not None:
        counted.append(total[0])
    return wall, lat


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1e3 if xs else 0.0


def nbytes_gb(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def verify(out: np.ndarray, src: np.ndarray, codec: str) -> bool | None:
    """True: bytes identical. None: a lossy codec, values within its error bound. False: wrong."""
    if np.array_equal(out, src):
        return True
    if codec.split("+")[0] not in ("int8", "fp8"):
        return False
    a = src.view(np.float16)[:, 4:].astype(np.float32)  # past the 8-byte block index
    b = out.view(np.float16)[:, 4:].astype(np.float32)
    ok = np.abs(a - b) <= 0.15 * np.abs(a) + 0.05 * float(np.abs(a).max())
    return None if bool(ok.all()) else False


def timed_get(get, keys: list[bytes], src: np.ndarray, out: np.ndarray, batch: int, threads: int, codec: str,
              got: list[int], ok: bool | None) -> tuple[float, list[float], bool | None]:
    """``get`` every block into ``out`` (zeroed first) from ``threads`` callers, then check it against
    ``src``: (seconds, latencies, ``ok`` and'ed with this check: True, None for in bound, False)."""
    out[:] = 0
    t, lat = run_op(get, keys, out, batch, threads, got)
    v = verify(out, src, codec) if got[-1] == len(keys) else False
    return t, lat, False if (ok is False or v is False) else (None if (ok is None or v is None) else True)


def not_measured(tier: str, codec: str, block_tokens: int, threads: int, e: Exception) -> dict:
    """The skipped row of a measurement that failed (e.g. a codec the store does not implement)."""
    return {"tier": tier, "codec": codec, "block_tokens": block_tokens, "concurrency": threads,
            "error": f"{type(e).__name__}: {e}"}


def cpu_s() -> float:
    """This process's CPU seconds so far, every thread (user + system)."""
    import resource

    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime


def put_then_get(put, get, keys: list[bytes], src: np.ndarray, out: np.ndarray, batch: int, threads: int,
                 codec: str) -> dict:
    """``put`` then ``get`` every block from ``threads`` callers: wall seconds, latencies, this
    process's CPU seconds (a figure a busy machine moves less than the wall time), what came back
    and whether its bytes are right (``verified``: True, None for a lossy codec in bound, False)."""
    c0 = cpu_s()
    put_s, put_lat = run_op(put, keys, src, batch, threads)
    c1 = cpu_s()
    out[:] = 0
    got: list[int] = []
    c2 = cpu_s()
    get_s, get_lat = run_op(get, keys, out, batch, threads, got)
    c3 = cpu_s()
    ok = verify(out, src, codec) if got[-1] == len(keys) else False
    return {"put_s": put_s, "put_lat": put_lat, "put_cpu": c1 - c0, "get_s": get_s, "get_lat": get_lat,
            "get_cpu": c3 - c2, "verified": ok, "got": got[-1]}
