"""Replay requests through :class:`kvstore.store.KVStore` itself, over tiers that hold no bytes, with
a virtual clock.

:class:`Simulator` opens a store whose tiers are each medium's stand-in
(:attr:`kvstore.tiers.spec.TierSpec.stand_in`, a :class:`kvstore.tiers.nobytes.NoBytesTier`: a
DRAM of slots, an NVMe of files) and makes, for each request of a trace, the store calls a
connector's request makes: the lookup (``contains_prefix``), the load of the matched prefix (pin,
read: promotions into DRAM; release) and a ``put`` of the prompt's full blocks. The order of each
call's steps, and every rule (admission, demotion, promotion, eviction, TTL, miss reasons, the
DRAM slots and their headroom), is the store's own code, so a simulated run follows the store by
construction; ``tests/test_tune.py`` replays a trace through a real store beside it and checks
that they agree exactly. The counts come from the store's metrics sink
(:class:`kvstore.tune.counts.ReplayCounts`).

The model of time: the store's background moves (demotions, write-through copies, files of
victims) run on :class:`kvstore.tune.deferred.Deferred`, which runs them at the end of each
store call, in the order they started; within a call, a victim being written down keeps its
DRAM slot. Entry sizes are each stand-in's: a DRAM slot is the block rounded up to 4 KiB, the
DRAM capacity a whole number of slots less the headroom; an NVMe file the same padded size (the
``xattr`` header layout, the default where the file system keeps xattrs; ``header: inline``
adds the 4 KiB header). A shared folder, when the config has one, is its files under the
capacity and TTL its sweeper keeps (:class:`kvstore.tiers.nobytes.NoBytesSharedTier`). A medium
without a stand-in (Redis: its eviction is the server's) is left out.

Only prompt blocks are stored (output blocks have no keys in a trace). Keys may be any hashable
(the tuner interns them to ints: the calls used here take them as they are). The simulator also
reports whether a tier's capacity or TTL was ever *consulted* (the tiers' indexes record it: a
reserve found the tier full; an entry was seen past its TTL): a run where it was not gives
identical results for any larger capacity or TTL, which the grid search uses to skip work.
"""

from __future__ import annotations

import dataclasses
from array import array
from typing import Hashable, Sequence

from kvstore.config import StoreConfig
from kvstore.store.store import KVStore
from kvstore.tiers.nobytes import NO_BYTES
from kvstore.tiers.registry import SPECS
from kvstore.tune.counts import ReplayCounts
from kvstore.tune.deferred import Deferred

NAMES = tuple(s.name for s in SPECS if s.stand_in is not None)  # the tiers a result names, present or not
# The tuner's search is over the first two of them, the local chain's top and the tier below it
# (DRAM and NVMe today): their capacities and TTLs, and the lower one's admission. Its grid,
# results, report and YAML name them through these two, never by a literal.
TOP, LOWER = NAMES[:2]
REASONS = ("never_stored", "evicted", "expired", "diverged", "below_min", "not_admitted")
GHOST_CAPACITY = 1 << 17  # KVStore's default ghost_capacity
_ROOT = b"\x00" * 16  # the replay's chain root: its namespaces are never written


