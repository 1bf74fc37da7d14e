"""``kvstore bench tiers``: store/load GB/s and latency per tier, beside the machine's limits.

Every figure is printed beside a limit measured in the same run, on the same bytes, right
before it (so a busy machine slows both sides of the ratio alike):

* DRAM put/get: a memcpy of the same blocks, one block per copy, from as many threads as the
  bench has callers (numpy releases the GIL while it copies), or from one thread when that is
  faster (more threads than cores);
* NVMe put/get: the better of an O_DIRECT sequential write/read of the same blocks in 4 MiB chunks at
  queue depth 1 (what ``dd oflag=direct bs=4M`` does, but from and into the blocks' own memory: dd's
  one reused buffer reads ~1.4x faster here than any store can fill its callers' rows,
  bench/tiers/limits.py) and an O_DIRECT write/read of the same blocks, one block
  per I/O, at the store's I/O parallelism (``--io-threads``; the store writes one file per block
  from that many threads, which a virtual disk serves faster than queue depth 1) into a new file;
* NVMe ``put_full``: a put into a full cache, as in a store that has run a while (the cache holds
  the run's blocks; other blocks are put first, untimed, then the run's blocks again, each evicting
  one of them: their files recycled, kvstore/tiers/nvme/pool.py, the fan-out folders there), timed
  up to ``store.flush()`` and read back; its limit is the best of the put's and an O_DIRECT
  overwrite of the same rows in place at the store's I/O parallelism (what a recycled file costs
  the disk: no block allocation);
* sharedfs put/get (``--tiers sharedfs``: a folder every host mounts, here under ``--dir``): the
  better of a buffered write/read of the same rows, one new file per block (what a tier that
  writes a block as one file, then renames it into place, can do at best: no O_DIRECT assumed on a
  shared file system), and the O_DIRECT rows of the NVMe limit, both at the store's I/O
  parallelism, on the same folder;
* remote put/get (``--tiers remote``, Redis or Valkey: ``--redis-url``, else a private
  ``redis-server`` started for the run, ``bench/common/redis_local.py``): a raw pipelined ``SET ... PX``
  then ``GETEX ... PX`` of values of the store's size (block bytes + the 88-byte header, built
  before the clock starts), with the same redis-py client type (a ``BlockingConnectionPool`` of
  as many connections as callers), on the same server, the same batch per pipeline and as many
  caller threads. The store under test has DRAM and NVMe off and ``tiers.remote.url`` set (its remote
  connection pool and I/O pool as wide as the callers); its put is timed up to ``store.flush()``,
  so a write-through still running on the store's I/O pool is counted. Should a put with no local tier store nothing (the store writes Redis only through a
  local tier), the put side is measured with a DRAM tier in front (write-through, the DRAM copy
  included in the time) and the row says so; the get side always reads a store with no local tier.

The default block is shaped like a 7B-class model: 32 layers, 8 KV heads, head size 128, fp16,
so 16 / 32 / 128 tokens are 2 / 4 / 16 MiB. Latency is per put/get call of ``--batch`` blocks.
``--codecs`` measures the tiers with a codec (GB/s of uncompressed bytes); a codec the store does
not implement yet is listed as skipped. Each row also gives the compression ratio (raw bytes / bytes
the tier accounts for the blocks, which are the files' real sizes, cross-checked against the files on
disk) and the capacity gain (blocks per GB vs codec none on the same tier). A codec's ratio depends on
the bytes, so ``--kv-data`` picks KV-like contents (``bench/tiers/kvdata.py``): ``tiny-llama`` (KV captured
from the tiny random-weight Llama; the default when a codec other than none is measured) or
``synthetic`` (normal values with per-head scales; the default otherwise). Options can come from a
YAML (``--config``).
"""


from __future__ import annotations

import argparse
import gc
import os
import tempfile

import numpy as np

