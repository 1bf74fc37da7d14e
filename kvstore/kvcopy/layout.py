"""KV-cache layouts as data, and the fixed store block format.

A :class:`KVLayout` says where element ``(layer, block, kv, head, token, dim)`` of
an engine's paged KV cache lives: the per-layer tensor's shape and strides, and
from them the element strides of the block, K/V, head and token axes (the head
dim itself must be contiguous).  Named constructors build the layouts of the
engines we serve; :meth:`KVLayout.from_tensor` / :meth:`KVLayout.from_vllm` read
them off live tensors (strides, padding and all).

Store block format (fixed, version 1; see csrc/README.md), raw bytes of the
cache dtype in C order, all layers and K and V of one engine block::

    packing "std" (every GPU layout):   [layer][token][head][kv][dim]
    packing "vllm_cpu" (vLLM CPU):      [layer][head][kv][section of block_size*head_size]
    MLA:                                [layer][token][latent]
    block_bytes = layers * 2 * block_size * heads * head_size * elem_size
    MLA:          layers * block_size * latent_dim * elem_size

"std" is byte for byte the page of vLLM's default GPU layout (LBNHC, per block and
layer ``[token][head][K dims, V dims]``), so a (block, layer) is one contiguous
run there and a whole block is one run in the cross-layer BLNHC layout (long
runs for the kernel and for DMA).  "vllm_cpu" is vLLM's CPU page
``[heads, block_size, 2*head_size]`` as is: per head a K section then a V
section, each packed by the CPU attention kernel its own way (ISA dependent;
with 'vec', K is stored transposed), copied byte for byte with one memcpy per
(block, layer).  Blocks move freely between layouts of the same packing;
``fingerprint()`` carries the packing so CPU and GPU blocks never mix.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from kvstore.dtypes import dtype_info
from kvstore.kvcopy.layout_read import read_axes

# Store block axis order, outermost first; the head dim (contiguous) is always last.
STORE_ORDER: tuple[str, ...] = ("layer", "token", "head", "kv")  # packing "std"
CPU_PAGE_ORDER: tuple[str, ...] = ("layer", "head", "kv", "token")  # packing "vllm_cpu"
STORE_FORMAT_VERSION = 1

# vLLM (>= 0.2x, RFC #42082) KV cache layouts: the physical order of the logical
# axes (L, B, H, N, C) of the per-layer views [B, H, N, C], C = K dims then V dims.
VLLM_LAYOUTS: dict[str, tuple[int, ...]] = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}

KINDS = ("vllm_cpu", "vllm", "flash_attn", "flashinfer", "cross_layer", "mla")


def _contig_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides = [0] * len(shape)
    acc = 1
    for i in range(len(shape) - 1, -1, -1):
        strides[i] = acc
        acc *= shape[i]
    return tuple(strides)


def _dims(num_blocks, num_layers, block_size, num_heads, head_size) -> tuple[int, int, int, int, int]:
    return (_pos("num_blocks", num_blocks), _pos("num_layers", num_layers), _pos("block_size", block_size),
            _pos("num_heads", num_heads), _pos("head_size", head_size))


def _pos(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) and not hasattr(value, "__index__"):
        raise TypeError(f"{name} must be an int, got {value!r}")
    v = int(value)
    if v <= 0:
        raise ValueError(f"{name} must be positive, got {v}")
    return v


@dataclass(frozen=True)
class KVLayout:
    """Where each element of a paged KV cache lives (all strides in elements).

    The copy reads/writes rows of ``head_size`` contiguous elements at::

        layer base + block_id*block_stride + kv*kv_stride + head*head_stride + token*token_stride

    where the layer base is the data pointer of the per-layer tensor (list form)
    or ``base + layer*layer_stride`` of one stacked tensor.
    """

    kind: str
    num_layers: int
    num_blocks: int
    block_size: int
    num_heads: int
    head_size: int
    elem_size: int
    num_kv: int
    block_stride: int
    kv_stride: int
    head_stride: int
    token_stride: int
    layer_shape: tuple[int, ...]
    layer_strides: tuple[int, ...]
    stacked_shape: tuple[int, ...] | None = None
    stacked_strides: tuple[int, ...] | None = None
    layer_stride: int | None = None
    dtype: str | None = None
    options: tuple[tuple[str, Any], ...] = field(default=())

    # ------------------------------------------------------------ sizes
    @property
    def row_bytes(self) -> int:
        """Bytes of one contiguous (token, head) row: head_size * elem_size."""
        return self.head_size * self.elem_size

    @property
    def block_bytes(self) -> int:
        """Bytes of one store block (all layers, K and V)."""
        return (
            self.num_layers * self.num_kv * self.num_heads * self.block_size * self.row_bytes
        )

    @property
    def layer_bytes(self) -> int:
        """Bytes of one layer inside a store block."""
        return self.block_bytes // self.num_layers

    @property
    def is_mla(self) -> bool:
        return self.num_kv == 1

    def option(self, name: str, default: Any = None) -> Any:
        return dict(self.options).get(name, default)

    @property
    def store_order(self) -> tuple[str, ...]:
        """Axis order of this layout's store blocks (by packing), outermost first."""
        return CPU_PAGE_ORDER if self.packing == "vllm_cpu" else STORE_ORDER

    def store_strides(self) -> tuple[int, int, int, int]:
        """Byte strides (layer, kv, head, token) of the store block format."""
        sizes = {
            "layer": self.num_layers,
            "kv": self.num_kv,
            "head": self.num_heads,
            "token": self.block_size,
        }
        strides = {}
        acc = self.row_bytes
        for axis in reversed(self.store_order):
            strides[axis] = acc
            acc *= sizes[axis]
        return strides["layer"], strides["kv"], strides["head"], strides["token"]

    def paged_strides(self) -> tuple[int, int, int, int]:
        """Byte strides (block, kv, head, token) of the paged cache."""
        e = self.elem_size
        return self.block_stride * e, self.kv_stride * e, self.head_stride * e, self.token_stride * e

    def geometry(self) -> tuple[int, int, int, int, int, int]:
        """(layers, kv, heads, block_size, row_bytes, num_blocks) for the native module."""
        return self.num_layers, self.num_kv, self.num_heads, self.block_size, self.row_bytes, self.num_blocks

    @property
    def packing(self) -> str:
        """How a (head, K|V) section is laid out inside a store block.

        ``"std"``: ``[block_size][head_size]`` (every GPU layout).  ``"vllm_cpu"``:
        the CPU attention kernel's own packing, copied byte for byte (ISA
        dependent; with the 'vec' ISA, K is ``[head_size][block_size]``).  Blocks
        only move between layouts of the same packing.
        """
        return "vllm_cpu" if self.kind == "vllm_cpu" else "std"

    def fingerprint(self, isa: str | None = None) -> str:
        """What determines the meaning of store block bytes, for the model fingerprint:
        format version, packing (plus the CPU ISA when known), dims and dtype."""
        if self.is_mla:
            dims = f"L{self.num_layers}.N{self.block_size}.latent{self.head_size}"
        else:
            dims = f"L{self.num_layers}.N{self.block_size}.H{self.num_heads}.D{self.head_size}"
        pack = self.packing + (f"-{isa}" if isa and self.packing != "std" else "")
        return (
            f"kvblock-v{STORE_FORMAT_VERSION}.{pack}.{dims}.e{self.elem_size}.{self.dtype or '?'}"
        )

    def compatible_with(self, other: "KVLayout") -> bool:
        """True when blocks written with one layout can be read with the other."""
        return (
            self.packing == other.packing
            and self.num_layers == other.num_layers
            and self.num_kv == other.num_kv
            and self.num_heads == other.num_heads
            and self.block_size == other.block_size
            and self.row_bytes == other.row_bytes
        )

    # --------------------------------------------------- named constructors
    # Each builds its stacked form's contiguous (or, for vllm, ordered) shape and strides and
    # reads them with the one builder ``_read``, the same that reads live tensors.
    @classmethod
    def vllm_cpu(
        cls, num_blocks, num_layers, block_size, num_heads, head_size, dtype
    ) -> "KVLayout":
        """vLLM's CPU backend: per layer ``[num_blocks, heads, block_size, 2*head_size]``.

        The backend splits the ``[block_size, 2*head_size]`` page of a head into a K
        section then a V section of ``block_size*head_size`` elements each (vLLM 0.32
        ``cpu_attn.py``: ``kv_cache.view(B, H, 2*N, D).chunk(2, dim=2)``); inside a
        section the CPU kernel packs as its ISA likes (with 'vec', K is stored
        transposed, ``[head_size][block_size]``; V is ``[block_size][head_size]``).
        The copy moves whole sections byte for byte (``packing == "vllm_cpu"``).
        Stacked form: ``[layers, num_blocks, heads, block_size, 2*head_size]``.
        """
        B, L, N, H, D = _dims(num_blocks, num_layers, block_size, num_heads, head_size)
        return cls._stacked("vllm_cpu", (L, B, H, N, 2 * D), dtype)

    @classmethod
    def flash_attn(
        cls, num_blocks, num_layers, block_size, num_heads, head_size, dtype
    ) -> "KVLayout":
        """vLLM CUDA flash-attention (<= 0.1x): per layer ``[2, num_blocks, block_size, heads, head_size]``.

        Stacked form: ``[layers, 2, num_blocks, block_size, heads, head_size]``.
        """
        B, L, N, H, D = _dims(num_blocks, num_layers, block_size, num_heads, head_size)
        return cls._stacked("flash_attn", (L, 2, B, N, H, D), dtype)

    @classmethod
    def flashinfer(
        cls, num_blocks, num_layers, block_size, num_heads, head_size, dtype, *, hnd=False
    ) -> "KVLayout":
        """FlashInfer: per layer ``[num_blocks, 2, block_size, heads, head_size]`` (NHD),
        or ``[num_blocks, 2, heads, block_size, head_size]`` with ``hnd=True``.

        Stacked form: ``[layers, ...]``.
        """
        B, L, N, H, D = _dims(num_blocks, num_layers, block_size, num_heads, head_size)
        return cls._stacked("flashinfer", (L, B, 2, H, N, D) if hnd else (L, B, 2, N, H, D), dtype, hnd=hnd)

    @classmethod
    def cross_layer(
        cls, num_blocks, num_layers, block_size, num_heads, head_size, dtype
    ) -> "KVLayout":
        """Cross-layer block-contiguous cache: ONE tensor ``[num_blocks, layers, 2, block_size, heads, head_size]``.

        That is vLLM's flash-attention cache allocated with the layer axis
        (``get_kv_cache_stride_order(include_num_layers_dimension=True)``:
        physical ``(2, 0, 1, 3, 4, 5)`` of ``[L, 2, B, N, H, D]``), so all layers of
        a block are one contiguous run.  The list form takes the per-layer views
        ``t[:, l]`` (shape ``[num_blocks, 2, block_size, heads, head_size]``).
        For vLLM >= 0.2x's block-outermost layouts (BLNHC, ...) use :meth:`vllm`.
        """
        B, L, N, H, D = _dims(num_blocks, num_layers, block_size, num_heads, head_size)
        return cls._stacked("cross_layer", (B, L, 2, N, H, D), dtype)

    @classmethod
    def mla(
        cls, num_blocks, num_layers, block_size, latent_dim, dtype, *, heads_axis=False
    ) -> "KVLayout":
        """MLA: one latent tensor per layer ``[num_blocks, block_size, latent_dim]`` (no K/V split).

        ``heads_axis=True``: vLLM >= 0.2x's 4-D view ``[num_blocks, 1, block_size, latent_dim]``.
        Stacked form: ``[layers, ...]``.
        """
        B, L, N, D = (_pos("num_blocks", num_blocks), _pos("num_layers", num_layers),
                      _pos("block_size", block_size), _pos("latent_dim", latent_dim))  # fmt: skip
        return cls._stacked("mla", (L, B, 1, N, D) if heads_axis else (L, B, N, D), dtype)

    @classmethod
    def vllm(
        cls, layout_name, num_blocks, num_layers, block_size, num_heads, head_size, dtype
    ) -> "KVLayout":
        """vLLM >= 0.2x GPU backends (RFC #42082): per-layer views ``[B, H, N, 2*head_size]``
        (K dims then V dims in the last axis) over one allocation whose physical
        order is ``layout_name`` (``LBNHC`` = flash-attn's default NHD, ``LBHNC``,
        ``LHBNC``, and the cross-layer ``BLNHC``, ``BLHNC``, ``BHLNC``).

        The list form takes the per-layer views vLLM registers; the stacked form
        the 5-D view ``[L, B, H, N, 2*head_size]`` with the same strides.
        Note vLLM's CPU backend reads the same shape differently: use :meth:`vllm_cpu`.
        """
        if layout_name not in VLLM_LAYOUTS:
            raise ValueError(
                f"unknown vLLM KV cache layout {layout_name!r}; one of {sorted(VLLM_LAYOUTS)}"
            )
        B, L, N, H, D = _dims(num_blocks, num_layers, block_size, num_heads, head_size)
        logical = (L, B, H, N, 2 * D)
        strides = [0] * 5
        acc = 1
        for dim in reversed(VLLM_LAYOUTS[layout_name]):
            strides[dim] = acc
            acc *= logical[dim]
        es, name = dtype_info(dtype)
        return cls._read("vllm", logical, tuple(strides), stacked=True, elem_size=es, dtype=name,
                         options=(("vllm_layout", layout_name),))

    @classmethod
    def _stacked(cls, kind: str, shape: tuple[int, ...], dtype: Any, *, hnd: bool = False) -> "KVLayout":
        es, name = dtype_info(dtype)
        return cls._read(kind, shape, _contig_strides(shape), stacked=True, elem_size=es, dtype=name, hnd=hnd)

    # ------------------------------------------------------------ from tensors
    @classmethod
    def from_tensor(cls, kind: str, kv_caches: Any, *, hnd: bool = False) -> "KVLayout":
        """Read a layout off live cache tensors (a per-layer list, or one stacked tensor).

        ``kind`` says how to read the axes (see :data:`KINDS`); the sizes, strides
        (padding included) and dtype come from the tensors.  For ``flashinfer``,
        ``hnd=True`` reads ``[B, 2, H, N, D]``.
        """
        from ._buffers import tensor_meta

        if kind not in KINDS:
            raise ValueError(f"unknown layout kind {kind!r}; one of {KINDS}")
        stacked = not isinstance(kv_caches, (list, tuple))
        if stacked:
            t = tensor_meta(kv_caches, "kv_caches")
        else:
            if len(kv_caches) == 0:
                raise ValueError("kv_caches is an empty list")
            t = tensor_meta(kv_caches[0], "kv_caches[0]")
        return cls._read(kind, tuple(t.shape), tuple(t.strides), stacked=stacked,
                         num_layers=None if stacked else len(kv_caches), elem_size=t.itemsize,
                         dtype=t.dtype_name, hnd=hnd)

    @classmethod
    def _read(cls, kind: str, shape: tuple[int, ...], st: tuple[int, ...], *, stacked: bool, elem_size: int,
              dtype: str | None, num_layers: int | None = None, hnd: bool = False,
              options: tuple = ()) -> "KVLayout":
        """The one builder: a layout from a cache's shape and strides (in elements), read as
        ``kind`` (the stacked tensor, or one layer of a list of ``num_layers``)."""
        ax = read_axes(kind, shape, st, stacked=stacked, num_layers=num_layers, hnd=hnd)
        opts: tuple = (("hnd", bool(hnd)),) if kind == "flashinfer" else options
        return cls(kind=kind, elem_size=elem_size, dtype=dtype, options=opts, **ax)

    @classmethod
    def from_vllm(cls, kv_caches: Any, *, mla: bool = False) -> "KVLayout":
        """The layout of the per-layer caches vLLM (>= 0.2x) hands to ``register_kv_caches``.

        vLLM's views are ``[B, H, N, C]`` everywhere, but the backends read ``C``
        differently: the CPU backend as ``[2, N, D]`` per head (K rows, then V
        rows: kind ``vllm_cpu``), the GPU backends as K dims then V dims per token
        (kind ``vllm``).  The caches' device decides.  MLA caches (one latent,
        ``[B, 1, N, latent]``) need ``mla=True`` (from the spec: MLAAttentionSpec).
        """
        from ._buffers import tensor_meta

        if mla:
            return cls.from_tensor("mla", kv_caches)
        first = kv_caches[0] if isinstance(kv_caches, (list, tuple)) else kv_caches
        device = tensor_meta(first, "kv_caches").device
        return cls.from_tensor("vllm_cpu" if device == "cpu" else "vllm", kv_caches)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown layout kind {self.kind!r}")
        if self.num_kv not in (1, 2):
            raise ValueError("num_kv must be 1 (MLA) or 2")

    def describe(self) -> str:
        heads = f"latent={self.head_size}" if self.is_mla else f"heads={self.num_heads} head_size={self.head_size}"
        return (f"KVLayout({self.kind}, layers={self.num_layers} blocks={self.num_blocks} "
                f"block_size={self.block_size} {heads}, elem={self.elem_size}B, "
                f"layer shape {self.layer_shape}, block_bytes={self.block_bytes})")


