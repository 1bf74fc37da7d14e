"""``kvstore bench tiers --peer lmcache-l2``: kvstore's LMCache L2 adapter
(``connectors/lmcache/adapter.py``, ``KVStoreL2Adapter``) beside LMCache 0.5.6's own ``fs`` adapter
(buffered, its default, and with ``use_odirect``) and its ``raw_block`` adapter, on the same folder,
the same bytes and the same caller threads, each figure beside the O_DIRECT write/read limit of that
folder measured in the same run (``bench/tiers/limits.py``, :func:`odirect_gbps`).

Every adapter is driven through the same code path, LMCache's ``L2AdapterInterface`` as its store
and prefetch controllers drive it: put = ``submit_store_task`` of a batch of L1 memory objects, then
a wait on the store event fd until ``pop_completed_store_tasks`` has the task; get =
``submit_lookup_and_lock_task`` + wait + ``query_lookup_and_lock_result``, ``submit_load_task`` into
other L1 objects + wait + ``query_load_result``, ``submit_unlock``. Each of ``callers`` threads submits
its own batches, one at a time (one event-fd listener thread per fd wakes them, as LMCache's
controllers have one). The L1 memory is LMCache's own ``L1MemoryManager``; every get's bytes are
compared with what was put (a wrong byte fails the run). The chunk bytes are random, from a seed.

What is timed and what each choice favours (the report says it again beside the table):

* put: from the first submit to the last completed store task; for kvstore also its
  ``store.flush()`` (its NVMe writes may still be running on its I/O pool). ``put+sync`` adds an
  ``os.sync()`` right after: LMCache's buffered ``fs`` adapter reports a store done once its file is
  in the page cache, so only ``put+sync`` shows its disk.
* get: after an ``os.sync()``; kvstore runs with its DRAM tier off (its gets read the files, O_DIRECT
  where the file system takes it); the buffered ``fs`` adapter reads through the page cache, whose
  pages of its files are dropped first (``posix_fadvise(DONTNEED)`` on each file, no root needed):
  its get is a cold read through the page cache (kernel readahead), said in the table.
* raw_block runs on a pre-sized file in the same folder (``posix_fallocate``: its blocks allocated
  before the clock starts, which favours it over the adapters that create a file per chunk); it
  needs LMCache's Rust extension ``lmcache-rust-raw-block-io`` (not in ``make peers``): where the peer
  venv cannot import it (nor a folder named by ``$KVSTORE_PEER_L2_SITE`` holds it), its rows are
  one line saying so.
* each adapter with its shipped defaults (kvstore: 2 task workers, 4 NVMe I/O threads; fs: asyncio,
  the default executor; raw_block: 2 store and 4 load workers, posix I/O engine).

Like ``bench/tiers/peer.py``, this file is both sides: the bench side starts
``.venv-peers/bin/python bench/tiers/peer_l2.py <this venv's site-packages>`` and speaks one JSON
object a line; the peer side imports torch and LMCache, and kvstore (this checkout) after the peer
venv's packages (``site.addsitedir``, as ``tests/test_lmcache_adapter.py`` does).
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
ADAPTERS = ("kvstore", "fs", "fs-odirect", "raw_block")
WAIT_S = 30.0  # a task's result this long after the others: lost (a liveness bound, far above any task here)
SITE_ENV = "KVSTORE_PEER_L2_SITE"  # an extra folder for the peer's sys.path (e.g. lmcache-rust-raw-block-io)
FS_MISSING = "fs skipped: LMCache's fs adapter needs aiofiles, not importable in .venv-peers"
RAW_MISSING = "raw_block skipped: LMCache's Rust extension lmcache-rust-raw-block-io is not importable in .venv-peers"


# ------------------------------------------------------------------------------ bench side
class L2Peer:
    """The peer process. ``L2Peer.start()`` returns one, or the line that says why not."""

    def __init__(self, proc: subprocess.Popen, hello: dict, errlog):
        self.proc, self.hello, self.errlog = proc, hello, errlog
        self.version = hello.get("version", "?")
        self.missing: dict = hello.get("missing", {})

    @classmethod
    def start(cls, venv: str | os.PathLike | None = None, l1_bytes: int = 1 << 30, timeout_s: float = 180.0):
        import sysconfig
        import tempfile

        py = Path(venv or VENV) / "bin" / "python"
        if not py.exists():
            return MISSING
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "KVSTORE_"))}
        env.update(PYTHONPATH=str(ROOT), LMCACHE_LOG_LEVEL="WARNING")
        if os.environ.get(SITE_ENV):
            env[SITE_ENV] = os.environ[SITE_ENV]
        errlog = tempfile.TemporaryFile(mode="w+")
        try:
            proc = subprocess.Popen([str(py), str(Path(__file__).resolve()), sysconfig.get_paths()["purelib"]],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errlog, env=env,
                                    text=True, bufsize=1, cwd="/")
        except OSError as e:
            return f"{MISSING} ({e.strerror})"
        peer = cls(proc, {}, errlog)
        try:
            hello = peer.call({"cmd": "hello", "l1_bytes": int(l1_bytes)}, timeout_s)
        except RuntimeError as e:
            peer.close()
            return f"{MISSING} ({e})"
        peer.hello, peer.version, peer.missing = hello, hello.get("version", "?"), hello.get("missing", {})
        return peer

    def _stderr_tail(self) -> str:
        try:
            self.errlog.seek(0)
            lines = [ln for ln in self.errlog.read().splitlines() if ln.strip()]
            return " | ".join(lines[-3:])[-400:]
        except (OSError, ValueError):
            return ""

    def call(self, msg: dict, timeout_s: float = 900.0) -> dict:
        """One request, one reply; RuntimeError when the peer is gone or says it failed."""
        import select

        try:
            self.proc.stdin.write(json.dumps(msg) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise RuntimeError(f"the peer process exited: {self._stderr_tail()}") from None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            why = "no answer from the peer process" if not ready else "the peer process exited"
            raise RuntimeError(f"{why}: {self._stderr_tail()}")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(reply["error"])
        return reply

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                self.proc.stdin.write(json.dumps({"cmd": "bye"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
        except (OSError, ValueError, subprocess.TimeoutExpired):
            self.proc.kill()
        self.errlog.close()


def _ratio(gbps: float, limit: float) -> float:
    return gbps / limit if limit > 0 else float("nan")


def run(a) -> dict:
    """The bench: ``a`` is ``kvstore bench tiers``'s resolved arguments (``--block-tokens``,
    ``--total-mb``, ``--concurrency``, ``--batch``, ``--repeats`` (rounds, the adapters' order
    rotated each round), ``--dir``, the block shape flags); prints the table, returns the data."""
    import tempfile

    from kvstore.bench.common import harness
    from kvstore.bench.tiers.limits import odirect_gbps

    block_tokens = [int(x) for x in str(a.block_tokens).split(",") if x]
    concurrency = [int(x) for x in str(a.concurrency).split(",") if x]
    total = a.total_mb << 20
    hidden = a.kv_heads * a.head_size
    dtype = {1: "uint8", 2: "float16", 4: "float32"}[a.dtype_bytes]

    def chunk_bytes(bt):
        return 2 * a.layers * bt * hidden * a.dtype_bytes

    ns = {bt: max(1, total // chunk_bytes(bt)) for bt in block_tokens}
    l1_bytes = max(2 * n * chunk_bytes(bt) for bt, n in ns.items()) + (64 << 20)
    data = {"mode": "lmcache-l2", "results": [], "skipped": [], "limits": [], "peer": None,
            "params": {"total_mb": a.total_mb, "block_tokens": block_tokens, "concurrency": concurrency,
                       "batch": a.batch, "repeats": a.repeats, "layers": a.layers, "kv_heads": a.kv_heads,
                       "head_size": a.head_size, "dtype_bytes": a.dtype_bytes, "seed": 0}}
    peer = L2Peer.start(l1_bytes=l1_bytes)
    if isinstance(peer, str):
        print(peer)
        data["peer"] = peer
        return harness.report(a, data, render)
    data["peer"] = f"lmcache {peer.version}"
    adapters = [x for x in ADAPTERS if x not in peer.missing]
    for name, why in peer.missing.items():
        print(why)
        data["skipped"].append({"adapter": name, "error": why})
    folder_ctx = tempfile.TemporaryDirectory(prefix="kvstore-bench-l2-", dir=a.dir)
    folder = folder_ctx.name
    try:
        n_steps = len(block_tokens) * (1 + len(concurrency) * a.repeats * (1 + len(adapters)))
        with harness.Progress(n_steps, "bench tiers --peer lmcache-l2") as bar:
            for bt in block_tokens:
                cb, n = chunk_bytes(bt), ns[bt]
                peer.call({"cmd": "data", "shape": [2, a.layers, bt, hidden], "dtype": dtype, "n": n, "seed": 0})
                for ad in adapters:  # untimed: each adapter's first run in the process (imports, pools, first faults)
                    try:
                        peer.call({"cmd": "run", "adapter": ad, "callers": 1, "batch": a.batch, "n": 2 * a.batch,
                                   "folder": os.path.join(folder, f"warm-{ad}-{bt}")})
                    except RuntimeError:
                        pass  # its timed runs say why
                bar.advance()
                for c in concurrency:
                    for rnd in range(a.repeats):
                        # the limit of this cell, right before its adapters (same folder, same bytes moved)
                        lw, lr, direct = odirect_gbps(folder, n * cb)
                        data["limits"].append({"block_tokens": bt, "concurrency": c, "round": rnd,
                                               "odirect_write_gbps": lw, "odirect_read_gbps": lr, "o_direct": direct})
                        bar.advance()
                        k = rnd % len(adapters)
                        for ad in adapters[k:] + adapters[:k]:  # alternately: each adapter leads a round
                            sub = os.path.join(folder, f"{ad}-{bt}-{c}-{rnd}")
                            try:
                                r = peer.call({"cmd": "run", "adapter": ad, "callers": c, "batch": a.batch,
                                               "folder": sub})
                            except RuntimeError as e:
                                data["skipped"].append({"adapter": ad, "block_tokens": bt, "concurrency": c,
                                                        "error": str(e)})
                                bar.advance()
                                continue
                            nbytes = r["n"] * cb
                            row = {"adapter": ad, "block_tokens": bt, "chunk_mib": cb / 2**20, "concurrency": c,
                                   "round": rnd, "n": r["n"], "verified": r["verified"], "bad": r["bad"],
                                   "put_gbps": nbytes / r["put_s"] / 1e9,
                                   "put_sync_gbps": nbytes / r["put_sync_s"] / 1e9,
                                   "get_gbps": nbytes / r["get_s"] / 1e9,
                                   "put_cpu_us_chunk": r["put_cpu"] / r["n"] * 1e6,
                                   "get_cpu_us_chunk": r["get_cpu"] / r["n"] * 1e6,
                                   "odirect_write_gbps": lw, "odirect_read_gbps": lr, "note": r.get("note", "")}
                            row["put_ratio"] = _ratio(row["put_gbps"], lw)
                            row["put_sync_ratio"] = _ratio(row["put_sync_gbps"], lw)
                            row["get_ratio"] = _ratio(row["get_gbps"], lr)
                            data["results"].append(row)
                            bar.advance()
    finally:
        peer.close()
        folder_ctx.cleanup()
    bad = [r for r in data["results"] if not r["verified"]]
    harness.report(a, data, render)
    if bad:  # a wrong byte fails the run
        raise SystemExit(f"bench tiers --peer lmcache-l2: wrong bytes read back from {sorted({r['adapter'] for r in bad})}")
    return data


LABEL = {"kvstore": "kvstore (KVStoreL2Adapter, DRAM off, NVMe o_direct auto)",
         "fs": "LMCache fs (buffered: default)",
         "fs-odirect": "LMCache fs (use_odirect)",
         "raw_block": "LMCache raw_block (pre-sized file, O_DIRECT)"}


def render(data: dict) -> str:
    """The Markdown table: per chunk size, callers and adapter, the median over rounds of put,
    put+sync and get GB/s, each with its ratio to the same cell's O_DIRECT limit (median too)."""
    import statistics

    out = [f"## kvstore's LMCache L2 adapter beside {data.get('peer')}'s L2 adapters", ""]
    if not data.get("results"):
        out.append(str(data.get("peer")) if data.get("peer") else "no results")
        for s in data.get("skipped", []):
            out.append(f"- skipped {s.get('adapter')}: {s.get('error')}")
        return "\n".join(out)
    p = data["params"]
    out.append(f"{p['total_mb']} MiB per phase, {p['batch']} chunks per task, {p['repeats']} round(s) (median), "
               f"random bytes (seed {p['seed']}); every get compared byte for byte with the put.")
    out.append("")
    out.append("| chunk MiB | callers | adapter | put GB/s | x O_DIRECT write | put+sync GB/s | x | get GB/s "
               "| x O_DIRECT read | O_DIRECT write / read GB/s | CPU us/chunk put / get | bytes ok | get reads |")
    out.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    keys = []
    for r in data["results"]:
        k = (r["block_tokens"], r["concurrency"], r["adapter"])
        if k not in keys:
            keys.append(k)
    order = {a: i for i, a in enumerate(ADAPTERS)}
    keys.sort(key=lambda k: (k[0], k[1], order.get(k[2], 99)))
    for bt, c, ad in keys:
        rs = [r for r in data["results"] if (r["block_tokens"], r["concurrency"], r["adapter"]) == (bt, c, ad)]

        def med(f):
            return statistics.median(r[f] for r in rs)

        ok = "yes" if all(r["verified"] for r in rs) else f"NO ({sum(r['bad'] for r in rs)} wrong)"
        out.append(f"| {rs[0]['chunk_mib']:g} | {c} | {LABEL.get(ad, ad)} | {med('put_gbps'):.2f} | "
                   f"{med('put_ratio'):.2f} | {med('put_sync_gbps'):.2f} | {med('put_sync_ratio'):.2f} | "
                   f"{med('get_gbps'):.2f} | {med('get_ratio'):.2f} | {med('odirect_write_gbps'):.2f} / "
                   f"{med('odirect_read_gbps'):.2f} | {med('put_cpu_us_chunk'):.0f} / {med('get_cpu_us_chunk'):.0f} "
                   f"| {ok} | {rs[0]['note']} |")
    for s in data.get("skipped", []):
        where = f" ({s['block_tokens']} tokens, {s['concurrency']} callers)" if "block_tokens" in s else ""
        out.append(f"\n- {s['adapter']}{where}: {s['error']}")
    return "\n".join(out)