from kvstore.bench.common import harness
from kvstore.bench.common.paired import REPEATS
from kvstore.bench.tiers.kvdata import KINDS
from kvstore.bench.tiers.kvdata import fill as fill_kv
from kvstore.bench.tiers.limits import memcpy_gbps, odirect_gbps
from kvstore.bench.tiers.local import measure
from kvstore.bench.tiers.peer import CHOICES as PEER_CHOICES
from kvstore.bench.tiers.remote import REMOTE_HEADER
from kvstore.bench.tiers.report import plot, render
from kvstore.tiers.memory import alloc_aligned

__all__ = ["DEFAULTS", "REMOTE_HEADER", "add_args", "main", "plot", "render", "resolve", "run"]

DEFAULTS = {
    "total_mb": 512, "block_tokens": "16,32,128", "layers": 32, "kv_heads": 8, "head_size": 128, "dtype_bytes": 2,
    "batch": 32, "concurrency": "1,4", "io_threads": 4, "repeats": REPEATS, "tiers": "dram,nvme", "codecs": "none",
    "dir": None, "o_direct": "auto", "json": None, "plots": None, "kv_data": "auto",
    "redis_url": None, "redis_timeout_ms": 10000, "nvme_paths": "store", "engine_backend": "auto",
    "engine_depth": None, "peer": None,
}


def add_args(p: argparse.ArgumentParser) -> None:
    d = DEFAULTS
    p.add_argument("--config", default=None, help="YAML of any of these options (keys as the flags, with _), "
                   "e.g. configs/bench_tiers.yaml; flags win")
    p.add_argument("--total-mb", type=int, default=None, help=f"bytes moved per measurement, MiB ({d['total_mb']})")
    p.add_argument("--block-tokens", default=None, help=f"comma list of tokens per block ({d['block_tokens']})")
    p.add_argument("--layers", type=int, default=None, help=f"({d['layers']})")
    p.add_argument("--kv-heads", type=int, default=None, help=f"({d['kv_heads']})")
    p.add_argument("--head-size", type=int, default=None, help=f"({d['head_size']})")
    p.add_argument("--dtype-bytes", type=int, default=None, help="2 = fp16/bf16, 1 = fp8/int8 (2)")
    p.add_argument("--batch", type=int, default=None, help=f"blocks per put/get call ({d['batch']})")
    p.add_argument("--concurrency", default=None, help=f"comma list of caller threads ({d['concurrency']})")
    p.add_argument("--io-threads", type=int, default=None, help=f"NVMe I/O threads ({d['io_threads']})")
    p.add_argument("--repeats", type=int, default=None, help=f"({d['repeats']})")
    p.add_argument("--tiers", default=None, help=f"comma list of dram, nvme, remote, sharedfs ({d['tiers']})")
    p.add_argument("--redis-url", default=None, help="remote tier: redis://host:port of the server to measure (its "
                   "password from KVSTORE_REDIS_PASSWORD); default: a private redis-server started for the run")
    p.add_argument("--redis-timeout-ms", type=int, default=None,
                   help=f"remote tier: socket timeout of the store and the raw client ({d['redis_timeout_ms']})")
    p.add_argument("--codecs", default=None, help="comma list of tier codecs to measure (none | int8 | fp8 | "
                   "...+zstd); a codec the store does not implement yet is reported as such (none)")
    p.add_argument("--kv-data", default=None, choices=["auto", *KINDS],
                   help="block contents: KV captured from the tiny random-weight Llama, or synthetic normal KV with "
                   "per-head scales (auto: tiny-llama when a codec other than none is measured)")
    p.add_argument("--dir", default=None, type=harness.folder, help="folder for the NVMe tier (default: a temp folder)")
    p.add_argument("--nvme-paths", default=None, help="comma list of NVMe paths, each a store on its own: store "
                   "(tiers.nvme.engine as configured by default), blockio (the batched native engine on: "
                   "--engine-backend), noengine (engine off: the tier's own write/read per block) (store)")
    p.add_argument("--engine-backend", default=None, choices=["auto", "io_uring", "threads"],
                   help="blockio path: io_uring where the kernel allows it, else a thread pool (auto)")
    p.add_argument("--engine-depth", type=int, default=None,
                   help="blockio path: block files in flight per I/O thread (io_uring) or in all (threads) "
                   "(default: the tier's, 8)")
    p.add_argument("--peer", default=None, choices=["lmcache", "lmcache-l2"], help="lmcache: also run the peer's "
                   "local CPU and disk backends on the same bytes, threads and folder, interleaved (its venv: make "
                   "peers); lmcache-l2: instead, kvstore's LMCache L2 adapter beside LMCache's fs and raw_block L2 "
                   "adapters on the same folder (bench/tiers/peer_l2.py)")
    p.add_argument("--o-direct", default=None, choices=["auto", "true", "false"])
    harness.output_args(p)


