"""The shared file-system tier as kvstore knows it (``tiers.sharedfs``): its config section, its
KV events, how it opens. Off while ``path`` is null."""

from __future__ import annotations

from dataclasses import dataclass

from kvstore import configfields as F
from kvstore.tiers.spec import TierSpec

# write_through: every block stored on this host, at once (shared before this host lets it go, as
# Redis); write_back: only what this host's tiers let go (their victims: the folder as the overflow
# of each host's DRAM and NVMe, shared once it is there)
WRITE_MODES = ("write_through", "write_back")


@dataclass(frozen=True)
class SharedFsConfig(F.Sized):
    """One folder on a file system every host mounts; several engines on several hosts write and
    read it at once. ``capacity_gb`` and ``ttl_s`` (idle: a hit refreshes a file's time) hold for
    all of them together: one sweeper at a time (a lease in the folder, taken over
    ``lease_s`` after its holder stopped renewing it) removes what is past its TTL, then the
    least recent files past the capacity, every ``sweep_s``. A call the file system does not
    answer within ``timeout_ms`` is a miss, then a backoff (a stalled mount costs an engine no
    more), on ``io_threads`` threads of its own. ``write_mode``: ``write_through`` (every block
    stored on this host, at once) or ``write_back`` (only the victims of this host's tiers above:
    what its DRAM and NVMe let go)."""

    path: str | None = F.field(None, F.path, what="folder", expand=True)  # null: the tier is off
    capacity_gb: float = F.field(100.0, F.number)
    ttl_s: float | None = F.field(86400.0, F.ttl, **F.TTL)
    codec: str = F.field("none", F.choice, choices=F.codec_names)
    zstd_level: int = F.field(3, F.integer, minimum=1, maximum=19)
    write_mode: str = F.field("write_through", F.choice, choices=WRITE_MODES)
    sweep_s: float = F.field(10.0, F.number, minimum=0.05, maximum=86400)
    lease_s: float = F.field(60.0, F.number, minimum=0.1, maximum=86400)
    timeout_ms: int = F.field(1000, F.integer, minimum=1, maximum=60_000)  # a slower call is a miss, then a backoff
    io_threads: int = F.field(4, F.integer, minimum=1, maximum=64)

    @property
    def enabled(self) -> bool:
        return self.path is not None and self.capacity_bytes > 0


@dataclass(frozen=True)
class SharedFsEvents:
    """Off unless asked: every engine sharing the folder would announce the same blocks."""

    medium: str | None = F.field(None, F.word, choices=F.MEDIA, **F.NOT_ANNOUNCED)
    locality: str | None = F.field("REMOTE", F.word, choices=F.LOCALITIES, **F.UNSPECIFIED)


def open_tier(ts, cfg: SharedFsConfig):
    from kvstore.codecs.registry import CODEC_IDS
    from kvstore.tiers.sharedfs.tier import SharedFsTier

    return SharedFsTier(path=cfg.path, namespace=ts.namespace(SPEC.name), block_bytes=ts.block_bytes,
                        codec=ts.codec(cfg), codec_id=CODEC_IDS[cfg.codec], capacity_bytes=cfg.capacity_bytes,
                        ttl_s=cfg.ttl_s, sweep_s=cfg.sweep_s, lease_s=cfg.lease_s, timeout_ms=cfg.timeout_ms,
                        io_threads=cfg.io_threads, write_through=cfg.write_mode == "write_through")


def stand_in(ts, cfg: SharedFsConfig):
    """The tuner's model: the folder's files (a 4 KiB header, then the payload, as the sweeper
    counts them; a codec's smaller payloads are counted whole, so a compressed folder holds more
    than the model says), under the capacity and idle TTL its sweeper keeps."""
    from kvstore.tiers.fileformat import HEADER_BYTES
    from kvstore.tiers.nobytes import NoBytesSharedTier

    return NoBytesSharedTier(SPEC.name, capacity_bytes=cfg.capacity_bytes, ttl_s=cfg.ttl_s,
                             entry_bytes=HEADER_BYTES + ts.block_bytes, block_bytes=ts.block_bytes, clock=ts.clock,
                             write_through=cfg.write_mode == "write_through")


def check(cfg: SharedFsConfig) -> list:
    from kvstore.tiers.nvme.folder import folder_errors

    return folder_errors("tiers.sharedfs.path", cfg.path)


SPEC = TierSpec(name="sharedfs", order=400, config=SharedFsConfig, events=SharedFsEvents, open=open_tier,
                hit_source="DISK", local=False, namespaced=True, check=check, stand_in=stand_in)
