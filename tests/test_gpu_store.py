"""The store round trip against a paged KV cache on the device the engine uses (issue 15).

The worker-side ``StepRunner`` and a ``KVStore`` with a pinned DRAM tier and an NVMe tier, on a
FlashAttention-layout cache ``[2, B, N, H, D]`` per layer: save more blocks than DRAM holds (the
rest is demoted to NVMe files), then load them all back into other engine blocks, byte for byte.
On CUDA the load is also ordered before a consumer kernel through the copy's event, and the DRAM
slab is checked to be registered (``mode="kernel"`` refuses unpinned memory) with an RSS about its
capacity. The CPU case runs everywhere (same code, the CPU copy module); the CUDA case skips
cleanly without a GPU.
"""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import pytest
import torch

from kvstore import kvcopy
from kvstore.config import from_dict
from kvstore.keys import ModelFingerprint, chain_keys
from kvstore.tiers.dram.pool import SlabPool
from kvstore.offload import LoadPlan, LocalClient, StepRunner, StepPlan, StorePlan, acquire_shared, release_shared

from conftest import dram_gb, nvme_gb

HAS_CUDA = torch.cuda.is_available()
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA,
                                                                                   reason="no CUDA device")])]
L, BS, H, D, NB = 4, 16, 4, 64, 64  # layers, tokens per block, KV heads, head size, engine blocks
DTYPE = torch.bfloat16


def _paged_cache(device: str, gen: torch.Generator):
    """One allocation for all layers (as vLLM does) with random bytes, as per-layer views."""
    layout = kvcopy.KVLayout.flash_attn(NB, L, BS, H, D, DTYPE)
    raw = torch.randint(0, 256, (L, 2, NB, BS, H, D * 2), dtype=torch.uint8, generator=gen)
    stacked = raw.to(device).view(DTYPE)
    return [stacked[l] for l in range(L)], layout


def _block_bytes(caches, ids) -> torch.Tensor:
    """Engine blocks ``ids`` as bytes on the CPU: [n, layer, k/v, token, head, dim]."""
    idx = torch.as_tensor(list(ids), device=caches[0].device)
    return torch.stack([c.index_select(1, idx).transpose(0, 1) for c in caches], 1).view(torch.uint8).cpu()


@contextmanager
def _async_mover(name: str, gen: torch.Generator):
    """A CUDA paged cache, a store with a pinned 64-block DRAM tier, and a StepRunner with async saves
    and loads over it: (caches, shared store, mover); closed and released after."""
    caches, layout = _paged_cache("cuda", gen)
    cfg = from_dict({"tiers": {"dram": {"capacity_gb": dram_gb(64, layout.block_bytes), "pin_memory": True}}})
    fp = ModelFingerprint(model=f"gpu-{name}", dtype="bfloat16", block_size=BS, num_layers=L, num_kv_heads=H,
                          head_size=D, layout=layout.fingerprint())
    shared = acquire_shared(f"gpu-test/{name}", cfg, fp, layout.block_bytes, BS)
    mover = None
    try:
        mover = StepRunner(shared, async_saves=True, async_loads=True)
        mover.register(caches, layout)
        yield caches, shared, mover
    finally:
        if mover is not None:
            mover.close()
        release_shared(shared)