# ------------------------------------------------------------------------------ peer side
class _Side:
    """The adapters, LMCache's L1 memory, and the driving of one run."""

    def __init__(self, l1_bytes: int):
        import torch
        from lmcache.v1.distributed.config import L1MemoryManagerConfig
        from lmcache.v1.distributed.memory_manager.l1_memory_manager import L1MemoryManager

        self.torch = torch
        self.l1 = L1MemoryManager(L1MemoryManagerConfig(size_in_bytes=int(l1_bytes), use_lazy=False, shm_name=""))
        self.src, self.dst, self.want = [], [], []

    def data(self, m: dict) -> dict:
        import numpy as np
        from lmcache.v1.distributed.api import MemoryLayoutDesc

        torch = self.torch
        if self.src:
            self.l1.free(self.src + self.dst)
        self.layout = MemoryLayoutDesc(shapes=[torch.Size(m["shape"])], dtypes=[getattr(torch, m["dtype"])])
        n = m["n"]
        err, self.src = self.l1.allocate(self.layout, n)
        assert self.src, f"L1 allocate: {err}"
        err, self.dst = self.l1.allocate(self.layout, n)
        assert self.dst, f"L1 allocate: {err}"
        rng = np.random.default_rng(m["seed"])
        for o in self.src:
            u8 = o.tensor.view(torch.uint8).reshape(-1)
            u8.copy_(torch.from_numpy(rng.integers(0, 256, u8.numel(), dtype=np.uint8)))
        for o in self.dst:
            o.tensor.view(torch.uint8).fill_(0)  # pre-faulted
        self.chunk = self.src[0].tensor.numel() * self.src[0].tensor.element_size()
        self.n = n
        return {"ok": True, "chunk_bytes": self.chunk}

    def _adapter(self, name: str, folder: str):
        import argparse

        from lmcache.v1.distributed.l2_adapters import create_l2_adapter
        from lmcache.v1.distributed.l2_adapters.config import add_l2_adapters_args, parse_args_to_l2_adapters_config

        os.makedirs(folder, mode=0o700, exist_ok=True)
        need = self.n * (self.chunk + 4096)
        if name == "kvstore":
            cfg = {"tiers": {"dram": {"capacity_gb": 0}, "nvme": {"path": os.path.join(folder, "kv"),
                                                                 "capacity_gb": 2 * need / 2**30 + 0.0625,
                                                                 "o_direct": "auto"}}}
            spec = {"type": "plugin", "module_path": "kvstore.connectors.lmcache.adapter",
                    "class_name": "KVStoreL2Adapter", "adapter_params": {"config": cfg, "chunk_bytes": self.chunk}}
        elif name in ("fs", "fs-odirect"):
            spec = {"type": "fs", "base_path": os.path.join(folder, "fs"), "use_odirect": name == "fs-odirect"}
        elif name == "raw_block":
            dev = os.path.join(folder, "raw_block.img")
            meta = 16 << 20
            size = meta + 2 * self.n * (self.chunk + 4096) + (16 << 20)
            fd = os.open(dev, os.O_CREAT | os.O_RDWR, 0o600)
            try:
                os.posix_fallocate(fd, 0, size)
            finally:
                os.close(fd)
            spec = {"type": "raw_block", "device_path": dev, "slot_bytes": self.chunk + 4096,
                    "meta_total_bytes": meta, "use_odirect": True}
        else:
            raise ValueError(f"unknown adapter {name!r}; known: {', '.join(ADAPTERS)}")
        ap = add_l2_adapters_args(argparse.ArgumentParser())
        cfg = parse_args_to_l2_adapters_config(ap.parse_args(["--l2-adapter", json.dumps(spec)]))
        return create_l2_adapter(cfg.adapters[0], self.l1.get_l1_memory_desc())

    def run(self, m: dict) -> dict:
        import resource
        import shutil
        import threading

        from lmcache.v1.distributed.api import ObjectKey

        torch = self.torch
        name, callers, batch, folder = m["adapter"], m["callers"], m["batch"], m["folder"]
        n = min(self.n, m.get("n") or self.n)  # a warm-up runs the first few chunks only
        ad = self._adapter(name, folder)
        salt = time.perf_counter_ns()
        keys = [ObjectKey(chunk_hash=(salt + i).to_bytes(16, "big"), model_name="bench/l2", kv_rank=0)
                for i in range(n)]
        starts = list(range(0, n, batch))
        per = [starts[t::callers] for t in range(callers)]
        waits = {op: _FdWaiter(fd) for op, fd in (("store", ad.get_store_event_fd()),
                                                   ("lookup", ad.get_lookup_and_lock_event_fd()),
                                                   ("load", ad.get_load_event_fd()))}
        done_stores: dict = {}
        store_lock = threading.Lock()
        errors: list[str] = []

        def store_result(tid):
            with store_lock:
                done_stores.update(ad.pop_completed_store_tasks())
                return done_stores.pop(tid, None)

        def put(s):
            tid = ad.submit_store_task(keys[s:s + batch], self.src[s:s + batch])
            try:
                res = waits["store"].wait(lambda: store_result(tid))
            except TimeoutError as e:
                raise TimeoutError(f"store task {tid} (chunks {s}..{s + batch - 1}): {e}") from None
            if not res.is_successful():
                errors.append(f"store task at chunk {s} failed")

        def get(s):
            ks = keys[s:s + batch]
            tid = ad.submit_lookup_and_lock_task(ks, {0: self.layout})
            bits = waits["lookup"].wait(lambda: ad.query_lookup_and_lock_result(tid))
            found = bits.get_indices_list()
            if len(found) != len(ks):
                errors.append(f"lookup at chunk {s}: {len(found)} of {len(ks)} found")
            tid = ad.submit_load_task(ks, self.dst[s:s + batch])
            bits = waits["load"].wait(lambda: ad.query_load_result(tid))
            if len(bits.get_indices_list()) != len(ks):
                errors.append(f"load at chunk {s}: {len(bits.get_indices_list())} of {len(ks)} loaded")
            ad.submit_unlock(ks)

        def cpu_now():
            u = resource.getrusage(resource.RUSAGE_SELF)
            return u.ru_utime + u.ru_stime

        def timed(fn):
            def worker(mine):
                try:
                    for s in mine:
                        fn(s)
                except Exception as e:  # noqa: BLE001 (said in the reply)
                    errors.append(f"{type(e).__name__}: {e}")

            ths = [threading.Thread(target=worker, args=(p,)) for p in per]
            t = time.perf_counter()
            for th in ths:
                th.start()
            for th in ths:
                th.join()
            return t

        note = ""
        try:
            for o in self.dst:
                o.tensor.view(torch.uint8).fill_(0)
            os.sync()
            c0 = cpu_now()
            t = timed(put)
            if name == "kvstore":
                ad.store.flush()  # its NVMe writes may still be on its I/O pool
            put_s = time.perf_counter() - t
            os.sync()
            put_sync_s = time.perf_counter() - t
            c1 = cpu_now()
            if name == "fs":  # buffered: drop its files' pages, so the get reads the disk (through the page cache)
                base = os.path.join(folder, "fs")
                for f in os.listdir(base):
                    fd = os.open(os.path.join(base, f), os.O_RDONLY)
                    try:
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    finally:
                        os.close(fd)
                note = "page cache (its pages dropped first: cold, kernel readahead)"
            elif name == "kvstore":
                note = "disk (DRAM tier off; O_DIRECT)" if _odirect_ok(folder) else "disk (DRAM tier off; buffered)"
            else:
                note = "disk (O_DIRECT)"
            os.sync()
            c2 = cpu_now()
            t = timed(get)
            get_s = time.perf_counter() - t
            c3 = cpu_now()
            bad = sum(1 for a_, b_ in zip(self.src[:n], self.dst[:n]) if not torch.equal(a_.tensor.view(torch.uint8),
                                                                                   b_.tensor.view(torch.uint8)))
        finally:
            for w in waits.values():
                w.close()
            try:
                ad.close()
            finally:
                shutil.rmtree(folder, ignore_errors=True)
        if errors:
            raise RuntimeError(f"{name}: " + "; ".join(errors[:3]))
        return {"n": n, "put_s": put_s, "put_sync_s": put_sync_s, "get_s": get_s, "put_cpu": c1 - c0,
                "get_cpu": c3 - c2, "verified": bad == 0, "bad": bad, "note": note}


