"""The codecs by name, in one place: what the config accepts, the id written in every block
header (never reused: a file or a Redis value names its codec by it), and how each is built
(an optional int8/fp8 quantizer, then optionally zstd). :func:`register_codec` adds one, as
:func:`kvstore.tiers.policy.register_policy` adds a policy."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CodecSpec:
    name: str
    id: int  # in block headers: never changed, never reused
    quant: str | None = None  # "int8" | "fp8": the lossy stage, None = the raw bytes
    zstd: bool = False  # then zstd (lossless, variable size)


CODECS: dict[str, CodecSpec] = {}
CODEC_IDS: dict[str, int] = {}  # name -> header id
CODEC_NAMES: dict[int, str] = {}  # header id -> name


def register_codec(spec: CodecSpec) -> CodecSpec:
    if spec.name in CODECS or spec.id in CODEC_NAMES:
        raise ValueError(f"codec {spec.name!r} (id {spec.id}) is registered already")
    CODECS[spec.name] = spec
    CODEC_IDS[spec.name] = spec.id
    CODEC_NAMES[spec.id] = spec.name
    return spec


for _spec in (CodecSpec("none", 0), CodecSpec("int8", 1, "int8"), CodecSpec("fp8", 2, "fp8"),
              CodecSpec("zstd", 3, None, True), CodecSpec("int8+zstd", 4, "int8", True),
              CodecSpec("fp8+zstd", 5, "fp8", True)):
    register_codec(_spec)


def make_codec(name: str, geometry, zstd_level: int = 3):
    """A codec by config name (:data:`CODECS`)."""
    from kvstore.codecs.base import Codec
    from kvstore.codecs.quant import QuantCodec
    from kvstore.codecs.zstd import ZstdCodec

    spec = CODECS.get(name)
    if spec is None:
        raise ValueError(f"unknown codec {name!r}; known: {', '.join(CODECS)}")
    inner = Codec(geometry) if spec.quant is None else QuantCodec(geometry.checked(), spec.quant)
    codec = ZstdCodec(inner, zstd_level) if spec.zstd else inner
    codec.id = spec.id
    return codec
