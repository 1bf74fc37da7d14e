"""MLA and hybrid-state blocks through the copy kernels and the codecs (issue 31), on data shaped
as vLLM registers it, against the reference.

* MLA: one latent per token (DeepSeek: 512 + 64 rope = 576), vLLM's view ``[blocks, 1, N, 576]``;
  no K/V split. The native copy equals the reference, whole blocks round-trip, and the lossy codecs
  quantize it one latent row per scale (``Geometry(layout="latent")``), within their bounds,
  through a real store.
* A Mamba / Gated DeltaNet state page: vLLM registers a raw int8 view ``[blocks, 1, 1, used]``
  over a page padded to the attention page (68,608 of 73,728 bytes for the tiny Qwen3-Next). Read
  as one latent-like row per block, the used bytes move and the padding is never touched; the lossy
  codecs refuse such blocks with a clear error, and the connector turns that into a ConfigError
  naming the key.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvstore import kvcopy
from kvstore.codecs.base import Geometry
from kvstore.codecs.registry import make_codec
from kvstore.config import from_dict
from kvstore.keys import ModelFingerprint, chain_keys
from kvstore.store import KVStore

from conftest import tiny_config

LATENT, N, L, B = 576, 16, 2, 24


def mla_caches(gen, dtype=torch.bfloat16):
    return [(torch.randn(B, 1, N, LATENT, generator=gen) * torch.logspace(-2, 1, LATENT)).to(dtype)
            for _ in range(L)]


@pytest.mark.parametrize("native", [True, False], ids=["native", "reference"])
def test_mla_blocks_gather_and_scatter_as_the_reference(native, monkeypatch):
    if not native:
        monkeypatch.setenv("KVSTORE_KVCOPY_REFERENCE", "1")
    gen = torch.Generator().manual_seed(0)
    caches = mla_caches(gen)
    layout = kvcopy.KVLayout.from_vllm(caches, mla=True)
    assert layout.is_mla and layout.block_bytes == L * N * LATENT * 2
    ids = [3, 17, 5, 0]
    dst = torch.zeros(len(ids), layout.block_bytes, dtype=torch.uint8)
    kvcopy.gather(caches, layout, ids, dst)
    ref = torch.zeros_like(dst)
    kvcopy.reference.gather(caches, layout, np.asarray(ids), ref)
    assert torch.equal(dst, ref)
    # store format [layer][token][latent]
    assert torch.equal(dst[1].view(torch.bfloat16).view(L, N, LATENT)[1], caches[1][17, 0])
    out = [torch.zeros_like(c) for c in caches]
    kvcopy.scatter(dst, layout, [9, 1, 22, 4], out)
    for c, o in zip(caches, out):
        assert torch.equal(o[[9, 1, 22, 4]], c[ids]) and not o[[0, 2]].any()


def test_a_state_page_moves_its_used_bytes_and_never_its_padding():
    page, used = 4096, 3584
    raw = torch.randint(-128, 127, (L, B, page), dtype=torch.int8, generator=torch.Generator().manual_seed(1))
    views = [raw[i].as_strided((B, 1, 1, used), (page, used, used, 1)) for i in range(L)]  # as vLLM registers
    layout = kvcopy.KVLayout.from_tensor("mla", views)
    assert layout.block_bytes == L * used and layout.block_stride == page
    dst = np.zeros((2, layout.block_bytes), np.uint8)
    kvcopy.gather(views, layout, [4, 7], dst)
    ref = np.zeros_like(dst)
    kvcopy.reference.gather(views, layout, np.asarray([4, 7]), ref)
    assert np.array_equal(dst, ref)
    assert np.array_equal(dst[1][:used], raw[0, 7, :used].numpy().view(np.uint8))
    pad = raw[:, :, used:].clone()
    kvcopy.scatter(dst, layout, [1, 2], views)
    assert torch.equal(raw[:, 1, :used], raw[:, 4, :used]) and torch.equal(raw[:, 2, :used], raw[:, 7, :used])
    assert torch.equal(raw[:, :, used:], pad)  # the padding of every page as it was


def latent_bound(x: torch.Tensor, y: torch.Tensor, codec: str) -> bool:
    """Per latent row (one scale each): int8 half a scale, fp8 e4m3's relative bound; plus
    bfloat16's half-ulp of the result."""
    rows = x.view(-1, LATENT)
    amax = rows.abs().amax(1, keepdim=True)
    if codec.startswith("int8"):
        b = amax / 127 / 2
    else:
        b = rows.abs() * 2**-4 + amax / 448 * 2**-10
    return bool(((y.view(-1, LATENT) - rows).abs() <= b * (1 + 1e-5) + y.view(-1, LATENT).abs() * 2**-8 + 1e-30).all())


