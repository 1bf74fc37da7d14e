"""Scheduler side: what to load and what to store, per request and step. No tensors, no I/O.

For each request the planner keeps the chain keys of its full blocks (computed incrementally
from the live token list, with the request's extra keys), its block table, how many blocks
were handed to the store, and a pinned load if one is planned.

* ``lookup``: the longest stored prefix of the prompt (never the whole prompt: the engine
  must compute at least one token), one index walk. With ``async_loads`` (the default), a hit
  with blocks below DRAM is loaded asynchronously (``RequestState.load_async``): vLLM keeps the
  request in ``WAITING_FOR_REMOTE_KVS`` while the worker reads and scatters, and other requests
  run. Without it (the first design), a prefetch to DRAM starts and ``None`` ("ask again") is
  returned until it is done. Blocks the engine already holds are never read.
* ``allocated``: the engine gave blocks for the matched tokens; the blocks are pinned in the
  store (two-phase: they cannot be evicted before the worker copied them), and the request's
  prompt tokens are accounted: the engine's own hit, kvstore's promise, and why the rest could
  not be supplied (``outcome``; kvstore.offload.metrics says what each counter means).
* ``build_step``: load plans for newly scheduled hits (``loads``: before this step's forward)
  and for hits allocated to wait (``async_loads``), store plans for every block that becomes
  full in this step (prompt blocks *and* blocks completed during decode).
* ``track``: a new request's exact prompt is named and marked a replay if it was seen before
  (kvstore.offload.replay); its loads carry the kind, which the worker counts when served.
* ``finished``: the request's trace line (``trace_path``): its keys, what its first lookup
  found (engine-local, kvstore's, the store's miss reason), replay or not, and with
  ``trace_tokens`` its prompt's token ids. With ``async_saves``, whether vLLM must keep the
  request's blocks until the worker reports its stores done (``finished_sending``); a store
  that already finished (the usual case: the gather ran while vLLM sampled) frees them at once.

Hybrid models (``groups``: :class:`~kvstore.offload.groups.KVGroups`, several KV cache groups).
Every block table is kept per group; a lookup offers only what every group can supply
(``KVGroups.hit``), loads are always asynchronous and all or nothing per request (a failed one
is reported by the worker as the request's, vLLM recomputes it, and the request is never offered
a hit again: ``load_failed``), stores follow each group's rule, and Mamba states come from vLLM's
hand-offs (``boundary_states``). ``StepPlan.fresh`` names the blocks given out in the step: the
worker waits for a gather still reading one of them (a sliding-window block is freed, and may be
given to another request, while its own request runs).

Cache truth under failure. A block is stored only when its KV is known good:

* The worker drops, within the step, every store at or after a block whose load failed in
  that step (the request's own, or a block it shares): ``StorePlan.prior_ids`` carries the
  block table before the stored blocks whenever the step loads anything.
* When vLLM rewinds a request (a failed load truncates its computed tokens at the first bad
  block; a preempted request restarts from its cache hits), the "already saved" mark rolls back
  to what the engine says is computed, so the recomputed blocks are stored and the cache heals.
* A store that cannot be reached is a miss: every call to it is guarded, and a load that
  could not be pinned is still planned (with no handle) so the worker reports its blocks as
  failed and the engine recomputes them.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Sequence

import xxhash

from kvstore.keys import ModelFingerprint, chain_keys
from kvstore.offload import hints
from kvstore.offload.client import StoreClient
from kvstore.offload.groups import KVGroups
from kvstore.offload.metrics import RequestOutcome
from kvstore.offload.replay import GENUINE, REPLAY, ReplayMemory, prompt_digest
from kvstore.store.stepcost import pairs
from kvstore.tiers.registry import rank, top
from kvstore.trace import TraceWriter

TOP = top()  # the medium whose slots the engine's copies reach: a hit there loads in the step

log = logging.getLogger(__name__)

# How long ``finished`` waits for a finished request's stores before leaving its blocks to vLLM's
# delayed free. They were submitted at the end of its last forward pass, and vLLM has sampled and
# processed the step's output since, so they are usually done and the wait is none. A delayed free
# is released only by a later engine step, which an offline ``LLM.generate`` may never take (its
# blocks then stay held and ``reset_prefix_cache`` fails), so the wait is generous and bounded.
SAVE_WAIT_S = 0.5


@dataclass
class LoadPlan:
    req_id: str
    block_ids: list[int]  # engine blocks to fill, in prefix order
    handle_id: int | tuple  # the pinned LoadHandle in the shared store (0: none, every block fails);
    # with tensor parallelism one per rank (kvstore.offload.ranks)
    num_tokens: int
    first: int = 0  # position of block_ids[0] in the request's block table
    tiers: tuple[str, ...] = ()  # the tier each block was found in (for the served-tokens counters)
    kind: str = ""  # replay or genuine (kvstore.offload.replay), for the served-by-kind counter
    groups: list[int] = field(default_factory=list)  # KV cache group of each block (empty: all group 0)


@dataclass
class StorePlan:
    req_id: str
    block_ids: list[int]
    keys: list[bytes]
    start: int = 0  # position of block_ids[0] in the request's block table
    prior_ids: list[int] = field(default_factory=list)  # block_ids before ``start`` (steps that load)
    ttl: float | None = None  # the request's retention hint (idle TTL), None = the config's
    groups: list[int] = field(default_factory=list)  # KV cache group of each block (empty: all group 0)
    positions: list[int] = field(default_factory=list)  # each block's index in the request (empty: start, start+1 ...)
    meta: list = field(default_factory=list)  # each block's engine name for KV events (kvstore.store.events.BlockMeta)


@dataclass
class StepPlan:
    loads: list[LoadPlan] = field(default_factory=list)
    stores: list[StorePlan] = field(default_factory=list)
    step: int = 0  # the planner's step number (the worker pairs a step's loads with its stores)
    async_loads: list[LoadPlan] = field(default_factory=list)  # requests waiting for their KV
    preempted: list[str] = field(default_factory=list)  # their blocks are reused: finish their stores first
    idle: bool = False  # the engine scheduled no tokens in this step (it only waits for loads)
    prefill_tokens: int = 0  # of this step's scheduled tokens, those of prompts (for PrefillRate)
    tokens: int = 0  # all its scheduled tokens
    pairs: int = 0  # their attention (query, context) pairs (kvstore.store.stepcost.pairs)
    hook_s: dict = field(default_factory=dict)  # hook -> (seconds, calls) of a scheduler in another process
    fresh: list[int] = field(default_factory=list)  # blocks given out in this step (hybrid models)


@dataclass
class RequestState:
    req_id: str
    tokens: Sequence[int]  # live: grows as the engine appends output tokens
    num_prompt_tokens: int
    extra: object = None  # LoRA name, cache salt ... (applies to every block)
    mm: list[tuple[int, int, str]] = field(default_factory=list)  # (start, end, identifier) spans
    keys: list[bytes] = field(default_factory=list)
    tables: list[list[int]] = field(default_factory=lambda: [[]])  # the block table of each KV cache group
    saved_blocks: int = 0
    prefetch: int | None = None  # token of a running prefetch (client.prefetch_done)
    load: tuple | None = None  # (handle_id, first block, n blocks, tiers), until planned
    num_local: int = 0  # tokens the engine had in its own prefix cache at the lookup
    origin: tuple[str, ...] = ()  # tier of each matched block before any prefetch
    load_async: bool = False  # the last lookup's hit has blocks below DRAM: vLLM loads it asynchronously
    had_stores: bool = False  # stores were planned for it (its blocks' frees may wait for them)
    looked_up: bool = False  # a lookup since the last allocation (vLLM allocates again, without one,
    # when a request's asynchronous load completed: nothing to pin or count then)
    found: int = 0  # blocks of the stored prefix at the last lookup
    miss_reason: str | None = "never_stored"  # why the store's prefix ended (None: all of it is stored)
    failed: bool = False  # the lookup failed (a store error): nothing is known of the store
    arrival: float = 0.0  # wall-clock seconds (for the trace)
    session: str = ""  # the conversation (vLLM's session_id, or the kvstore.session hint); else the request
    cacheable: bool = True
    replay: bool = False  # the exact prompt was seen before
    ttl: float | None = None  # retention hint (kv_transfer_params: kvstore.ttl_s), None = the config's
    store: bool = True  # False: a one-off request (kvstore.store: false), its blocks are never stored
    first_hit: tuple | None = None  # (engine-local tokens, kvstore tokens pinned, miss reason) at the first lookup
    gkeys: dict = field(default_factory=dict)  # group -> its keys so far (hybrid models)
    junction: int = 0  # blocks of the stored prefix the first lookup found, where it ended early
    load_failed: bool = False  # a load of this request failed as a whole: never offered a hit again
    tag: str = ""  # the request's tag (kv_transfer_params kvstore.tag)
    hit_tiers: tuple[str, ...] = ()  # the tier each block of the last allocated hit was found in

    @property
    def block_ids(self) -> list[int]:
        """The block table of group 0 (the only one of most models)."""
        return self.tables[0]

    @block_ids.setter
    def block_ids(self, ids: list[int]) -> None:
        self.tables[0] = ids


def _own_session(req_id: str) -> str:
    """A request without a session is its own: named by its id, which an OpenAI client may choose
    (any length, any characters); one that a session name could not be (hints.WORD_RULE) is
    named by its digest instead, so the trace and ``kvstore explain`` never carry it raw."""
    if 0 < len(req_id) <= hints.MAX_WORD and req_id.isprintable():
        return req_id
    return "req-" + xxhash.xxh3_64_hexdigest(req_id.encode("utf-8", "surrogatepass"))


class Planner:
    def __init__(self, client: StoreClient, fingerprint: ModelFingerprint, block_size: int, *, prefetch: bool = True,
                 trace: TraceWriter | None = None, async_loads: bool = False, async_saves: bool = False,
                 always_delay: bool = False, trace_tokens: bool = False, groups: KVGroups | None = None):
        self.client = client
        self.groups = groups if groups is not None and not groups.plain else None  # None: one full-attention group
        self.replays = ReplayMemory()
        self.trace_tokens = trace_tokens  # the trace keeps prompt token ids (opt-in)
        self.async_loads = async_loads
        self.async_saves = async_saves
        self.always_delay = always_delay  # TP > 1: every rank reports its own stores (get_finished)
        self._async_pending: list[LoadPlan] = []
        self.trace = trace
        self.fp = fingerprint
        self.root = fingerprint.digest()
        self.bs = block_size
        self.prefetch_enabled = prefetch
        self.reqs: dict[str, RequestState] = {}
        self.errors = 0  # store calls that failed (each one a miss or a failed load)
        self._unreported = 0
        self._last_warn = 0.0
        self.rollbacks = 0  # times vLLM rewound a request below its saved mark
        self.steps = 0

    def _failed(self, op: str, e: BaseException) -> None:
        self.errors += 1
        self._unreported += 1
        now = time.monotonic()
        if now - self._last_warn > 10.0:  # a dead store must not flood the log
            self._last_warn = now
            log.warning("kvstore: store call %s failed (%s: %s); treated as a miss (%d failures so far)",
                        op, type(e).__name__, e, self.errors)

    # -- keys ----------------------------------------------------------------------------------
    def _mm_extra(self, st: RequestState, start: int, n: int) -> list | None:
        if not st.mm:
            return None
        out = []
        for b in range(start, start + n):
            lo, hi = b * self.bs, (b + 1) * self.bs
            out.append(tuple(ident for s, e, ident in st.mm if s < hi and e > lo))
        return out

    def keys_upto(self, st: RequestState, n_blocks: int) -> list[bytes]:
        """Keys of the first ``n_blocks`` full blocks (as far as tokens are known)."""
        n_blocks = min(n_blocks, len(st.tokens) // self.bs)
        have = len(st.keys)
        if n_blocks > have:
            toks = list(st.tokens[have * self.bs:n_blocks * self.bs])
            st.keys.extend(chain_keys(self.root, toks, self.bs, extra=st.extra,
                                      extra_per_block=self._mm_extra(st, have, n_blocks - have),
                                      parent=st.keys[-1] if have else None))
        return st.keys[:n_blocks]

    # -- scheduler hooks -----------------------------------------------------------------------
    def track(self, req_id: str, tokens: Sequence[int] | None, num_prompt_tokens: int, extra=None,
              mm: list[tuple[int, int, str]] | None = None, arrival: float = 0.0, session: str = "") -> RequestState:
        st = self.reqs.get(req_id)
        if st is None:
            st = RequestState(req_id, tokens if tokens is not None else (), num_prompt_tokens, extra, list(mm or []))
            st.cacheable = tokens is not None
            st.arrival, st.session = arrival, session or _own_session(req_id)
            self.reqs[req_id] = st
            if st.cacheable:
                st.replay = self.replays.see(self._digest(st))
        return st

    def _digest(self, st: RequestState) -> int:
        """The name of ``st``'s exact prompt (kvstore.offload.replay)."""
        p, bs = st.num_prompt_tokens, self.bs
        full = p // bs
        keys = self.keys_upto(st, full)
        mm = tuple(ident for s, e, ident in st.mm if e > full * bs and s < p)
        return prompt_digest(keys[-1] if keys else self.root, st.tokens[full * bs:p], p, st.extra, mm)

    def lookup(self, st: RequestState, num_computed: int) -> int | None:
        """Tokens beyond ``num_computed`` the store can supply, or None to be asked again."""
        st.num_local = num_computed
        st.looked_up = True
        if not st.cacheable:
            return 0
        try:
            return self._lookup(st, num_computed)
        except Exception as e:  # the store is unreachable or closed: a miss, never an engine error
            self._failed("lookup", e)
            st.prefetch = -1
            st.failed = True
            return 0

    def _lookup(self, st: RequestState, num_computed: int) -> int | None:
        if self.groups is not None:
            return self._lookup_groups(st, num_computed)
        keys = self.keys_upto(st, self._max_blocks(st))
        if st.prefetch is not None and st.prefetch >= 0:
            if not self.client.prefetch_done(st.prefetch):
                return None
            st.prefetch = -1  # done; never prefetch this request again
        skip = num_computed // self.bs  # blocks the engine holds itself: never worth a read
        m = self.client.contains_prefix(keys, record=False, held=skip)
        st.failed = False
        if st.prefetch is None:
            st.origin = m.tiers
        st.found, st.miss_reason = m.num_blocks, m.miss_reason
        st.load_async = self.async_loads and any(t != TOP for t in m.tiers[skip:m.num_blocks])
        if self.async_loads:
            return max(0, m.num_blocks * self.bs - num_computed)
        if self.prefetch_enabled and st.prefetch is None and any(t != TOP for t in m.tiers[skip:]):
            st.prefetch = self.client.prefetch(keys[skip: m.num_blocks])
            return None
        hit = m.num_blocks * self.bs
        return max(0, hit - num_computed)

    # -- hybrid models (several KV cache groups) -------------------------------------------------
    def group_keys(self, st: RequestState, g: int, n_blocks: int) -> list[bytes]:
        """Group ``g``'s keys of the first ``n_blocks`` full blocks (derived once per block)."""
        have = st.gkeys.setdefault(g, [])
        if n_blocks > len(have):
            have.extend(self.groups.keys(g, self.keys_upto(st, n_blocks)[len(have):]))
        return have[:n_blocks]

    def _lookup_groups(self, st: RequestState, num_computed: int) -> int:
        """The longest prefix every group can supply: the full-attention groups' common stored
        prefix (one call, their keys interleaved block by block), then shortened until every
        window and state group has what a hit there needs (``KVGroups.hit``)."""
        G, bs, top = self.groups, self.bs, self._max_blocks(st)
        skip = num_computed // bs
        st.load_async = True  # all or nothing, reported per request: vLLM's async path only
        if st.load_failed:  # vLLM recomputes it whole and asks again: never the same failing hit
            st.found, st.miss_reason = skip, "load_failed"
            return 0
        self.keys_upto(st, top)
        reason, tiers = None, [TOP] * top
        m_full = top
        if G.full:
            cols = [self.group_keys(st, g.index, top) for g in G.full]
            m = self.client.contains_prefix([k for row in zip(*cols) for k in row], record=False,
                                            held=skip * len(cols))
            m_full = m.num_blocks // len(cols)
            reason = m.miss_reason if m_full < top else None
            for i in range(m_full):  # each block's slowest tier among the groups
                tiers[i] = max(m.tiers[i * len(cols):(i + 1) * len(cols)], key=rank)

        def probe(g, need: list[int]) -> tuple[int, str | None]:
            keys = self.group_keys(st, g.index, need[-1] + 1)
            m = self.client.contains_prefix([keys[i] for i in reversed(need)], record=False)
            return m.num_blocks, m.miss_reason

        k, _, why = G.hit(m_full, skip, probe)
        st.failed = False
        if not st.junction and 0 < m_full < top:
            st.junction = m_full  # a stored prefix ends here: another prompt shares it
        st.origin = tuple(tiers[:k])
        st.found, st.miss_reason = k, (why or reason) if k < top else None
        return max(0, k * bs - num_computed)

    def _keyed(self, st: RequestState, picks: list[tuple[int, int, int]]) -> tuple[list, list, list]:
        """(keys, engine blocks, groups) of ``(group, block index, engine block)`` picks."""
        top = {}
        for g, i, _ in picks:
            top[g] = max(top.get(g, 0), i + 1)
        gk = {g: self.group_keys(st, g, n) for g, n in top.items()}
        return [gk[g][i] for g, i, _ in picks], [b for _, _, b in picks], [g for g, _, _ in picks]

    def _pin_groups(self, st: RequestState, num_computed: int, num_external: int, tables) -> tuple[int, tuple]:
        """Pin every non-null block the engine allocated for the hit, in every group, and plan
        their load (asynchronous, all or nothing). Returns (blocks pinned, their tiers)."""
        first, k = num_computed // self.bs, (num_computed + num_external) // self.bs
        picks = self.groups.loads(tables, first, k)
        keys, ids, groups = self._keyed(st, picks or [])
        hid, got = 0, 0
        if picks is None:
            log.warning("kvstore: request %s: block tables %s do not cover the %d-block hit; it is recomputed",
                        st.req_id, None if tables is None else [len(t) for t in tables], k)
        else:
            try:
                hid, got, _ = self.client.begin_load(keys, session=st.session, ttl_s=st.ttl)
            except Exception as e:  # promised but not pinned: the worker fails the request
                self._failed("begin_load", e)
        ok = picks is not None and got == len(keys)
        if ok:
            st.saved_blocks = max(st.saved_blocks, k)
        tiers = tuple(st.origin[i] if i < len(st.origin) else TOP for i in range(first, k))
        self._async_pending.append(LoadPlan(st.req_id, ids, hid, num_external, first, tiers,
                                            REPLAY if st.replay else GENUINE, groups))
        return (k - first) if ok else 0, tiers

    def boundary_states(self, states: dict) -> list[StorePlan]:
        """Store plans for the Mamba states vLLM handed off this step (``{req_id: [(group,
        block id, boundary tokens)]}``): :meth:`KVGroups.states`."""
        out = []
        for rid, handed in states.items():
            st = self.reqs.get(rid)
            if self.groups is None or st is None or not st.cacheable or not st.store:
                continue
            picks = [(g, i, b) for g, i, b in self.groups.states(handed) if i < len(st.tokens) // self.bs]
            if picks:
                keys, ids, groups = self._keyed(st, picks)
                out.append(StorePlan(rid, ids, keys, ttl=st.ttl, groups=groups, positions=[i for _, i, _ in picks]))
                st.had_stores = True
        return out

    def load_failed(self, req_ids) -> None:
        """The worker reported these requests' loads failed (vLLM recomputes them whole)."""
        for rid in req_ids:
            st = self.reqs.get(rid)
            if st is not None:
                st.load_failed = True

    def _max_blocks(self, st: RequestState) -> int:
        """Full prompt blocks that may be offered: never the prompt's last token (the engine
        must compute at least one)."""
        return max(0, (st.num_prompt_tokens - 1) // self.bs)

    def outcome(self, st: RequestState, num_external: int, got: int, tiers: tuple[str, ...]) -> RequestOutcome:
        """Every prompt token of a scheduled request, counted once (see kvstore.offload.metrics):
        the engine's own hit, what kvstore promised (served or failed: the worker counts those),
        and why the rest could not be supplied. Tokens kvstore held under the engine's own hit
        are counted apart (``held``), never as hits."""
        # a resumed (preempted) request's own hit may cover generated tokens too: count the prompt's
        p, bs = st.num_prompt_tokens, self.bs
        local = min(st.num_local, p)
        o = RequestOutcome(st.req_id, p, local, num_external, got, tiers, tag=st.tag)
        why: dict[str, int] = {}
        if not st.cacheable or st.failed:
            why["uncacheable" if not st.cacheable else "store_error"] = p - local - num_external
        else:
            for t in st.origin[: min(st.found, len(st.origin), local // bs)]:
                o.held[t] = o.held.get(t, 0) + bs
            top = self._max_blocks(st) * bs  # the end of the blocks that may be offered
            covered = local + num_external  # the engine's hit, then kvstore's
            stored = min(st.found * bs, top)  # the end of the stored prefix
            why["not_loaded"] = max(0, stored - covered)
            why[st.miss_reason or "never_stored"] = max(0, top - max(covered, stored))
            why["partial_block"] = p - max(top, covered)
        o.unsupplied = {k: v for k, v in why.items() if v > 0}
        return o

    def allocated(self, st: RequestState, num_external: int, block_ids: Sequence[int] | None = None) -> None:
        """Blocks were allocated for ``num_external`` tokens after the engine's own hit: pin them.
        An asynchronous load (``st.load_async``; ``block_ids``: the request's whole block table)
        is planned for the next step whether or not the request is scheduled in it."""
        if not st.looked_up:  # scheduled after its asynchronous load: pinned and counted then
            return
        st.looked_up = False
        num_computed = st.num_local
        self._drop_load(st)
        hid, got_blocks, tiers = 0, 0, ()
        if num_external > 0 and self.groups is not None:
            got_blocks, tiers = self._pin_groups(st, num_computed, num_external, block_ids)
        elif num_external > 0:
            first = num_computed // self.bs
            n = num_external // self.bs
            keys = self.keys_upto(st, first + n)[first:first + n]
            try:
                hid, got_blocks, tier_of = self.client.begin_load(keys, session=st.session, ttl_s=st.ttl)
            except Exception as e:  # promised but not pinned: plan it anyway, the worker fails every block
                self._failed("begin_load", e)
                hid, got_blocks, tier_of = 0, 0, ()
            # the blocks found are in the store already: never offered to it again (a load that
            # fails rewinds the request below them, and _plan_req stores what it recomputes)
            st.saved_blocks = max(st.saved_blocks, first + got_blocks)
            # attribute each block to the tier it was found in (a prefetch may have moved it)
            tiers = tuple(st.origin[first + i] if first + i < len(st.origin) else t for i, t in enumerate(tier_of))
            st.load = (hid, first, n, tiers)
            if st.load_async and block_ids is not None and len(block_ids) >= first + n:
                self._async_pending.append(LoadPlan(st.req_id, list(block_ids[first:first + n]), hid, n * self.bs,
                                                    first, tiers, REPLAY if st.replay else GENUINE))
                st.load = None
            elif st.load_async:  # should not happen: the connector passes the whole block table
                log.warning("kvstore: request %s: an asynchronous load without its %d blocks (got %s); "
                            "it loads when scheduled", st.req_id, first + n,
                            None if block_ids is None else len(block_ids))
        st.hit_tiers = tuple(tiers) if num_external > 0 else ()
        if st.first_hit is None:
            st.first_hit = (st.num_local, got_blocks * self.bs, "store_error" if st.failed else st.miss_reason)
        o = self.outcome(st, num_external, got_blocks * self.bs, tiers)
        o.errors, self._unreported = self._unreported, 0
        try:
            self.client.record_request(o)
        except Exception as e:  # the errors it carried are reported with the next one
            self._unreported += o.errors
            self._failed("record_request", e)

    def _guard(self, op: str, fn, *args, **kw):
        try:
            return fn(*args, **kw)
        except Exception as e:
            self._failed(op, e)
            return None

    def _drop_load(self, st: RequestState) -> None:
        if st.load is not None:
            if st.load[0]:
                self._guard("end_load", self.client.end_load, st.load[0])
            st.load = None

    def build_step(self, new: Sequence[tuple[str, list[int] | tuple, int]],
                   cached: Sequence[tuple[str, list[int] | tuple | None, int, bool]],
                   num_scheduled: dict[str, int], states: dict | None = None) -> StepPlan:
        """``new``: (req_id, block_ids, num_computed); ``cached``: (req_id, new_block_ids or None,
        num_computed, resumed); block ids a list (one group) or a tuple of lists (one per group).
        ``states``: the Mamba states vLLM handed off (:meth:`boundary_states`). Returns this
        step's loads and stores."""
        self.steps += 1
        plan = StepPlan(step=self.steps, async_loads=self._async_pending)
        self._async_pending = []
        multi = self.groups is not None
        for rid, block_ids, computed in new:
            st = self.reqs.get(rid)
            if st is None:
                continue
            st.tables = [list(t) for t in block_ids] if isinstance(block_ids, tuple) else [list(block_ids)]
            if multi:
                plan.fresh.extend(b for t in st.tables for b in t if b)
            self._plan_req(plan, st, computed, num_scheduled.get(rid, 0))
        for rid, new_ids, computed, resumed in cached:
            st = self.reqs.get(rid)
            if st is None:
                continue
            if new_ids or resumed:  # else a decode step in its last block: its table is unchanged
                per = list(new_ids) if isinstance(new_ids, tuple) else [new_ids]
                if resumed:
                    st.tables = [list(t or []) for t in per]
                else:
                    for t, more in zip(st.tables, per):
                        t.extend(more or ())
                if multi and new_ids:
                    plan.fresh.extend(b for t in per for b in (t or ()) if b)
            self._plan_req(plan, st, computed, num_scheduled.get(rid, 0))
        if states:
            plan.stores.extend(self.boundary_states(states))
        if plan.loads:  # the worker drops stores computed over a block that fails to load
            for sp in plan.stores:
                st = self.reqs[sp.req_id]
                sp.prior_ids = st.block_ids[:sp.start]
        return plan

    def _plan_req(self, plan: StepPlan, st: RequestState, computed: int, scheduled: int) -> None:
        plan.tokens += scheduled
        plan.pairs += pairs(computed, scheduled)
        if computed < st.num_prompt_tokens:
            plan.prefill_tokens += min(scheduled, st.num_prompt_tokens - computed)
        # The usual decode step: no load and no block filled or rewound, so nothing to plan. It
        # skips the live token list's length and the block table (a property): build_connector_meta
        # took 50 us a step for 16 decoding requests before, on the 2-core VM.
        saved = st.saved_blocks
        if st.load is None and saved * self.bs <= computed and (computed + scheduled) // self.bs <= saved:
            return
        if st.load is not None:
            hid, first, n, tiers = st.load
            st.load = None
            ids = st.block_ids[first:first + n]
            if len(ids) < n:  # should not happen; never load into blocks we do not know
                log.warning("kvstore: request %s has %d blocks, expected %d", st.req_id, len(ids), first + n)
                if hid:
                    self._guard("end_load", self.client.end_load, hid)
            else:
                plan.loads.append(LoadPlan(st.req_id, ids, hid, n * self.bs, first, tuple(tiers),
                                           REPLAY if st.replay else GENUINE))
        if not st.cacheable or not st.store:
            return
        if computed < st.saved_blocks * self.bs:
            # vLLM rewound the request (a failed load truncated it at the first bad block, or it
            # was preempted): what it recomputes from here is stored again, once it is good
            st.saved_blocks = computed // self.bs
            self.rollbacks += 1
        if self.groups is not None:
            self._store_groups(plan, st, min((computed + scheduled) // self.bs, len(st.tokens) // self.bs))
            return
        full = min((computed + scheduled) // self.bs, len(st.tokens) // self.bs, len(st.block_ids))
        if full > st.saved_blocks:
            keys = self.keys_upto(st, full)
            start = st.saved_blocks
            plan.stores.append(StorePlan(st.req_id, st.block_ids[start:full], keys[start:full], start, ttl=st.ttl))
            st.saved_blocks = full
            st.had_stores = True

    def _store_groups(self, plan: StepPlan, st: RequestState, full: int) -> None:
        """The blocks that become full in this step, in every table group that keeps them
        (``KVGroups.stores``); a block is stored in the step that computes it, while vLLM still
        holds it in every group (a sliding-window block is freed soon after)."""
        start = st.saved_blocks
        if full <= start:
            return
        picks = self.groups.stores(st.tables, start, full, self._max_blocks(st), st.junction)
        st.saved_blocks = full
        if picks:
            keys, ids, groups = self._keyed(st, picks)
            plan.stores.append(StorePlan(st.req_id, ids, keys, start, ttl=st.ttl, groups=groups,
                                         positions=[i for _, i, _ in picks]))
            st.had_stores = True

    def finished(self, req_id: str) -> bool:
        """The request finished; True when vLLM must keep its blocks until the worker reports
        its stores done (``finished_sending``)."""
        st = self.reqs.pop(req_id, None)
        if st is None:
            return False
        self._drop_load(st)
        if self.trace is not None and st.cacheable:
            p = st.num_prompt_tokens
            local, hit, why = st.first_hit or (None, None, None)
            self.trace.write(st.arrival, st.session, self.keys_upto(st, p // self.bs), self.bs, p,
                             max(0, len(st.tokens) - p), local_tokens=local, hit_tokens=hit, miss_reason=why,
                             replay=st.replay, tokens=tuple(st.tokens[:p]) if self.trace_tokens else None,
                             tag=st.tag or None)
        if self.trace is not None and not self.reqs:  # idle: the lines go to the file now, so a stop
            self.trace.flush()  # loses none (vLLM's default --shutdown-timeout 0 SIGKILLs the engine core)
        if not (self.async_saves and st.had_stores):
            return False
        if self.always_delay:
            return True
        try:  # the usual case: the gather ran while vLLM sampled, and is done
            return not self.client.saves_done(req_id, SAVE_WAIT_S)
        except Exception as e:  # unknown: keep the blocks, the worker reports them (get_finished)
            self._failed("saves_done", e)
            return True

    def close(self) -> None:
        if self.trace is not None:
            self.trace.close()
