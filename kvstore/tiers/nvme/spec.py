"""The NVMe tier as kvstore knows it: its config section, its KV events, how it opens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvstore import configfields as F
from kvstore.tiers.spec import TierSpec

O_DIRECT_CHOICES = ("auto", True, False)
WRITE_MODES = ("write_back", "write_through")
HEADER_CHOICES = ("auto", "xattr", "inline")


@dataclass(frozen=True)
class NvmeConfig(F.Sized):
    path: str | None = F.field(None, F.path, what="folder", expand=True)  # null: a private temporary folder, removed at close (or, after a crash, by the next store: tiers/nvme/folder.py)
    capacity_gb: float = F.field(100.0, F.number)
    ttl_s: float | None = F.field(86400.0, F.ttl, **F.TTL)
    ttl_shared_s: float | None = F.field(None, F.ttl, **F.TTL_SHARED)  # TTL of blocks hit by >= 2 distinct sessions; None = ttl_s
    policy: str = F.field("lru", F.choice, choices=F.policy_names)
    codec: str = F.field("none", F.choice, choices=F.codec_names)
    zstd_level: int = F.field(3, F.integer, minimum=1, maximum=19)  # for the +zstd codecs (1 fast .. 19 small)
    o_direct: Any = F.field("auto", F.choice, choices=O_DIRECT_CHOICES)
    write_mode: str = F.field("write_back", F.choice, choices=WRITE_MODES)
    io_threads: int = F.field(4, F.integer, minimum=1, maximum=64)
    header: str = F.field("auto", F.choice, choices=HEADER_CHOICES)  # auto | xattr | inline: where a block file keeps its header
    engine: Any = F.field("auto", F.choice, choices=("auto", "io_uring", "threads", "off", False))  # batched native block I/O (kvstore/tiers/nvme/blockio.py): auto = io_uring, else its thread pool; off (YAML reads off as False)
    engine_depth: Any = F.field("auto", F.auto_or_int, minimum=1, maximum=64)  # the engine's blocks in flight per I/O thread; auto: about 16 MiB in flight in all (kvstore/tiers/nvme/tier.py, auto_depth)
    admit_after: int = F.field(0, F.integer, minimum=0)  # write a block to NVMe once this many requests used it (0, 1: all); placement.Admission


@dataclass(frozen=True)
class NvmeEvents:
    medium: str | None = F.field("STORAGE", F.word, choices=F.MEDIA, **F.NOT_ANNOUNCED)
    locality: str | None = F.field("LOCAL", F.word, choices=F.LOCALITIES, **F.UNSPECIFIED)


def open_tier(ts, cfg: NvmeConfig):
    """One file per block in ``cfg.path`` (null: a private temporary folder the tier set removes
    at its close); each file keeps its block's event metadata when the tier is announced."""
    from kvstore.codecs.registry import CODEC_IDS
    from kvstore.tiers.nvme import NvmeTier

    path = cfg.path if cfg.path is not None else ts.temporary_folder()
    return NvmeTier(path=path, namespace=ts.namespace(SPEC.name), capacity_bytes=cfg.capacity_bytes,
                    ttl_s=cfg.ttl_s, policy=cfg.policy, block_bytes=ts.block_bytes, codec_id=CODEC_IDS[cfg.codec],
                    o_direct=cfg.o_direct, header=cfg.header, clock=ts.clock, codec=ts.codec(cfg), engine=cfg.engine,
                    engine_depth=cfg.engine_depth, io_threads=cfg.io_threads, keep_meta=ts.announced(SPEC),
                    ttl_shared_s=cfg.ttl_shared_s, write_through=cfg.write_mode == "write_through",
                    admit_after=cfg.admit_after)


def stand_in(ts, cfg: NvmeConfig):
    """Files of the size :class:`NvmeTier` counts: the block padded to 4 KiB, plus a 4 KiB header
    when it is inline (``auto`` takes the xattr, where the file system keeps them)."""
    from kvstore.tiers.fileformat import file_bytes, round_up
    from kvstore.tiers.nobytes import NoBytesTier

    entry = file_bytes(ts.block_bytes) if cfg.header == "inline" else round_up(ts.block_bytes)
    return NoBytesTier(SPEC.name, capacity_bytes=cfg.capacity_bytes, ttl_s=cfg.ttl_s, ttl_shared_s=cfg.ttl_shared_s,
                       policy=cfg.policy, entry_bytes=entry, clock=ts.clock,
                       write_through=cfg.write_mode == "write_through", admit_after=cfg.admit_after)


def check(cfg: NvmeConfig) -> list:
    from kvstore.tiers.nvme.folder import folder_errors

    return folder_errors("tiers.nvme.path", cfg.path)


SPEC = TierSpec(name="nvme", order=200, config=NvmeConfig, events=NvmeEvents, open=open_tier, hit_source="DISK",
                namespaced=True, check=check, stand_in=stand_in)
