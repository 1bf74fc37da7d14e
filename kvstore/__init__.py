"""kvstore: a tiered KV-cache offload store for LLM serving (pinned DRAM, NVMe files, a shared
Redis), with a vLLM connector (``kvstore.connectors.vllm``).

The public face::

    from kvstore import KVStore, load_config, ModelFingerprint, chain_keys

Names are imported on first use, so ``import kvstore.config`` stays light.
"""

from importlib import import_module

_FACE = {
    "KVStore": "kvstore.store",
    "PrefixMatch": "kvstore.store",
    "StoreHandle": "kvstore.store",
    "LoadHandle": "kvstore.store",
    "StoreConfig": "kvstore.config",
    "ConfigError": "kvstore.config",
    "load_config": "kvstore.config",
    "from_dict": "kvstore.config",
    "ModelFingerprint": "kvstore.keys",
    "chain_keys": "kvstore.keys",
}

__all__ = sorted(_FACE)


def __getattr__(name: str):
    if name in _FACE:
        return getattr(import_module(_FACE[name]), name)
    raise AttributeError(f"module 'kvstore' has no attribute {name!r}")
