"""Every problem of a config at once: its keys (kvstore.config) and what this machine can give it
(kvstore.store.machine: memory for the DRAM pool, the NVMe folder, a free metrics port).

``kvstore config`` prints them; the vLLM plugin (``kvstore.connectors.vllm.register``) runs the
same check in the process that builds vLLM's config, before any model loads, so a bad key fails
the start-up in seconds instead of after the model is in memory.
"""

from __future__ import annotations

import os
from typing import Mapping

from kvstore.config import ConfigError, StoreConfig, load_config


def config_errors(path: str | os.PathLike | None = None, overrides: Mapping | None = None, *,
                  ports: bool = True) -> tuple[StoreConfig | None, list[ConfigError]]:
    """(the config, or None where the file cannot be read; every error, one per key, in order).
    ``ports=False`` leaves ``metrics.port`` to the store's own bind (a process that will run a
    store of its own on that port must not find it "in use" by itself)."""
    from kvstore.store.machine import dram_error, nvme_error, port_error

    errors: list[ConfigError] = []
    cfg = load_config(path, overrides=overrides, errors=errors)
    if cfg is not None:  # the machine's checks, for keys not already bad
        bad = {e.key for e in errors}
        machine = [dram_error(cfg), nvme_error(cfg)] + ([port_error(cfg.metrics.port)] if ports else [])
        errors += [e for e in machine if e is not None and e.key not in bad]
    return cfg, errors
