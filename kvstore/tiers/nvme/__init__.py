"""NVMe: one file per block in a private folder (see :mod:`kvstore.tiers.nvme.tier`)."""

from kvstore.tiers.nvme.tier import NvmeTier

__all__ = ["NvmeTier"]
