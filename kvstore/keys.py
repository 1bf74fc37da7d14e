"""Block keys: a hash chain seeded by a model fingerprint.

    root    = H(canonical encoding of the ModelFingerprint)
    key_i   = H(key_{i-1} || tokens of block i || extra keys of block i)

H is xxh3-128 (stable across processes, platforms and restarts; never Python's ``hash()``).
Keys are 16-byte ``bytes``; ``key.hex()`` names files. Only *full* blocks get keys.
"""

from __future__ import annotations

import array
import dataclasses
import struct
import sys
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import xxhash

KEY_BYTES = 16


_U32 = next((c for c in "IL" if array.array(c).itemsize == 4), None)  # the array code of a uint32


def _h(data: bytes) -> bytes:
    return xxhash.xxh3_128_digest(data)


def encode(value: Any) -> bytes:
    """A small, stable, type-tagged encoding of str/int/float/bytes/bool/None/tuples/lists/dicts.

    Used for fingerprints and vLLM's extra keys (LoRA name, multimodal hashes, cache salt).
    Unknown types raise TypeError rather than fall back to ``repr`` (which can vary).
    """
    if value is None:
        return b"N"
    if isinstance(value, bool):
        return b"T" if value else b"F"
    if isinstance(value, int):
        s = str(value).encode()
        return b"I" + struct.pack("<I", len(s)) + s
    if isinstance(value, float):
        return b"D" + struct.pack("<d", value)
    if isinstance(value, str):
        s = value.encode("utf-8")
        return b"S" + struct.pack("<I", len(s)) + s
    if isinstance(value, (bytes, bytearray, memoryview)):
        b = bytes(value)
        return b"B" + struct.pack("<I", len(b)) + b
    if isinstance(value, (tuple, list)):
        return b"L" + struct.pack("<I", len(value)) + b"".join(encode(v) for v in value)
    if isinstance(value, dict):
        items = sorted((str(k), v) for k, v in value.items())
        return b"M" + struct.pack("<I", len(items)) + b"".join(encode(k) + encode(v) for k, v in items)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return encode(dataclasses.asdict(value))
    raise TypeError(f"cannot encode {type(value).__name__} in a block key")


@dataclass(frozen=True)
class ModelFingerprint:
    """Everything that determines the bytes of a block besides its tokens."""

    model: str
    revision: str = ""
    dtype: str = "float16"
    layout: str = "store"  # the store block format id / KV layout name
    block_size: int = 16  # tokens per block
    num_layers: int = 1
    num_kv_heads: int = 1
    head_size: int = 1
    tp_rank: int = 0
    tp_size: int = 1
    codec: str = "none"
    extra: tuple = ()  # anything else (e.g. kv-cache dtype, pp rank)
    # how a block's bytes are packed (kvcopy.KVLayout.packing: "std", "vllm_cpu"), which the worker
    # checks against the engine's caches; part of ``layout`` already, so it is kept out of the digest
    packing: str = ""

    def __post_init__(self) -> None:
        if self.packing and f".{self.packing}" not in self.layout:
            raise ValueError(f"fingerprint packing {self.packing!r} is not the one of layout {self.layout!r}")

    def digest(self) -> bytes:
        d = dataclasses.asdict(self)
        del d["packing"]
        return _h(b"kvstore-fp-v1" + encode(d))

    def hex(self) -> str:
        return self.digest().hex()


def root_of(fingerprint: ModelFingerprint | bytes) -> bytes:
    if isinstance(fingerprint, ModelFingerprint):
        return fingerprint.digest()
    if isinstance(fingerprint, (bytes, bytearray)) and len(fingerprint) == KEY_BYTES:
        return bytes(fingerprint)
    raise TypeError("fingerprint must be a ModelFingerprint or 16 digest bytes")


def _token_bytes(token_ids: Sequence[int] | np.ndarray) -> bytes:
    """Token ids as little-endian uint32 bytes; each must be in [0, 2**32). A list goes through
    ``array`` (73 us for 8k tokens, against 220 us for numpy's conversion of Python ints)."""
    if not isinstance(token_ids, np.ndarray) and _U32 is not None:
        try:
            a = array.array(_U32, token_ids)  # checks every value's range
        except OverflowError as e:
            raise ValueError(f"token ids must be in [0, 2**32): {e}") from None
        if sys.byteorder != "little":  # pragma: no cover
            a.byteswap()
        return a.tobytes()
    toks = np.ascontiguousarray(token_ids, dtype=np.int64)
    if toks.size and (toks.min() < 0 or toks.max() >= 2**32):
        raise ValueError("token ids must be in [0, 2**32)")
    return toks.astype("<u4").tobytes()


def next_key(parent: bytes, block_tokens: Sequence[int] | np.ndarray, extra: Any = None) -> bytes:
    """The key of the block of ``block_tokens`` after ``parent``: ``chain_keys``'s step, with the
    same token validation."""
    toks = _token_bytes(block_tokens)
    tail = b"" if extra is None else encode(extra)
    return _h(parent + struct.pack("<I", len(toks)) + toks + tail)


def chain_keys(
    fingerprint: ModelFingerprint | bytes,
    token_ids: Sequence[int] | np.ndarray,
    block_size: int,
    extra: Any = None,
    extra_per_block: Sequence[Any] | None = None,
    parent: bytes | None = None,
) -> list[bytes]:
    """Keys of every *full* block of ``token_ids``.

    ``extra`` applies to every block (e.g. a LoRA name, a cache salt); ``extra_per_block`` has
    one value per full block (e.g. the multimodal hashes overlapping that block).
    ``parent`` continues an existing chain (the key of the block before ``token_ids[0]``).
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    n = len(token_ids) // block_size
    if extra_per_block is not None and len(extra_per_block) < n:
        raise ValueError(f"extra_per_block has {len(extra_per_block)} values for {n} full blocks")
    prev = root_of(fingerprint) if parent is None else parent
    # next_key's bytes, built once for the whole prompt: ~2.5x faster on an 8k-token prompt
    raw = _token_bytes(token_ids[: n * block_size])
    size = struct.pack("<I", 4 * block_size)
    tail = b"" if extra is None else encode(extra)
    out = []
    for i in range(n):
        if extra_per_block is not None:
            tail = encode((extra, extra_per_block[i]))
        prev = _h(prev + size + raw[4 * i * block_size:4 * (i + 1) * block_size] + tail)
        out.append(prev)
    return out


def derive_keys(keys: Sequence[bytes], tag: bytes) -> list[bytes]:
    """``H(key || tag)`` for each key: another block per key (e.g. one per KV cache group of a
    hybrid model, ``tag`` naming the group), as stable as the keys themselves."""
    h = xxhash.xxh3_128_digest
    return [h(k + tag) for k in keys]