def _odirect_ok(folder: str) -> bool:
    """Whether the folder's file system takes O_DIRECT (tmpfs refuses it)."""
    path = os.path.join(folder, ".odirect-probe")
    try:
        fd = os.open(path, os.O_CREAT | os.O_WRONLY | getattr(os, "O_DIRECT", 0), 0o600)
        os.close(fd)
        return hasattr(os, "O_DIRECT")
    except OSError:
        return False
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass


class _FdWaiter:
    """One listener thread on an adapter's event fd (as LMCache's controllers have one); callers
    wait on a condition it notifies, then ask the adapter for their own task."""

    def __init__(self, fd: int):
        import select
        import threading

        from lmcache.v1.platform.event_notifier import consume_fd

        self.fd, self.cond, self.stop = fd, threading.Condition(), False
        self._consume, self._poll = consume_fd, select.poll()
        self._poll.register(fd, select.POLLIN)
        self.thread = threading.Thread(target=self._listen, daemon=True)
        self.thread.start()

    def _listen(self) -> None:
        while not self.stop:
            if self._poll.poll(50):
                self._consume(self.fd)
                with self.cond:
                    self.cond.notify_all()

    def wait(self, query, timeout: float = WAIT_S):
        end = time.monotonic() + timeout
        with self.cond:
            while True:
                got = query()
                if got is not None:
                    return got
                if time.monotonic() > end:
                    raise TimeoutError(f"no result for {timeout:g} s after its event fd: the completion was lost")
                self.cond.wait(0.05)

    def close(self) -> None:
        self.stop = True
        self.thread.join()


