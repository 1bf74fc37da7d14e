"""NVMe: one file per block in a private folder (see :mod:`kvstore.tiers.nvme.tier`)."""

import importlib

__all__ = ["NvmeTier"]


def __getattr__(name: str):  # on first use: the config imports this medium's spec, not its tier
    if name == "NvmeTier":
        return importlib.import_module("kvstore.tiers.nvme.tier").NvmeTier
    raise AttributeError(f"module 'kvstore.tiers.nvme' has no attribute {name!r}")
