"""Store blocks given as a list of buffers (the DRAM tier's slot views): the native module reads
their addresses at once (``buffer_ptrs``), and whatever it cannot vouch for goes through the
wrapper's per-block checks, with the same clear errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvstore import kvcopy
from kvstore.kvcopy import _blocks
from kvstore.kvcopy._blocks import _Blocks

BB = 4096

native = pytest.mark.skipif(_blocks._cpu is None, reason="kvstore._kvcopy_cpu is not built")


def slots(n: int) -> tuple[np.ndarray, list[np.ndarray]]:
    pool = np.zeros(n * BB, dtype=np.uint8)
    return pool, [pool[i * BB:(i + 1) * BB] for i in range(n)]


@native
def test_the_native_reader_stops_at_the_first_block_it_cannot_vouch_for():
    assert _blocks._buffer_ptrs is not None, "a stale build of kvstore._kvcopy_cpu: run make install"
    _, views = slots(4)
    out = np.zeros(8, dtype=np.uint64)
    assert _blocks._buffer_ptrs(views, BB, True, out) == 4
    assert out[:4].tolist() == [v.ctypes.data for v in views]
    ro = views[2].copy()
    ro.flags.writeable = False
    cases = {
        "short": views[:1] + [np.zeros(BB - 1, np.uint8)],
        "2-D": views[:1] + [np.zeros((1, BB), np.uint8)],
        "int16": views[:1] + [np.zeros(BB // 2, np.int16)],
        "strided": views[:1] + [np.zeros(2 * BB, np.uint8)[::2]],
        "read-only": views[:1] + [ro],
        "torch": views[:1] + [torch.zeros(BB, dtype=torch.uint8)],
        "not a buffer": views[:1] + ["text"],
    }
    for name, blocks in cases.items():
        assert _blocks._buffer_ptrs(blocks, BB, True, out) == 1, name
    assert _blocks._buffer_ptrs([ro], BB, False, out) == 1  # reading a read-only block is fine
    assert _blocks._buffer_ptrs([bytearray(BB)], BB, True, out) == 1
    with pytest.raises(ValueError, match="too short"):
        _blocks._buffer_ptrs(views, BB, True, out[:2])


def test_a_list_of_slots_gives_each_slots_address_in_order():
    _, views = slots(5)
    order = [views[3], views[0], views[4]]
    t = torch.zeros(BB, dtype=torch.uint8)
    for blocks in (order, tuple(order), order + [t], [t] + order):  # numpy first, torch first, mixed
        b = _Blocks(blocks, BB, write=True, what="dst")
        assert b.n == len(blocks) and b.device == "cpu"
        want = [x.data_ptr() if isinstance(x, torch.Tensor) else x.ctypes.data for x in blocks]
        assert b.ptrs.tolist() == want


@pytest.mark.parametrize("bad, match", [
    (np.zeros(BB - 1, np.uint8), r"dst\[2\]: expected a 1-D buffer of block_bytes=4096"),
    (np.zeros((1, BB), np.uint8), r"dst\[2\]: expected a 1-D buffer"),
    (np.zeros(BB // 2, np.int16), r"dst\[2\]: store blocks are uint8 buffers, got dtype int16"),
    (np.zeros(2 * BB, np.uint8)[::2], r"dst\[2\]: the buffer is not contiguous"),
])
def test_a_bad_block_after_good_ones_is_named(bad, match):
    _, views = slots(3)
    with pytest.raises(ValueError, match=match):
        _Blocks(views[:2] + [bad], BB, write=True, what="dst")


def test_a_read_only_slot_is_refused_for_a_gather_and_read_for_a_scatter():
    _, views = slots(3)
    ro = views[1].copy()
    ro.flags.writeable = False
    with pytest.raises(ValueError, match=r"dst\[1\]: the buffer is read-only"):
        _Blocks([views[0], ro, views[2]], BB, write=True, what="dst")
    assert _Blocks([views[0], ro], BB, write=False, what="src").ptrs[1] == ro.ctypes.data


def test_slot_views_round_trip_through_a_cache():
    """Gather into listed slot views (out of order), scatter back elsewhere: the same bytes."""
    layers, blocks, bs, heads, hd = 2, 8, 4, 2, 16
    kv = [torch.randn(blocks, heads, bs, 2 * hd, dtype=torch.float32) for _ in range(layers)]  # vLLM's [B, H, N, C]
    lay = kvcopy.KVLayout.from_vllm(kv)
    pool = np.zeros(6 * lay.block_bytes, dtype=np.uint8)
    views = [pool[i * lay.block_bytes:(i + 1) * lay.block_bytes] for i in range(6)]
    kvcopy.gather(kv, lay, [5, 1, 6], [views[4], views[0], views[2]])
    kvcopy.scatter([views[4], views[0], views[2]], lay, [0, 2, 3], kv)
    for t in kv:
        for src, dst in ((5, 0), (1, 2), (6, 3)):
            assert torch.equal(t[src], t[dst])
    assert not views[1].any() and not views[3].any()  # slots not named were not written
