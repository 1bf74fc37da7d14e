"""kvstore's copy path beside vLLM native's, on the same bytes, in the same run (issue 28).

    python -m kvstore.bench.copy.gpu_native --out DIR       # writes DIR/gpu_native.json and DIR/gpu_native.md

Four ways to move ``n`` paged KV blocks between the GPU cache and pinned host memory:

* ``kernel`` and ``dma``: ``KVCopier.gather`` / ``scatter`` in each of its modes (the connector ships
  ``auto``: the kernel unless the runs are >= 1 MiB), each block to or from one contiguous host slot
  in the store format ``[layer][token][head][kv][dim]``;
* ``memcpy``: one ``cudaMemcpyAsync`` of the same number of bytes between one contiguous pinned
  buffer and one device buffer (torch ``copy_``): what the link gives;
* ``vllm``: vLLM native's CPU offload path, one ``cuMemcpyBatchAsync`` per block list: a host
  tensor per layer (per K and V when the layout keeps them apart, as FlashAttention's does)
  shaped like the GPU one, one descriptor per block per such tensor, built on the host per call
  (with numpy; vLLM builds them with Python lists), the source read in stream order.

Three figures each: device time (CUDA events on the copy stream, interleaved, the median of
``reps``); sustained throughput with the host's issue time (calls back to back, then a sync: what a
copy thread gets); and, at ``--contention-at`` blocks a call, device time while a bf16 matmul loop
holds the compute stream. Every cell is checked first: each way moves exactly the blocks asked for.
Two block sizes: 2 MiB (Llama-3-8B: 32 layers x 8 KV heads x 128, bf16, 16 tokens) and 64 KiB
(8 layers x 1 KV head x 128).

``--clock`` also checks the forward-pass clock (:class:`kvstore.offload.prefillrate.PrefillRate`,
CUDA events on the compute stream) against ``torch.cuda.Event`` pairs around the same matmuls.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from kvstore.bench.copy.gpu_report import write_run

GEOMETRIES = {"2MiB": (32, 8, 128), "64KiB": (8, 1, 128)}  # layers, KV heads, head size (16 tokens, bf16)
SRC_ORDER_STREAM = 1  # CU_MEMCPY_SRC_ACCESS_ORDER_STREAM


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kvstore.bench.copy.gpu_native", description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--geometries", default="2MiB,64KiB")
    p.add_argument("--layouts", default="flash_attn,flashinfer")
    p.add_argument("--per-call", default="16,64,256")
    p.add_argument("--min-ms", type=float, default=20.0)
    p.add_argument("--contention-at", type=int, default=64,
                   help="blocks per call also timed while a bf16 matmul loop runs on the compute stream (0 = never)")
    p.add_argument("--clock", choices=["on", "off"], default="on")
    p.add_argument("--seed", type=int, default=0)
    return p


class _Loc(ctypes.Structure):
    _fields_ = [("type", ctypes.c_uint), ("id", ctypes.c_int)]


class _Attrs(ctypes.Structure):  # CUmemcpyAttributes
    _fields_ = [("srcAccessOrder", ctypes.c_uint), ("srcLocHint", _Loc), ("dstLocHint", _Loc), ("flags", ctypes.c_uint)]


def _batch_fn():
    """The driver's ``cuMemcpyBatchAsync`` (the 12.8 entry point, with ``failIdx``), as vLLM resolves it."""
    proto = ctypes.CFUNCTYPE(ctypes.c_uint, *[ctypes.c_void_p] * 3, ctypes.c_size_t, ctypes.c_void_p,
                             ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_void_p)
    try:
        from cuda.bindings import driver as drv

        err, ptr, _ = drv.cuGetProcAddress(b"cuMemcpyBatchAsync", 12080, 0)
        if err == drv.CUresult.CUDA_SUCCESS and ptr:
            return proto(ptr), "cuda.bindings cuGetProcAddress"
    except Exception as e:  # noqa: BLE001 - fall back to the library's symbol
        print(f"# cuda.bindings: {e!r}; trying libcuda.so.1", file=sys.stderr)
    lib = ctypes.CDLL("libcuda.so.1")
    return proto(ctypes.cast(lib.cuMemcpyBatchAsync, ctypes.c_void_p).value), "libcuda.so.1 cuMemcpyBatchAsync"


