"""kvstore as an L2 adapter of LMCache's multiprocess server (LMCache 0.5.6's ``L2AdapterInterface``).

Loaded by LMCache's plugin adapter, never imported by kvstore itself (it imports lmcache)::

    --l2-adapter '{"type": "plugin", "module_path": "kvstore.connectors.lmcache.adapter",
                   "class_name": "KVStoreL2Adapter", "adapter_params": {...}}'

See ``docs/lmcache.md``.
"""