def resolve(a: argparse.Namespace) -> argparse.Namespace:
    """flags > YAML (--config) > DEFAULTS."""
    y = {}
    if getattr(a, "config", None):
        y = harness.read_yaml(a.config)
        bad = set(y) - set(DEFAULTS)
        if bad:
            raise SystemExit(f"{a.config}: unknown keys {sorted(bad)}; known: {sorted(DEFAULTS)}")
    out = argparse.Namespace(**vars(a))
    for k, v in DEFAULTS.items():
        if getattr(out, k, None) is None:
            val = y.get(k, v)
            if isinstance(val, list):
                val = ",".join(str(x) for x in val)
            setattr(out, k, val)
    return out


def _block_bytes(a, block_tokens: int) -> int:
    return 2 * a.layers * a.kv_heads * a.head_size * a.dtype_bytes * block_tokens


def _fill(src: np.ndarray, a, tokens: int) -> str:
    """KV-like content (what a codec would see, see bench/tiers/kvdata.py), block index in the first bytes
    (so a block served under another's key is seen). Returns what the data is."""
    n, bb = src.shape
    dtype = {2: "float16", 4: "float32"}.get(a.dtype_bytes)
    if dtype is None:  # 1-byte elements: no codec quantizes them further
        src[:] = np.random.default_rng(0).integers(0, 256, size=bb, dtype=np.uint8)[None, :]
        what = "uint8 noise (--dtype-bytes 1)"
    else:
        what = fill_kv(src, a.kv_data, layers=a.layers, tokens=tokens, kv_heads=a.kv_heads, head_size=a.head_size,
                       dtype=dtype)
    src[:, :8] = np.arange(n, dtype=np.uint64).view(np.uint8).reshape(n, 8)
    return what