class VllmBatch:
    """vLLM native's copy of a block list: one cuMemcpyBatchAsync, one descriptor per block per
    per-layer (K/V) tensor, between the GPU cache and host tensors of the same shape."""

    def __init__(self, gpu_parts: list, n: int, stream, fn):
        import torch

        self.gpu, self.fn, self.stream = gpu_parts, fn, stream.cuda_stream
        pay = [p[0].numel() * p.element_size() for p in gpu_parts]
        assert all(p[0].is_contiguous() for p in gpu_parts)
        self.host_raw = torch.empty(n * sum(pay), dtype=torch.uint8, pin_memory=True)
        self.host, off = [], 0
        for p, b in zip(gpu_parts, pay):
            self.host.append(self.host_raw[off:off + n * b].view(p.dtype).view(n, *p.shape[1:]))
            off += n * b
        self.g_base = np.array([p.data_ptr() for p in gpu_parts], np.uint64)[:, None]
        self.g_stride = np.array([p.stride(0) * p.element_size() for p in gpu_parts], np.uint64)[:, None]
        self.h_base = np.array([h.data_ptr() for h in self.host], np.uint64)[:, None]
        self.pay = np.array(pay, np.uint64)[:, None]
        self.attrs = _Attrs(srcAccessOrder=SRC_ORDER_STREAM)
        self.idx, self.fail = ctypes.c_size_t(0), ctypes.c_size_t(0)

    def copy(self, ids: np.ndarray, to_host: bool) -> None:
        n = len(ids)
        g = (self.g_base + ids.astype(np.uint64)[None, :] * self.g_stride).ravel()
        h = (self.h_base + np.arange(n, dtype=np.uint64)[None, :] * self.pay).ravel()
        sizes = np.repeat(self.pay.ravel(), n)
        src, dst = (g, h) if to_host else (h, g)
        err = self.fn(dst.ctypes.data, src.ctypes.data, sizes.ctypes.data, len(sizes), ctypes.addressof(self.attrs),
                      ctypes.byref(self.idx), 1, ctypes.byref(self.fail), self.stream)
        if err != 0:
            raise RuntimeError(f"cuMemcpyBatchAsync returned {err} (failIdx {self.fail.value})")


def _raw(t):
    """Bits, not values: random bytes hold NaNs, and NaN != NaN."""
    import torch

    return t.contiguous().view(torch.int16)


def _parts(name: str, caches: list) -> list:
    """vLLM's per-layer tensors with the block first: FlashAttention's ``[2, B, ...]`` is split into K, V."""
    return [t for c in caches for t in (c.unbind(0) if name == "flash_attn" else (c,))]


def _wall(fns: dict, side, rounds: int = 3, min_s: float = 0.02) -> dict:
    """Sustained seconds per call, host issue included: ``k`` calls back to back, then a sync;
    the methods interleaved, the median of ``rounds``."""
    import torch

    out = {k: [] for k in fns}
    ks = {}
    for k, f in fns.items():
        side.synchronize()
        t0 = time.perf_counter()
        with torch.cuda.stream(side):
            keep = [f()]
        side.synchronize()
        ks[k] = max(2, min(100, int(min_s / max(time.perf_counter() - t0, 1e-5))))
        del keep
    for _ in range(rounds):
        for k, f in fns.items():
            side.synchronize()
            t0 = time.perf_counter()
            with torch.cuda.stream(side):
                keep = [f() for _ in range(ks[k])]
            side.synchronize()
            out[k].append((time.perf_counter() - t0) / ks[k])
            del keep
    return {k: statistics.median(v) for k, v in out.items()}


