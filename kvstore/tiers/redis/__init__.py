"""Redis or Valkey: the tier every engine shares (see :mod:`kvstore.tiers.redis.tier`)."""

import importlib

__all__ = ["RedisTier"]


def __getattr__(name: str):  # on first use: the config imports this medium's spec, not its tier
    if name == "RedisTier":
        return importlib.import_module("kvstore.tiers.redis.tier").RedisTier
    raise AttributeError(f"module 'kvstore.tiers.redis' has no attribute {name!r}")
