"""The ``trust`` family's decode bombs (issue 45 findings 1-2; the family itself: :mod:`.trust`):
zstd frames that declare 4 GiB or 1 TiB, or lie about their size (:mod:`.bombs`), behind a valid
header and checksum, where a store with a zstd codec reads them:

- ``redis``: a remote-only store without a secret (anyone who may write to Redis can plant
  them) with the issue's geometry, 2 MiB blocks, so the 4 GiB frame is whole (131 KB);
- ``nvme``: the same frames in block files (written by the tier itself, its codec's output
  swapped for the frame: a file valid in every other respect).

Each get of a prefix through the bad block is timed and traced (tracemalloc: the most bytes
Python's allocators held at once, python-zstandard's output included), as is the same get before
the frame was planted. A case is ``unbounded`` if the get raised, served the block, did not count
it (``decode`` in Redis, ``bad_payload`` on NVMe), left it in place, or allocated more than two
blocks beyond what the get of good blocks did (~10 MiB for three 2 MiB blocks from Redis, ~4 MiB
from files; trust_bomb_peak_mib is the most over it). Before issue 45
the 4 GiB frame took 9-10 s and 4.1 GiB of RSS per get, and the 1 TiB one raised MemoryError out
of every ``KVStore.get``."""

from __future__ import annotations

import contextlib
import resource
import time
import tracemalloc
from pathlib import Path
from typing import Callable

import numpy as np

from kvstore.bench.faults.families.bombs import hostile_payloads
from kvstore.bench.faults.families.common import block_of, key_of, open_store
from kvstore.tiers import fileformat as ff

BIG = 2 << 20  # the block size: a 4 GiB frame (131 KB) fits in one value whole
SLACK = 2 * BIG  # what a bad block's get may allocate beyond the same get of good blocks


def bombs(folder: Path, srv, make_remote: Callable, seed: int) -> dict:
    """Every hostile frame in Redis (``srv``; None: skipped) and in block files under ``folder``.
    ``make_remote(url, password, codec, block_bytes)``: a remote-only store without a secret."""
    rows = []
    rss0 = _max_rss_mib()
    for frame in sorted(hostile_payloads(BIG, BIG + 1)):
        if srv is not None:
            rows.append(_case("redis", frame, lambda f=frame: _redis(srv, make_remote, f, seed)))
        rows.append(_case("nvme", frame, lambda f=frame: _nvme(folder / f, f, seed)))
    bad = [f"{r['where']} {r['frame']}: {r['why']}" for r in rows if r["why"]]
    return {"trust_bombs_tried": len(rows), "trust_bombs_unbounded": len(bad), "trust_bombs_failed": bad,
            "trust_bomb_longest_s": round(max(r["seconds"] for r in rows), 3),
            "trust_bomb_peak_mib": round(max(r["peak"] for r in rows) / 2**20, 1),  # over the good get
            "trust_bomb_rss_growth_mib": round(_max_rss_mib() - rss0, 1), "bomb_rows": rows}


def _max_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _case(where: str, frame: str, run: Callable[[], dict]) -> dict:
    try:
        got = run()
    except Exception as e:  # the case itself failed: reported, never the whole family
        got = {"seconds": 0.0, "peak": 0, "why": f"{type(e).__name__}: {e}"[:200]}
    return {"where": where, "frame": frame, **got}


def _traced_get(store, keys: list[bytes], bb: int, good_peak: int | None = None) -> tuple[float, int, int, str]:
    """(seconds, traced peak, blocks served, what went wrong) of one get of ``keys`` (the first
    good, the second bad: served alone); ``good_peak``: the peak of the same get of good blocks."""
    out = np.zeros((len(keys), bb), np.uint8)
    why, n = "", 0
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        n = store.get(keys, out)
    except Exception as e:
        why = f"get raised {type(e).__name__}: {e}"[:200]
    dt = time.perf_counter() - t0
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    if good_peak is None:  # the control: every block good and served
        return dt, peak, n, why or ("" if n == len(keys) else f"served {n} of {len(keys)} good blocks")
    if n > 1:
        why = why or f"served {n} blocks, the bad one among them"
    elif n == 1 and not np.array_equal(out[0], block_of(keys[0], bb)):
        why = why or "served a wrong block"
    if peak > good_peak + SLACK:
        why = why or f"allocated {peak / 2**20:.0f} MiB (good blocks: {good_peak / 2**20:.0f} MiB)"
    return dt, max(0, peak - good_peak), n, why


def _redis(srv, make_remote: Callable, frame: str, seed: int) -> dict:
    keys = [key_of(f"bomb-{seed}-redis-{frame}", i) for i in range(3)]
    s = make_remote(srv.url, srv.password, "zstd", BIG)
    c = srv.client(socket_timeout=5)
    try:
        s.put(keys, np.stack([block_of(k, BIG) for k in keys]))
        _, good, _, why = _traced_get(s, keys, BIG)
        if why:
            return {"seconds": 0.0, "peak": 0, "why": f"control: {why}"}
        t = s.remote.client
        payload = np.frombuffer(hostile_payloads(t.values.codec.inner.encoded_bytes, t.values.payload_max)[frame],
                                np.uint8)
        head = ff.Header(t.values.codec_id, payload.nbytes, ff.checksum(payload), time.time(), t.namespace, keys[1])
        name = t.redis_key(keys[1])
        c.set(name, ff.header_bytes(head) + payload.tobytes())
        dt, peak, _, why = _traced_get(s, keys, BIG, good)
        if not why and s.remote.corrupt_reasons.get("decode", 0) != 1:
            why = f"not counted as decode: {s.remote.corrupt_reasons}"
        if not why and c.exists(name):
            why = "left in Redis"
        return {"seconds": round(dt, 4), "peak": peak, "why": why}
    finally:
        s.close()
        c.close()


@contextlib.contextmanager
def _encoding(codec, payload: np.ndarray):
    """The codec's output replaced by ``payload`` for the block: the tier writes a valid file of it."""
    def planted(src, dst):
        dst[: payload.nbytes] = payload
        return payload.nbytes

    codec.encode = planted
    try:
        yield
    finally:
        del codec.encode  # the class's method again


def _nvme(folder: Path, frame: str, seed: int) -> dict:
    keys = [key_of(f"bomb-{seed}-nvme-{frame}", i) for i in range(3)]
    s = open_store(folder, block_bytes=BIG, nvme_blocks=12, nvme_codec="zstd")
    try:
        c = s.nvme.codec
        payload = np.frombuffer(hostile_payloads(c.inner.encoded_bytes, c.encoded_bytes)[frame], np.uint8)
        control = [key_of(f"bomb-{seed}-nvme-{frame}-good", i) for i in range(3)]
        s.put(control, np.stack([block_of(k, BIG) for k in control]))
        s.put(keys[:1], block_of(keys[0], BIG)[None])
        with _encoding(c, payload):
            s.put(keys[1:2], block_of(keys[1], BIG)[None])
        s.put(keys[2:], block_of(keys[2], BIG)[None])
        _, good, _, why = _traced_get(s, control, BIG)  # three good files: the I/O threads' buffers made
        if why:
            return {"seconds": 0.0, "peak": 0, "why": f"control: {why}"}
        dt, peak, _, why = _traced_get(s, keys, BIG, good)
        if not why and s.nvme.corrupt_reasons.get("bad_payload", 0) != 1:
            why = f"not counted as bad_payload: {s.nvme.corrupt_reasons}"
        if not why and Path(s.nvme.path_of(keys[1])).exists():
            why = "file left"
        return {"seconds": round(dt, 4), "peak": peak, "why": why}
    finally:
        s.close()
