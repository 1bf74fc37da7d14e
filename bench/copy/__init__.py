"""Copy-kernel benchmark: GB/s of gather and scatter against limits measured in the same run.

    python -m kvstore.bench.copy                       # CPU: vllm_cpu + flash_attn, block sizes 16/32/128
    python -m kvstore.bench.copy --device cuda         # GPU: kernel / dma vs pinned memcpy and a per-block loop
    python -m kvstore.bench.copy --json out.json

CPU limits: ``memcpy`` = numpy copyto of one pre-faulted contiguous buffer of the
same total size (one thread), and ``memcpy_mt`` = the native module's parallel
memcpy with the same thread count and store policy.  ``ratio`` is against the
better of the two.  GPU limits: one contiguous pinned ``cudaMemcpyAsync`` of the
same bytes (torch ``copy_(non_blocking=True)``), and the per-(block, layer)
``cudaMemcpyAsync`` loop a naive connector would issue (torch copies).

Bytes are counted once (n_blocks * block_bytes per operation).  ``run(args)``
returns a dict (used by ``kvstore bench copy``).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from typing import Any

import numpy as np

from kvstore.bench.common import harness
from kvstore.bench.common.report import write_json


def build_parser() -> argparse.ArgumentParser:
    return harness.parser(__name__, prog="python -m kvstore.bench.copy")


def add_args(p: argparse.ArgumentParser) -> None:
    """The flags (``kvstore bench copy`` and ``python -m kvstore.bench.copy`` share them)."""
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--layouts", default=None,
                   help="comma list of layouts (cpu default: vllm_cpu,flash_attn; cuda default: "
                        "vllm_LBNHC,vllm_BLNHC,flash_attn). vllm_<NAME> = KVLayout.vllm(NAME)")
    p.add_argument("--block-sizes", default="16,32,128")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--dtype", default="float16")
    p.add_argument("--blocks", type=int, default=1024,
                   help="blocks per copy at block size 16; other block sizes copy the same bytes")
    p.add_argument("--total-mb", type=float, default=None,
                   help="bytes per copy instead of --blocks (MiB)")
    p.add_argument("--pool-factor", type=float, default=1.25,
                   help="cache blocks = ceil(n * factor); ids are a random sample")
    p.add_argument("--threads", type=int, default=0, help="CPU threads (0 = module default)")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--list-form", action="store_true", help="store blocks as a list of 1-D slots")
    p.add_argument("--modes", default="kernel,dma", help="cuda modes to time")
    p.add_argument("--max-dma-runs", type=int, default=200_000,
                   help="skip mode=dma when a copy would take more cudaMemcpy calls than this")
    p.add_argument("--nt", choices=["auto", "on", "off"], default="auto",
                   help="CPU non-temporal stores")
    harness.output_args(p, plots=False)
    p.add_argument("--seed", type=int, default=0)


def _torch_dtype(name: str):
    import torch

    return getattr(torch, name)


def _make_layout(name: str, B: int, a, N: int):
    from kvstore.kvcopy import KVLayout

    dt = _torch_dtype(a.dtype)
    if name.startswith("vllm_") and name != "vllm_cpu":
        return KVLayout.vllm(name[5:], B, a.layers, N, a.heads, a.head_size, dt)
    if name == "mla":
        return KVLayout.mla(B, a.layers, N, a.heads * a.head_size, dt)
    ctor = getattr(KVLayout, name)
    return ctor(B, a.layers, N, a.heads, a.head_size, dt)


def _alloc_cache(layout, device: str):
    """One allocation for all layers (as vLLM does), handed over as per-layer views."""
    import torch

    dt = _torch_dtype_from_layout(layout)
    stacked = torch.empty_strided(layout.stacked_shape, layout.stacked_strides, dtype=dt,
                                  device=device)
    stacked.zero_()  # pre-fault
    if layout.kind == "cross_layer":
        return [stacked[:, l] for l in range(layout.num_layers)], stacked
    return [stacked[l] for l in range(layout.num_layers)], stacked


def _torch_dtype_from_layout(layout):
    import torch

    return getattr(torch, layout.dtype) if layout.dtype else torch.uint8


def _time(fn, repeat: int, sync=None) -> list[float]:
    fn()  # warm-up (also faults in anything not yet touched)
    if sync:
        sync()
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        if sync:
            sync()
        out.append(time.perf_counter() - t0)
    return out


def _gbps(nbytes: int, secs: list[float]) -> float:
    return nbytes / statistics.median(secs) / 1e9


def _row(table, **kw):
    table.append(kw)
    return kw


def _storage_u8(t):
    import torch

    return torch.tensor([], dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


def _interleaved(fns: dict, repeat: int, sync=None) -> dict:
    """Time several functions round-robin (so machine noise hits all alike); one
    warm-up each.  Returns name -> list of seconds."""
    for fn in fns.values():
        fn()
    if sync:
        sync()
    out = {k: [] for k in fns}
    for _ in range(repeat):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            if sync:
                sync()
            out[k].append(time.perf_counter() - t0)
    return out


def run_cpu(a) -> list[dict]:
    import torch

    from kvstore import kvcopy

    cpu = kvcopy.cpu_module()
    if a.threads:
        kvcopy.set_num_threads(a.threads)
    threads = kvcopy.get_num_threads()
    nt = {"auto": None, "on": True, "off": False}[a.nt]
    nt_i = -1 if nt is None else int(nt)
    rng = np.random.default_rng(a.seed)
    layouts = (a.layouts or "vllm_cpu,flash_attn").split(",")
    rows: list[dict] = []
    for bs in [int(x) for x in a.block_sizes.split(",")]:
        for name in layouts:
            probe = _make_layout(name, 1, a, bs)
            if a.total_mb:
                n = max(1, int(a.total_mb * 2**20 // probe.block_bytes))
            else:
                n = max(1, a.blocks * 16 // bs)
            nbytes = n * probe.block_bytes
            B = int(math.ceil(n * a.pool_factor))
            layout = _make_layout(name, B, a, bs)
            caches, stacked = _alloc_cache(layout, "cpu")
            ids = rng.choice(B, size=n, replace=False).astype(np.int64)
            ids2 = rng.choice(B, size=n, replace=False).astype(np.int64)
            slab = torch.zeros(n, layout.block_bytes, dtype=torch.uint8)
            dst: Any = [slab[i] for i in range(n)] if a.list_form else slab
            cp = kvcopy.KVCopier(caches, layout)
            plan = cp.plan_info()
            # limits on the same (pre-faulted) memory: cache storage -> slab
            src_np = _storage_u8(stacked).numpy()[:nbytes]
            dst_np = slab.numpy().reshape(-1)
            fns = {
                "memcpy": lambda: np.copyto(dst_np, src_np),
                "gather": lambda: cp.gather(ids, dst, nt=nt),
                "scatter": lambda: cp.scatter(dst, ids2, nt=nt),
            }
            if cpu is not None:
                sp, dp = src_np.ctypes.data, dst_np.ctypes.data
                fns["memcpy_mt"] = lambda: cpu.memcpy(dp, sp, nbytes, threads, nt_i)
            t = _interleaved(fns, a.repeat)
            lim1 = _gbps(nbytes, t["memcpy"])
            limmt = _gbps(nbytes, t["memcpy_mt"]) if "memcpy_mt" in t else None
            limit = max(lim1, limmt or 0.0)
            for op in ("gather", "scatter"):
                gb = _gbps(nbytes, t[op])
                _row(rows, device="cpu", layout=name, op=op, block_size=bs, n_blocks=n,
                     mib=round(nbytes / 2**20, 1), threads=threads, run_bytes=plan.get("run_bytes"),
                     gbps=round(gb, 2), limit_gbps=round(limit, 2),
                     memcpy_gbps=round(lim1, 2),
                     memcpy_mt_gbps=round(limmt, 2) if limmt else None,
                     ratio=round(gb / limit, 3))  # fmt: skip
            caches = stacked = slab = dst = cp = src_np = dst_np = fns = t = None  # free before the next allocation
    return rows


def run_cuda(a) -> list[dict]:
    import torch

    from kvstore import kvcopy

    if not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device")
    cu = kvcopy.cuda_module()
    rng = np.random.default_rng(a.seed)
    layouts = (a.layouts or "vllm_LBNHC,vllm_BLNHC,flash_attn").split(",")
    modes = a.modes.split(",")
    stream = torch.cuda.Stream()
    sync = stream.synchronize
    rows: list[dict] = []
    for bs in [int(x) for x in a.block_sizes.split(",")]:
        probe = _make_layout(layouts[0], 1, a, bs)
        n = max(1, int(a.total_mb * 2**20 // probe.block_bytes)) if a.total_mb else max(1, a.blocks * 16 // bs)
        nbytes = n * probe.block_bytes
        host = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=True)
        dev = torch.ones(nbytes, dtype=torch.uint8, device="cuda")
        with torch.cuda.stream(stream):
            d2h = _gbps(nbytes, _time(lambda: host.copy_(dev, non_blocking=True), a.repeat, sync))
            h2d = _gbps(nbytes, _time(lambda: dev.copy_(host, non_blocking=True), a.repeat, sync))
        dev = None  # free before the next allocation
        for name in layouts:
            B = int(math.ceil(n * a.pool_factor))
            layout = _make_layout(name, B, a, bs)
            caches, stacked = _alloc_cache(layout, "cuda")
            ids = rng.choice(B, size=n, replace=False).astype(np.int64)
            slab = host[: n * layout.block_bytes].view(n, layout.block_bytes)
            dst: Any = [slab[i] for i in range(n)] if a.list_form else slab
            cp = kvcopy.KVCopier(caches, layout)
            # naive connector: one cudaMemcpyAsync per (block, layer) page (torch copies)
            flat = stacked.view(torch.uint8)
            L, lb = layout.num_layers, layout.layer_bytes

            def naive_gather():
                with torch.cuda.stream(stream):
                    for i, b in enumerate(ids.tolist()):
                        for l in range(L):
                            src = flat[l][b] if layout.kind != "flash_attn" else flat[l][:, b]
                            slab[i, l * lb:(l + 1) * lb].view(src.shape).copy_(src, non_blocking=True)

            naive_ok = layout.kind in ("vllm_cpu", "flash_attn", "mla") or (
                layout.kind == "vllm" and layout.option("vllm_layout", "").startswith("L"))
            naive = _gbps(nbytes, _time(naive_gather, max(1, a.repeat // 2), sync)) if naive_ok else None
            runs = n * cp.plan_info().get("runs_per_block", 0)
            for mode in modes:
                if mode == "dma" and runs > a.max_dma_runs:
                    _row(rows, device="cuda", layout=name, op="gather+scatter", mode=mode,
                         block_size=bs, n_blocks=n, mib=round(nbytes / 2**20, 1),
                         note=f"skipped: {runs} copies of {cp.plan_info().get('run_bytes')} B")  # fmt: skip
                    continue
                g = _time(lambda: cp.gather(ids, dst, mode=mode, stream=stream.cuda_stream), a.repeat, sync)
                s = _time(lambda: cp.scatter(dst, ids, mode=mode, stream=stream.cuda_stream), a.repeat, sync)
                for op, secs, lim in (("gather", g, d2h), ("scatter", s, h2d)):
                    gb = _gbps(nbytes, secs)
                    _row(rows, device="cuda", layout=name, op=op, mode=mode, block_size=bs,
                         n_blocks=n, mib=round(nbytes / 2**20, 1), gbps=round(gb, 2),
                         limit_gbps=round(lim, 2), ratio=round(gb / lim, 3),
                         naive_loop_gbps=round(naive, 2) if (naive and op == "gather") else None)  # fmt: skip
            caches = stacked = cp = dst = slab = None  # free before the next allocation
        host = None  # free before the next allocation
    if cu is not None:
        print(f"# CUDA module: {cu.runtime_info()}; auto mode DMA threshold "
              f"{cu.get_dma_min_run()} B runs", file=sys.stderr)
    return rows


def markdown(rows: list[dict]) -> str:
    if not rows:
        return "(no results)"
    keys = [k for k in rows[0].keys()]
    for r in rows[1:]:
        for k in r:
            if k not in keys:
                keys.append(k)
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for r in rows:
        lines.append("| " + " | ".join("" if r.get(k) is None else str(r.get(k)) for k in keys) + " |")
    return "\n".join(lines)


def run(args: argparse.Namespace | None = None) -> dict:
    """Run the benchmark; returns {"config": ..., "rows": [...], "markdown": str}."""
    a = args if args is not None else build_parser().parse_args([])
    rows = run_cuda(a) if a.device == "cuda" else run_cpu(a)
    from kvstore import kvcopy

    result = {
        "config": {k: v for k, v in vars(a).items()},
        "native": kvcopy.native_available(a.device),
        "cpu_count": os.cpu_count(),
        "rows": rows,
    }
    result["markdown"] = markdown(rows)
    if args is not None:  # the command line (kvstore bench copy, python -m kvstore.bench.copy) prints it
        print(result["markdown"])
    write_json(a.json, {k: v for k, v in result.items() if k != "markdown"})
    return result


def main(argv: list[str] | None = None) -> int:
    harness.main(__name__, argv, prog="python -m kvstore.bench.copy")
    return 0
