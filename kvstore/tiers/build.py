"""The tiers a config asks for, opened in chain order: each registered medium
(:mod:`kvstore.tiers.registry`) whose section is enabled, by its spec's ``open``.

What a medium's ``open`` may ask of the set: the block's bytes, the clock, its namespace and codec,
whether a local tier sits below it, whether it is announced on the KV-event stream, the options
the caller gave it (a node daemon's DRAM slab), and a temporary folder removed at close.

Each tier's namespace is the model fingerprint's root plus the tier's codec (and, for a codec,
the element dtype and scale group), so a folder or a Redis namespace never mixes blocks of
different bytes; two tiers' are the same when their codecs are.
"""

from __future__ import annotations

import math
import os
import shutil
import time
from typing import Any, Callable

import xxhash

from kvstore.codecs import DTYPES, Geometry, make_codec, normalize_dtype
from kvstore.config import StoreConfig
from kvstore.keys import ModelFingerprint, root_of
from kvstore.tiers.base import Tier
from kvstore.tiers.registry import SPECS
from kvstore.tiers.spec import TierSpec


class TierSet:
    """The opened tiers (``tiers``, top first), the codec geometry and the namespaces; closes
    what it opened if a later tier fails to open."""

    def __init__(self, config: StoreConfig, *, block_bytes: int, fingerprint: ModelFingerprint | bytes,
                 clock: Callable[[], float] = time.time, kv_dtype: str | None = None, group_elems: int | None = None,
                 events: bool = False, options: dict[str, dict[str, Any]] | None = None, stand_ins: bool = False):
        """``options``: per medium name, what its ``open`` takes beyond its section (a node
        daemon's DRAM slab in a memfd); ``events``: the store keeps KV events; ``stand_ins``:
        each medium's stand-in that holds no bytes (the tuner's replay), not the medium."""
        self.tiers: list[Tier] = []
        self.config = config
        self.clock = clock
        self._events = events
        self._options = options or {}
        self._stand_ins = stand_ins
        self._namespaces: dict[str, bytes] = {}
        self._tmpdir: str | None = None  # a tier's folder when it has no path: removed at close
        self._tmplock = -1  # its owner lock (kvstore/tiers/nvme/folder.py, make_temp_folder)
        self.block_bytes = int(block_bytes)
        self.geometry = _geometry(block_bytes, fingerprint, kv_dtype, group_elems)
        self._root = root_of(fingerprint)
        for s in SPECS:  # every namespace, opened or not (the store's own is the first's)
            if s.namespaced:
                self._namespace(s.name, getattr(self.section(s), "codec", "none"))
        try:
            for s in SPECS:
                open_ = s.stand_in if stand_ins else s.open
                if open_ is not None and self.section(s).enabled:
                    tier = open_(self, self.section(s))
                    if tier is not None:
                        self.tiers.append(tier)
        except BaseException:
            self.close()
            raise

    # -- what a medium's open asks ----------------------------------------------------------------
    def section(self, spec: TierSpec):
        return getattr(self.config.tiers, spec.name)

    def options(self, name: str) -> dict[str, Any]:
        return self._options.get(name, {})

    def has_lower(self, spec: TierSpec) -> bool:
        """Is a tier enabled below ``spec``'s that takes its victims (where they are written
        down): a local one, or a shared one under ``write_mode: write_back``?"""
        return any(s.order > spec.order and self.section(s).enabled
                   and (s.local or getattr(self.section(s), "write_mode", None) == "write_back")
                   and (s.stand_in is not None or not self._stand_ins) for s in SPECS)

    def announced(self, spec: TierSpec) -> bool:
        """Does the store announce this tier's blocks on the KV-event stream?"""
        return self._events and getattr(self.config.events, spec.name).medium is not None

    def namespace(self, name: str) -> bytes | None:
        return self._namespaces.get(name)

    @property
    def first_namespace(self) -> bytes | None:
        """The namespace of the first namespaced medium (the store's, in its metrics and files)."""
        return next(iter(self._namespaces.values()), None)

    def _namespace(self, name: str, codec: str) -> bytes:
        tag = b"" if codec == "none" else f",dtype={self.geometry.dtype},group={self.geometry.group_elems}".encode()
        ns = self._namespaces[name] = xxhash.xxh3_128_digest(self._root + f"codec={codec}".encode() + tag)
        return ns

    def codec(self, cfg):
        return make_codec(cfg.codec, self.geometry, cfg.zstd_level) if cfg.codec != "none" else None

    def temporary_folder(self) -> str:
        """A private temporary folder, removed at close (or, after a crash, by the next store)."""
        from kvstore.tiers.nvme.folder import make_temp_folder

        if self._tmpdir is None:
            self._tmpdir, self._tmplock = make_temp_folder()
        return self._tmpdir

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
        """Is a tier's folder one this set made, to be removed at close?"""
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
