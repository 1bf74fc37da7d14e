"""One DRAM budget for the models of a node daemon: the rule that moves capacity between them.

A daemon keeps one store per model (kvstore.node.daemon), each with a slab of its own: slots of
that model's block size, so no two models share a slot. ``tiers.dram.capacity_gb`` is the whole
host's budget, not each model's: every so often (the daemon's drain thread, ``PERIOD_S``) this
rule looks at each model's DRAM and returns the bytes each may hold (data: the daemon applies them
with :meth:`DramTier.limit`; a model over its new limit writes its least recent blocks down at its
next sweep, then its free slots' memory goes back to the host, :meth:`DramTier.trim`).

The rule is the LRU across models, a period at a time: a model that had to make room (its index
asked for bytes past its limit: ``wanted``) gets them, from the budget left free first, then
from the model whose least recent block is the oldest (``oldest``), as long as that block is
older than the taker's own (else the taker's block goes, as in one LRU). Quotas
(``node.model_quota_gb``) cap a model; with none, one model alone may hold the whole budget.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

PERIOD_S = 0.5  # how often capacity moves (the daemon's drain period); a newcomer's first writes
# wait at most this long for room


@dataclass(frozen=True)
class Share:
    """One model's DRAM at a rebalance."""

    limit: int  # bytes of slots it may hold now
    used: int  # bytes its index holds
    wanted: int  # bytes its reserves asked past its limit since the last rebalance
    oldest: float  # last access of its least recent unpinned block (inf: none)
    unit: int  # one slot's bytes (limits move in whole slots)
    quota: int | None = None  # at most this many bytes (None: the whole budget)


def rebalance(shares: list[Share], total: int) -> list[int]:
    """The limits of ``shares`` (the same order): the sum never above ``total``, no limit above its
    quota, bytes moved only to a model that wanted them."""
    limits = [min(s.limit, s.quota if s.quota is not None else total) for s in shares]
    free = total - sum(limits)
    if free < 0:  # the budget shrank under them (not done here): cut the largest first
        for i in sorted(range(len(shares)), key=lambda i: -limits[i]):
            cut = min(limits[i], -free)
            limits[i] -= cut
            free += cut
    takers = sorted((i for i, s in enumerate(shares) if s.wanted > 0), key=lambda i: -shares[i].wanted)
    for i in takers:
        s = shares[i]
        cap = s.quota if s.quota is not None else total
        want = min(_whole(s.wanted, s.unit), max(0, cap - limits[i]))
        got = min(want, free)
        free -= got
        want -= got
        # then from the models whose least recent block is older than the taker's, oldest first
        for j in sorted(range(len(shares)), key=lambda j: shares[j].oldest):
            if want <= 0:
                break
            d = shares[j]
            if j == i or not d.oldest < s.oldest or not math.isfinite(d.oldest):
                continue
            give = min(want, limits[j])
            limits[j] -= give
            want -= give
            got += give
        limits[i] += got
    return limits


def _whole(nbytes: int, unit: int) -> int:
    """``nbytes`` rounded up to whole slots of ``unit`` bytes."""
    return -(-nbytes // unit) * unit
