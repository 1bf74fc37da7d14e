"""The Redis tier as kvstore knows it (``tiers.remote``): its config section, its KV events, how
it opens."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from kvstore import configfields as F
from kvstore.configfields import ConfigError
from kvstore.tiers.spec import TierSpec

REMOTE_WRITE_MODES = ("write_through",)  # write-back to a shared tier: not built (see RemoteConfig)


@dataclass(frozen=True)
class RemoteConfig:
    """A tier shared by every engine, on Redis or Valkey (issue 14); off while ``url`` is null.

    ``url``: ``redis://host:port[/db]`` or ``rediss://`` (TLS; the server's certificate is checked
    against the system's trust store, or ``SSL_CERT_FILE``); with ``cluster: true`` one url or
    a list of seed nodes. Credentials only from the environment (``KVSTORE_REDIS_USERNAME``,
    ``KVSTORE_REDIS_PASSWORD``), never here. ``ttl_s``: idle TTL (SET PX, refreshed by PEXPIRE on a
    hit), so Redis's ``volatile-lru`` can evict under ``maxmemory``. ``write_mode``:
    write-through only (sharing needs a block there before DRAM evicts it). ``timeout_ms``: a
    slower answer is a miss."""

    url: Any = F.field(None, F.remote_url, needs=("cluster",))
    cluster: bool = F.field(False, F.choice, choices=F.BOOL)
    ttl_s: float | None = F.field(86400.0, F.ttl, **F.TTL)
    codec: str = F.field("none", F.choice, choices=F.codec_names)
    zstd_level: int = F.field(3, F.integer, minimum=1, maximum=19)
    write_mode: str = F.field("write_through", F.choice, choices=REMOTE_WRITE_MODES)
    timeout_ms: int = F.field(200, F.integer, minimum=1, maximum=60_000)
    io_threads: int = F.field(4, F.integer, minimum=1, maximum=64)

    @property
    def enabled(self) -> bool:
        return self.url is not None

    @staticmethod
    def _refuse(key: str, name: Any) -> ConfigError | None:
        """No credentials in a config file, under any key name."""
        if isinstance(name, str) and any(w in name.lower() for w in ("pass", "user", "auth", "token", "secret")):
            return ConfigError(key, "<not shown>", "no credentials in the config: set "
                               "KVSTORE_REDIS_USERNAME / KVSTORE_REDIS_PASSWORD in the environment")
        return None


@dataclass(frozen=True)
class RemoteEvents:
    """Off unless asked: every engine sharing the Redis tier would announce the same blocks, and
    Redis evicts on its own (no removal is seen)."""

    medium: str | None = F.field(None, F.word, choices=F.MEDIA, **F.NOT_ANNOUNCED)
    locality: str | None = F.field("REMOTE", F.word, choices=F.LOCALITIES, **F.UNSPECIFIED)


def open_tier(ts, cfg: RemoteConfig):
    """The client of ``cfg.url`` (credentials and the secret from the environment)."""
    from kvstore.codecs.registry import CODEC_IDS
    from kvstore.tiers.redis import RedisTier

    return RedisTier.open(cfg, namespace=ts.namespace(SPEC.name), block_bytes=ts.block_bytes, codec=ts.codec(cfg),
                          codec_id=CODEC_IDS[cfg.codec], environ=os.environ)


# Redis is a remote store, which vLLM counts as external_unspecified (p2p is for engines' peers)
SPEC = TierSpec(name="remote", order=300, config=RemoteConfig, events=RemoteEvents, open=open_tier,
                hit_source="EXTERNAL_UNSPECIFIED", local=False, namespaced=True)
