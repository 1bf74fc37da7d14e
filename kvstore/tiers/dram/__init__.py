"""DRAM: slots of one pre-allocated, pre-faulted (and, with CUDA, pinned) pool."""

import importlib

__all__ = ["DramTier"]


def __getattr__(name: str):  # on first use: the config imports this medium's spec, not its tier
    if name == "DramTier":
        return importlib.import_module("kvstore.tiers.dram.tier").DramTier
    raise AttributeError(f"module 'kvstore.tiers.dram' has no attribute {name!r}")
