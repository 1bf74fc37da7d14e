"""int8 and fp8 (e4m3) quantization with one fp32 scale per group of elements.

Encoded block: ``[n_groups x float32 scale][n_elems x 1-byte code]`` (scales first, so the
codes stay contiguous). A group is ``geometry.group_elems`` consecutive elements (see
:class:`~kvstore.codecs.base.Geometry`: one token-head K or V row in the "std" packing).

* int8: symmetric, ``scale = max|x| / 127``, ``q = round(x / scale)``; error <= scale / 2.
* fp8:  ``scale = max|x| / 448`` (e4m3's largest finite), ``q = e4m3(x / scale)``
  (round to nearest even); relative error <= 2**-4 for normal codes, absolute <= 2**-10 * scale
  in e4m3's subnormal range.

The fp32 scale is the quotient rounded up to the next float32 where it fell short (``qmax *
scale >= max|x|`` exactly), so no code clamps and the bounds hold; a group that is not all zeros
never gets scale 0 (its max / 127 under float32's smallest subnormal rounds up to that). Codes are
``x / scale``, never ``x * (1 / scale)``: the reciprocal of a subnormal scale overflows to inf, and
a float32 or bfloat16 group of subnormal magnitude (~1e-39) came back off by ~98 % (int8) or as
e4m3 NaN codes (fp8, refused at every decode). The division costs ~10 % of an encode (a 2 MiB
float32 block, one thread, best of 5: int8 0.35 -> 0.39 ms, fp8 0.60 -> 0.66 ms).

Decoding multiplies back in float32 (exact for a subnormal scale: a code has at most 8 significant
bits), clamps to the block dtype's finite range where a scale could reach past it (a group whose
max is near float32's max gave inf), and rounds to the block dtype (one more half-ulp of it).
Vectorized torch (multithreaded, and it has fp8 and bfloat16, which numpy lacks; numpy's int8 path
measured 4 to 20x slower); fp8 decodes through float16 bits rather than torch's slow fp8 cast.
"""

from __future__ import annotations

import numpy as np
import torch

from kvstore.codecs.base import Codec, CodecError, Geometry

_TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
_FINITE_MAX = {name: torch.finfo(t).max for name, t in _TORCH_DTYPES.items()}
FP8_MAX = 448.0
INT8_MAX = 127.0


class QuantCodec(Codec):
    fixed_size = True

    def __init__(self, geometry: Geometry, kind: str):
        if kind not in ("int8", "fp8"):
            raise ValueError(f"unknown quantization {kind!r}")
        super().__init__(geometry)
        self.name = kind
        self.tdtype = _TORCH_DTYPES[geometry.dtype]
        self.n = geometry.n_elems
        self.group = int(geometry.group_elems)
        self.n_groups = self.n // self.group
        self.scale_bytes = 4 * self.n_groups
        self.qmax = INT8_MAX if kind == "int8" else FP8_MAX
        self.qdtype = torch.int8 if kind == "int8" else torch.float8_e4m3fn
        self.finite_max = _FINITE_MAX[geometry.dtype]  # decoded values are clamped to +-this

    @property
    def encoded_bytes(self) -> int:
        return self.scale_bytes + self.n

    @property
    def lossless(self) -> bool:
        return False

    def _x(self, u8: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(u8[: self.block_bytes]).view(self.tdtype).view(self.n_groups, self.group)

    def encode(self, src: np.ndarray, dst: np.ndarray) -> int:
        x = self._x(src).to(torch.float32, copy=True)
        scale = self._scales(x.abs().amax(dim=1, keepdim=True))
        y = x.div_(torch.where(scale > 0, scale, torch.ones_like(scale)))  # an all-zero group stays 0
        if self.name == "int8":
            q = y.round_().clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
        else:
            q = y.clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        d = torch.from_numpy(dst[: self.encoded_bytes])
        d[: self.scale_bytes].view(torch.float32).copy_(scale.view(-1))
        d[self.scale_bytes:].view(q.dtype).copy_(q.view(-1))
        return self.encoded_bytes

    def _scales(self, amax: torch.Tensor) -> torch.Tensor:
        """``amax / qmax`` in float32, rounded up one float32 where ``qmax * scale`` falls short of
        ``amax`` (checked in float64, exact: 24 by 9 bits), so that no code clamps; this also lifts
        a nonzero group's scale off 0."""
        scale = amax / self.qmax
        short = scale.double() * self.qmax < amax.double()
        return torch.where(short, torch.nextafter(scale, torch.full_like(scale, float("inf"))), scale)

    def decode(self, src: np.ndarray, nbytes: int, dst: np.ndarray) -> None:
        if nbytes != self.encoded_bytes:
            raise CodecError(f"{self.name}: {nbytes} bytes, expected {self.encoded_bytes}")
        if not src.flags.writeable:  # torch wants writable numpy memory (it is only read)
            src = src.copy()
        s = torch.from_numpy(src[: self.encoded_bytes])
        scale = s[: self.scale_bytes].view(torch.float32).view(self.n_groups, 1)
        if not bool(torch.isfinite(scale).all()) or bool((scale < 0).any()):
            raise CodecError(f"{self.name}: bad scales")
        # a decoded value reaches at most qmax * scale: past the dtype's max only for a group near it
        clamp = float(scale.max()) * self.qmax > self.finite_max
        if self.name == "int8":
            q = s[self.scale_bytes:].view(torch.int8).view(self.n_groups, self.group)
            y = q.float().mul_(scale)
        else:
            # fp8: torch's e4m3 -> float cast runs ~1 GB/s on CPU; moving the bits into a float16
            # (sign; exponent and mantissa shifted into place) gives the same value times 2**-8,
            # exactly, for every finite code, subnormals included, at ~4x the speed (bench/tiers/codec_speed.py)
            u = s[self.scale_bytes:].view(self.n_groups, self.group).to(torch.int16)
            mag = u & 0x7F
            if bool((mag == 0x7F).any()):  # e4m3's NaN codes: the encoder never writes them
                raise CodecError(f"{self.name}: NaN codes")
            h = (u & 0x80).bitwise_left_shift_(8).bitwise_or_(mag.bitwise_left_shift_(7))
            y = h.view(torch.float16).float().mul_(scale * 256.0)
        if clamp:
            y.clamp_(-self.finite_max, self.finite_max)
        self._x(dst).copy_(y)