__all__ = ["KVLayout", "STORE_ORDER", "CPU_PAGE_ORDER", "STORE_FORMAT_VERSION", "VLLM_LAYOUTS", "KINDS",
           "dtype_info"]


def named_layout(name: str, B: int, L: int, N: int, H: int, D: int, dtype: Any) -> KVLayout:
    """A layout by name, for tests and benchmarks: ``vllm_cpu``, ``flash_attn``, ``flashinfer``
    (``flashinfer_nhd``), ``flashinfer_hnd``, ``cross_layer``, ``vllm_<ORDER>`` (one of
    ``VLLM_LAYOUTS``), ``mla`` (latent ``H * D``), ``mla_4d``."""
    if name in ("flashinfer", "flashinfer_nhd", "flashinfer_hnd"):
        return KVLayout.flashinfer(B, L, N, H, D, dtype, hnd=name.endswith("hnd"))
    if name.startswith("vllm_") and name != "vllm_cpu":
        return KVLayout.vllm(name[5:], B, L, N, H, D, dtype)
    if name in ("mla", "mla_4d"):
        return KVLayout.mla(B, L, N, H * D, dtype, heads_axis=name == "mla_4d")
    if name in ("vllm_cpu", "flash_attn", "cross_layer"):
        return getattr(KVLayout, name)(B, L, N, H, D, dtype)
    raise ValueError(f"unknown layout name {name!r}")
