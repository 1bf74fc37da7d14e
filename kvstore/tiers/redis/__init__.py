"""Redis or Valkey: the tier every engine shares (see :mod:`kvstore.tiers.redis.tier`)."""

from kvstore.tiers.redis.tier import RedisTier

__all__ = ["RedisTier"]