class Simulator:
    """A :class:`KVStore` over stand-in tiers (a tier may be off: capacity 0), and what it counted."""

    def __init__(self, config: StoreConfig, block_bytes: int, *, ghost_capacity: int = GHOST_CAPACITY,
                 record_samples: bool = True):
        if block_bytes <= 0:
            raise ValueError(f"block_bytes must be positive, got {block_bytes}")
        # every hit is loaded: whether loading beats recomputing is measured live, never replayed
        config = dataclasses.replace(config, io=dataclasses.replace(config.io, load_only_if_faster=False))
        self.block_bytes = int(block_bytes)
        self.now = 0.0
        self.counts = ReplayCounts()
        self.io = Deferred()
        self.store = KVStore(config, block_bytes=self.block_bytes, fingerprint=_ROOT, clock=self._clock,
                             metrics=self.counts, ghost_capacity=ghost_capacity, io_executor=self.io,
                             check_memory=False, stand_ins=True)
        self.chain = self.store.chain
        self.adm = self.chain.adm
        self.tiers = {t.name: t for t in self.chain.tiers}
        self.D = self.tiers[TOP].index if TOP in self.tiers else None
        self.N = self.tiers[LOWER].index if LOWER in self.tiers else None
        self.record_samples = record_samples
        # results
        self.requests = 0
        self.prompt_tokens = 0
        self.lookup_tokens = 0
        self.lookup_blocks = 0
        self.hit_tokens = dict.fromkeys(NAMES, 0)
        self.replay_hit_tokens = 0
        self.genuine_hit_tokens = 0
        self.replay_requests = 0
        self.miss_tokens = dict.fromkeys(REASONS, 0)
        self.samples = {n: array("q") for n in NAMES}  # bytes held at each request
        self.byte_seconds = dict.fromkeys(NAMES, 0.0)  # time integral of bytes held
        self.t0: float | None = None
        self.t_last: float | None = None

    @classmethod
    def from_config(cls, cfg: StoreConfig, block_bytes: int, **kw) -> "Simulator":
        return cls(cfg, block_bytes, **kw)

    def _clock(self) -> float:
        return self.now

    # -- what the store counted --------------------------------------------------------------------
    @property
    def demotions(self) -> int:
        return self.counts.demotions

    @property
    def promotions(self) -> int:
        return self.counts.promotions

    @property
    def skipped(self) -> int:
        """Blocks that found no free DRAM slot (or no room: every entry pinned)."""
        return self.counts.skipped["no_slot"] + self.counts.skipped["pinned"]

    @property
    def not_admitted(self) -> int:
        return self.counts.skipped["not_admitted"]

    @property
    def nvme_writes(self) -> int:
        """Blocks written into NVMe (demotions, write-through copies, stores)."""
        return self.counts.written[LOWER]

    def _unseen(self, name: str, what: str) -> int:
        """What a shared stand-in removed itself (the medium's sweeper: the store never sees it)."""
        t = self.tiers.get(name)
        return t.stats.get(what, 0) if t is not None and t.shared else 0

    @property
    def evicted(self) -> dict[str, int]:
        return {n: self.counts.evicted[n] + self._unseen(n, "evicted") for n in NAMES}

    @property
    def expired(self) -> dict[str, int]:
        return {n: self.counts.expired[n] + self._unseen(n, "expired") for n in NAMES}

    @property
    def cap_used(self) -> dict[str, bool]:
        """Was a tier's capacity ever consulted (a disabled tier counts: a larger capacity enables it)."""
        return {n: n not in self.tiers or self.tiers[n].index.consulted["capacity"] for n in NAMES}

    @property
    def ttl_used(self) -> dict[str, bool]:
        return {n: n in self.tiers and self.tiers[n].index.consulted["ttl"] for n in NAMES}

    @property
    def free_slots(self) -> int:
        return sum(t.free_slots for t in self.tiers.values() if t.addressable)

    # -- one request -----------------------------------------------------------------------------
    def request(self, t: float, session: Hashable, keys: Sequence[Hashable], prompt_tokens: int,
                block_tokens: int, replay: bool = False) -> tuple[int, int, str | None]:
        """The store's lookup, the load of the matched prefix, the put of the prompt's blocks.
        Returns (dram hits, nvme hits, miss reason) in blocks."""
        self.now = t
        self._advance(t)
        self.requests += 1
        self.prompt_tokens += prompt_tokens
        keys = list(keys)
        nk = len(keys)
        self.lookup_tokens += nk * block_tokens
        self.lookup_blocks += nk
        if replay:
            self.replay_requests += 1
        store = self.store
        n, where, reason = store._match(keys, False, None, 0)  # contains_prefix
        if reason is not None:
            self.miss_tokens[reason] += (nk - n) * block_tokens if nk else prompt_tokens
        if n:
            for name in dict.fromkeys(where):  # (a count per tier: a loop per block was a tenth of a replay's own work)
                self.hit_tokens[name] += where.count(name) * block_tokens
            if replay:
                self.replay_hit_tokens += n * block_tokens
            else:
                self.genuine_hit_tokens += n * block_tokens
            h = store._pin(keys[:n], session, failpoint=False)  # begin_load
            try:
                store._read(h, None)
            finally:
                store.end_load(h)
            self.io.run()
        if store.chain.top is not None and n < nk:  # put: the blocks the engine computed (as the
            # connector saves them: a loaded block is not stored again; putting it was a no-op that
            # cost a third of a replay)
            store._put(keys[n:], None, [NO_BYTES] * (nk - n))
            self.io.run()
        if self.record_samples:
            for name in NAMES:
                ti = self.tiers.get(name)
                self.samples[name].append(ti.used_bytes if ti is not None else 0)
        return where.count(TOP), where.count(LOWER), reason

    def _advance(self, now: float) -> None:
        if self.t0 is None:
            self.t0 = self.t_last = now
            return
        dt = now - self.t_last
        if dt > 0:
            for t in self.tiers.values():
                self.byte_seconds[t.name] += t.used_bytes * dt
            self.t_last = now

    # -- results -----------------------------------------------------------------------------------
    def result(self) -> dict:
        """Totals: token-weighted hit rates, replay vs genuine, misses by reason, bytes held."""
        pt = self.prompt_tokens or 1
        hits = sum(self.hit_tokens.values())
        dur = (self.t_last - self.t0) if self.t0 is not None else 0.0
        held = {}
        for name in NAMES:
            ix = self.tiers[name].index if name in self.tiers else None
            s = self.samples[name]
            held[name] = {"p50": _pct(s, 50), "p99": _pct(s, 99), "max": max(s) if len(s) else 0,
                          "mean": self.byte_seconds[name] / dur if dur > 0 else (float(s[-1]) if len(s) else 0.0),
                          "capacity": ix.capacity if ix is not None else 0}
        return {
            "requests": self.requests,
            "replay_requests": self.replay_requests,
            "prompt_tokens": self.prompt_tokens,
            "hit_rate": hits / pt,
            "hit_rate_by_tier": {k: v / pt for k, v in self.hit_tokens.items()},
            "hit_tokens_by_tier": dict(self.hit_tokens),
            "saved_prefill_tokens": hits,
            "replay_hit_tokens": self.replay_hit_tokens,
            "genuine_hit_tokens": self.genuine_hit_tokens,
            "replay_hit_rate": self.replay_hit_tokens / pt,
            "genuine_hit_rate": self.genuine_hit_tokens / pt,
            "misses_by_reason": dict(self.miss_tokens),
            "lookup_tokens": self.lookup_tokens,
            "tail_tokens": self.prompt_tokens - self.lookup_tokens,  # partial last blocks: never stored
            "block_tokens": self.lookup_tokens / self.lookup_blocks if self.lookup_blocks else 0.0,
            "bytes_held": held,
            "evicted_for_capacity": self.evicted,
            "expired": self.expired,
            "demotions": self.demotions,
            "promotions": self.promotions,
            "admit_after": self.adm.after,
            "nvme_not_admitted": self.not_admitted,
            "nvme_written_bytes": self.nvme_writes * self.block_bytes,
            "nvme_written_bytes_per_hour": per_hour(self.nvme_writes * self.block_bytes, dur),
            "duration_s": dur,
            "capacity_consulted": dict(self.cap_used),
            "ttl_consulted": dict(self.ttl_used),
        }


def per_hour(n: float, seconds: float) -> float | None:
    """``n`` per hour of trace (None for a trace without duration)."""
    return n * 3600.0 / seconds if seconds > 0 else None


def _pct(a: array, q: float) -> float:
    if not len(a):
        return 0.0
    import numpy as np

    return float(np.percentile(np.frombuffer(a, dtype=np.int64), q))


def simulate(requests, config: StoreConfig, block_bytes: int, **kw) -> dict:
    """Run ``requests`` (iterable of (t, session, keys, prompt_tokens, block_tokens, replay)) once."""
    sim = Simulator(config, block_bytes, **kw)
    for r in requests:
        sim.request(*r)
    return sim.result()

