"""Block codecs: none, int8, fp8 (lossy, per-group scales) and zstd (stacks on any of them)."""

from kvstore.codecs.base import DTYPES, Codec, CodecError, Geometry, normalize_dtype
from kvstore.codecs.registry import make_codec

__all__ = ["DTYPES", "Codec", "CodecError", "Geometry", "make_codec", "normalize_dtype"]