@pytest.mark.parametrize("design", ["sync", "async"])
@pytest.mark.parametrize("device", DEVICES)
def test_save_demote_load_round_trip_is_byte_identical(device, design, tmp_path):
    """``async``: the gathers run on the store thread (CUDA: a side stream ordered after the compute
    stream by an event), the load on the load thread (a high-priority stream), reported by
    ``get_finished`` with no failed block."""
    gen = torch.Generator().manual_seed(15)
    caches, layout = _paged_cache(device, gen)
    dram_blocks, n = 8, 24
    cfg = from_dict({"tiers": {
        # one step's stores of headroom: a step stores into a full DRAM while the victims of the
        # step before it are written down (each holds its slot until then)
        "dram": {"capacity_gb": dram_gb(2 * dram_blocks, layout.block_bytes), "pin_memory": device == "cuda",
                 "headroom_blocks": dram_blocks},
        "nvme": {"path": str(tmp_path / "s"), "capacity_gb": nvme_gb(64, layout.block_bytes)}}})
    fp = ModelFingerprint(model="gpu-round-trip", dtype="bfloat16", block_size=BS, num_layers=L, num_kv_heads=H,
                          head_size=D, layout=layout.fingerprint())
    shared = acquire_shared(f"gpu-test/{device}/{design}", cfg, fp, layout.block_bytes, BS)
    asy = design == "async"
    mover = None
    try:
        store = shared.store
        if device == "cuda":
            assert store.dram.pool.pinned, "the DRAM slab must be registered with CUDA"
        mover = StepRunner(shared, async_saves=asy, async_loads=asy)
        mover.register(caches, layout)
        keys = chain_keys(store.root, list(range(1000, 1000 + n * BS)), BS)
        src_ids = list(range(n))
        for i in range(0, n, dram_blocks):  # one engine step per DRAM-full: older blocks are demoted
            mover.save(StepPlan(stores=[StorePlan("a", src_ids[i:i + dram_blocks], keys[i:i + dram_blocks],
                                                  start=i)], step=1 + i))
            if asy:
                assert mover.jobs.wait_idle(30)
            store.flush()  # the demotions finish meanwhile (in an engine: during the next forward pass)
        assert store.metrics.value("kvstore_tier_skipped_blocks_total", tier="dram", reason="no_slot") == 0
        if asy:
            assert mover.jobs.counts["stores"] == n // dram_blocks
            assert mover.get_finished({"a"}) == ({"a"}, None)  # its blocks may be freed now
        assert store.contains_prefix(keys, record=False).num_blocks == n
        assert store.metrics.value("kvstore_demoted_blocks_total") >= n - dram_blocks  # through NVMe files
        assert store.metrics.value("kvstore_tier_blocks", tier="nvme") >= n - dram_blocks
        # load into other engine blocks, poisoned first
        dst_ids = list(range(NB - n, NB))
        for c in caches:
            c[:, dst_ids] = 0
        hid, got, tiers = LocalClient(shared).begin_load(keys)
        assert got == n and {"dram", "nvme"} <= set(tiers)
        lp = LoadPlan("b", dst_ids, hid, n * BS, tiers=tuple(tiers))
        if asy:  # the request waits in WAITING_FOR_REMOTE_KVS meanwhile
            mover.load(StepPlan(async_loads=[lp], step=100))
            assert mover.jobs.wait_idle(30)
            assert mover.get_finished(set()) == (None, {"b"})
        else:
            mover.load(StepPlan(loads=[lp], step=100))
        assert mover.take_load_errors() == set()
        assert torch.equal(_block_bytes(caches, dst_ids), _block_bytes(caches, src_ids))
        for t in ("dram", "nvme"):
            assert shared.metrics.registry.get_sample_value(
                "kvstore_engine_served_tokens_total", {"tier": t}) == tiers.count(t) * BS
    finally:
        if mover is not None:
            mover.close()
        release_shared(shared)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")
