"""The DRAM tier as kvstore knows it: its config section, its KV events, how it opens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvstore import configfields as F
from kvstore.configfields import ConfigError
from kvstore.tiers.spec import TierSpec

PIN_CHOICES = ("auto", True, False)


@dataclass(frozen=True)
class DramConfig(F.Sized):
    capacity_gb: float = F.field(4.0, F.number)
    ttl_s: float | None = F.field(3600.0, F.ttl, **F.TTL)
    ttl_shared_s: float | None = F.field(None, F.ttl, **F.TTL_SHARED)  # TTL of blocks hit by >= 2 distinct sessions; None = ttl_s
    policy: str = F.field("lru", F.choice, choices=F.policy_names)
    codec: str = F.field("none", F.choice, choices=F.codec_names)
    pin_memory: Any = F.field("auto", F.choice, choices=PIN_CHOICES)  # auto: pin through torch when CUDA is available
    headroom_blocks: Any = F.field("auto", F.auto_or_int)  # slots held back for victims being demoted; auto: 1/8 of them


@dataclass(frozen=True)
class DramEvents:
    """How the DRAM tier's blocks are announced on vLLM's KV-event stream."""

    medium: str | None = F.field("CPU", F.word, choices=F.MEDIA, **F.NOT_ANNOUNCED)
    locality: str | None = F.field("LOCAL", F.word, choices=F.LOCALITIES, **F.UNSPECIFIED)


def open_tier(ts, cfg: DramConfig):
    """The slab pool (``ts.options``: ``shared``, a node daemon's memfd slab; ``prefault_bytes``,
    how much of it is pre-faulted), or None when it has no slot."""
    from kvstore.tiers.dram.tier import DramTier

    if cfg.codec != "none":
        raise ConfigError("tiers.dram.codec", cfg.codec,
                          "none (DRAM codecs are not implemented yet; set int8/fp8/zstd on a lower tier's codec)")
    opts = ts.options(SPEC.name)
    tier = DramTier(capacity_bytes=cfg.capacity_bytes, ttl_s=cfg.ttl_s, policy=cfg.policy, block_bytes=ts.block_bytes,
                    clock=ts.clock, pin=cfg.pin_memory, headroom=cfg.headroom_blocks if ts.has_lower(SPEC) else 0,
                    shared=opts.get("shared", False), prefault_bytes=opts.get("prefault_bytes"), ttl_shared_s=cfg.ttl_shared_s)
    if tier.pool.n_slots == 0:  # a pool without a slot is no tier
        tier.close()
        return None
    return tier


def stand_in(ts, cfg: DramConfig):
    """Its slots and headroom as :class:`DramTier` counts them (None when it has no slot)."""
    from kvstore.tiers.dram.tier import headroom_slots
    from kvstore.tiers.fileformat import round_up
    from kvstore.tiers.nobytes import NoBytesTier

    slot = round_up(ts.block_bytes)
    n = cfg.capacity_bytes // slot
    if n == 0:
        return None
    held = headroom_slots(n, cfg.headroom_blocks, has_lower=ts.has_lower(SPEC))
    return NoBytesTier(SPEC.name, capacity_bytes=(n - held) * slot, ttl_s=cfg.ttl_s, ttl_shared_s=cfg.ttl_shared_s,
                       policy=cfg.policy, entry_bytes=slot, clock=ts.clock, slots=n)


SPEC = TierSpec(name="dram", order=100, config=DramConfig, events=DramEvents, open=open_tier, hit_source="HOST",
                stand_in=stand_in)
