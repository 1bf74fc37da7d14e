"""Replay requests through the store's own tier chain with a virtual clock (no bytes moved).

:class:`Simulator` builds a :class:`kvstore.store.chain.TierChain` over tiers that hold no bytes
(:class:`kvstore.tiers.nobytes.NoBytesTier`: a DRAM of slots, an NVMe of files) and drives it
through the calls :class:`kvstore.store.KVStore` makes for one request of the connector: the
lookup (``contains_prefix``), a load of the matched prefix (pin, promote the lower tier's blocks
into DRAM, release) and a ``put`` of the prompt's full blocks (reserve, commit, write through,
the blocks that found no slot straight to NVMe). Every rule (admission, demotion, promotion,
eviction, TTL, miss reasons, the DRAM slots and their headroom) is the chain's and the tiers'
own, so a simulated run follows the store by construction; ``tests/test_tune.py`` replays a
trace through a real store beside it and checks that they agree.

The model of time: background moves (demotions, write-through copies) complete at the end of
each store call (``get``, ``put``), in the order they were started; within a call, a victim
being written down keeps its DRAM slot. Entry sizes: a DRAM slot is the block rounded up to
4 KiB, DRAM capacity a whole number of slots less the headroom; an NVMe file is the same padded
size (the ``xattr`` header layout, the default where the file system keeps xattrs;
``nvme_header="inline"`` adds the 4 KiB header).

Only prompt blocks are stored (output blocks have no keys in a trace). Keys may be any hashable
(the tuner interns them to ints). The simulator also reports whether a tier's capacity or TTL
was ever *consulted* (the tiers' indexes record it: a reserve found the tier full; an entry was
seen past its TTL): a run where it was not gives identical results for any larger capacity or
TTL, which the grid search uses to skip work.
"""

from __future__ import annotations

from array import array
from typing import Hashable, Sequence

from kvstore.store.chain import COPY, DEMOTE, FREE, Plan, TierChain
from kvstore.tiers.dram.tier import headroom_slots
from kvstore.tiers.fileformat import file_bytes, round_up
from kvstore.tiers.nobytes import NoBytesTier

NAMES = ("dram", "nvme")  # the tiers a result names
REASONS = ("never_stored", "evicted", "expired", "diverged", "below_min", "not_admitted")
GHOST_CAPACITY = 1 << 17  # KVStore's default ghost_capacity


