"""The peer of ``kvstore bench tiers --peer lmcache``: LMCache 0.5.6's ``LocalCPUBackend`` and
``LocalDiskBackend`` (O_DIRECT on: ``extra_config.use_odirect``), driven as its ``StorageManager``
drives them, on the same bytes, threads and folder as kvstore's rows, interleaved with them.

LMCache cannot be imported in the test venv (it pulls CUDA packages and another numpy), so it runs
in its own venv (``make peers``: ``.venv-peers``) as a subprocess of the bench: this file is both
sides. The bench side (:class:`Peer`) starts ``.venv-peers/bin/python bench/tiers/peer.py`` and
speaks one JSON object a line over its stdin/stdout; the peer side (:func:`serve`, run as a
script) imports only numpy, torch and lmcache. The bytes are shared through a file in /dev/shm
that the bench writes once per block size; the peer copies from it as the engine's KV would come.

What the peer times, per call of ``batch`` blocks from each of ``threads`` callers:

* put: ``allocate`` a memory object per block from the ``LocalCPUBackend`` (the allocator backend
  of both), copy the block in, ``batched_submit_put_task`` to the backend, ``ref_count_down``
  (what ``StorageManager.batched_put`` does after the engine's copy). The disk backend's writes are
  asynchronous on its 4 I/O threads (``disk_io_threads``): the put is timed until the last file is
  written, as kvstore's put is timed until its files are in place.
* get: ``batched_get_blocking`` (what ``StorageManager.batched_get`` calls; disk: allocate, then
  reads on its 4-thread pool; DRAM: ``get_blocking`` per key), copy each block out,
  ``ref_count_down`` (the release).

A missing venv or LMCache is one line (``Peer.start`` returns it), never a failure.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout: bench/tiers/../..
VENV = ROOT / ".venv-peers"
MISSING = "lmcache peer not installed: run make peers"
NAMES = ("lmcache",)
# How the peer is driven, each choice beside the side it favours (printed with the table: issue
# 50 asks that a reader can weigh the comparison). From LMCache 0.5.6's StorageManager
# (batched_put, batched_get) and its two local backends, read for this bench.
CHOICES = (
    ("puts: allocate from its LocalCPUBackend, copy in, batched_submit_put_task on the caller's thread, "
     "ref_count_down, as StorageManager.batched_put does; disk writes run on its own 4 I/O threads "
     "(disk_io_threads) and the put is timed until the last file is written, as kvstore's until its files "
     "are in place", "neither"),
    ("gets: batched_get_blocking (one key on the caller's thread, more on its 4-thread pool), copy out, "
     "ref_count_down, as StorageManager.batched_get does", "neither"),
    ("no lookup call before a get, on either side (vLLM asks it apart, when it schedules; kvstore's get "
     "pins what it finds inside the call)", "neither"),
    ("O_DIRECT on for its disk (use_odirect; taken only where a chunk is page aligned, which every block "
     "here is), neither side fsyncs", "LMCache (its fastest disk path)"),
    ("disk rows: local_cpu off (its default keeps a DRAM copy of every chunk, so a get would read DRAM, "
     "not the disk)", "neither (the disk is what is measured)"),
    ("one block per chunk (chunk_size = the row's tokens), the bytes kvstore stores per key, not LMCache's "
     "256-token default chunk", "kvstore on 16- and 32-token rows (more objects per byte for LMCache)"),
    ("its MixedMemoryAllocator pool, sized for the row and pre-faulted, as a running LMCache's after "
     "warm-up", "neither"),
    ("the caller's rows (where a put reads, a get writes): anonymous memory, huge pages advised and "
     "pre-faulted, on both sides (the peer copies the shared blocks there before any clock starts)", "neither"),
    ("1 or 4 caller threads on one backend, as kvstore's rows (a vLLM worker calls it from one thread: the "
     "4-caller rows are outside its usual use)", "not measured apart"),
    ("per-call latency (p50/p99 ms) of a disk put counts its submission only: the writes end later",
     "LMCache in the latency columns only"),
)


# ------------------------------------------------------------------------------ bench side
class Peer:
    """A running peer process. ``Peer.start()`` returns one, or the line that says why not."""

    def __init__(self, proc: subprocess.Popen, version: str):
        self.proc, self.version = proc, version

    @classmethod
    def start(cls, name: str = "lmcache", venv: str | os.PathLike | None = None, timeout_s: float = 120.0):
        if name not in NAMES:
            raise SystemExit(f"--peer: unknown {name!r}; known: {', '.join(NAMES)}")
        py = Path(venv or VENV) / "bin" / "python"
        if not py.exists():
            return MISSING
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
        try:
            proc = subprocess.Popen([str(py), str(Path(__file__).resolve())], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True, bufsize=1)
        except OSError as e:
            return f"{MISSING} ({e.strerror})"
        peer = cls(proc, "")
        try:
            hello = peer.call({"cmd": "hello"}, timeout_s)
        except RuntimeError as e:
            peer.close()
            return f"{MISSING} ({e})"
        peer.version = hello.get("version", "?")
        return peer

    def call(self, msg: dict, timeout_s: float = 600.0) -> dict:
        """One request, one reply; RuntimeError when the peer is gone or says it failed."""
        import select

        try:
            self.proc.stdin.write(json.dumps(msg) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise RuntimeError("the peer process exited") from None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            raise RuntimeError("no answer from the peer process" if not ready else "the peer process exited")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(reply["error"])
        return reply

    def share(self, rows, shape: list[int], dtype: str) -> str:
        """Put the bench's blocks where the peer reads them (/dev/shm, else the temp folder)."""
        import tempfile

        import numpy as np

        where = "/dev/shm" if os.path.isdir("/dev/shm") else None
        fd, path = tempfile.mkstemp(prefix="kvstore-peer-", dir=where)
        with os.fdopen(fd, "wb") as f:
            f.write(np.ascontiguousarray(rows).data)
        self.call({"cmd": "data", "path": path, "n": int(rows.shape[0]), "bb": int(rows.shape[1]),
                   "shape": shape, "dtype": dtype})
        return path

    def run(self, tier: str, threads: int, batch: int, folder: str, io_threads: int) -> dict:
        return self.call({"cmd": "run", "tier": tier, "threads": threads, "batch": batch, "folder": folder,
                          "io_threads": io_threads})

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                self.proc.stdin.write(json.dumps({"cmd": "bye"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=30)
        except (OSError, ValueError, subprocess.TimeoutExpired):
            self.proc.kill()


# ------------------------------------------------------------------------------ peer side
class _Lmcache:
    """LMCache's two local backends on the shared bytes."""

    def __init__(self):
        import numpy as np
        import torch

        self.np, self.torch = np, torch
        self.src = None

    def _rows(self, n: int, bb: int):
        """Rows of the kind the bench gives kvstore (kvstore.tiers.memory.alloc_aligned): an
        anonymous mapping, huge pages advised, pre-faulted. The engine's memory is the caller's,
        not the library's, so both sides copy from and into the same kind (before, LMCache read
        the shared file's /dev/shm pages and wrote np.empty's: 4 KiB pages both). Measured no
        change on this VM (2026-11-30, DRAM 2 MiB: LMCache's put 15.4-16.4 GB/s either way)."""
        import mmap

        m = mmap.mmap(-1, max(1, n * bb), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        try:
            m.madvise(mmap.MADV_HUGEPAGE)
        except (OSError, AttributeError):
            pass
        self._maps.append(m)
        rows = self.np.frombuffer(m, dtype=self.np.uint8, count=n * bb).reshape(n, bb)
        rows[:] = 1  # pre-faulted, as the bench's own buffers are
        return rows

    def data(self, m: dict) -> dict:
        np = self.np
        self._maps = []
        self.n, self.bb = m["n"], m["bb"]
        self.src = self._rows(self.n, self.bb)
        self.src[:] = np.memmap(m["path"], dtype=np.uint8, mode="r", shape=(m["n"], m["bb"]))
        self.shape = self.torch.Size(m["shape"])
        self.dtype = getattr(self.torch, m["dtype"])
        self.out = self._rows(self.n, self.bb)
        return {"ok": True}

    def _backends(self, tier: str, folder: str, io_threads: int):
        import asyncio
        import threading

        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.memory_allocators.mixed_memory_allocator import MixedMemoryAllocator
        from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
        from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend

        gb = self.n * self.bb * 1.25 / 2**30 + 0.0625
        kw = dict(chunk_size=self.shape[2], local_cpu=tier == "dram", max_local_cpu_size=gb)
        if tier == "nvme":
            os.makedirs(folder, mode=0o700, exist_ok=True)
            kw.update(local_disk=folder, max_local_disk_size=2 * gb,
                      extra_config={"use_odirect": True, "disk_io_threads": io_threads})
        cfg = LMCacheEngineConfig.from_defaults(**kw)
        alloc = MixedMemoryAllocator(int(gb * 2**30), numa_mapping=None, config=cfg)
        alloc.buffer.view(-1)[:: 4096].fill_(1)  # pre-faulted, as a running LMCache's pool is after warm-up
        cpu = LocalCPUBackend(cfg, memory_allocator=alloc)
        if tier == "dram":
            return cpu, cpu, None
        loop = asyncio.new_event_loop()
        threading.Thread(target=loop.run_forever, daemon=True).start()
        return cpu, LocalDiskBackend(cfg, loop, cpu), loop

    def run(self, m: dict) -> dict:
        import threading

        from lmcache.utils import CacheEngineKey
        from lmcache.v1.memory_management import MemoryFormat

        np, torch = self.np, self.torch
        tier, threads, batch = m["tier"], m["threads"], m["batch"]
        cpu, backend, loop = self._backends(tier, m["folder"], m["io_threads"])
        salt = time.perf_counter_ns()
        keys = [CacheEngineKey("kvstore-bench", 1, 0, salt + i, self.dtype) for i in range(self.n)]
        starts = list(range(0, self.n, batch))
        per = [starts[t::threads] for t in range(threads)]

        def u8(obj):
            return obj.tensor.view(torch.uint8).numpy().reshape(-1)

        def put(s: int) -> None:
            ks = keys[s:s + batch]
            objs = [cpu.allocate(self.shape, self.dtype, MemoryFormat.KV_2LTD) for _ in ks]
            for i, o in enumerate(objs):
                np.copyto(u8(o), self.src[s + i])
            backend.batched_submit_put_task(ks, objs)
            for o in objs:
                o.ref_count_down()

        def get(s: int) -> int:
            ks = keys[s:s + batch]
            objs = backend.batched_get_blocking(ks)  # what StorageManager.batched_get calls
            got = 0
            for i, o in enumerate(objs):
                if o is not None:
                    np.copyto(self.out[s + i], u8(o))
                    o.ref_count_down()
                    got += 1
            return got

        import resource

        def cpu_now():
            u = resource.getrusage(resource.RUSAGE_SELF)
            return u.ru_utime + u.ru_stime

        def timed(fn):
            lat, got, lock = [], [0], threading.Lock()

            def worker(mine):
                my, g = [], 0
                for s in mine:
                    t = time.perf_counter()
                    g += fn(s) or 0
                    my.append(time.perf_counter() - t)
                with lock:
                    lat.extend(my)
                    got[0] += g

            ths = [threading.Thread(target=worker, args=(p,)) for p in per]
            t = time.perf_counter()
            for th in ths:
                th.start()
            for th in ths:
                th.join()
            if fn is put and tier == "nvme":  # its writes are asynchronous: until the last file is in place
                while backend.disk_worker.put_tasks:  # (one read of its list: no lock taken from its workers)
                    time.sleep(0.0005)
            return time.perf_counter() - t, lat, got[0]

        import shutil

        try:
            c0 = cpu_now()
            put_s, put_lat, _ = timed(put)
            c1 = cpu_now()
            self.out[:] = 0
            c2 = cpu_now()
            get_s, get_lat, got = timed(get)
            c3 = cpu_now()
            ok = got == self.n and bool(np.array_equal(self.out, self.src))
        finally:
            backend.close()
            if backend is not cpu:
                cpu.close()
            if loop is not None:
                loop.call_soon_threadsafe(loop.stop)
                shutil.rmtree(m["folder"], ignore_errors=True)  # its files (the next run starts empty)
        return {"put_s": put_s, "get_s": get_s, "put_lat": put_lat, "get_lat": get_lat, "verified": ok, "got": got,
                "put_cpu": c1 - c0, "get_cpu": c3 - c2}


def serve() -> None:
    """Peer side: JSON requests on stdin, one JSON reply a line on the real stdout (LMCache's own
    printing goes to stderr)."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    peer = None
    for line in sys.stdin:
        m = json.loads(line)
        try:
            if m["cmd"] == "hello":
                import lmcache  # noqa: F401  (fails here when the venv has no LMCache)
                from importlib.metadata import version

                peer = _Lmcache()
                reply = {"ok": True, "version": version("lmcache")}
            elif m["cmd"] == "bye":
                break
            else:
                reply = getattr(peer, m["cmd"])(m)
        except Exception as e:  # reported to the bench, which says it in one line
            reply = {"error": f"{type(e).__name__}: {e}"}
        out.write(json.dumps(reply) + "\n")


if __name__ == "__main__":
    serve()
