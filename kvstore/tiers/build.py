"""The tiers a config asks for, opened top first: DRAM, NVMe, then the shared Redis tier.

The one place that knows every medium: a new tier is a module of :mod:`kvstore.tiers` and a
few lines here (and its section of :mod:`kvstore.config`); the store and the chain only loop
over what this returns.

Each tier's namespace is the model fingerprint's root plus the tier's codec (and, for a codec,
the element dtype and scale group), so a folder or a Redis namespace never mixes blocks of
different bytes; NVMe's and Redis's are the same when their codecs are.
"""

from __future__ import annotations

import math
import os
import shutil
import time
from typing import Callable

import xxhash

from kvstore.codecs import DTYPES, Geometry, make_codec, normalize_dtype
from kvstore.codecs.registry import CODEC_IDS
from kvstore.config import ConfigError, StoreConfig
from kvstore.keys import ModelFingerprint, root_of
from kvstore.tiers.base import Tier

ENV_USER, ENV_PASSWORD = "KVSTORE_REDIS_USERNAME", "KVSTORE_REDIS_PASSWORD"


class TierSet:
    """The opened tiers (``tiers``, top first), the codec geometry and the namespaces; closes
    what it opened if a later tier fails to open."""

    def __init__(self, config: StoreConfig, *, block_bytes: int, fingerprint: ModelFingerprint | bytes,
                 clock: Callable[[], float] = time.time, kv_dtype: str | None = None, group_elems: int | None = None,
                 events: bool = False, shared_dram: bool = False, dram_prefault_bytes: int | None = None):
        """``shared_dram``: the DRAM slab in one memfd, for a node daemon's engines (kvstore.node);
        ``dram_prefault_bytes``: how much of it is pre-faulted (None: all)."""
        self.tiers: list[Tier] = []
        self._namespaces: dict[str, bytes] = {}
        self._tmpdir: str | None = None  # the NVMe tier's folder when it has no path: removed at close
        self._tmplock = -1  # its owner lock (kvstore/tiers/nvme/folder.py, make_temp_folder)
        self.block_bytes = int(block_bytes)
        self.geometry = _geometry(block_bytes, fingerprint, kv_dtype, group_elems)
        self._root = root_of(fingerprint)
        t = config.tiers
        if t.dram.enabled and t.dram.codec != "none":
            raise ConfigError("tiers.dram.codec", t.dram.codec,
                              "none (DRAM codecs are not implemented yet; set int8/fp8/zstd on tiers.nvme.codec)")
        self._namespace("nvme", t.nvme.codec)
        try:
            if t.dram.enabled:
                self._open_dram(t.dram, has_lower=t.nvme.enabled, clock=clock, shared=shared_dram,
                                prefault=dram_prefault_bytes)
            if t.nvme.enabled:
                self._open_nvme(t.nvme, clock=clock, keep_meta=events and config.events.nvme.medium is not None)
            if t.remote.enabled:
                self._open_redis(t.remote)
        except BaseException:
            self.close()
            raise

    def namespace(self, name: str) -> bytes | None:
        return self._namespaces.get(name)

    def _namespace(self, name: str, codec: str) -> bytes:
        tag = b"" if codec == "none" else f",dtype={self.geometry.dtype},group={self.geometry.group_elems}".encode()
        ns = self._namespaces[name] = xxhash.xxh3_128_digest(self._root + f"codec={codec}".encode() + tag)
        return ns

    def _codec(self, cfg):
        return make_codec(cfg.codec, self.geometry, cfg.zstd_level) if cfg.codec != "none" else None

    def _open_dram(self, cfg, *, has_lower: bool, clock, shared: bool = False, prefault: int | None = None) -> None:
        from kvstore.tiers.dram import DramTier

        tier = DramTier(capacity_bytes=cfg.capacity_bytes, ttl_s=cfg.ttl_s, policy=cfg.policy,
                        block_bytes=self.block_bytes, clock=clock, pin=cfg.pin_memory,
                        headroom=cfg.headroom_blocks if has_lower else 0, shared=shared,
                        prefault_bytes=prefault)
        if tier.pool.n_slots == 0:  # a pool without a slot is no tier
            tier.close()
            return
        tier.index.ttl_shared = cfg.ttl_shared_s
        self.tiers.append(tier)

    def _open_nvme(self, cfg, *, clock, keep_meta: bool = False) -> None:
        from kvstore.tiers.nvme import NvmeTier

        path = cfg.path
        if path is None:
            from kvstore.tiers.nvme.folder import make_temp_folder

            self._tmpdir, self._tmplock = make_temp_folder()
            path = self._tmpdir
        tier = NvmeTier(path=path, namespace=self._namespaces["nvme"], capacity_bytes=cfg.capacity_bytes,
                        ttl_s=cfg.ttl_s, policy=cfg.policy, block_bytes=self.block_bytes,
                        codec_id=CODEC_IDS[cfg.codec], o_direct=cfg.o_direct, header=cfg.header, clock=clock,
                        codec=self._codec(cfg), engine=cfg.engine, engine_depth=cfg.engine_depth,
                        io_threads=cfg.io_threads, keep_meta=keep_meta)
        tier.index.ttl_shared = cfg.ttl_shared_s
        tier.write_through = cfg.write_mode == "write_through"
        tier.admit_after = cfg.admit_after
        self.tiers.append(tier)

    def _open_redis(self, cfg) -> None:
        from kvstore.tiers.redis import RedisTier

        ns = self._namespace("remote", cfg.codec)
        self.tiers.append(RedisTier.open(cfg, namespace=ns, block_bytes=self.block_bytes, codec=self._codec(cfg),
                                         codec_id=CODEC_IDS[cfg.codec], environ=os.environ))

    def close(self, keep_memory: bool = False) -> None:
        """Close every tier (``keep_memory``: not the DRAM tier, whose slab a handle still open
        may be copying into: left to the process's exit)."""
        tiers, self.tiers = self.tiers, []
        for t in tiers:
            if keep_memory and t.addressable:
                continue
            t.close()
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None
        if self._tmplock >= 0:
            os.close(self._tmplock)
            self._tmplock = -1

    @property
    def temporary(self) -> bool:
        """Is the NVMe tier's folder one this set made, to be removed at close?"""
        return self._tmpdir is not None


def _geometry(block_bytes: int, fingerprint, kv_dtype: str | None, group_elems: int | None) -> Geometry:
    """What the codecs need: the element dtype and the scale group (an automatic group divides the block)."""
    fp = fingerprint if isinstance(fingerprint, ModelFingerprint) else None
    dtype = normalize_dtype(kv_dtype if kv_dtype is not None else (fp.dtype if fp is not None else None))
    if group_elems is None:
        group_elems = fp.head_size if fp is not None and fp.head_size >= 8 else 128
        n = block_bytes // DTYPES.get(dtype, 1)
        if n % group_elems:
            group_elems = math.gcd(n, group_elems) or 1
    return Geometry(block_bytes, dtype, int(group_elems))