def test_load_on_a_side_stream_is_ordered_before_the_consumer_kernel():
    """A scatter on a copy stream, then a kernel on the compute stream that waits on its event only
    (no host sync): the kernel sees the loaded blocks. Repeated with fresh data each round."""
    gen = torch.Generator().manual_seed(16)
    caches, layout = _paged_cache("cuda", gen)
    cp = kvcopy.KVCopier(caches, layout)
    side, compute = torch.cuda.Stream(), torch.cuda.current_stream()
    ids = list(range(8, 40))
    for r in range(5):
        src = torch.randint(0, 256, (len(ids), layout.block_bytes), dtype=torch.uint8, generator=gen).pin_memory()
        for c in caches:
            c[:, ids] = 0
        torch.cuda.synchronize()
        big = torch.randn(4096, 4096, device="cuda", dtype=DTYPE)
        big @ big  # keep the compute stream busy while the copy is queued
        ev = cp.scatter(src, ids, stream=side)
        ev.wait(compute)
        idx = torch.as_tensor(ids, device="cuda")
        sums = torch.stack([c.index_select(1, idx).view(torch.uint8).to(torch.int64).sum() for c in caches]).sum()
        expect = src.to(torch.int64).sum()
        assert int(sums) == int(expect), f"round {r}: the consumer read blocks before the load completed"


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")
def test_dram_slab_is_registered_and_resident_at_its_capacity():
    torch.cuda.init()
    torch.zeros(1, device="cuda")  # CUDA context first: its RSS is not the pool's

    def rss() -> int:
        with open("/proc/self/status") as f:
            return next(int(x.split()[1]) * 1024 for x in f if x.startswith("VmRSS:"))

    gen = torch.Generator().manual_seed(17)
    caches, layout = _paged_cache("cuda", gen)
    n_slots = (256 << 20) // layout.block_bytes
    before = rss()
    pool = SlabPool(n_slots, layout.block_bytes, pin=True)
    try:
        grew = rss() - before
        cap = n_slots * layout.block_bytes
        assert pool.pinned and pool.ready
        assert 0.9 * cap <= grew <= 1.15 * cap, f"RSS grew {grew / 2**20:.0f} MiB for a {cap / 2**20:.0f} MiB pool"
        slots = [pool.view(i) for i in range(0, n_slots, max(1, n_slots // 16))][:16]
        ids = list(range(len(slots)))
        kvcopy.gather(caches, layout, ids, slots, mode="kernel").synchronize()  # refuses unregistered memory
        st = caches[0].untyped_storage()
        base = torch.tensor([], dtype=torch.uint8, device="cuda").set_(st).cpu()
        cpu = [base.view(c.dtype).as_strided(c.shape, c.stride(), c.storage_offset()) for c in caches]
        expect = torch.empty(len(ids), layout.block_bytes, dtype=torch.uint8)
        kvcopy.reference.gather(cpu, layout, ids, expect)
        got = torch.stack([torch.from_numpy(np.asarray(s)[: layout.block_bytes]) for s in slots])
        assert torch.equal(got, expect)
    finally:
        pool.close()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")
def test_prefill_rate_times_the_gpu_not_the_host():
    """On CUDA the forward pass is timed by events on the compute stream, read a step later:
    the host returns from the launches long before the GPU is done (its clock would make prefill
    look nearly free and cut every load)."""
    import time

    from kvstore.offload.prefillrate import PrefillRate

    seen = []
    r = PrefillRate(lambda t, s, p: seen.append((t, s, p)), min_tokens=1, device="cuda", device_index=0)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    r.start(1024, 1024, 5000)
    t0 = time.perf_counter()
    for _ in range(20):  # 22 TFLOP of bf16: tens of ms on an H200
        a @ a
    host_s = time.perf_counter() - t0
    r.stop()
    assert seen == []  # never waited for
    torch.cuda.synchronize()
    r.start(0, 0)  # the next step reads the finished events (and times nothing: no tokens)
    r.stop()
    assert len(seen) == 1 and seen[0][0] == 1024 and seen[0][2] == 5000
    assert seen[0][1] > 0.005 and seen[0][1] > 2 * host_s, (seen, host_s)
    # step by step, the clock agrees with torch.cuda.Event pairs around the same matmuls within 10 %
    seen.clear()
    refs = []
    for size, reps in ((2048, 100), (4096, 20), (8192, 4), (8192, 12)):
        m = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
        for _ in range(3):
            torch.cuda.synchronize()
            r.start(1024, 1024)
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for _ in range(reps):
                m @ m
            e.record()
            r.stop()
            refs.append((s, e))
    torch.cuda.synchronize()
    r.start(0, 0)
    assert len(seen) == len(refs)
    ratios = [got[1] / (s.elapsed_time(e) / 1e3) for got, (s, e) in zip(seen, refs)]
    assert all(0.9 <= x <= 1.1 for x in ratios), ratios


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")
def test_async_save_is_ordered_after_the_kernel_that_writes_the_blocks(tmp_path):
    """The forward pass writes the blocks on the compute stream behind a deliberately slow kernel
    (``torch.cuda._sleep``, ~0.3 s); the save is asked for at once, with no host sync. The side
    stream's gathers wait on the compute stream's event, so the store holds the new bytes, never
    the blocks' old contents (which a gather that ran at once would read)."""
    gen = torch.Generator().manual_seed(28)
    with _async_mover("order", gen) as (caches, shared, mover):
        for r in range(3):  # round 0 without the slow kernel: the copy path's first allocations
            n = 16
            src_ids, dst_ids = list(range(n)), list(range(NB - n, NB))
            keys = chain_keys(shared.store.root, list(range(5000 * (r + 1), 5000 * (r + 1) + n * BS)), BS)
            new = [torch.randint(0, 256, (2, n, BS, H, D * 2), dtype=torch.uint8, generator=gen).to("cuda")
                   .view(DTYPE) for _ in caches]
            torch.cuda.synchronize()
            idx = torch.as_tensor(src_ids, device="cuda")
            if r:
                torch.cuda._sleep(600_000_000)  # cycles: 0.3 s at 2 GHz
            for c, v in zip(caches, new):  # queued behind the slow kernel
                c.index_copy_(1, idx, v)
            written = torch.cuda.current_stream().record_event()
            assert r == 0 or not written.query(), "the slow kernel ended before the save: no ordering tested"
            mover.save(StepPlan(stores=[StorePlan("a", src_ids, keys, start=0)], step=1 + r))
            assert mover.jobs.wait_idle(30)
            assert mover.get_finished({"a"}) == ({"a"}, None)
            for c in caches:
                c[:, dst_ids] = 0
            hid, got, tiers = LocalClient(shared).begin_load(keys)
            assert got == n
            mover.load(StepPlan(async_loads=[LoadPlan("b", dst_ids, hid, n * BS, tiers=tuple(tiers))], step=50 + r))
            assert mover.jobs.wait_idle(30)
            assert mover.get_finished(set()) == (None, {"b"})
            want = torch.stack([v.transpose(0, 1) for v in new], 1).view(torch.uint8).cpu()
            assert torch.equal(_block_bytes(caches, dst_ids), want), f"round {r}: the store holds the old bytes"


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")
def test_a_gather_that_fails_after_queueing_work_is_waited_for_before_its_slots_go():
    """A gather can raise after part of its work is queued on the side stream (a chunk's DMA, then
    an error on the next). Its DRAM slots go back to the pool at end_store; the queued part must
    have ended by then, or it lands in a slot another store took (wrong KV under that key)."""
    with _async_mover("drain", torch.Generator().manual_seed(41)) as (caches, shared, mover):
        seen = []
        real_end = shared.store.end_store

        def end_store(h, ok=True):
            seen.append((ok, mover._streams["store"].query()))  # True: nothing queued is left
            return real_end(h, ok)

        def gather(ids, slots, stream=None, ctas=None, **kw):
            with torch.cuda.stream(stream):
                torch.cuda._sleep(600_000_000)  # ~0.3 s of queued work, then the failure
            raise RuntimeError("a later chunk failed")

        shared.store.end_store = end_store
        for c in mover.copiers:
            c.gather = gather
        keys = chain_keys(shared.store.root, list(range(9000, 9000 + 8 * BS)), BS)
        mover.save(StepPlan(stores=[StorePlan("a", list(range(8)), keys, start=0)], step=1))
        assert mover.jobs.wait_idle(30)
        assert seen == [(False, True)], seen
