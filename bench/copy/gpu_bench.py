"""GPU copy path against its limit, measured in the same run (issue 15).

    python -m kvstore.bench.copy.gpu_bench --out DIR          # writes DIR/gpu_bench.json and DIR/gpu_bench.md

For each layout (FlashAttention ``[2, B, N, H, D]``, FlashInfer ``[B, 2, N, H, D]``, vLLM's default
LBNHC), block size (16, 32, 128 tokens) and blocks per call (1, 16, 256): GB/s of gather (D2H) and
scatter (H2D) in ``kernel`` mode (``--modes`` for more), beside the limit: one ``cudaMemcpyAsync`` (torch ``copy_``,
non-blocking) of the same bytes between the same pinned host memory and one device buffer. Each
figure is the median of CUDA-event timings on a side stream, interleaved with the limit's, idle
and again while a bf16 matmul loop keeps the compute stream busy (16 and 256 blocks per call).
``mode=dma`` apart (``--dma-probe``): batched and looped, short runs and whole-block runs. The DRAM slab: a
``SlabPool`` registered with ``cudaHostRegister`` chunk by chunk, its RSS against its capacity
(and PyTorch's pinned allocator for the same size), and scatter from its slots against memcpy.

Model geometry defaults to Llama-3-8B (32 layers, 8 KV heads, head size 128, bf16): a 16-token
block is 2 MiB.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from kvstore.bench.copy.gpu_report import markdown, write_run


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kvstore.bench.copy.gpu_bench", description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="folder for gpu_bench.json and gpu_bench.md")
    p.add_argument("--layouts", default="flash_attn,flashinfer,vllm_LBNHC")
    p.add_argument("--block-sizes", default="16,32,128")
    p.add_argument("--per-call", default="1,16,256", help="blocks per gather/scatter call")
    p.add_argument("--modes", default="kernel",
                   help="modes timed in the grid; mode=dma is timed apart (--dma-probe): with 256-byte runs "
                        "it moves 0.1-0.7 GB/s (H200, measured), which would eat the budget")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--min-ms", type=float, default=40.0, help="time each figure over at least this long")
    p.add_argument("--contention-per-call", default="16,256",
                   help="blocks per call also measured while a bf16 matmul loop runs on the compute stream "
                        "('' = never)")
    p.add_argument("--budget-s", type=float, default=240.0,
                   help="start no new copy cell after this many seconds (what ran is reported)")
    p.add_argument("--dma-probe", choices=["on", "off"], default="on",
                   help="time mode=dma with cudaMemcpyBatchAsync and with a cudaMemcpyAsync loop, short runs "
                        "(FlashAttention) and whole-block runs (cross-layer)")
    p.add_argument("--slab-gib", type=float, default=4.0, help="DRAM slab size for the pinning check")
    p.add_argument("--seed", type=int, default=0)
    return p


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(x.split()[1]) * 1024 for x in f if x.startswith("VmRSS:"))


def _layout(name: str, B: int, a, N: int):
    import torch

    from kvstore.kvcopy.layout import named_layout

    return named_layout(name, B, a.layers, N, a.heads, a.head_size, getattr(torch, a.dtype))


def _cache(layout, gen):
    """One allocation for all layers, random bytes (never zeros), as per-layer views."""
    import torch

    extent = 1 + sum((n - 1) * s for n, s in zip(layout.stacked_shape, layout.stacked_strides))
    raw = torch.empty(extent * layout.elem_size, dtype=torch.uint8, device="cuda")
    raw.random_(0, 256, generator=gen)
    st = raw.view(getattr(torch, layout.dtype)).as_strided(layout.stacked_shape, layout.stacked_strides)
    return [st[:, l] for l in range(layout.num_layers)] if layout.kind == "cross_layer" else \
        [st[l] for l in range(layout.num_layers)]


class Timer:
    """Median seconds of ``fn`` on ``stream`` by CUDA events; reps sized to ``min_ms``."""

    def __init__(self, stream, min_ms: float):
        self.stream, self.min_ms = stream, min_ms

    def reps_for(self, fn) -> int:
        import torch

        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.stream):
            k0 = fn()  # warm-up
            s.record()
            k1 = fn()
            e.record()
        e.synchronize()
        del k0, k1
        one = max(s.elapsed_time(e), 1e-3)
        return int(min(200, max(3 if one > 50 else 8, math.ceil(self.min_ms / one))))

    def interleaved(self, fns: dict, reps: int) -> dict:
        """Median seconds of each fn, timed round-robin on the stream."""
        import torch

        out = {k: [] for k in fns}
        evs, keep = [], []  # keep the copies' events: dropping one waits for it on the host
        with torch.cuda.stream(self.stream):
            for _ in range(reps):
                for k, fn in fns.items():
                    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    s.record()
                    keep.append(fn())
                    e.record()
                    evs.append((k, s, e))
        self.stream.synchronize()
        keep.clear()
        for k, s, e in evs:
            out[k].append(s.elapsed_time(e) / 1e3)
        return {k: statistics.median(v) for k, v in out.items()}


class MatmulLoad:
    """Keeps the compute (default) stream busy with bf16 16k x 16k matmuls (~11 ms each: few
    launches, so queuing seconds of them never blocks the host on a full launch queue)."""

    N = 16384

    def __init__(self):
        import torch

        self.a = torch.randn(self.N, self.N, device="cuda", dtype=torch.bfloat16)
        self.b = torch.randn(self.N, self.N, device="cuda", dtype=torch.bfloat16)
        self.c = torch.empty_like(self.a)
        torch.matmul(self.a, self.b, out=self.c)
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(10):
            torch.matmul(self.a, self.b, out=self.c)
        e.record()
        e.synchronize()
        self.ms = s.elapsed_time(e) / 10
        self.tflops = 2 * self.N**3 / (self.ms / 1e3) / 1e12

    def enqueue(self, ms: float):
        """Queue about ``ms`` of matmuls on the default stream; returns an event recorded after them."""
        import torch

        with torch.cuda.stream(torch.cuda.default_stream()):
            for _ in range(max(1, int(math.ceil(ms / self.ms)))):
                torch.matmul(self.a, self.b, out=self.c)
            ev = torch.cuda.Event()
            ev.record()
        return ev


def bench_copies(a, gen, rows: list, flush) -> None:
    import torch

    from kvstore import kvcopy

    # The copy stream has the higher priority: its kernels' blocks are scheduled before queued
    # matmul blocks (what the worker's copy stream should do too).
    side = torch.cuda.Stream(priority=-1)
    timer = Timer(side, a.min_ms)
    contended = {int(x) for x in a.contention_per_call.split(",") if x}
    load = MatmulLoad() if contended else None
    if load:
        print(f"# bf16 {load.N}^3 matmul alone: {load.ms:.2f} ms ({load.tflops:.0f} TFLOP/s)", file=sys.stderr)
    per_call = [int(x) for x in a.per_call.split(",")]
    t_start = time.perf_counter()
    for bs in [int(x) for x in a.block_sizes.split(",")]:
        for name in a.layouts.split(","):
            nmax = max(per_call)
            layout = _layout(name, nmax + 8, a, bs)
            caches = _cache(layout, gen)
            cp = kvcopy.KVCopier(caches, layout)
            host = torch.empty(nmax * layout.block_bytes, dtype=torch.uint8, pin_memory=True)
            dev = torch.empty(nmax * layout.block_bytes, dtype=torch.uint8, device="cuda")
            dev.random_(0, 256, generator=gen)
            host.copy_(dev)  # random bytes, never zeros
            for n in per_call:
                if time.perf_counter() - t_start > a.budget_s:
                    print(f"# budget of {a.budget_s:.0f} s spent: {name} bs={bs} n={n} and later cells not run",
                          file=sys.stderr, flush=True)
                    return
                t_cell = time.perf_counter()
                nbytes = n * layout.block_bytes
                ids = np.random.default_rng(a.seed + n).choice(layout.num_blocks, n, replace=False)
                slab = host[:nbytes].view(n, layout.block_bytes)
                h, d = host[:nbytes], dev[:nbytes]
                fns = {"d2h_limit": lambda: h.copy_(d, non_blocking=True),
                       "h2d_limit": lambda: d.copy_(h, non_blocking=True)}
                for mode in a.modes.split(","):
                    fns[f"gather_{mode}"] = lambda m=mode: cp.gather(ids, slab, mode=m, stream=side)
                    fns[f"scatter_{mode}"] = lambda m=mode: cp.scatter(slab, ids, mode=m, stream=side)
                reps = min(timer.reps_for(f) for f in fns.values())  # the slowest sets it
                t = timer.interleaved(fns, reps)
                phases = [("idle", t, None)]
                if load and n in contended:
                    # queue 1.5x the idle run's copy time of matmuls, then the same copies; the figure
                    # counts only if the matmuls were still running when the copies ended
                    mm_end = load.enqueue(sum(t.values()) * 1e3 * reps * 1.5 + 5)
                    tm = timer.interleaved(fns, reps)
                    overlapped = not mm_end.query()
                    torch.cuda.synchronize()
                    phases.append(("matmul", tm, overlapped))
                for under, tt, overlapped in phases:
                    for mode in a.modes.split(","):
                        for op, lim in (("gather", "d2h_limit"), ("scatter", "h2d_limit")):
                            gb, lgb = nbytes / tt[f"{op}_{mode}"] / 1e9, nbytes / tt[lim] / 1e9
                            rows.append(dict(section="copy", layout=name, block_tokens=bs, blocks_per_call=n,
                                             mib=round(nbytes / 2**20, 1), op=op, mode=mode, under=under,
                                             gbps=round(gb, 2), limit_gbps=round(lgb, 2),
                                             ratio=round(gb / lgb, 3), reps=reps, overlapped=overlapped))
                flush()
                print(f"# {name} bs={bs} n={n}: {reps} reps, {time.perf_counter() - t_cell:.1f} s",
                      file=sys.stderr, flush=True)
            caches = cp = host = dev = slab = h = d = None
            torch.cuda.empty_cache()


def bench_dma(a, gen, rows: list, flush) -> None:
    """mode=dma as cudaMemcpyBatchAsync and as a cudaMemcpyAsync loop, against kernel and the limit,
    for short runs (FlashAttention: one K or V page per layer) and whole-block runs (cross-layer)."""
    import torch

    from kvstore import kvcopy

    if a.dma_probe != "on":
        return
    cu = kvcopy.cuda_module()
    side = torch.cuda.Stream(priority=-1)
    timer = Timer(side, a.min_ms)
    for name in ("flash_attn", "vllm_BLNHC"):
        n = 16
        layout = _layout(name, n + 8, a, 16)
        caches = _cache(layout, gen)
        cp = kvcopy.KVCopier(caches, layout)
        nbytes = n * layout.block_bytes
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        slab = host.view(n, layout.block_bytes)
        ids = np.arange(n)

        def dma(batch: bool, op: str):
            def f():
                cu.set_use_batch_api(int(batch))
                return cp.gather(ids, slab, mode="dma", stream=side) if op == "gather" else \
                    cp.scatter(slab, ids, mode="dma", stream=side)
            return f

        fns = {"d2h_limit": lambda: host.copy_(dev, non_blocking=True),
               "h2d_limit": lambda: dev.copy_(host, non_blocking=True),
               "gather_kernel": lambda: cp.gather(ids, slab, mode="kernel", stream=side),
               "scatter_kernel": lambda: cp.scatter(slab, ids, mode="kernel", stream=side),
               "gather_dma_batch": dma(True, "gather"), "scatter_dma_batch": dma(True, "scatter"),
               "gather_dma_loop": dma(False, "gather"), "scatter_dma_loop": dma(False, "scatter")}
        t = timer.interleaved(fns, 5)
        cu.set_use_batch_api(1)
        info = cp.plan_info()
        for k, v in t.items():
            if k.endswith("_limit"):
                continue
            lim = t["d2h_limit" if k.startswith("gather") else "h2d_limit"]
            rows.append(dict(section="dma", layout=name, op=k, blocks_per_call=n, run_bytes=info.get("run_bytes"),
                             copies=n * info.get("runs_per_block", 0), gbps=round(nbytes / v / 1e9, 2),
                             limit_gbps=round(nbytes / lim / 1e9, 2), ratio=round(lim / v, 3),
                             us_per_copy=round(v * 1e6 / max(1, n * info.get("runs_per_block", 1)), 2)))
        flush()
        caches = cp = host = dev = slab = None
        torch.cuda.empty_cache()


def bench_slab(a, gen, rows: list, flush) -> None:
    """The DRAM slab: registered, resident at its capacity, copies at pinned speed."""
    import torch

    from kvstore import kvcopy
    from kvstore.tiers.dram.pool import SlabPool

    side = torch.cuda.Stream()
    timer = Timer(side, a.min_ms)
    layout = _layout("flash_attn", 264, a, 16)
    caches = _cache(layout, gen)
    cp = kvcopy.KVCopier(caches, layout)
    n_slots = int(a.slab_gib * 2**30) // layout.block_bytes
    cap = n_slots * layout.block_bytes
    r0, t0 = _rss(), time.perf_counter()
    pool = SlabPool(n_slots, layout.block_bytes, pin=True)
    prep = time.perf_counter() - t0
    grew = _rss() - r0
    rows.append(dict(section="slab", what="kvstore SlabPool (mmap + cudaHostRegister per chunk)",
                     capacity_gib=round(cap / 2**30, 3), rss_gib=round(grew / 2**30, 3),
                     rss_over_capacity=round(grew / cap, 3), pinned=pool.pinned, prepare_s=round(prep, 2)))
    # PyTorch's pinned allocator, for the same size plus a little (not a power of two)
    ask = cap + (cap >> 3)
    r1, t1 = _rss(), time.perf_counter()
    tp = torch.empty(ask, dtype=torch.uint8, pin_memory=True)
    tprep = time.perf_counter() - t1
    tgrew = _rss() - r1
    stats = {}
    try:
        stats = {k: v for k, v in torch.cuda.host_memory_stats().items() if "reserved_bytes.current" in k
                 or "allocated_bytes.current" in k}
    except Exception:
        pass
    rows.append(dict(section="slab", what="torch.empty(pin_memory=True)", capacity_gib=round(ask / 2**30, 3),
                     rss_gib=round(tgrew / 2**30, 3), rss_over_capacity=round(tgrew / ask, 3), pinned=True,
                     prepare_s=round(tprep, 2), host_memory_stats=stats))
    # copies from slab slots (one slot per block, spread over the pool) against memcpy
    n = 256
    step = max(1, n_slots // n)
    slots = [pool.view(i * step) for i in range(n)]
    ids = np.arange(n)
    nbytes = n * layout.block_bytes
    h, d = tp[:nbytes], torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    fns = {"h2d_limit": lambda: d.copy_(h, non_blocking=True),
           "d2h_limit": lambda: h.copy_(d, non_blocking=True),
           "scatter_kernel": lambda: cp.scatter(slots, ids, mode="kernel", stream=side),
           "gather_kernel": lambda: cp.gather(ids, slots, mode="kernel", stream=side),
           "scatter_dma": lambda: cp.scatter(slots, ids, mode="dma", stream=side),
           "gather_dma": lambda: cp.gather(ids, slots, mode="dma", stream=side)}
    reps = min(timer.reps_for(f) for f in fns.values())  # the slowest sets it
    t = timer.interleaved(fns, reps)
    for k in ("scatter_kernel", "scatter_dma", "gather_kernel", "gather_dma"):
        lim = t["h2d_limit" if k.startswith("scatter") else "d2h_limit"]
        rows.append(dict(section="slab_copy", op=k, block_tokens=16, blocks_per_call=n,
                         gbps=round(nbytes / t[k] / 1e9, 2), limit_gbps=round(nbytes / lim / 1e9, 2),
                         ratio=round(lim / t[k], 3)))
    pool.close()
    flush()


def main(argv: list[str] | None = None) -> int:
    import torch

    a = build_parser().parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_bench: no CUDA device", file=sys.stderr)
        return 2
    from kvstore import kvcopy

    cu = kvcopy.cuda_module()
    if cu is None:
        print(f"gpu_bench: the CUDA copy module is not built: {kvcopy.native_error('cuda')}", file=sys.stderr)
        return 2
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator(device="cuda").manual_seed(a.seed)
    rows: list = []
    header = (f"# GPU copy path: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
              f"{cu.runtime_info()}; {a.layers} layers x {a.heads} KV heads x {a.head_size} ({a.dtype})")
    errors: list = []

    def flush() -> str:
        return write_run(out, "gpu_bench", a, rows, errors, markdown(rows, header), torch.cuda.get_device_name(0))

    for part in (bench_slab, bench_dma, bench_copies):
        try:
            part(a, gen, rows, flush)
        except Exception as e:  # report what ran, then fail
            import traceback

            traceback.print_exc()
            errors.append(f"{part.__name__}: {type(e).__name__}: {e}")
    print(flush())
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
