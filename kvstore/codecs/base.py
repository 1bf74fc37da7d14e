"""The codec contract: raw block bytes <-> stored (encoded) bytes.

A codec turns one raw block (``block_bytes`` of uint8, the store block format) into at most
``encoded_bytes`` stored bytes and back. ``fixed_size`` codecs always produce exactly
``encoded_bytes``; the others (zstd) produce a variable length, recorded in the NVMe header's
``payload_len``. ``decode`` raises :class:`CodecError` on bytes it cannot decode (the store
turns that into a counted miss, never an exception to the caller).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from kvstore import dtypes


LAYOUTS = ("kv", "latent", "state")
LOSSY_LAYOUTS = ("kv", "latent")  # blocks of rows of one element dtype


class CodecError(ValueError):
    """Stored bytes that do not decode (corrupt or foreign)."""


# element dtypes the lossy codecs understand (name -> bytes per element), from the one table
DTYPES = {d: dtypes.SIZES[d] for d in dtypes.QUANTIZABLE}
normalize_dtype = dtypes.normalize


@dataclass(frozen=True)
class Geometry:
    """What a codec needs to know about a block: its size, element dtype and scale group size.

    ``group_elems`` consecutive elements share one scale. In the "std" packing
    ([layer][token][head][kv][dim]) a group of ``head_size`` elements is one token's K (or V)
    row of one head; in vLLM's CPU packing ([layer][head][kv][section], section ISA-packed) it
    is ``head_size`` consecutive elements of one head's K (or V) section, which never straddles
    a head or K/V (a section is ``block_size * head_size`` elements) but need not be one token.
    """

    block_bytes: int
    dtype: str = "uint8"
    group_elems: int = 128
    # what the block holds: "kv" (K/V rows of attention heads), "latent" (MLA: one latent row per
    # token, no K/V split), "state" (a hybrid model's raw Mamba / linear-attention state pages:
    # several tensors of their own dtypes and padding, no rows a lossy codec may quantize)
    layout: str = "kv"

    @property
    def itemsize(self) -> int:
        return DTYPES.get(self.dtype, 1)

    @property
    def n_elems(self) -> int:
        return self.block_bytes // self.itemsize

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"unknown block layout {self.layout!r}; one of {', '.join(LAYOUTS)}")

    def checked(self) -> "Geometry":
        """Validate for a lossy codec (ValueError names what is wrong)."""
        if self.layout not in LOSSY_LAYOUTS:
            raise ValueError(f"a lossy codec (int8/fp8) cannot quantize {self.layout!r} blocks (it understands "
                             f"{', '.join(LOSSY_LAYOUTS)}; a model with Mamba or linear-attention state needs a "
                             "lossless codec: none or zstd)")
        if self.dtype not in DTYPES:
            raise ValueError(f"a lossy codec (int8/fp8) needs the KV element dtype, one of {sorted(DTYPES)}; "
                             f"got {self.dtype!r} (pass KVStore(..., kv_dtype=...) or a ModelFingerprint dtype)")
        if self.block_bytes % self.itemsize:
            raise ValueError(f"block_bytes {self.block_bytes} is not a whole number of {self.dtype} elements")
        g = int(self.group_elems)
        if g <= 0:
            raise ValueError(f"group_elems must be positive, got {g}")
        if self.n_elems % g:
            g2 = math.gcd(self.n_elems, g)
            raise ValueError(f"group_elems {g} does not divide the block's {self.n_elems} elements "
                             f"(largest divisor of both: {g2})")
        return self


class Codec:
    name: str = "none"
    id: int = 0  # in block headers (kvstore.codecs.registry sets it: make_codec)
    fixed_size: bool = True

    def __init__(self, geometry: Geometry):
        self.geometry = geometry
        self.block_bytes = geometry.block_bytes

    @property
    def encoded_bytes(self) -> int:
        """The most bytes one encoded block can take (exact for ``fixed_size`` codecs)."""
        return self.block_bytes

    @property
    def lossless(self) -> bool:
        return True

    def encode(self, src: np.ndarray, dst: np.ndarray) -> int:
        """Encode one raw block ``src`` (uint8) into ``dst`` (>= encoded_bytes); returns bytes written."""
        np.copyto(dst[: self.block_bytes], src[: self.block_bytes], casting="no")
        return self.block_bytes

    def decode(self, src: np.ndarray, nbytes: int, dst: np.ndarray) -> None:
        """Decode ``src[:nbytes]`` into ``dst[:block_bytes]``; CodecError if it does not decode."""
        if nbytes != self.block_bytes:
            raise CodecError(f"{self.name}: {nbytes} bytes, expected {self.block_bytes}")
        np.copyto(dst[: self.block_bytes], src[: self.block_bytes], casting="no")

    def __repr__(self) -> str:
        g = self.geometry
        return f"<codec {self.name} {g.block_bytes}B {g.dtype}/{g.group_elems} -> <={self.encoded_bytes}B>"