def serve(main_site: str) -> None:
    """Peer side: JSON requests on stdin, one JSON reply a line on the real stdout."""
    import site

    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    extra = os.environ.get(SITE_ENV)
    if extra:
        site.addsitedir(extra)
    site.addsitedir(main_site)  # kvstore (this checkout) after the peer venv's own packages
    side = None
    for line in sys.stdin:
        m = json.loads(line)
        try:
            if m["cmd"] == "hello":
                import lmcache.v1.distributed.l2_adapters  # noqa: F401  (fails here without LMCache)
                from importlib.metadata import version

                import kvstore.connectors.lmcache.adapter  # noqa: F401

                missing = {}
                try:
                    import lmcache_rust_raw_block_io  # noqa: F401
                except ImportError:
                    missing["raw_block"] = RAW_MISSING + (f" (nor ${SITE_ENV})" if extra else
                                                          f" (pip install lmcache-rust-raw-block-io, or ${SITE_ENV})")
                try:
                    import aiofiles  # noqa: F401  (LMCache's fs adapter; make peers installs aiofile, not aiofiles)
                except ImportError:
                    why = FS_MISSING + (f" (nor ${SITE_ENV})" if extra else f" (pip install aiofiles, or ${SITE_ENV})")
                    missing.update({"fs": why, "fs-odirect": why})
                side = _Side(m["l1_bytes"])
                reply = {"ok": True, "version": version("lmcache"), "missing": missing}
            elif m["cmd"] == "bye":
                break
            else:
                reply = getattr(side, m["cmd"])(m)
        except Exception as e:  # noqa: BLE001 (reported to the bench)
            reply = {"error": f"{type(e).__name__}: {e}"}
        out.write(json.dumps(reply) + "\n")


if __name__ == "__main__":
    serve(sys.argv[1])
