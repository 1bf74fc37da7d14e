"""The shared tier: blocks in Redis or Valkey (:class:`~kvstore.tiers.redis.client.RedisClient`),
under every engine of a model.

Redis keeps the index (its own TTL and eviction), so as a :class:`~kvstore.tiers.shared.SharedTier`
this one reserves nothing, pins nothing and has no victims: a write is a SET that overwrites
(in one namespace a key names the same bytes in every engine), a read a GETRANGE capped at the
longest value of ours (with a PEXPIRE beside it when there is a TTL) whose checks may find the block
gone or bad (a miss, then). Lookups ask in batches, after the local tiers, and
what Redis answered is remembered a moment (:class:`~kvstore.tiers.redis.presence.Presence`), so
a request's lookup and its pin ask once. Every call ends within ``timeout_ms`` (plus 50 ms per
MiB it moved) whatever the server does (:mod:`~kvstore.tiers.redis.conn`); a failure is a miss and a backoff, never an error.
"""

from __future__ import annotations

import logging
import time
from typing import Mapping, Sequence

import numpy as np

from kvstore.tiers.index import Entry
from kvstore.tiers.redis.client import RedisClient
from kvstore.tiers.redis.conn import ENV_PASSWORD, ENV_USER, RemoteAuthError, RemoteTLSError, RemoteUnavailable
from kvstore.tiers.redis.presence import Presence
from kvstore.tiers.redis.value import secrets_from_env
from kvstore.tiers.shared import SharedTier

log = logging.getLogger(__name__)

# the tier's failure counts (RedisClient.stats) as kvstore_tier_errors_total{tier="remote",op=...}
ERROR_OPS = {"errors_get": "read", "errors_exists": "lookup", "timeouts": "timeout", "skipped_down": "down"}


class RedisTier(SharedTier):
    name = "remote"

    def __init__(self, client: RedisClient, presence: Presence, block_bytes: int):
        super().__init__(block_bytes)
        self.client = client
        self.presence = presence
        self.ttl = None if client.ttl_ms is None else client.ttl_ms / 1000

    @classmethod
    def open(cls, cfg, *, namespace: bytes, block_bytes: int, codec, codec_id: int,
             environ: Mapping[str, str]) -> "RedisTier":
        """The tier of ``tiers.remote`` (credentials and the secret from ``environ``). A refused
        password or an untrusted TLS certificate is an error now (naming the variable to set); an
        unreachable server a warning: the engine starts on its local tiers, and this tier tries
        again after its backoff."""
        secret, previous = secrets_from_env(environ)  # a ConfigError for a bad one
        client = RedisClient(url=cfg.url, cluster=cfg.cluster, namespace=namespace, block_bytes=block_bytes,
                             ttl_s=cfg.ttl_s, timeout_ms=cfg.timeout_ms, io_threads=cfg.io_threads, codec=codec,
                             codec_id=codec_id, username=environ.get(ENV_USER) or None,
                             password=environ.get(ENV_PASSWORD) or None, secret=secret, secret_previous=previous)
        try:
            client.check()
        except (RemoteAuthError, RemoteTLSError):
            client.close()
            raise
        except RemoteUnavailable as e:
            log.warning("kvstore: remote tier %s unreachable at start-up (%s); serving from the local tiers, "
                        "retrying later", client.url, e)
        return cls(client, Presence(time.monotonic), block_bytes)

    def __repr__(self) -> str:
        return f"<RedisTier {self.client!r}>"

    # -- lookups (one batch each; within timeout_ms together) ---------------------------------------
    def leading(self, keys: Sequence[bytes]) -> int:
        if not keys:
            return 0
        with self.client.deadline():  # the probe and the rest of the prompt: timeout_ms in all
            return self.presence.walk(keys, self.client.exists)  # one ask per request (see .presence)

    def holds(self, keys: Sequence[bytes]) -> list[bool]:
        """What Redis holds, less the values this engine refused and kept a moment ago: a store
        then writes over them."""
        return self.presence.unheld(keys, self.client.exists(keys)) if keys else []

    # what this engine wrote, and what a read found gone or bad (ask again next time): .presence
    def stored(self, keys: list[bytes]) -> None:
        self.presence.stored(keys)

    def gone(self, keys: list[bytes]) -> None:
        self.presence.forget(keys)

    # -- the medium ----------------------------------------------------------------------------------
    def write_many(self, entries: Sequence[Entry], srcs: Sequence[np.ndarray]) -> list[bool]:
        by_ttl: dict = {}
        for i, e in enumerate(entries):
            by_ttl.setdefault(e.ttl, []).append(i)
        oks = [False] * len(entries)
        for ttl, idx in by_ttl.items():
            for i, ok in zip(idx, self.client.put([entries[i].key for i in idx], [srcs[i] for i in idx], ttl_s=ttl)):
                oks[i] = ok
        return oks

    def read_many(self, entries: Sequence[Entry], outs: Sequence[np.ndarray]) -> list[bool]:
        refused: list[bytes] = []
        oks = self.client.get([e.key for e in entries], outs, refused)
        self.presence.refused(refused)  # kept in Redis, absent here a while (see .presence)
        return oks

    # -- accounting ----------------------------------------------------------------------------------
    @property
    def stats(self) -> dict:
        return self.client.stats

    @property
    def corrupt_reasons(self) -> dict:
        return self.client.corrupt_reasons

    def error_counts(self) -> dict[str, int]:
        s = self.client.stats
        return {op: s.get(stat, 0) for stat, op in ERROR_OPS.items()}

    @property
    def up(self) -> bool:
        return self.client.up

    def close(self) -> None:
        self.client.close()
