"""The rules for moving blocks between tiers: pure functions, no I/O, no locks, the clock passed in.

The tier chain (:mod:`kvstore.store.chain`) calls these; the tuner's simulator is that same
chain over tiers that hold no bytes (:mod:`kvstore.tune.simulate`), so a simulated run follows
the store's rules by construction.

* **admit**: a block goes into the top tier unless a lower tier already holds it (or is writing
  it): :func:`admit`.
* **slots**: reserved entries get a free DRAM slot in order; the rest are skipped, never waited
  for (``no_slot``): :meth:`kvstore.tiers.local.LocalTier.attach`. The index holds fewer blocks than there are slots
  (:func:`kvstore.tiers.dram.tier.headroom_slots`), so a step's stores find slots while the
  last step's victims are still being written down.
* **demote**: a DRAM victim (evicted for capacity or expired) is written down unless there is no
  lower tier, the lower tier already holds it, or it is already past the lower tier's TTL
  (counted from its last access); the lower copy keeps the upper recency: :func:`demote_action`.
  Its slot stays taken (and the block servable from it) until the write is done.
* **promote**: a lower-tier hit is copied up when a slot is free: :func:`promote`.
* **admission to NVMe** (``tiers.nvme.admit_after`` = N; 0 = off): :class:`Admission`.
* **miss reasons**: :func:`miss_reason`, and what a block that left is remembered as:
  :func:`gone_reason`.
* **load or recompute**: a found prefix is cut where loading it is slower than the engine
  recomputing it (``slower_than_recompute``): :func:`worth_loading`.

Admission (``tiers.nvme.admit_after``), to spare the SSD the writes of blocks nobody reuses
(the idea of Dynamo's frequency filter and vLLM's ``store_threshold``). A block's *asks* are the
requests that used it: the one that stored it (computed it), each load that served it (a hit:
:meth:`kvstore.tiers.index.TierIndex.touch` counts one per request), and each later request that
stored it again (it missed, having been turned away, and computed it again). A block is written
to NVMe (by a demotion, a write-through copy, a ``put`` with no free DRAM slot, or a store
without DRAM) only once it has N asks. So N = 0 and N = 1 write every block; N = 2 writes a
block once it was hit or computed a second time. Asks count requests, not distinct sessions:
the live store learns a session only at a load, and there the connector names the request.

* With DRAM: a block is stored in DRAM as always; a DRAM victim with fewer than N asks is
  dropped (``NOT_ADMITTED``: its slot is freed at once, counted as
  ``kvstore_tier_skipped_blocks_total{tier="nvme",reason="not_admitted"}``, remembered as the
  miss reason ``not_admitted``). ``write_through`` copies a block when it is stored only if it
  has its N asks then; the others are written at eviction if they have them by then.
* Without DRAM (or for ``put``'s blocks that found no DRAM slot): a store is an ask; a block
  without its N asks is not written, counted and remembered alike (with N = 2 the first store
  of a block is not written, the second one is).
* A block copied up from NVMe (or from the shared tier) into DRAM was admitted already.
* The asks of a block in no tier are remembered (bounded, oldest forgotten first, as the miss
  reasons are) and carried by its next DRAM entry: a block turned away and computed again by
  a later request has 2 asks.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Hashable, Mapping, Sequence

MISS_REASONS = ("never_stored", "evicted", "expired", "diverged", "below_min", "corrupt", "not_admitted",
                "slower_than_recompute")

# demote_action results
DEMOTE = "demote"  # write it down, then free the slot
ALREADY_LOWER = "already_lower"  # the lower tier holds (or is writing) it: free the slot now
STALE = "stale"  # past the lower tier's TTL: not worth a write; remembered as expired
NO_LOWER = "no_lower"  # nothing below: the block is gone (evicted / expired)
NOT_ADMITTED = "not_admitted"  # fewer asks than tiers.nvme.admit_after: dropped, not written


def admit(lower_holds: bool) -> bool:
    """Store a block in the upper tier? Not when a lower tier already holds (or writes) it."""
    return not lower_holds


def demote_action(last_access: float, now: float, *, has_lower: bool, lower_holds: bool,
                  lower_ttl: float | None, admitted: bool = True) -> str:
    """What to do with a victim of the upper tier (see the module doc); ``admitted``:
    :meth:`Admission.admits` of its asks."""
    if not has_lower:
        return NO_LOWER
    if lower_holds:
        return ALREADY_LOWER
    if lower_ttl is not None and last_access + lower_ttl <= now:
        return STALE
    if not admitted:
        return NOT_ADMITTED
    return DEMOTE


def promote(has_upper: bool) -> bool:
    """Copy a lower-tier hit up (into a free slot; none free: read into the caller's buffer)."""
    return has_upper


def gone_reason(left_because: str) -> str:
    """What a block that left every tier is remembered as (the miss reason it will give)."""
    return left_because if left_because in ("expired", "corrupt", NOT_ADMITTED) else "evicted"


def miss_reason(*, expired: bool, remembered: str | None, at: int) -> str:
    """Why the block at position ``at`` of a lookup is missing: still indexed but past its TTL,
    else what was remembered when it left, else the prefix diverged (``at`` > 0) or it never
    was stored."""
    if expired:
        return "expired"
    if remembered is not None:
        return remembered
    return "diverged" if at > 0 else "never_stored"


class Admission:
    """``tiers.nvme.admit_after`` (see the module doc): the threshold, and the asks of blocks
    turned away (in no tier), up to ``capacity`` of them, the oldest forgotten first. No lock:
    the store calls it under its ghost lock; the simulator from its one thread."""

    def __init__(self, after: int = 0, capacity: int = 1 << 17) -> None:
        self.after = int(after)
        self.active = self.after >= 2  # 0 and 1 admit every block (its store is its first ask)
        self.capacity = capacity
        self._waiting: OrderedDict[Hashable, int] = OrderedDict()

    def __len__(self) -> int:
        return len(self._waiting)

    def admits(self, asks: int) -> bool:
        """May a block with ``asks`` asks be written to NVMe?"""
        return asks >= self.after

    def recall(self, key: Hashable) -> int:
        """The asks remembered for a block stored again (taken: its DRAM entry carries them now;
        a store straight to NVMe adds its own ask: ``recall(key) + 1``)."""
        return self._waiting.pop(key, 0) if self._waiting else 0

    def turn_away(self, key: Hashable, asks: int) -> None:
        """Remember the asks of a block not written (it is in no tier now)."""
        w = self._waiting
        w[key] = asks
        w.move_to_end(key)
        while len(w) > self.capacity:
            w.popitem(last=False)


def worth_loading(tiers: Sequence[str], load_s: Mapping[str, float],
                  recompute_s: float | Callable[[int], float] | None, held: int = 0) -> int:
    """How many of the found blocks (their tiers, in prefix order) to load: the prefix that
    saves the most time, block ``i`` saving ``recompute_s(i)`` (the engine's time to compute it
    there: a block late in a long prompt costs more, its attention reads the whole prefix; a
    number: the same for every block) minus ``load_s[tier]`` (a tier not measured costs
    nothing: DRAM, or no sample yet). The first ``held`` blocks the engine holds itself: never
    read, so free. Among prefixes that save the same, the longest. Without a recompute
    estimate: all of them.

    The costs are additive: reads of one request run in parallel on the I/O pool, which the
    per-tier throughput (measured on such batches) already reflects; the step's fixed cost is
    paid either way (the engine computes at least the prompt's last token)."""
    if recompute_s is None or not any(t in load_s for t in tiers[held:]):
        return len(tiers)
    cost = recompute_s if callable(recompute_s) else (lambda i: recompute_s)
    best_k, best, saved = len(tiers[:held]), 0.0, 0.0
    for i in range(held, len(tiers)):
        saved += cost(i) - load_s.get(tiers[i], 0.0)
        if saved >= best:
            best_k, best = i + 1, saved
    return best_k

