"""A file system every host mounts (CephFS, Lustre, NFS, Weka): the tier many engines on many
hosts share (see :mod:`kvstore.tiers.sharedfs.tier`)."""

import importlib

__all__ = ["SharedFsTier"]


def __getattr__(name: str):  # on first use: the config imports this medium's spec, not its tier
    if name == "SharedFsTier":
        return importlib.import_module("kvstore.tiers.sharedfs.tier").SharedFsTier
    raise AttributeError(f"module 'kvstore.tiers.sharedfs' has no attribute {name!r}")
