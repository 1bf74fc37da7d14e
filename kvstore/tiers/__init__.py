"""Storage tiers: every medium is a :class:`Tier` (an index plus a medium): DRAM, NVMe, Redis."""

from kvstore.tiers.base import Reservation, Tier
from kvstore.tiers.build import TierSet
from kvstore.tiers.dram import DramTier
from kvstore.tiers.local import LocalTier
from kvstore.tiers.nvme import NvmeTier

__all__ = ["Reservation", "Tier", "LocalTier", "TierSet", "DramTier", "NvmeTier"]
