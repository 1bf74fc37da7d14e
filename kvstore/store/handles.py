"""The store's value types: what a lookup answers and the two-phase handles, plus argument checks."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

import numpy as np

from kvstore.tiers.base import Tier
from kvstore.tiers.index import Entry


class PrefixMatch(NamedTuple):
    num_blocks: int
    tiers: tuple[str, ...]  # where each matched block is ("dram", "nvme" or "remote")
    miss_reason: str | None  # why block ``num_blocks`` is missing; None if all matched


@dataclass
class StoreHandle:
    """Phase 1 of a zero-copy store: write each ``views[i]`` (None = already stored, or no free
    DRAM slot: skipped and counted), then end."""

    keys: list[bytes]
    entries: list[Entry | None]
    views: list[np.ndarray | None]
    tier: Tier | None
    started: float = field(default_factory=time.perf_counter)
    done: bool = False
    ttl: float | None = None  # the request's retention hint (idle TTL in every tier), None = the config's
    borrowed: bool = False  # views are the caller's own rows (put): nothing may read them after end_store


@dataclass
class LoadHandle:
    """Phase 1 of a zero-copy load: ``views[:num_blocks]`` hold the blocks (read-only use) once
    the lower tiers' ones are read (``unread``: block index -> (its tier, its entry), pinned
    where the tier pins; see ``read_load``)."""

    keys: list[bytes]
    num_blocks: int
    views: list[np.ndarray | None]
    entries: list[Entry | None]  # pinned top-tier entries (None for a block read into a private buffer)
    tier_of: list[str]
    unread: dict[int, tuple[Tier, Entry]] = field(default_factory=dict)
    read: bool = False
    started: float = field(default_factory=time.perf_counter)
    done: bool = False


def rows_of(buf, n: int, block_bytes: int, *, writable: bool, name: str) -> list[np.ndarray]:
    """``buf`` as ``n`` contiguous 1-D uint8 views of at least ``block_bytes``; clear errors otherwise."""
    if isinstance(buf, (list, tuple)):
        if len(buf) < n:
            raise ValueError(f"{name}: {len(buf)} buffers for {n} keys")
        rows = []
        for i, b in enumerate(buf[:n]):
            a = np.asarray(b)
            if a.dtype != np.uint8 or not a.flags.c_contiguous or a.nbytes < block_bytes:
                raise ValueError(f"{name}[{i}]: need a contiguous uint8 buffer of >= {block_bytes} bytes, "
                                 f"got {a.dtype} {a.shape}")
            if writable and not a.flags.writeable:
                raise ValueError(f"{name}[{i}] is read-only")
            rows.append(a.reshape(-1).view(np.uint8)[:block_bytes])
        return rows
    a = np.asarray(buf)
    if a.dtype != np.uint8 or a.ndim != 2 or not a.flags.c_contiguous:
        raise ValueError(f"{name}: need a C-contiguous uint8 array [n, block_bytes] or a list of buffers, "
                         f"got {a.dtype} {a.shape}")
    if a.shape[0] < n or a.shape[1] < block_bytes:
        raise ValueError(f"{name}: shape {a.shape} is too small for {n} blocks of {block_bytes} bytes")
    if writable and not a.flags.writeable:
        raise ValueError(f"{name} is read-only")
    return [a[i, :block_bytes] for i in range(n)]


def check_keys(keys: Sequence[bytes]) -> list[bytes]:
    keys = list(keys)
    for k in keys:
        if not isinstance(k, (bytes, bytearray)) or len(k) != 16:
            raise ValueError(f"keys must be 16-byte digests (kvstore.keys.chain_keys), got {k!r:.40}")
    return [bytes(k) for k in keys]


def check_ttl(ttl_s) -> float | None:
    """A retention hint: a positive finite number of seconds, or None (the config's TTL)."""
    if ttl_s is None:
        return None
    if isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)) or not ttl_s > 0:
        raise ValueError(f"ttl_s must be a positive number of seconds or None, got {_said(ttl_s)}")
    try:  # an int past a float's range (JSON can give 10**400) is as infinite as inf, not an OverflowError
        ttl = float(ttl_s)
    except OverflowError:
        ttl = math.inf
    if ttl == math.inf:
        raise ValueError(f"ttl_s must be a finite number of seconds, got {_said(ttl_s)}")
    return ttl


def _said(v) -> str:
    """``v`` in an error message: at most 40 characters, and no repr of a 100,000-digit int."""
    if isinstance(v, int) and v.bit_length() > 64:
        return f"an integer of {v.bit_length()} bits"
    return f"{v!r:.40}"
