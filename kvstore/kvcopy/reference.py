"""Slow pure-torch reference of gather/scatter: the test oracle and the fallback
when the compiled module is missing.

It does not use the layout's stride arithmetic: each kind's per-layer tensor is
turned into a logical ``[blocks, kv, heads, tokens, head_bytes]`` uint8 view with
torch reshapes/permutes (the way the attention backends read it), and the store
block is that view, permuted to :data:`~kvstore.kvcopy.layout.STORE_ORDER`.
Works on CPU and CUDA tensors and on numpy arrays (wrapped zero-copy).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from .layout import KVLayout

# axis positions in the stacked logical tensor [n, layer, kv, head, token, bytes]
_AXIS = {"layer": 1, "kv": 2, "head": 3, "token": 4}


def _as_torch(x: Any) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, np.ndarray):
        return torch.from_numpy(x)
    return torch.from_dlpack(x)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def logical_layer(t: Any, layout: KVLayout) -> torch.Tensor:
    """One layer's cache as a uint8 view ``[num_blocks, kv, heads, block_size, row_bytes]``."""
    u = _bytes(_as_torch(t))
    k = layout.kind
    if k == "vllm_cpu":
        B, H, N, C = u.shape
        # the CPU backend: kv_cache.view(B, H, 2*N, D).chunk(2, dim=2)
        return u.view(B, H, 2, N, C // 2).permute(0, 2, 1, 3, 4)
    if k == "vllm":
        return u.unflatten(-1, (2, u.shape[-1] // 2)).permute(0, 3, 1, 2, 4)
    if k == "flash_attn":  # [2, B, N, H, D]
        return u.permute(1, 0, 3, 2, 4)
    if k == "flashinfer":
        return u if layout.option("hnd") else u.permute(0, 1, 3, 2, 4)
    if k == "cross_layer":  # per-layer view [B, 2, N, H, D]
        return u.permute(0, 1, 3, 2, 4)
    if k == "mla":  # [B, N, latent] or [B, 1, N, latent]
        return u[:, None] if u.dim() == 4 else u[:, None, None]
    raise ValueError(f"unknown layout kind {k!r}")


def logical_layers(kv_caches: Any, layout: KVLayout) -> list[torch.Tensor]:
    if isinstance(kv_caches, (list, tuple)):
        layers = list(kv_caches)
    else:
        t = _as_torch(kv_caches)
        if layout.kind == "cross_layer":
            layers = [t[:, l] for l in range(t.shape[1])]
        else:
            layers = [t[l] for l in range(t.shape[0])]
    if len(layers) != layout.num_layers:
        raise ValueError(f"expected {layout.num_layers} layers, got {len(layers)}")
    return [logical_layer(x, layout) for x in layers]


def _store_perm(layout: KVLayout) -> tuple[int, ...]:
    return (0, *(_AXIS[a] for a in layout.store_order), 5)


def _rows(blocks: Any) -> list[torch.Tensor]:
    if isinstance(blocks, (list, tuple)):
        return [_bytes(_as_torch(b)).reshape(-1) for b in blocks]
    t = _bytes(_as_torch(blocks))
    return [t[i] for i in range(t.shape[0])]


def gather(kv_caches: Any, layout: KVLayout, block_ids: Sequence[int], dst: Any) -> None:
    """dst[i] = store block of cache block block_ids[i] (all layers, K and V)."""
    layers = logical_layers(kv_caches, layout)
    dev = layers[0].device
    ids = torch.as_tensor(np.asarray(block_ids, dtype=np.int64), device=dev)
    if ids.numel() == 0:
        return
    stacked = torch.stack([lv[ids] for lv in layers], dim=1)  # [n, L, KV, H, N, R]
    out = stacked.permute(_store_perm(layout)).reshape(ids.numel(), layout.block_bytes)
    rows = _rows(dst)
    if len(rows) != ids.numel():
        raise ValueError("dst and block_ids differ in length")
    for i, r in enumerate(rows):
        r.copy_(out[i])


def scatter(src: Any, layout: KVLayout, block_ids: Sequence[int], kv_caches: Any) -> None:
    """Cache block block_ids[i] = store block src[i] (all layers, K and V)."""
    layers = logical_layers(kv_caches, layout)
    dev = layers[0].device
    ids = torch.as_tensor(np.asarray(block_ids, dtype=np.int64), device=dev)
    if ids.numel() == 0:
        return
    rows = _rows(src)
    if len(rows) != ids.numel():
        raise ValueError("src and block_ids differ in length")
    data = torch.stack([r.to(dev) for r in rows])  # [n, block_bytes]
    sizes = {
        "layer": layout.num_layers,
        "kv": layout.num_kv,
        "head": layout.num_heads,
        "token": layout.block_size,
    }
    shaped = data.view(ids.numel(), *(sizes[a] for a in layout.store_order), layout.row_bytes)
    perm = _store_perm(layout)
    inv = [0] * 6
    for i, p in enumerate(perm):
        inv[p] = i
    logical = shaped.permute(inv)  # [n, L, KV, H, N, R]
    for l, lv in enumerate(layers):
        lv[ids] = logical[:, l]
