"""Reading a paged KV cache's axes off its shape and strides: the one path by which every
:class:`~kvstore.kvcopy.layout.KVLayout` is built (named constructors read their own stacked
form; ``from_tensor`` reads live tensors, padding and all)."""

from __future__ import annotations


def read_axes(kind: str, shape: tuple[int, ...], st: tuple[int, ...], *, stacked: bool,
              num_layers: int | None = None, hnd: bool = False) -> dict:
    """The layout fields of a cache read as ``kind`` from its shape and strides (in elements):
    the stacked tensor, or one layer of a list of ``num_layers``. Raises ValueError for a
    shape or strides that ``kind`` cannot have."""
    layer_nd = {"vllm_cpu": 4, "vllm": 4, "flash_attn": 5, "flashinfer": 5,
                "cross_layer": 5, "mla": 3}[kind]  # fmt: skip
    if kind == "mla" and len(shape) == layer_nd + 1 + int(stacked):
        layer_nd += 1  # vLLM >= 0.2x: [B, 1, N, latent]
    if stacked:
        if len(shape) != layer_nd + 1:
            raise ValueError(
                f"{kind}: expected a {layer_nd + 1}-D stacked tensor or a list of "
                f"{layer_nd}-D per-layer tensors, got shape {tuple(shape)}"
            )
        ldim = 1 if kind == "cross_layer" else 0
        L, layer_stride = shape[ldim], st[ldim]
        lshape = shape[:ldim] + shape[ldim + 1 :]
        lst = st[:ldim] + st[ldim + 1 :]
    else:
        L, layer_stride = num_layers, None
        if len(shape) != layer_nd:
            raise ValueError(
                f"{kind}: expected {layer_nd}-D per-layer tensors, got shape {tuple(shape)}"
            )
        lshape, lst = shape, st
    if lst[-1] != 1 and lshape[-1] > 1:
        raise ValueError(f"{kind}: the last (head) dim must be contiguous, strides {lst}")
    num_kv = 2
    if kind in ("vllm_cpu", "vllm"):
        B, H, N, C = lshape
        if C % 2:
            raise ValueError(f"{kind}: last dim {C} is not 2*head_size")
        D = C // 2
        if kind == "vllm_cpu":
            if (H > 1 and lst[1] != N * C) or (N > 1 and lst[2] != C):
                raise ValueError(
                    "vllm_cpu: each block's [heads, block_size, 2*head_size] must be "
                    f"contiguous (the backend reads it as [heads, 2, block_size, head_size]); "
                    f"strides {lst}"
                )
            bs, kvs, hs, ts = lst[0], N * D, N * C, D
        else:
            bs, kvs, hs, ts = lst[0], D, lst[1], lst[2]
    elif kind in ("flash_attn",):
        two, B, N, H, D = lshape
        bs, kvs, hs, ts = lst[1], lst[0], lst[3], lst[2]
    elif kind in ("flashinfer", "cross_layer"):
        if kind == "flashinfer" and hnd:
            B, two, H, N, D = lshape
            bs, kvs, hs, ts = lst[0], lst[1], lst[2], lst[3]
        else:
            B, two, N, H, D = lshape
            bs, kvs, hs, ts = lst[0], lst[1], lst[3], lst[2]
    else:  # mla
        if len(lshape) == 4:
            if lshape[1] != 1:
                raise ValueError(f"mla: expected [B, 1, N, latent], got {tuple(lshape)}")
            B, _, N, D = lshape
        else:
            B, N, D = lshape
        H, num_kv = 1, 1
        bs, kvs, hs, ts = lst[0], 0, 0, lst[-2]
    if kind in ("flash_attn", "flashinfer", "cross_layer") and two != 2:
        raise ValueError(f"{kind}: the K/V axis has size {two}, expected 2")
    for nm, v in (("num_blocks", B), ("num_layers", L), ("block_size", N),
                  ("heads", H), ("head_size", D)):  # fmt: skip
        if v <= 0:
            raise ValueError(f"{kind}: {nm} is {v}")
    if any(s < 0 for s in lst) or (layer_stride is not None and layer_stride < 0):
        raise ValueError(f"{kind}: negative strides are not supported ({lst})")
    return dict(num_layers=L, num_blocks=B, block_size=N, num_heads=H, head_size=D, num_kv=num_kv,
                block_stride=bs, kv_stride=kvs, head_stride=hs, token_stride=ts,
                layer_shape=tuple(lshape), layer_strides=tuple(lst),
                stacked_shape=tuple(shape) if stacked else None,
                stacked_strides=tuple(st) if stacked else None, layer_stride=layer_stride)
