"""DRAM: slots of one pre-allocated, pre-faulted (and, with CUDA, pinned) pool."""

from kvstore.tiers.dram.tier import DramTier

__all__ = ["DramTier"]
