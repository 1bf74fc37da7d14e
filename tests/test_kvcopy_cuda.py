"""CUDA copy path (issue 3), checked against the CPU oracle.

* ``test_kernels_emulated_on_cpu`` compiles the CUDA kernels' source as host C++
  and runs them thread by thread on random geometries (needs only a C++
  compiler), so their index math is tested on every machine.
* The ``gpu``-marked tests run the real module when ``torch.cuda.is_available()``
  and skip cleanly otherwise.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from kvstore import kvcopy
from kvstore.kvcopy import KVLayout, reference

ROOT = Path(__file__).resolve().parents[1]
HAS_CUDA = torch.cuda.is_available()
needs_gpu = pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")


# ------------------------------------------------------------ kernel emulation
def test_kernels_emulated_on_cpu(tmp_path):
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not cxx:
        pytest.skip("no C++ compiler")
    exe = tmp_path / "emulate_kernels"
    subprocess.run(
        [cxx, "-O1", "-std=c++17", "-Wno-unknown-pragmas", f"-I{ROOT / 'csrc'}",
         str(ROOT / "csrc/tests/emulate_kernels.cpp"), "-o", str(exe)],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    res = subprocess.run([str(exe), "400"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    assert " 0 failures" in res.stdout


# ----------------------------------------------------------------- helpers
LAYOUTS = {
    "vllm_cpu": lambda B, L, N, H, D, dt: KVLayout.vllm_cpu(B, L, N, H, D, dt),
    "flash_attn": lambda B, L, N, H, D, dt: KVLayout.flash_attn(B, L, N, H, D, dt),
    "flashinfer_hnd": lambda B, L, N, H, D, dt: KVLayout.flashinfer(B, L, N, H, D, dt, hnd=True),
    "cross_layer": lambda B, L, N, H, D, dt: KVLayout.cross_layer(B, L, N, H, D, dt),
    "vllm_LBNHC": lambda B, L, N, H, D, dt: KVLayout.vllm("LBNHC", B, L, N, H, D, dt),
    "vllm_BLNHC": lambda B, L, N, H, D, dt: KVLayout.vllm("BLNHC", B, L, N, H, D, dt),
    "mla": lambda B, L, N, H, D, dt: KVLayout.mla(B, L, N, H * D, dt),
}
DIMS = {
    "aligned": dict(B=12, L=3, N=16, H=4, D=64),   # 16-byte vectors, long and short runs
    "odd": dict(B=11, L=3, N=5, H=3, D=7),         # 14-byte rows: 2-byte vectors
}  # fmt: skip


def make_cache(layout, dtype, gen, device="cuda"):
    """Random per-layer views of one allocation, on `device`."""
    extent = 1 + sum((n - 1) * s for n, s in zip(layout.stacked_shape, layout.stacked_strides))
    raw = torch.randint(0, 256, (extent * layout.elem_size,), dtype=torch.uint8, generator=gen)
    stacked = raw.to(device).view(dtype).as_strided(layout.stacked_shape, layout.stacked_strides)
    if layout.kind == "cross_layer":
        return [stacked[:, l] for l in range(layout.num_layers)]
    return [stacked[l] for l in range(layout.num_layers)]


def to_cpu(kv):
    """Same views over a CPU copy of the storage."""
    st = kv[0].untyped_storage()
    base = torch.tensor([], dtype=torch.uint8, device=kv[0].device).set_(st).cpu()
    return [base.view(t.dtype).as_strided(t.shape, t.stride(), t.storage_offset()) for t in kv]


def storage(kv):
    return torch.tensor([], dtype=torch.uint8, device=kv[0].device).set_(kv[0].untyped_storage()).cpu()


def rand_blocks(n, nbytes, gen, pin=True):
    t = torch.randint(0, 256, (n, nbytes), dtype=torch.uint8, generator=gen)
    return t.pin_memory() if pin else t


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(7)


# ---------------------------------------------------------------- GPU tests
@pytest.mark.gpu
@needs_gpu
def test_cuda_module_is_built():
    """Where there is a GPU, the CUDA module must be there (no silent fallback)."""
    assert kvcopy.native_available("cuda"), f"_kvcopy_cuda missing: {kvcopy.native_error('cuda')}"
    assert kvcopy.cuda_module().device_count() >= 1


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("mode", ["kernel", "dma", "auto"])
@pytest.mark.parametrize("dims", list(DIMS))
@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float8_e4m3fn],
                         ids=["fp16", "bf16", "fp8"])  # fmt: skip
def test_cuda_gather_scatter_match_cpu(name, dims, mode, dtype, gen):
    d = DIMS[dims]
    lay = LAYOUTS[name](d["B"], d["L"], d["N"], d["H"], d["D"], dtype)
    kv = make_cache(lay, dtype, gen)
    ids = torch.randperm(lay.num_blocks, generator=gen)[:6].numpy()
    # gather: poisoned pinned blocks, twice with different poison
    expect = torch.empty(6, lay.block_bytes, dtype=torch.uint8)
    reference.gather(to_cpu(kv), lay, ids, expect)
    for poison in (0x5A, 0xA5):
        dst = torch.full((6, lay.block_bytes), poison, dtype=torch.uint8).pin_memory()
        ev = kvcopy.gather(kv, lay, ids, dst, mode=mode)
        ev.synchronize()
        assert ev.query()
        assert torch.equal(dst, expect), f"{name}/{dims}/{mode}: gather differs from the CPU oracle"
    # scatter into other blocks; the whole storage must match the CPU oracle
    ids2 = torch.randperm(lay.num_blocks, generator=gen)[:6].numpy()
    src = rand_blocks(6, lay.block_bytes, gen)
    cpu_kv = to_cpu(kv)
    reference.scatter(src, lay, ids2, cpu_kv)
    kvcopy.scatter(src, lay, ids2, kv, mode=mode).synchronize()
    assert torch.equal(storage(kv), storage(cpu_kv))


def _cuda_case(gen, name="vllm_LBNHC", dims="aligned", dtype=torch.float16):
    d = DIMS[dims]
    lay = LAYOUTS[name](d["B"], d["L"], d["N"], d["H"], d["D"], dtype)
    return lay, make_cache(lay, dtype, gen)


@pytest.mark.gpu
@needs_gpu
def test_cuda_list_slots_device_blocks_and_pageable(gen):
    lay, kv = _cuda_case(gen)
    ids = [9, 2, 5, 0]
    expect = torch.empty(4, lay.block_bytes, dtype=torch.uint8)
    reference.gather(to_cpu(kv), lay, ids, expect)
    # list of pinned slot views of a slab, out of order
    slab = torch.zeros(6, lay.block_bytes, dtype=torch.uint8).pin_memory()
    slots = [slab[4], slab[0], slab[5], slab[2]]
    kvcopy.gather(kv, lay, ids, slots, mode="kernel").synchronize()
    for i, s in enumerate(slots):
        assert torch.equal(s, expect[i])
    # device-resident store blocks
    dev = torch.zeros(4, lay.block_bytes, dtype=torch.uint8, device="cuda")
    kvcopy.gather(kv, lay, ids, dev, mode="kernel").synchronize()
    assert torch.equal(dev.cpu(), expect)
    # pageable host memory: auto falls back to DMA, kernel mode refuses
    pageable = torch.zeros(4, lay.block_bytes, dtype=torch.uint8)
    ev = kvcopy.gather(kv, lay, ids, pageable, mode="auto")
    ev.synchronize()
    assert ev.mode == "dma"
    assert torch.equal(pageable, expect)
    with pytest.raises(ValueError, match="pinned"):
        kvcopy.gather(kv, lay, ids, pageable, mode="kernel")


@pytest.mark.gpu
@needs_gpu
def test_cuda_streams_and_events(gen):
    lay, kv = _cuda_case(gen, "vllm_cpu")
    cp = kvcopy.KVCopier(kv, lay)
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    ids = [3, 7, 1]
    dst = torch.zeros(3, lay.block_bytes, dtype=torch.uint8).pin_memory()
    ev = cp.gather(ids, dst, stream=s1)
    assert ev.mode in ("kernel", "dma")
    ev.wait(s2)  # s2 waits on the device, the host does not block
    back = torch.zeros(3, lay.block_bytes, dtype=torch.uint8, device="cuda")
    with torch.cuda.stream(s2):
        back.copy_(dst, non_blocking=True)
    s2.synchronize()
    expect = torch.empty_like(dst)
    reference.gather(to_cpu(kv), lay, ids, expect)
    assert torch.equal(back.cpu(), expect)
    # integer handle and the current stream (None)
    cp.gather(ids, dst, stream=s1.cuda_stream).synchronize()
    cp.gather(ids, dst).synchronize()
    assert torch.equal(dst, expect)


@pytest.mark.gpu
@needs_gpu
def test_cuda_many_blocks_and_modes_agree(gen):
    """Big enough for a full grid (grid-stride loops) and > 1 piece per run."""
    lay = KVLayout.vllm_cpu(300, 8, 64, 4, 128, torch.bfloat16)  # 256 KiB pages
    kv = make_cache(lay, torch.bfloat16, gen)
    ids = torch.randperm(300, generator=gen)[:200].numpy()
    out = {}
    for mode in ("kernel", "dma"):
        dst = torch.full((200, lay.block_bytes), 0x3C, dtype=torch.uint8).pin_memory()
        kvcopy.gather(kv, lay, ids, dst, mode=mode).synchronize()
        out[mode] = dst
    assert torch.equal(out["kernel"], out["dma"])
    expect = torch.empty_like(out["dma"])
    kvcopy.gather(to_cpu(kv), lay, ids, expect)  # CPU native path as the oracle
    assert torch.equal(out["kernel"], expect)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("ctas", [1, 3, 32])
def test_a_capped_grid_copies_every_block(ctas, gen):
    """``ctas`` caps the kernel's grid (a gather beside the engine's kernels takes fewer SMs):
    with 1, 3 or 32 thread blocks for 200 blocks of 2 KiB runs, every byte still moves, both ways,
    on a side stream."""
    lay = KVLayout.flash_attn(300, 4, 16, 8, 64, torch.bfloat16)
    kv = make_cache(lay, torch.bfloat16, gen)
    cp = kvcopy.KVCopier(kv, lay)
    ids = torch.randperm(300, generator=gen)[:200].numpy()
    side = torch.cuda.Stream()
    dst = torch.full((200, lay.block_bytes), 0x3C, dtype=torch.uint8).pin_memory()
    cp.gather(ids, dst, mode="kernel", stream=side, ctas=ctas).synchronize()
    expect = torch.empty_like(dst)
    kvcopy.gather(to_cpu(kv), lay, ids, expect)
    assert torch.equal(dst, expect)
    src = torch.randint(0, 256, dst.shape, dtype=torch.uint8, generator=gen).pin_memory()
    cp.scatter(src, ids, mode="kernel", stream=side, ctas=ctas).synchronize()
    back = torch.empty_like(src)
    kvcopy.gather(to_cpu(kv), lay, ids, back)
    assert torch.equal(back, src)
    with pytest.raises(ValueError, match="ctas"):
        cp.gather(ids, dst, ctas=0)


@pytest.mark.gpu
@needs_gpu
def test_cuda_rejects_bad_ids_and_devices(gen):
    lay, kv = _cuda_case(gen)
    dst = torch.zeros(2, lay.block_bytes, dtype=torch.uint8).pin_memory()
    with pytest.raises(IndexError):
        kvcopy.gather(kv, lay, [0, lay.num_blocks], dst)
    with pytest.raises(ValueError, match="duplicate"):
        kvcopy.scatter(dst, lay, [1, 1], kv)
    with pytest.raises(ValueError, match="mode"):
        kvcopy.gather(kv, lay, [0, 1], dst, mode="fast")
    # the C++ entry point re-checks ids on its own
    cp = kvcopy.KVCopier(kv, lay)
    with pytest.raises(IndexError):
        kvcopy.cuda_module().copy_blocks(
            True, cp.layer_ptrs, lay.geometry(), lay.paged_strides(), lay.store_strides(),
            np.array([-1, 0], dtype=np.int64), np.array([dst.data_ptr()] * 2, dtype=np.uint64),
        )  # fmt: skip
    if torch.cuda.device_count() > 1:
        other = torch.zeros(2, lay.block_bytes, dtype=torch.uint8, device="cuda:1")
        with pytest.raises(ValueError):
            kvcopy.gather(kv, lay, [0, 1], other)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("n", [1, 16, 257, 4096])
@pytest.mark.parametrize("on", ["default", "side"])
@pytest.mark.parametrize("name", ["flash_attn", "flashinfer_hnd", "cross_layer", "mla"])
def test_cuda_block_counts_and_streams(name, on, n, gen):
    """1 to 4,096 blocks per call, on the default stream and on a side stream, in both modes:
    gather and scatter equal the CPU oracle byte for byte (fresh random data, poisoned outputs)."""
    lay = LAYOUTS[name](n + 3, 2, 16, 2, 64, torch.bfloat16)  # 16 KiB blocks; 64 MiB at 4,096
    kv = make_cache(lay, torch.bfloat16, gen)
    ids = torch.randperm(lay.num_blocks, generator=gen)[:n].numpy()
    expect = torch.empty(n, lay.block_bytes, dtype=torch.uint8)
    reference.gather(to_cpu(kv), lay, ids, expect)
    stream = torch.cuda.Stream() if on == "side" else None
    for mode in ("kernel", "dma"):
        dst = torch.full((n, lay.block_bytes), 0xA5, dtype=torch.uint8).pin_memory()
        kvcopy.gather(kv, lay, ids, dst, mode=mode, stream=stream).synchronize()
        assert torch.equal(dst, expect), f"{name}/{n}/{on}/{mode}: gather differs from the CPU oracle"
        ids2 = torch.randperm(lay.num_blocks, generator=gen)[:n].numpy()
        src = rand_blocks(n, lay.block_bytes, gen)
        cpu_kv = to_cpu(kv)
        reference.scatter(src, lay, ids2, cpu_kv)
        kvcopy.scatter(src, lay, ids2, kv, mode=mode, stream=stream).synchronize()
        assert torch.equal(storage(kv), storage(cpu_kv)), f"{name}/{n}/{on}/{mode}: scatter differs"
        expect = torch.empty(n, lay.block_bytes, dtype=torch.uint8)
        reference.gather(cpu_kv, lay, ids, expect)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, needs_gpu])])
@pytest.mark.parametrize("name", ["flash_attn", "cross_layer", "mla"])
def test_gather_with_repeated_and_unordered_ids(name, device, gen):
    """A gather may name a block twice (two store slots of one cache block) and in any order; each
    slot gets the block's bytes, as the CPU oracle gives them (a scatter refuses duplicates)."""
    lay = LAYOUTS[name](12, 3, 16, 4, 64, torch.bfloat16)
    kv = make_cache(lay, torch.bfloat16, gen, device=device)
    ids = np.array([7, 3, 7, 0, 11, 3, 3], dtype=np.int64)
    expect = torch.empty(len(ids), lay.block_bytes, dtype=torch.uint8)
    reference.gather(to_cpu(kv), lay, ids, expect)
    for mode in (("kernel", "dma") if device == "cuda" else ("auto",)):
        dst = torch.full((len(ids), lay.block_bytes), 0x5A, dtype=torch.uint8)
        dst = dst.pin_memory() if device == "cuda" else dst
        ev = kvcopy.gather(kv, lay, ids, dst, mode=mode)
        if ev is not None:
            ev.synchronize()
        assert torch.equal(dst, expect), f"{name}/{device}/{mode}: a repeated id gathered wrong bytes"
    assert torch.equal(expect[0], expect[2]) and torch.equal(expect[1], expect[5])


@pytest.mark.parametrize("bad", [0, -2, 1.5, True, "16"])
def test_a_bad_grid_cap_is_refused_on_every_device(bad, gen):
    """``ctas`` is checked before the copy, also where it means nothing (a CPU cache)."""
    lay = KVLayout.flash_attn(8, 2, 16, 2, 64, torch.float16)
    kv = make_cache(lay, torch.float16, gen, device="cpu")
    dst = torch.zeros(2, lay.block_bytes, dtype=torch.uint8)
    with pytest.raises(ValueError, match="ctas must be a positive int or None"):
        kvcopy.KVCopier(kv, lay).gather([0, 1], dst, ctas=bad)
    kvcopy.KVCopier(kv, lay).gather([0, 1], dst, ctas=4)  # ignored on a CPU cache
    expect = torch.empty_like(dst)
    kvcopy.gather(kv, lay, [0, 1], expect)
    assert torch.equal(dst, expect)
