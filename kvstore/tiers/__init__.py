"""Storage tiers: every medium is a :class:`Tier` (an index plus a medium), registered once in
:mod:`kvstore.tiers.registry`. Names are imported on first use (the config reads the registry,
and the tier set reads the config)."""

import importlib

_WHERE = {"Reservation": "kvstore.tiers.base", "Tier": "kvstore.tiers.base", "LocalTier": "kvstore.tiers.local",
          "TierSet": "kvstore.tiers.build"}

__all__ = list(_WHERE)


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'kvstore.tiers' has no attribute {name!r}")