class Simulator:
    """Two tiers (either may be disabled with capacity 0) under the store's chain."""

    def __init__(self, *, block_bytes: int, dram_bytes: int, nvme_bytes: int,
                 dram_ttl: float | None = None, nvme_ttl: float | None = None,
                 dram_ttl_shared: float | None = None, nvme_ttl_shared: float | None = None,
                 dram_policy: str = "lru", nvme_policy: str = "lru", write_mode: str = "write_back",
                 nvme_header: str = "xattr", ghost_capacity: int = GHOST_CAPACITY,
                 record_samples: bool = True, dram_headroom: int | str = 0, admit_after: int = 0):
        if block_bytes <= 0:
            raise ValueError(f"block_bytes must be positive, got {block_bytes}")
        if write_mode not in ("write_back", "write_through"):
            raise ValueError(f"write_mode must be write_back or write_through, got {write_mode!r}")
        self.block_bytes = int(block_bytes)
        self.slot_bytes = round_up(self.block_bytes)
        self.nvme_entry_bytes = self.slot_bytes if nvme_header != "inline" else file_bytes(self.block_bytes)
        self.n_slots = int(dram_bytes) // self.slot_bytes
        self.now = 0.0
        clock = self._clock
        tiers = []
        if dram_bytes > 0 and self.n_slots > 0:  # as KVStore: a pool without a slot is no tier
            self.headroom = headroom_slots(self.n_slots, dram_headroom, has_lower=nvme_bytes > 0)
            dram = NoBytesTier("dram", capacity_bytes=(self.n_slots - self.headroom) * self.slot_bytes,
                               ttl_s=dram_ttl, policy=dram_policy, entry_bytes=self.slot_bytes, clock=clock,
                               slots=self.n_slots)
            dram.index.ttl_shared = dram_ttl_shared
            tiers.append(dram)
        if nvme_bytes > 0:
            nvme = NoBytesTier("nvme", capacity_bytes=int(nvme_bytes), ttl_s=nvme_ttl, policy=nvme_policy,
                               entry_bytes=self.nvme_entry_bytes, clock=clock)
            nvme.index.ttl_shared = nvme_ttl_shared
            nvme.write_through = write_mode == "write_through"
            nvme.admit_after = admit_after
            tiers.append(nvme)
        self.tiers = {t.name: t for t in tiers}  # the results name both, present or not
        self.D = self.tiers["dram"].index if "dram" in self.tiers else None
        self.N = self.tiers["nvme"].index if "nvme" in self.tiers else None
        self.chain = TierChain(tiers, clock=clock, ghost_capacity=ghost_capacity)
        self.adm = self.chain.adm
        self._deferred: list = []  # background moves of the current call, in start order
        self.record_samples = record_samples
        # results
        self.requests = 0
        self.prompt_tokens = 0
        self.lookup_tokens = 0
        self.lookup_blocks = 0
        self.hit_tokens = {"dram": 0, "nvme": 0}
        self.replay_hit_tokens = 0
        self.genuine_hit_tokens = 0
        self.replay_requests = 0
        self.miss_tokens = dict.fromkeys(REASONS, 0)
        self.evicted = {"dram": 0, "nvme": 0}  # for capacity
        self.expired = {"dram": 0, "nvme": 0}
        self.skipped = 0  # blocks that found no free DRAM slot
        self.demotions = 0
        self.promotions = 0
        self.nvme_writes = 0  # blocks written to NVMe (demotions, write-through copies, puts)
        self.not_admitted = 0  # blocks not written to NVMe for want of asks (admit_after)
        self.samples = {"dram": array("q"), "nvme": array("q")}  # bytes held at each request
        self.byte_seconds = {"dram": 0.0, "nvme": 0.0}  # time integral of bytes held
        self.t0: float | None = None
        self.t_last: float | None = None

    def _clock(self) -> float:
        return self.now

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

    @classmethod
    def from_config(cls, cfg, block_bytes: int, **kw) -> "Simulator":
        """A simulator with the tiers of a :class:`kvstore.config.StoreConfig`."""
        d, n = cfg.tiers.dram, cfg.tiers.nvme
        return cls(block_bytes=block_bytes, dram_bytes=d.capacity_bytes if d.enabled else 0,
                   nvme_bytes=n.capacity_bytes if n.enabled else 0, dram_ttl=d.ttl_s, nvme_ttl=n.ttl_s,
                   dram_ttl_shared=d.ttl_shared_s, nvme_ttl_shared=n.ttl_shared_s, dram_policy=d.policy,
                   nvme_policy=n.policy, write_mode=n.write_mode,
                   nvme_header="inline" if n.header == "inline" else "xattr", dram_headroom=d.headroom_blocks,
                   admit_after=n.admit_after, **kw)

    # -- one request -----------------------------------------------------------------------------
    def request(self, t: float, session: Hashable, keys: Sequence[Hashable], prompt_tokens: int,
                block_tokens: int, replay: bool = False) -> tuple[int, int, str | None]:
        """Look up, load the matched prefix, store the prompt's blocks. Returns (dram hits, nvme
        hits, miss reason) in blocks."""
        self.now = t
        self._advance(t)
        self.requests += 1
        self.prompt_tokens += prompt_tokens
        nk = len(keys)
        self.lookup_tokens += nk * block_tokens
        self.lookup_blocks += nk
        if replay:
            self.replay_requests += 1
        where = self.chain.locate(keys)  # contains_prefix
        n = len(where)
        n_dram = sum(1 for w in where if w.name == "dram")
        n_nvme = n - n_dram
        reason = None
        if nk == 0:
            reason = "below_min"
            self.miss_tokens[reason] += prompt_tokens
        elif n < nk:
            reason = self.chain.miss_reason(keys[n], n)
            self.miss_tokens[reason] += (nk - n) * block_tokens
        if n:
            self.hit_tokens["dram"] += n_dram * block_tokens
            self.hit_tokens["nvme"] += n_nvme * block_tokens
            if replay:
                self.replay_hit_tokens += n * block_tokens
            else:
                self.genuine_hit_tokens += n * block_tokens
            self._load(keys[:n], session)
        self._put(keys)
        if self.record_samples:
            for t in self.tiers.values():
                self.samples[t.name].append(t.used_bytes)
            for n in NAMES:
                if n not in self.tiers:
                    self.samples[n].append(0)
        return n_dram, n_nvme, reason

    def _advance(self, now: float) -> None:
        if self.t0 is None:
            self.t0 = self.t_last = now
            return
        dt = now - self.t_last
        if dt > 0:
            for t in self.tiers.values():
                self.byte_seconds[t.name] += t.used_bytes * dt
            self.t_last = now

    def _load(self, keys: Sequence[Hashable], session) -> None:
        """KVStore.get of the found prefix: pin, read the lower tier's blocks (promoted into DRAM
        where a slot is free), release."""
        chain, top = self.chain, self.chain.top
        where, entries = chain.pin(keys, session)
        held = [e for w, e in zip(where, entries) if w is top and top.addressable]
        for t in chain.tiers:
            if t is top and t.addressable:
                continue
            src = [e for w, e in zip(where, entries) if w is t]
            if src:
                plan = Plan()
                up = chain.promotion([e.key for e in src], plan)
                self._run(plan)
                chain.promoted(t, src, up, [True] * len(src))
                got = [de for de in up if de is not None]
                self.promotions += len(got)
                held += got
        if top is not None and held:
            chain.release(top, held)
        self._finish()

    def _put(self, keys: Sequence[Hashable]) -> None:
        """KVStore.put of the prompt's full blocks (present keys skipped)."""
        chain, top = self.chain, self.chain.top
        if top is None:
            return
        plan = Plan()
        entries = chain.store_entries(keys, plan)
        self._run(plan)
        self._stored(top, entries)
        below, rest = chain.overflow(keys, entries)
        if rest:  # no free DRAM slot: straight to NVMe (written by put itself)
            entries = chain.reserve(below, [keys[j] for j in rest], plan)
            self._run(plan)
            self._stored(below, entries)
        self._finish()

    def _stored(self, t, entries) -> None:
        """KVStore.end_store: a tier without slots is written now (its blocks count as NVMe writes)."""
        oks = [e is not None for e in entries]
        if not t.addressable:
            self.nvme_writes += sum(oks)
        plan = Plan()
        self.chain.committed(t, entries, oks, plan)
        self._run(plan)

    # -- the moves, without bytes ------------------------------------------------------------------
    def _run(self, plan: Plan) -> None:
        for event, tier, n in plan.counts:
            if event == "evicted":
                self.evicted[tier] += n
            elif event == "expired":
                self.expired[tier] += n
            elif event in ("no_slot", "pinned"):
                self.skipped += n
            elif event == "not_admitted":
                self.not_admitted += n
        plan.counts = []
        for m in plan.transfers:
            if m.kind == FREE:
                m.src.free(m.pairs)
            else:
                self._deferred.append(m)
        plan.transfers = []

    def _finish(self) -> None:
        """The end of a store call: background moves complete, in the order they started."""
        chain = self.chain
        while self._deferred:
            m = self._deferred.pop(0)
            if m.kind == DEMOTE:
                chain.demoted(m, [True] * len(m.pairs))
                self.demotions += len(m.pairs)
                self.nvme_writes += len(m.pairs)
            elif m.kind == COPY:  # a copy whose DRAM block left meanwhile is dropped
                oks = [se is not None and de is not None for se, de in m.pairs]
                chain.copied(m, oks)
                self.nvme_writes += sum(oks)

    # -- results -----------------------------------------------------------------------------------
    def result(self) -> dict:
        """Totals: token-weighted hit rates, replay vs genuine, misses by reason, bytes held."""
        pt = self.prompt_tokens or 1
        hits = self.hit_tokens["dram"] + self.hit_tokens["nvme"]
        dur = (self.t_last - self.t0) if self.t0 is not None else 0.0
        held = {}
        for name, ix in (("dram", self.D), ("nvme", self.N)):
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
            "evicted_for_capacity": dict(self.evicted),
            "expired": dict(self.expired),
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


def simulate(requests, **kw) -> dict:
    """Run ``requests`` (iterable of (t, session, keys, prompt_tokens, block_tokens, replay)) once."""
    sim = Simulator(**kw)
    for r in requests:
        sim.request(*r)
    return sim.result()