def bench_layout(name, geo, a, gen, rows, batch_fn, load) -> None:
    """Every blocks-per-call count of one layout and block size, on buffers made once."""
    import torch

    from kvstore import kvcopy
    from kvstore.bench.copy.gpu_bench import Timer, _cache
    from kvstore.kvcopy.layout import named_layout

    L, H, D = GEOMETRIES[geo]
    per_call = [int(x) for x in a.per_call.split(",")]
    nmax = max(per_call)
    layout = named_layout(name, nmax + 64, L, 16, H, D, torch.bfloat16)
    caches = _cache(layout, gen)
    side = torch.cuda.Stream(priority=-1)
    cp = kvcopy.KVCopier(caches, layout)
    slab_all = torch.empty(nmax, layout.block_bytes, dtype=torch.uint8, pin_memory=True)
    back_all = torch.empty(nmax, layout.block_bytes, dtype=torch.uint8, pin_memory=True)
    host_all = torch.empty(nmax * layout.block_bytes, dtype=torch.uint8, pin_memory=True)
    dev_all = torch.empty(nmax * layout.block_bytes, dtype=torch.uint8, device="cuda")
    dev_all.random_(0, 256, generator=gen)
    host_all.copy_(dev_all)
    vb = VllmBatch(_parts(name, caches), nmax, side, batch_fn)
    stage_all = torch.empty(nmax, layout.block_bytes, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()  # the random fills ran on the default stream; the copies run on the side one
    for n in per_call:
        t_cell = time.perf_counter()
        nbytes = n * layout.block_bytes
        slab, host, dev = slab_all[:n], host_all[:nbytes], dev_all[:nbytes]
        ids = np.random.default_rng(a.seed + n).permutation(layout.num_blocks)[:n]  # out of order
        tids = torch.as_tensor(ids, device="cuda")
        torch.cuda.synchronize()
        # all of them move exactly the blocks asked for, checked before timing
        ev = cp.gather(ids, slab, stream=side)
        vb.copy(ids, True)
        side.synchronize()
        shipped = ev.mode
        for p, h in zip(vb.gpu, vb.host):
            assert torch.equal(_raw(p.index_select(0, tids)), _raw(h[:n].to("cuda"))), \
                f"vLLM reference gathered wrong bytes ({name})"
        before = [p.index_select(0, tids).clone() for p in vb.gpu]
        for mode in ("kernel", "dma"):
            back = back_all[:n]
            cp.gather(ids, back, mode=mode, stream=side).synchronize()
            assert torch.equal(back, slab), f"kvstore {mode} gather differs ({name})"
            for p in vb.gpu:
                p.index_fill_(0, tids, 0)
            cp.scatter(slab, ids, mode=mode, stream=side).synchronize()
            for p, want in zip(vb.gpu, before):
                assert torch.equal(_raw(p.index_select(0, tids)), _raw(want)), f"kvstore {mode} scatter ({name})"
        for p in vb.gpu:
            p.index_fill_(0, tids, 0)
        vb.copy(ids, False)
        side.synchronize()
        for p, want in zip(vb.gpu, before):
            assert torch.equal(_raw(p.index_select(0, tids)), _raw(want)), f"vLLM reference scatter wrong ({name})"

        fns = {"gather_limit": lambda: host.copy_(dev, non_blocking=True),
               "scatter_limit": lambda: dev.copy_(host, non_blocking=True),
               "gather_vllm": lambda: vb.copy(ids, True),
               "scatter_vllm": lambda: vb.copy(ids, False)}
        for m in ("kernel", "dma"):
            fns[f"gather_{m}"] = lambda m=m: cp.gather(ids, slab, mode=m, stream=side)
            fns[f"scatter_{m}"] = lambda m=m: cp.scatter(slab, ids, mode=m, stream=side)
        stage = stage_all[:n]

        def staged(per_block: bool):
            """A gather into device memory (the kernel, on the GPU's own memory), then the copy
            engines to the host: one copy (contiguous slots) or one a block (slots anywhere)."""
            def f():
                with torch.cuda.stream(side):
                    ev = cp.gather(ids, stage, mode="kernel", stream=side)
                    if per_block:
                        for i in range(n):
                            slab[i].copy_(stage[i], non_blocking=True)
                    else:
                        slab.copy_(stage, non_blocking=True)
                return ev
            return f

        fns["gather_staged"], fns["gather_staged_blocks"] = staged(False), staged(True)
        for f in (fns["gather_staged"], fns["gather_staged_blocks"]):
            slab.fill_(0)
            f()
            side.synchronize()
            cp.gather(ids, back, mode="kernel", stream=side).synchronize()
            assert torch.equal(slab, back), f"staged gather differs ({name})"
        timer = Timer(side, a.min_ms)
        reps = min(timer.reps_for(f) for f in fns.values())
        dev_t = timer.interleaved(fns, reps)
        wall_t = _wall(fns, side)
        mm_t, overlapped = None, None
        if load is not None and n == a.contention_at:
            end = load.enqueue(sum(dev_t.values()) * 1e3 * reps * 1.5 + 5)
            mm_t = timer.interleaved(fns, reps)
            overlapped = not end.query()
            torch.cuda.synchronize()
        for op in ("gather", "scatter"):
            row = dict(section="copy", geometry=geo, layout=name, blocks_per_call=n, mib=nbytes / 2**20, op=op,
                       shipped=shipped, descriptors=len(vb.gpu) * n, reps=reps, matmul_overlapped=overlapped)
            for w in ("limit", "kernel", "dma", "vllm", "staged", "staged_blocks"):
                if f"{op}_{w}" not in dev_t:
                    continue
                row[f"{w}_gbps"] = round(nbytes / dev_t[f"{op}_{w}"] / 1e9, 2)
                row[f"{w}_wall_gbps"] = round(nbytes / wall_t[f"{op}_{w}"] / 1e9, 2)
                if mm_t:
                    row[f"{w}_matmul_gbps"] = round(nbytes / mm_t[f"{op}_{w}"] / 1e9, 2)
            rows.append(row)
        print(f"# {geo} {name} n={n}: {reps} reps, {time.perf_counter() - t_cell:.1f} s", file=sys.stderr, flush=True)


def bench_clock(rows) -> None:
    """PrefillRate's step times against torch.cuda.Event pairs around the same matmuls, with the
    host gaps an engine has (scheduling before the forward pass, sampling after it)."""
    import torch

    from kvstore.offload.prefillrate import PrefillRate

    seen: list = []
    clock = PrefillRate(lambda t, s, p: seen.append(s), min_tokens=1, device="cuda", device_index=0)
    refs = []
    for size, reps in ((2048, 100), (4096, 20), (8192, 4), (8192, 12), (4096, 60)):
        a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
        for _ in range(6):
            torch.cuda.synchronize()
            clock.start(1024, 1024)  # the step's metadata bound, right before the forward pass
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for _ in range(reps):
                a @ a
            e.record()
            clock.stop()
            refs.append((s, e, size, reps))
            time.sleep(0.0005)  # sampling, output processing
    torch.cuda.synchronize()
    clock.start(0, 0)  # reads the finished events
    assert len(seen) == len(refs), (len(seen), len(refs))
    for got, (s, e, size, reps) in zip(seen, refs):
        ref = s.elapsed_time(e) / 1e3
        rows.append(dict(section="clock", matmul=size, per_step=reps, clock_ms=round(got * 1e3, 3),
                         event_ms=round(ref * 1e3, 3), ratio=round(got / ref, 4)))


def _r(a, b) -> str:
    return f"{a / b:.3f}" if b else "-"


def markdown(rows: list, header: str) -> str:
    out = [header, ""]
    cp = [r for r in rows if r["section"] == "copy"]
    if cp:
        out += ["## Device time (CUDA events on the copy stream), GB/s", "",
                "| block | layout | blocks/call | MiB | op | vLLM descriptors | memcpy | kvstore kernel | kvstore dma | "
                "vLLM batch | kernel / memcpy | dma / memcpy | vLLM / memcpy | kernel / vLLM | dma / vLLM |",
                "|" + "---|" * 15]
        out += [f"| {r['geometry']} | {r['layout']} | {r['blocks_per_call']} | {r['mib']:g} | {r['op']} | "
                f"{r['descriptors']} | {r['limit_gbps']} | {r['kernel_gbps']} | {r['dma_gbps']} | {r['vllm_gbps']} | "
                f"{_r(r['kernel_gbps'], r['limit_gbps'])} | {_r(r['dma_gbps'], r['limit_gbps'])} | "
                f"{_r(r['vllm_gbps'], r['limit_gbps'])} | {_r(r['kernel_gbps'], r['vllm_gbps'])} | "
                f"{_r(r['dma_gbps'], r['vllm_gbps'])} |" for r in cp]
        out += ["", "## Sustained, host issue included (calls back to back, then a sync), GB/s", "",
                "| block | layout | blocks/call | op | memcpy | kvstore kernel | kvstore dma | vLLM batch | "
                "kernel / vLLM | dma / vLLM | best kvstore / vLLM |", "|" + "---|" * 11]
        out += [f"| {r['geometry']} | {r['layout']} | {r['blocks_per_call']} | {r['op']} | {r['limit_wall_gbps']} | "
                f"{r['kernel_wall_gbps']} | {r['dma_wall_gbps']} | {r['vllm_wall_gbps']} | "
                f"{_r(r['kernel_wall_gbps'], r['vllm_wall_gbps'])} | {_r(r['dma_wall_gbps'], r['vllm_wall_gbps'])} | "
                f"{_r(max(r['kernel_wall_gbps'], r['dma_wall_gbps']), r['vllm_wall_gbps'])} |" for r in cp]
        mm = [r for r in cp if "limit_matmul_gbps" in r]
        if mm:
            out += ["", "## Device time while a bf16 matmul loop holds the compute stream, GB/s", "",
                    "| block | layout | blocks/call | op | matmul still running | memcpy | kvstore kernel | kvstore dma | "
                    "vLLM batch | kernel / memcpy | dma / memcpy |", "|" + "---|" * 11]
            out += [f"| {r['geometry']} | {r['layout']} | {r['blocks_per_call']} | {r['op']} | {r['matmul_overlapped']} | "
                    f"{r['limit_matmul_gbps']} | {r['kernel_matmul_gbps']} | {r['dma_matmul_gbps']} | "
                    f"{r['vllm_matmul_gbps']} | {_r(r['kernel_matmul_gbps'], r['limit_matmul_gbps'])} | "
                    f"{_r(r['dma_matmul_gbps'], r['limit_matmul_gbps'])} |" for r in mm]
    st = [r for r in cp if "staged_gbps" in r]
    if st:
        out += ["", "## Gather staged through device memory, then the copy engines (GB/s; ratio to memcpy)", "",
                "| block | layout | blocks/call | kernel | staged, one copy | staged, a copy a block | "
                "matmul: memcpy | matmul: kernel | matmul: staged | matmul: staged a block | "
                "sustained: kernel | sustained: staged a block |", "|" + "---|" * 12]
        for r in st:
            mm = lambda w: f"{r[w + '_matmul_gbps']} ({_r(r[w + '_matmul_gbps'], r['limit_matmul_gbps'])})" \
                if w + "_matmul_gbps" in r else "-"
            out.append(f"| {r['geometry']} | {r['layout']} | {r['blocks_per_call']} | {r['kernel_gbps']} "
                       f"({_r(r['kernel_gbps'], r['limit_gbps'])}) | {r['staged_gbps']} "
                       f"({_r(r['staged_gbps'], r['limit_gbps'])}) | {r['staged_blocks_gbps']} "
                       f"({_r(r['staged_blocks_gbps'], r['limit_gbps'])}) | "
                       f"{r.get('limit_matmul_gbps', '-')} | {mm('kernel')} | {mm('staged')} | {mm('staged_blocks')} | "
                       f"{r['kernel_wall_gbps']} | {r['staged_blocks_wall_gbps']} |")
    ck = [r for r in rows if r["section"] == "clock"]
    if ck:
        rs = [r["ratio"] for r in ck]
        out += ["", "## Forward-pass clock (PrefillRate, CUDA events) vs torch.cuda.Event around the same matmuls",
                "", "| matmul | per step | clock ms | event ms | ratio |", "|---|---|---|---|---|"]
        out += [f"| {r['matmul']} | {r['per_step']} | {r['clock_ms']} | {r['event_ms']} | {r['ratio']} |" for r in ck]
        out += ["", f"{len(rs)} steps: ratio min {min(rs)}, max {max(rs)}, median {statistics.median(rs):.4f} "
                "(goal: within 10 %)."]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    import torch

    a = build_parser().parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_native: no CUDA device", file=sys.stderr)
        return 2
    from kvstore import kvcopy

    if kvcopy.cuda_module() is None:
        print(f"gpu_native: the CUDA copy module is not built: {kvcopy.native_error('cuda')}", file=sys.stderr)
        return 2
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    fn, how = _batch_fn()
    gen = torch.Generator(device="cuda").manual_seed(a.seed)
    header = (f"# kvstore vs vLLM native copies: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
              f"{kvcopy.cuda_module().runtime_info()}; vLLM reference via {how}")
    rows, errors = [], []

    def flush() -> None:
        write_run(out, "gpu_native", a, rows, errors, markdown(rows, header), torch.cuda.get_device_name(0))

    if a.clock == "on":
        try:
            bench_clock(rows)
        except Exception as e:  # noqa: BLE001 - reported, the copies still run
            errors.append(f"clock: {e!r}")
        flush()
    from kvstore.bench.copy.gpu_bench import MatmulLoad

    load = MatmulLoad() if a.contention_at else None
    for geo in a.geometries.split(","):
        for name in a.layouts.split(","):
            try:
                bench_layout(name, geo, a, gen, rows, fn, load)
            except Exception as e:  # noqa: BLE001
                errors.append(f"{geo} {name}: {e!r}")
                print(f"FAILED {errors[-1]}", file=sys.stderr, flush=True)
            flush()
            torch.cuda.empty_cache()
    print(markdown(rows, header))
    for e in errors:
        print("FAILED", e)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
