"""Replay requests through the store's own tier accounting with a virtual clock (no bytes moved).

:class:`Simulator` drives two :class:`kvstore.index.TierIndex` objects (policies from
:func:`kvstore.policy.make_policy`) through exactly the calls :class:`kvstore.store.KVStore`
makes for one request of the connector — ``contains_prefix``, a load of the matched prefix
(``get``: pin, count hits, promote NVMe blocks into DRAM) and a ``put`` of the prompt's full
blocks — with the store's cross-tier rules, which come from :mod:`kvstore.placement` (the
module the store calls too; the store's pieces are in :mod:`kvstore.tune.simtiers`):

* a DRAM victim (expired or evicted for capacity) is demoted to NVMe unless NVMe already holds
  it or it is already past NVMe's TTL (counted from its last access); the NVMe copy keeps the
  DRAM recency. The demotion runs in the background: its NVMe entry is reserved at once, its
  DRAM slot stays taken until the write is done. The model: background writes (demotions,
  write-through copies) complete at the end of each store call (``get``, ``put``), in the
  order they were started (what :func:`kvstore.tune.verify.replay_store` makes the real store
  do); within a call, a block that finds no free DRAM slot is skipped (``put`` writes it to
  NVMe instead; a promotion reads it without keeping it in DRAM);
* an NVMe hit is promoted (copied) into DRAM; keys NVMe holds are not stored in DRAM again;
* entry sizes: a DRAM slot is the block rounded up to 4 KiB, DRAM capacity a whole number of
  slots; an NVMe file is the same padded size (the ``xattr`` header layout, the default where
  the file system keeps xattrs; ``nvme_header="inline"`` adds the 4 KiB header);
* admission to NVMe (``tiers.nvme.admit_after``) as the store's
  (:class:`kvstore.placement.Admission`): a block's asks are its commit and its hits (counted by
  :class:`kvstore.index.TierIndex`), plus those remembered from when it was turned away; a DRAM
  victim without them is dropped, a store straight to NVMe without them is not written; NVMe
  bytes written are counted (block bytes, as the store's
  ``kvstore_tier_written_bytes_total{tier="nvme"}``);
* miss reasons as the store's: ``expired`` (still indexed, past its TTL), then what the store
  remembers about keys that left (a bounded "ghost" list: ``evicted`` / ``expired`` /
  ``not_admitted``), then
  ``diverged`` (a prefix matched) or ``never_stored``; ``below_min`` for a request without a
  full block.

Only prompt blocks are stored (output blocks have no keys in a trace). Keys may be any
hashable (the tuner interns them to ints). The simulator also records whether a tier's
capacity or TTL was ever *consulted* (a reserve found the tier full; an entry was seen past its
TTL): a run where it was not gives identical results for any larger capacity or TTL, which the
grid search uses to skip work.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from typing import Hashable, Sequence

from kvstore import placement
from kvstore.fileformat import file_bytes, round_up
from kvstore.index import READY, Entry, TierIndex
from kvstore.policy import make_policy
from kvstore.tune.simtiers import SimTiers


def _none(_k):
    return None


REASONS = ("never_stored", "evicted", "expired", "diverged", "below_min", "not_admitted")
GHOST_CAPACITY = 1 << 17  # KVStore's default ghost_capacity


class Simulator(SimTiers):
    """Two tiers (either may be disabled with capacity 0) and the store's rules between them."""

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
        self.D: TierIndex | None = None
        self.N: TierIndex | None = None
        if dram_bytes > 0 and self.n_slots > 0:  # as KVStore: a pool without a slot is no tier
            self.headroom = placement.dram_headroom(self.n_slots, dram_headroom, has_lower=nvme_bytes > 0)
            self.D = TierIndex((self.n_slots - self.headroom) * self.slot_bytes, dram_ttl, make_policy(dram_policy),
                               ttl_shared_s=dram_ttl_shared)
        if nvme_bytes > 0:
            self.N = TierIndex(int(nvme_bytes), nvme_ttl, make_policy(nvme_policy), ttl_shared_s=nvme_ttl_shared)
        self.write_through = write_mode == "write_through"
        self.free_slots = self.n_slots  # DRAM slots neither attached to an entry nor held by a demotion
        self._deferred: list[tuple] = []  # background writes of the current call, in start order
        self.skipped = 0  # blocks that found no free DRAM slot
        self._ghosts: OrderedDict[Hashable, str] = OrderedDict()
        self._ghost_cap = ghost_capacity
        self.adm = placement.Admission(admit_after if self.N is not None else 0, ghost_capacity)
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
        self.demotions = 0
        self.promotions = 0
        self.nvme_writes = 0  # blocks written to NVMe (demotions, write-through copies, puts)
        self.not_admitted = 0  # blocks not written to NVMe for want of asks (admit_after)
        self.samples = {"dram": array("q"), "nvme": array("q")}  # bytes held at each request
        self.byte_seconds = {"dram": 0.0, "nvme": 0.0}  # time integral of bytes held
        self.t0: float | None = None
        self.t_last: float | None = None
        # was the capacity / TTL of a tier ever consulted (see the module doc)
        # (a disabled tier counts as consulted: a larger capacity enables it, a different run)
        self.cap_used = {"dram": self.D is None, "nvme": self.N is None}
        self.ttl_used = {"dram": False, "nvme": False}

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
        now = t
        D, N = self.D, self.N
        self._advance(now)
        self.requests += 1
        self.prompt_tokens += prompt_tokens
        nk = len(keys)
        self.lookup_tokens += nk * block_tokens
        self.lookup_blocks += nk
        if replay:
            self.replay_requests += 1
        # contains_prefix (lookups do not change state; the load below reuses what they found)
        # (TierIndex.lookup's test, inlined: READY and not past its deadline)
        dents: list[Entry | None] = []
        nents: list[Entry | None] = []
        dget = D.entries.get if D is not None else _none
        nget = N.entries.get if N is not None else _none
        n_nvme = 0
        for k in keys:
            de = dget(k)
            if de is not None:
                if de.state == READY and de.expire_at > now:
                    dents.append(de)
                    nents.append(None)
                    continue
                self.ttl_used["dram"] = True  # indexed but past its TTL (WRITING is impossible here)
            ne = nget(k)
            if ne is None or ne.state != READY or ne.expire_at <= now:
                if ne is not None:
                    self.ttl_used["nvme"] = True
                break
            dents.append(None)
            nents.append(ne)
            n_nvme += 1
        n = len(dents)
        n_dram = n - n_nvme
        reason = None
        if nk == 0:
            reason = "below_min"
            self.miss_tokens[reason] += prompt_tokens
        elif n < nk:
            reason = self._miss_reason(keys[n], n, now)
            self.miss_tokens[reason] += (nk - n) * block_tokens
        if n:
            self.hit_tokens["dram"] += n_dram * block_tokens
            self.hit_tokens["nvme"] += n_nvme * block_tokens
            if replay:
                self.replay_hit_tokens += n * block_tokens
            else:
                self.genuine_hit_tokens += n * block_tokens
            self._load(keys, dents, nents, n_nvme, session, now)
        self._put(keys, now)
        if self.record_samples:
            self.samples["dram"].append(D.used if D is not None else 0)
            self.samples["nvme"].append(N.used if N is not None else 0)
        return n_dram, n_nvme, reason

    def _advance(self, now: float) -> None:
        if self.t0 is None:
            self.t0 = self.t_last = now
            return
        dt = now - self.t_last
        if dt > 0:
            if self.D is not None:
                self.byte_seconds["dram"] += self.D.used * dt
            if self.N is not None:
                self.byte_seconds["nvme"] += self.N.used * dt
            self.t_last = now

    def _load(self, keys, dents, nents, n_nvme: int, session, now: float) -> None:
        """KVStore.begin_load (pin_load + read_load) + end_load for the matched prefix."""
        D, N = self.D, self.N
        for e in dents:
            if e is not None:
                e.pins += 1
        for e in nents:
            if e is not None:
                e.pins += 1
        if D is not None:
            for e in reversed(dents):  # head of the chain ends most recent
                if e is not None:
                    D.touch(e, now, session)
        if N is not None and n_nvme:
            for e in reversed(nents):
                if e is not None:
                    N.touch(e, now, session)
        if not n_nvme:
            for e in dents:
                e.pins -= 1
            return
        # promote: NVMe blocks are copied into fresh DRAM slots (while the DRAM hits stay pinned)
        nv = [e for e in nents if e is not None]
        up = D is not None and placement.promote(True)
        dres = self._reserve(D, [e.key for e in nv], self.slot_bytes, now) if up else [None] * len(nv)
        for e in nv:
            N.unpin(e)
        if D is not None:
            for de in dres:
                if de is not None:
                    de.asks = self.adm.after  # a copy from NVMe was admitted already (KVStore._reserve_dram)
                    D.commit(de, now)
                    self.promotions += 1
            for e in dents:
                if e is not None:
                    D.unpin(e)
        self._complete(now)

    def _put(self, keys: Sequence[Hashable], now: float) -> None:
        """KVStore.put of the prompt's full blocks (present keys skipped)."""
        D, N = self.D, self.N
        if D is None:
            if N is not None:
                self._put_nvme(keys, now)
            return
        # begin_store: keys NVMe holds are not stored in DRAM again
        if N is not None:
            nget = N.entries.get
            want = []
            for k in keys:  # placement.admit(not N.present_or_writing(k))
                e = nget(k)
                if e is None:
                    want.append(k)
                elif e.state == READY and e.expire_at <= now:
                    self.ttl_used["nvme"] = True
                    want.append(k)
            got = {}
            if want:
                for k, e in zip(want, self._reserve(D, want, self.slot_bytes, now)):
                    if e is not None:
                        got[k] = e
            entries = [got.pop(k, None) for k in keys]
        else:
            entries = self._reserve(D, keys, self.slot_bytes, now)
        adm = self.adm
        if adm.active:  # KVStore._reserve_dram(stored=True): the asks remembered for it
            for e in entries:
                if e is not None:
                    e.asks = adm.recall(e.key)
        # end_store: commit, last block first
        stored = []
        for e in reversed(entries):
            if e is not None:
                D.commit(e, now)
                stored.append(e.key)
        self._forget_gone(stored)
        if stored and self.write_through and N is not None:
            stored.reverse()  # the keys' order
            if adm.active:  # blocks short of their asks: written at eviction if they get them
                stored = [e.key for e in entries if e is not None and adm.admits(e.asks)]
            if stored:
                self._write_through(stored, now)
        if N is not None:
            # no DRAM slot: straight to NVMe (written by put itself)
            rest = [k for k, e in zip(keys, entries) if e is None and not self._holds(D, k, now)]
            if rest:
                self._put_nvme(rest, now)
        self._complete(now)

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