@pytest.mark.parametrize("codec", ["int8", "fp8", "fp8+zstd"])
def test_lossy_codecs_quantize_mla_blocks_one_latent_row_per_scale(codec):
    gen = torch.Generator().manual_seed(2)
    block = mla_caches(gen)[0][:1].reshape(-1)  # 16 tokens x 576, bfloat16
    raw = block.view(torch.uint8).numpy().copy()
    c = make_codec(codec, Geometry(raw.nbytes, "bfloat16", LATENT, layout="latent"))
    enc = np.empty(c.encoded_bytes, np.uint8)
    n = c.encode(raw, enc)
    out = np.zeros_like(raw)
    c.decode(enc, n, out)
    x, y = block.float(), torch.from_numpy(out).view(torch.bfloat16).float()
    assert latent_bound(x, y, codec) and not torch.equal(x, y)


def test_mla_blocks_through_a_store_with_a_lossy_codec(tmp_path, clock):
    """The store's own geometry for an MLA fingerprint (head 576, one "head") groups one latent row."""
    fp = ModelFingerprint(model="mla-test", dtype="bfloat16", block_size=N, num_layers=L, num_kv_heads=1,
                          head_size=LATENT)
    bb = L * N * LATENT * 2
    d = tiny_config(tmp_path / "s", dram_blocks=2, nvme_blocks=16, block_bytes=bb).to_dict()
    d["tiers"]["nvme"]["codec"] = "int8"
    s = KVStore(from_dict(d), block_bytes=bb, fingerprint=fp, clock=clock)
    try:
        assert s.geometry.group_elems == LATENT
        gen = torch.Generator().manual_seed(3)
        caches = mla_caches(gen)
        layout = kvcopy.KVLayout.from_vllm(caches, mla=True)
        blocks = torch.zeros(6, bb, dtype=torch.uint8)
        kvcopy.gather(caches, layout, list(range(6)), blocks)
        keys = chain_keys(fp, list(range(6 * N)), N)
        assert s.put(keys, blocks.numpy()) == 6  # 2 DRAM slots: the others encoded in files
        s.flush()
        out = np.zeros((6, bb), np.uint8)
        assert s.get(keys, out) == 6
        for i in range(6):
            x, y = blocks[i].view(torch.bfloat16).float(), torch.from_numpy(out[i]).view(torch.bfloat16).float()
            assert latent_bound(x, y, "int8")
    finally:
        s.close()


@pytest.mark.parametrize("codec", ["int8", "fp8", "int8+zstd", "fp8+zstd"])
def test_lossy_codecs_refuse_state_pages_and_the_connector_names_the_key(codec):
    with pytest.raises(ValueError, match="cannot quantize 'state' blocks.*none or zstd"):
        make_codec(codec, Geometry(4096, "bfloat16", 64, layout="state"))
    for ok in ("none", "zstd"):
        make_codec(ok, Geometry(4096, "bfloat16", 64, layout="state"))
    with pytest.raises(ValueError, match="unknown block layout"):
        Geometry(4096, "bfloat16", 64, layout="pages")
    pytest.importorskip("vllm")
    from kvstore.config import load_config
    from kvstore.configfields import ConfigError
    from kvstore.connectors.vllm.connector import _check_codecs
    from kvstore.offload.groups import Group, KVGroups

    cfg = load_config(overrides={"tiers": {"nvme": {"codec": codec}}})
    hybrid = KVGroups([Group(0, "mamba", 288, 0, 2), Group(1, "full_attention", 288, 0, 2)])
    with pytest.raises(ConfigError, match=r"tiers\.nvme\.codec.*none or zstd"):
        _check_codecs(cfg, hybrid)
    _check_codecs(cfg, KVGroups([Group(0, "sliding_window", 32, 64, 2), Group(1, "full_attention", 32, 0, 2)]))
