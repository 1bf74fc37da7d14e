"""Storage tiers: each one an index (capacity, TTL, policy, pins) plus a medium."""

from kvstore.tiers.base import Reservation, Tier
from kvstore.tiers.dram import DramTier
from kvstore.tiers.nvme import NvmeTier

__all__ = ["Reservation", "Tier", "DramTier", "NvmeTier"]