def run(a: argparse.Namespace) -> dict:
    a = resolve(a)
    if a.peer == "lmcache-l2":  # its own table (bench/tiers/peer_l2.py)
        from kvstore.bench.tiers.peer_l2 import run as run_l2

        return run_l2(a)
    block_tokens = [int(x) for x in str(a.block_tokens).split(",") if x]
    concurrency = [int(x) for x in str(a.concurrency).split(",") if x]
    tiers = [t for t in str(a.tiers).split(",") if t]
    codecs = [c for c in str(a.codecs).split(",") if c]
    if a.kv_data == "auto":
        a.kv_data = "tiny-llama" if any(c != "none" for c in codecs) else "synthetic"
    data_notes: list[str] = []
    total = a.total_mb << 20
    folder_ctx = tempfile.TemporaryDirectory(prefix="kvstore-bench-", dir=a.dir)
    folder = folder_ctx.name
    results: list[dict] = []
    skipped: list[dict] = []
    bad = [t for t in tiers if t not in ("dram", "nvme", "remote", "sharedfs")]
    if bad:
        raise SystemExit(f"--tiers: unknown {bad}; known: dram, nvme, remote, sharedfs")
    server = None
    a._redis_url, a._redis_password = None, None
    if "remote" in tiers:
        if a.redis_url:
            a._redis_url, a._redis_password = a.redis_url, os.environ.get("KVSTORE_REDIS_PASSWORD") or None
        else:
            from kvstore.bench.common import redis_local

            if redis_local.available():
                server = redis_local.start()
                a._redis_url = server.url
            else:  # the other tiers are still measured
                tiers = [t for t in tiers if t != "remote"]
                skipped += [{"tier": "remote", "codec": c, "block_tokens": None, "concurrency": None,
                             "error": "no redis-server on PATH (install it, or pass --redis-url)"} for c in codecs]
    n_steps = len(block_tokens) * (len(concurrency) * len(tiers) * len(codecs) * a.repeats) + 2
    limits: dict = {}
    peer, peer_note = None, None
    if a.peer:
        from kvstore.bench.tiers.peer import Peer

        peer = Peer.start(a.peer)
        if isinstance(peer, str):  # not installed: one line, the rest is measured
            peer, peer_note = None, peer
            print(peer_note)
        else:
            peer_note = f"{a.peer} {peer.version}"
    try:
        with harness.Progress(n_steps, "bench tiers") as bar:
            _run_all(a, block_tokens, concurrency, tiers, codecs, total, folder, data_notes, results, skipped,
                     bar, limits, peer)
    finally:
        if server is not None:
            server.stop()
        if peer is not None:
            peer.close()
    folder_ctx.cleanup()
    data = {"limits": limits, "results": results, "skipped": skipped, "kv_data": data_notes,
            "peer": peer_note, "peer_choices": [list(c) for c in PEER_CHOICES] if peer is not None else None, "params": {"kv_data": a.kv_data, "total_mb": a.total_mb, "layers": a.layers, "kv_heads": a.kv_heads, "head_size": a.head_size,
                       "dtype_bytes": a.dtype_bytes, "batch": a.batch, "repeats": a.repeats,
                       "io_threads": a.io_threads, "block_tokens": block_tokens, "concurrency": concurrency,
                       "codecs": codecs, "tiers": tiers, "nvme_paths": a.nvme_paths,
                       **({"redis": "--redis-url" if a.redis_url else "private redis-server",
                           "redis_timeout_ms": a.redis_timeout_ms} if "remote" in tiers else {})}}
    return harness.report(a, data, render, plot)


def _run_all(a, block_tokens, concurrency, tiers, codecs, total, folder, data_notes, results, skipped, bar,
             limits: dict, peer=None) -> None:
    # the dd-style reference limits (one big buffer; bench/tiers/limits.py), for the header
    mem = memcpy_gbps(total)
    bar.advance()
    dw, dr, direct = odirect_gbps(folder, total)
    bar.advance()
    limits.update({"memcpy_gbps": mem, "odirect_write_gbps": dw, "odirect_read_gbps": dr, "o_direct": direct})
    for bt in block_tokens:
        bb = _block_bytes(a, bt)
        n = max(a.batch, total // bb)
        _m1, flat = alloc_aligned(n * bb)
        src = flat.reshape(n, bb)
        what = _fill(src, a, bt)
        if what not in data_notes:
            data_notes.append(what)
        _m2, oflat = alloc_aligned(n * bb)
        out = oflat.reshape(n, bb)
        shared = None
        if peer is not None:  # the same bytes, for the peer's process
            dtype = {1: "uint8", 2: "float16", 4: "float32"}[a.dtype_bytes]
            shared = peer.share(src, [2, a.layers, bt, a.kv_heads * a.head_size], dtype)
        try:
            for tier in tiers:
                for codec in codecs:
                    for c in concurrency:
                        row = measure(tier, codec, c, bt, bb, n, src, out, folder, a, bar,
                                      peer if tier != "remote" else None)
                        if "error" in row:
                            skipped.append(row)
                        else:
                            results.extend(row["rows"])
                            skipped.extend(row.get("errors", []))
        finally:
            if shared is not None:
                os.unlink(shared)
        del src, out, flat, oflat
        gc.collect()  # a failed measurement's traceback may still hold views of the buffers
        for m in (_m1, _m2):
            try:
                m.close()
            except BufferError:  # still viewed: unmapped with its last view
                pass


def main(argv=None) -> dict:
    return harness.main(__name__, argv)
