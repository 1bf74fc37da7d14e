"""Stores sized in blocks, for the benchmarks: the one place that turns "N blocks of B bytes in
this tier" into ``capacity_gb`` and opens the store.

A DRAM block takes a 4 KiB-aligned slot; an NVMe block a file of the 4 KiB header plus that
slot, or the slot alone when the header lives in an extended attribute (``tiers.nvme.header``
auto or xattr on a file system that keeps them: :func:`nvme_xattr` asks the folder as the tier
will).
"""

from __future__ import annotations

import os
import time
from typing import Callable, Mapping

from kvstore.tiers import fileformat as ff
from kvstore.config import GiB, StoreConfig, from_dict
from kvstore.keys import ModelFingerprint
from kvstore.store import KVStore


def entry_bytes(tier: str, block_bytes: int, *, xattr: bool = False) -> int:
    """What one block of ``block_bytes`` takes in ``tier`` ("dram" or "nvme")."""
    return ff.round_up(block_bytes) if tier == "dram" or xattr else ff.file_bytes(block_bytes)


def capacity_gb(blocks: int, block_bytes: int, tier: str, *, xattr: bool = False, spare_bytes: int = 0) -> float:
    """``capacity_gb`` of a ``tier`` that holds ``blocks`` blocks (plus ``spare_bytes``)."""
    return (blocks * entry_bytes(tier, block_bytes, xattr=xattr) + spare_bytes) / GiB


def nvme_xattr(folder: str | os.PathLike, header: str = "auto") -> bool:
    """Will an NVMe tier in ``folder`` keep block headers in xattrs? (creates the folder, as the tier does)"""
    from kvstore.tiers.nvme.folder import check_folder, probe_xattr

    return header != "inline" and probe_xattr(check_folder(folder))


def open_store(config: Mapping | StoreConfig, *, block_bytes: int, fingerprint: ModelFingerprint | bytes,
               block_tokens: int = 1, clock: Callable[[], float] = time.time, ready: bool = True) -> KVStore:
    """A KVStore of ``config`` (public schema, or a StoreConfig); with ``ready``, its whole DRAM
    pool prepared before it returns (a measurement times the tiers, not the pool's preparation)."""
    cfg = config if isinstance(config, StoreConfig) else from_dict(config)
    s = KVStore(cfg, block_bytes=block_bytes, fingerprint=fingerprint, block_tokens=block_tokens, clock=clock)
    if ready:
        s.wait_ready()
    return s
