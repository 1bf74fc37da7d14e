"""``kvstore bench tiers``: store/load GB/s and latency per tier, beside the machine's limits.

DRAM put/get are compared with a one-thread memcpy of the same bytes; NVMe put/get with an
O_DIRECT sequential write/read of a file of the same size, both measured in the same run.
The default block is shaped like a 7B-class model: 32 layers, 8 KV heads, head size 128,
fp16, 16 tokens a block (2 MiB across layers).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time

import numpy as np

from bench.limits import memcpy_gbps, odirect_gbps
from bench.report import markdown_table, progress, write_json
from kvstore.config import from_dict
from kvstore.keys import ModelFingerprint, chain_keys
from kvstore.memory import alloc_aligned
from kvstore.store import KVStore

GiB = 1 << 30


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--total-mb", type=int, default=1024, help="bytes moved per measurement (MiB)")
    p.add_argument("--block-tokens", default="16", help="comma list of tokens per block, e.g. 16,32,128")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--dtype-bytes", type=int, default=2, help="2 = fp16/bf16, 1 = fp8/int8")
    p.add_argument("--batch", type=int, default=32, help="blocks per put/get call")
    p.add_argument("--concurrency", default="1", help="comma list of caller threads, e.g. 1,4")
    p.add_argument("--io-threads", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tiers", default="dram,nvme")
    p.add_argument("--dir", default=None, help="folder for the NVMe tier (default: a temp folder)")
    p.add_argument("--o-direct", default="auto", choices=["auto", "true", "false"])
    p.add_argument("--json", default=None, help="write results as JSON here")
    p.add_argument("--plots", default=None, help="write PNG plots into this folder")


def _block_bytes(a, block_tokens: int) -> int:
    return 2 * a.layers * a.kv_heads * a.head_size * a.dtype_bytes * block_tokens


def _make_store(tier: str, n_blocks: int, block_bytes: int, folder: str, a, tokens: int) -> KVStore:
    slot = (block_bytes + 4095) // 4096 * 4096
    if tier == "dram":
        tiers = {"dram": {"capacity_gb": (n_blocks * slot + (1 << 20)) / GiB, "ttl_s": None},
                 "nvme": {"capacity_gb": 0}}
    else:
        tiers = {"dram": {"capacity_gb": 0},
                 "nvme": {"capacity_gb": (n_blocks * (slot + 4096) * 2) / GiB, "ttl_s": None, "path": folder,
                          "o_direct": {"auto": "auto", "true": True, "false": False}[a.o_direct],
                          "io_threads": a.io_threads}}
    cfg = from_dict({"tiers": tiers})
    fp = ModelFingerprint(model=f"bench-{tier}-{time.perf_counter_ns()}", block_size=tokens)
    return KVStore(cfg, block_bytes=block_bytes, fingerprint=fp, block_tokens=tokens)


def _run_op(fn, keys: list[bytes], rows: np.ndarray, batch: int, threads: int) -> tuple[float, list[float]]:
    """Call fn(keys[i:i+batch], rows[i:i+batch]) over all keys from ``threads`` callers."""
    starts = list(range(0, len(keys), batch))
    per = [starts[t::threads] for t in range(threads)]
    lat: list[float] = []
    lock = threading.Lock()

    def worker(my):
        mine = []
        for s in my:
            t = time.perf_counter()
            fn(keys[s:s + batch], rows[s:s + batch])
            mine.append(time.perf_counter() - t)
        with lock:
            lat.extend(mine)

    ths = [threading.Thread(target=worker, args=(p,)) for p in per]
    t0 = time.perf_counter()
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    return time.perf_counter() - t0, lat


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1e3 if xs else 0.0


def run(a: argparse.Namespace) -> dict:
    block_tokens = [int(x) for x in str(a.block_tokens).split(",") if x]
    concurrency = [int(x) for x in str(a.concurrency).split(",") if x]
    tiers = [t for t in a.tiers.split(",") if t]
    total = a.total_mb << 20
    folder_ctx = tempfile.TemporaryDirectory(prefix="kvstore-bench-", dir=a.dir)
    folder = folder_ctx.name
    results: list[dict] = []
    n_steps = len(block_tokens) * len(concurrency) * len(tiers) * a.repeats + 2
    bar, task = progress(n_steps, "bench tiers")
    with bar:
        mem = memcpy_gbps(total)
        bar.advance(task)
        dw, dr, direct = odirect_gbps(folder, total)
        bar.advance(task)
        limits = {"memcpy_gbps": mem, "odirect_write_gbps": dw, "odirect_read_gbps": dr, "o_direct": direct}
        for bt in block_tokens:
            bb = _block_bytes(a, bt)
            n = max(a.batch, total // bb)
            _, flat = alloc_aligned(n * bb)
            src = flat.reshape(n, bb)
            src[:] = np.arange(bb, dtype=np.uint64).astype(np.uint8)[None, :]
            src[:, :8] = np.arange(n, dtype=np.uint64).view(np.uint8).reshape(n, 8)
            _, oflat = alloc_aligned(n * bb)
            out = oflat.reshape(n, bb)
            for tier in tiers:
                for c in concurrency:
                    put_t, get_t, put_l, get_l, ok = [], [], [], [], True
                    for r in range(a.repeats):
                        store = _make_store(tier, n, bb, folder, a, bt)
                        keys = chain_keys(store.root, np.arange(n * bt) % 50000 + r, bt)
                        try:
                            t, lat = _run_op(store.put, keys, src, a.batch, c)
                            put_t.append(t)
                            put_l += lat
                            out[:] = 0
                            t, lat = _run_op(store.get, keys, out, a.batch, c)
                            get_t.append(t)
                            get_l += lat
                            ok = ok and bool(np.array_equal(out, src))
                        finally:
                            store.close(persist=False)
                        bar.advance(task)
                    for op, ts, lat in (("put", put_t, put_l), ("get", get_t, get_l)):
                        gbps = n * bb / statistics.median(ts) / 1e9
                        if tier == "dram":
                            limit, limit_name = mem, "memcpy"
                        else:
                            limit, limit_name = (dw, "odirect_write") if op == "put" else (dr, "odirect_read")
                        results.append({"tier": tier, "op": op, "block_tokens": bt, "block_bytes": bb,
                                        "concurrency": c, "gbps": gbps, "limit": limit_name, "limit_gbps": limit,
                                        "ratio": gbps / limit, "p50_ms": _pct(lat, 0.5), "p99_ms": _pct(lat, 0.99),
                                        "verified": ok})
    folder_ctx.cleanup()
    data = {"limits": limits, "results": results,
            "params": {"total_mb": a.total_mb, "layers": a.layers, "kv_heads": a.kv_heads, "head_size": a.head_size,
                       "dtype_bytes": a.dtype_bytes, "batch": a.batch, "repeats": a.repeats}}
    print(render(data))
    write_json(a.json, data)
    if a.plots:
        plot(data, a.plots)
    return data


def render(data: dict) -> str:
    L = data["limits"]
    head = (f"Limits measured in this run: memcpy {L['memcpy_gbps']:.2f} GB/s; "
            f"{'O_DIRECT' if L['o_direct'] else 'buffered+fsync'} sequential write {L['odirect_write_gbps']:.2f} GB/s, "
            f"read {L['odirect_read_gbps']:.2f} GB/s\n")
    cols = ["tier", "op", "block_tokens", "block_bytes", "concurrency", "gbps", "limit", "limit_gbps", "ratio",
            "p50_ms", "p99_ms", "verified"]
    return head + "\n" + markdown_table(data["results"], cols,
                                        ["tier", "op", "tokens/blk", "bytes/blk", "threads", "GB/s", "limit",
                                         "limit GB/s", "ratio", "p50 ms", "p99 ms", "ok"])


def plot(data: dict, folder: str) -> list[str]:
    import os

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(folder, exist_ok=True)
    rows = data["results"]
    labels = [f"{r['tier']} {r['op']}\n{r['block_tokens']}t x{r['concurrency']}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(6, len(rows) * 0.9), 4))
    x = np.arange(len(rows))
    ax.bar(x - 0.2, [r["gbps"] for r in rows], 0.4, label="kvstore GB/s")
    ax.bar(x + 0.2, [r["limit_gbps"] for r in rows], 0.4, label="limit GB/s (same run)")
    for i, r in enumerate(rows):
        ax.text(i, max(r["gbps"], r["limit_gbps"]), f"{r['ratio']:.0%}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(x, labels, fontsize=8)
    ax.set_ylabel("GB/s")
    ax.set_title("kvstore tiers vs. machine limits")
    ax.legend()
    fig.tight_layout()
    path = os.path.join(folder, "tiers_gbps.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="kvstore bench tiers", description=__doc__)
    add_args(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    main()
