"""KVStoreConnector: vLLM's KV connector API (``KVConnectorBase_V1``) onto kvstore.

Translation only: the scheduler half turns vLLM requests and scheduler outputs into
:class:`kvstore.offload.Planner` calls, the worker half hands the step's plan and the paged KV
tensors to :class:`kvstore.offload.StepRunner`. With ``io.async_loads`` (the default) a hit with
blocks below DRAM waits (``WAITING_FOR_REMOTE_KVS``) while the worker's load thread reads and
scatters them and other requests run; without it, lower-tier blocks are prefetched into DRAM
before the request is scheduled and loaded within the step. Stores gather new full blocks after
the forward pass.

Every model vLLM serves keeps vLLM's hybrid KV cache manager (``SupportsHMA``): block ids come
per KV cache group everywhere, and :func:`kv_groups` says what kvstore does with each group
(:mod:`kvstore.offload.groups`). A group kind kvstore cannot serve, or MLA on vLLM's CPU backend
(loads there gave wrong greedy output with byte-identical blocks; cause not found), is logged
once and the connector stores nothing for that model (``off``): the engine runs as without it.
With tensor parallelism the scheduler asks every rank's store (:mod:`kvstore.offload.ranks`).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvstore import kvcopy
from kvstore.config import load_config
from kvstore.offload.readout import render_engine
from kvstore.store.sizing import sizing_line, tiers_line
from kvstore.tiers.registry import SPECS
from kvstore.trace import TraceWriter, recorded_fields
from kvstore.offload import (LocalClient, StepRunner, Planner, RemoteClient, StepPlan, StoreServer, acquire_shared,
                             find, hints, release_shared)
from kvstore.connectors.vllm.events import KVStoreEvents, block_metas, events_enabled, vllm_events
from kvstore.connectors.vllm.model import kv_groups, model_fingerprint
from kvstore.connectors.vllm.stats import KVStorePromMetrics, KVStoreStats, StatsTaker
from kvstore.offload.groups import STATE, KVGroups
from kvstore.offload.hooktime import IDLE_HOOK, HookClock, timed
from kvstore.offload.prefillrate import PrefillRate
from kvstore.offload.ranks import RankedClient

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("vllm.kvstore")  # under vLLM's logger: shows in its log


def _log_under_vllm() -> None:
    """kvstore's own loggers (``kvstore.*``: the DRAM pool, the mover's warnings) write through
    vLLM's handlers, so their lines show in the engine's log, in its format."""
    k, v = logging.getLogger("kvstore"), logging.getLogger("vllm")
    if v.handlers and not k.handlers:
        for h in v.handlers:
            k.addHandler(h)
        k.setLevel(logging.INFO)
        k.propagate = False


_logged_off: set[str] = set()  # why a model is not served, logged once per process


def _check_codecs(config, groups: KVGroups) -> None:
    """A lossy codec cannot quantize a state page (kvstore.codecs: the codec's own refusal)."""
    from kvstore.codecs.base import Geometry
    from kvstore.codecs.registry import make_codec
    from kvstore.configfields import ConfigError

    if not groups.state:
        return
    for s in SPECS:
        tier, cfg = s.name, getattr(config.tiers, s.name, None)
        name = getattr(cfg, "codec", "none")
        if cfg is None or name == "none":
            continue
        try:
            make_codec(name, Geometry(256, "bfloat16", 64, layout="state"))
        except ValueError as e:
            raise ConfigError(f"tiers.{tier}.codec", name, "none or zstd", f"this model keeps Mamba or "
                              f"linear-attention state ({e})") from None


def _prefetches(config) -> bool:
    """Is there a lower local tier to promote blocks from into the top one (both on)?"""
    on = [getattr(config.tiers, t.name).enabled for t in SPECS if t.local]
    return bool(on) and on[0] and any(on[1:]) and SPECS[0].local


def _described(name: str, cfg) -> str:
    """A tier in the start-up line: its size and its folder, where it has them."""
    gb = getattr(cfg, "capacity_gb", None)
    return " ".join([name] + ([f"{gb:.2f} GiB"] if gb is not None else [])
                    + ([cfg.path or "temp folder"] if hasattr(cfg, "path") else []))


# vLLM's names of where a hit came from (vllm:prompt_tokens_cached_by_source{source}), each medium's
# from its spec (a name this vLLM does not have: external_unspecified)
HIT_SOURCES = {s.name: getattr(CacheHitSource, s.hit_source, CacheHitSource.EXTERNAL_UNSPECIFIED) for s in SPECS}


class KVStoreMetadata(KVConnectorMetadata):
    def __init__(self, plan: StepPlan):
        self.plan = plan


def _request_extra(request: "Request"):
    """Everything besides token ids that changes a request's KV: LoRA and cache salt."""
    lora = request.lora_request
    lora_key = (lora.lora_name, str(getattr(lora, "lora_path", "") or "")) if lora is not None else None
    salt = getattr(request, "cache_salt", None)
    if lora_key is None and salt is None:
        return None
    return ("lora", lora_key, "salt", salt)


def _session(request: "Request") -> str:
    """The conversation a request belongs to: vLLM's own ``session_id`` (the OpenAI API's field),
    else ``kv_transfer_params: {"kvstore": {"session": ...}}``; "" (the request is its own) without
    either. Never the cache salt: that isolates tenants, and every session of a tenant shares it."""
    # from the API client as the hint is, so held to the same rule (a bad one is logged, not used)
    sid = hints.checked(getattr(request, "session_id", None) or None, "session", request.request_id, "session_id")
    if sid:
        return sid
    return hints.word(getattr(request, "kv_transfer_params", None), "session", request.request_id) or ""


def _request_mm(request: "Request") -> list[tuple[int, int, str]]:
    out = []
    for f in getattr(request, "mm_features", None) or []:
        pos = f.mm_position
        out.append((int(pos.offset), int(pos.offset + pos.length), str(f.identifier)))
    return out


SLEEP_MODE_REFUSED = ("kvstore refuses vLLM's sleep mode (--enable-sleep-mode): a wake-up re-allocates the GPU KV "
                      "cache, and kvstore's copy tables hold pointers into the freed one. Re-registering the new "
                      "caches (unregister_kv_caches / restore_kv_caches) has not run on a GPU yet; start without "
                      "sleep mode, or without kvstore")


class KVStoreConnector(KVConnectorBase_V1, SupportsHMA):
    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config=None) -> bool:
        """vLLM 0.33 asks before it starts with sleep mode on (its default, inherited, is True: the
        first hit after a wake-up would copy into freed GPU memory). False until the re-registration
        is proven on a GPU; said in the log, since vLLM's refusal does not say why."""
        log.warning("%s", SLEEP_MODE_REFUSED)
        return False

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig"):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        _log_under_vllm()
        ktc = self._kv_transfer_config
        # a miss or a failed load is recomputed, never an error for the request
        if getattr(ktc, "kv_load_failure_policy", "recompute") != "recompute":
            try:
                ktc.kv_load_failure_policy = "recompute"
            except Exception:  # pragma: no cover
                log.warning("kvstore: could not set kv_load_failure_policy=recompute")
        extra = dict(ktc.kv_connector_extra_config or {})
        self.config = load_config(overrides=extra)
        codec = ",".join(f"{t.name}={getattr(self.config.tiers, t.name).codec}" for t in SPECS  # (dram=..,nvme=..)
                         if t.local and hasattr(getattr(self.config.tiers, t.name), "codec"))  # lossy never serves lossless
        self.groups, self.off = kv_groups(vllm_config, kv_cache_config)
        self.planner: Planner | None = None
        self.mover: StepRunner | None = None
        self.prefill: PrefillRate | None = None  # the engine's prefill tokens/s (worker side)
        self.shared = None
        self.server: StoreServer | None = None
        self.client = None
        self.clock: HookClock | None = None  # the hooks' time on the engine's thread (kvstore.offload.hooktime)
        self._closed = False
        # KV events (kvstore.connectors.vllm.events): on when vLLM publishes its own
        self.events_on = events_enabled(vllm_config)
        self._requests: dict[str, Any] = {}  # scheduler: the requests whose blocks are named in events
        self._events: list = []  # scheduler: the workers' events, until vLLM takes them
        self.stats: StatsTaker | None = None  # worker, rank 0: kvstore's metrics for vLLM's /metrics
        if self.off is not None:  # the engine runs as without a connector; nothing is stored
            if self.off not in _logged_off:
                log.warning("kvstore: %s; the connector stores nothing for this model", self.off)
                _logged_off.add(self.off)
            groups = kv_cache_config.kv_cache_groups  # none: an attention-free model
            self.block_size = int(groups[0].kv_cache_spec.block_size) if groups else 0
            return
        _check_codecs(self.config, self.groups)  # a lossy codec and a model with state: ConfigError
        self.fingerprint, block_bytes, self.layer_names = model_fingerprint(vllm_config, kv_cache_config, codec, role,
                                                                            self.groups)
        self.block_size = self.fingerprint.block_size
        engine = str(ktc.engine_id)
        if role == KVConnectorRole.WORKER:
            # the worker owns the store (bytes and index) and serves the scheduler's lookups
            name = f"{engine}/tp{self.fingerprint.tp_rank}"
            # rank 0 announces (every rank stores the same blocks): only its store keeps the journals
            self.shared = acquire_shared(name, self.config, self.fingerprint, block_bytes, self.block_size,
                                         events=self.events_on and self.fingerprint.tp_rank == 0)
            mover = None
            try:
                mover = StepRunner(self.shared, async_saves=self.config.io.async_saves,
                              async_loads=self.config.io.async_loads, rank=self.fingerprint.tp_rank)
                self.server = StoreServer(self.shared, name)  # may refuse its folder: SocketTrustError
            except BaseException:  # a process that goes on (an LLM built again) keeps no store, threads or port
                if mover is not None:
                    mover.close()
                release_shared(self.shared)
                self.shared = None
                raise
            self.mover = mover
            if self.config.mode != "node":  # a daemon's tiers are sized in its own log
                log.info("%s", sizing_line(self.config, block_bytes, self.block_size, self.fingerprint.model))
            self.clock = HookClock(self.shared.metrics.hooks, "worker")
            # rank 0's counters and gauges on vLLM's /metrics (kvstore.connectors.vllm.stats)
            store = self.shared.store
            self.stats = (StatsTaker(store.metrics.registry, refresh=store.update_gauges)
                          if self.fingerprint.tp_rank == 0 else None)
        else:
            # the scheduler asks rank 0's store: in this process if it is here, else over a socket;
            # with tensor parallelism every rank's, answered as one (kvstore.offload.ranks)
            name = f"{engine}/tp0"
            local = find(name)
            size = self.fingerprint.tp_size
            if size > 1:
                self.client = RankedClient([RemoteClient(f"{engine}/tp{r}") for r in range(size)])
            else:
                self.client = LocalClient(local) if local is not None else RemoteClient(name)
            # in the store's process the counts go straight to its totals; else in each step's plan
            self.clock = HookClock(local.metrics.hooks if local is not None else None, "scheduler")
            trace = TraceWriter(self.config.trace_path, recorded=recorded_fields(
                self.config.to_dict()["tiers"], block_bytes, self.block_size, "kvstore connector")
            ) if self.config.trace_path else None
            self.planner = Planner(self.client, self.fingerprint, self.block_size,
                                   # a prefetch promotes a lower local tier's blocks into the top one;
                                   # without both there is nothing to wait for, so the lookup need not
                                   # "ask again"
                                   prefetch=_prefetches(self.config),
                                   trace=trace, trace_tokens=self.config.trace_tokens,
                                   async_loads=self.config.io.async_loads,
                                   async_saves=self.config.io.async_saves,
                                   # over RPC (another process, or TP > 1): no call per finished
                                   # request; the engine core keeps stepping while a free is
                                   # delayed, and the worker reports it (get_finished)
                                   always_delay=self.fingerprint.tp_size > 1 or not isinstance(self.client,
                                                                                                LocalClient),
                                   groups=self.groups)
        tiers = (f"the node daemon {self.config.node.name!r}" if self.config.mode == "node" else
                 ", ".join(_described(t.name, getattr(self.config.tiers, t.name)) for t in SPECS
                           if getattr(self.config.tiers, t.name).enabled) or "no tier")
        log.info("kvstore connector (%s): %s, %d bytes/block, %s%s%s", role.name,
                 self.fingerprint.model, block_bytes, tiers,
                 "" if role == KVConnectorRole.WORKER else f", store {type(self.client).__name__}",
                 "" if self.groups.plain else f", KV cache groups {self.groups.describe()}")

    @property
    def requires_kv_delivery(self) -> bool:  # a best-effort cache: a dropped save is a later miss
        return False

    # ------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        if self.mover is None:  # off: this model is not served
            return
        if not self.groups.plain:
            return self._register_groups(kv_caches)
        tensors = [kv_caches[n] for n in self.layer_names if n in kv_caches]
        if len(tensors) != len(self.layer_names):
            tensors = list(kv_caches.values())
        expected = self.fingerprint.packing
        spec = self._kv_cache_config.kv_cache_groups[0].kv_cache_spec
        layout = kvcopy.KVLayout.from_vllm(tensors, mla=type(spec).__name__.startswith("MLA"))
        if layout.packing != expected:
            raise ValueError(f"kvstore: the engine's KV blocks are packed {layout.packing!r} but the keys were "
                             f"made for {expected!r}; {layout.describe()}")
        self.mover.register(tensors, layout)
        self._registered()
        log.info("kvstore: KV layout %s", layout.describe())

    def _registered(self) -> None:
        self.prefill = PrefillRate(self.mover.store.rates.observe_prefill, min_tokens=4 * self.block_size,
                                   device=self.mover.copier.device, device_index=self.mover.copier.device_index)

    def _register_groups(self, kv_caches: dict[str, Any]) -> None:
        """A hybrid model: each group's layers (layers that alias one cache counted once), read
        as vLLM packs them; a state group's page as raw bytes (one latent-like row per block)."""
        per = []
        for g, spec in zip(self.groups.groups, (x.kv_cache_spec for x in self._kv_cache_config.kv_cache_groups)):
            names = self._kv_cache_config.kv_cache_groups[g.index].layer_names
            tensors, seen = [], set()
            for n in names:
                t = kv_caches.get(n)
                if t is not None and t.data_ptr() not in seen:
                    seen.add(t.data_ptr())
                    tensors.append(t)
            if not tensors:
                raise ValueError(f"kvstore: no KV cache registered for group {g.index} ({list(names)[:3]} ...)")
            if g.role == STATE:
                layout = kvcopy.KVLayout.from_tensor("mla", tensors)
            else:
                layout = kvcopy.KVLayout.from_vllm(tensors, mla="mla" in g.kind)
                if layout.packing != self.fingerprint.packing:
                    raise ValueError(f"kvstore: group {g.index}'s KV blocks are packed {layout.packing!r} but the "
                                     f"keys were made for {self.fingerprint.packing!r}; {layout.describe()}")
            per.append((tensors, layout))
            log.info("kvstore: KV cache group %d (%s%s): %s", g.index, g.kind,
                     f", window {g.window}" if g.window else "", layout.describe())
        self.mover.register_groups(per)
        self._registered()

    def unregister_kv_caches(self) -> None:
        """vLLM 0.33's sleep: the copies in flight end, then the tables that point into the KV cache
        go (:meth:`StepRunner.unregister`). Not reached while :meth:`supports_sleep_mode` says False."""
        if self.mover is not None:
            self.mover.unregister()

    def restore_kv_caches(self) -> None:
        """vLLM 0.33's wake-up: the tables again, from the caches registered before the sleep."""
        if self.mover is not None and not self.mover.copiers:
            self.mover.restore()
            if self.mover.copiers:
                self._registered()

    @timed
    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if not isinstance(connector_metadata, KVStoreMetadata):
            return
        plan = connector_metadata.plan
        if self.shared is not None and plan.hook_s:  # a scheduler in another process: its hooks' time
            self.shared.metrics.hooks.add("scheduler", plan.hook_s)
        if self.prefill is not None:  # the forward pass follows: time it if it is mostly prefill
            self.prefill.start(plan.prefill_tokens, plan.tokens, plan.pairs)

    @timed
    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._connector_metadata
        if self.mover is not None and isinstance(meta, KVStoreMetadata):
            self.mover.load(meta.plan)
            if self.prefill is not None and meta.plan.loads:  # synchronous loads: before the forward pass
                self.prefill.loaded()

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads finish in start_load_kv, before any layer runs

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return  # all layers are gathered at once in wait_for_save

    @timed
    def wait_for_save(self) -> None:
        meta = self._connector_metadata
        if self.prefill is not None:
            self.prefill.stop()
        if self.mover is not None and isinstance(meta, KVStoreMetadata):
            self.mover.save(meta.plan)  # with io.async_saves: reserves slots and enqueues the gather

    @timed
    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if self.mover is not None and isinstance(kv_connector_metadata, KVStoreMetadata):
            self.mover.handle_preemptions(kv_connector_metadata.plan)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        r = self.get_transfer_results(finished_req_ids)
        return r.finished_sending or None, r.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Stores done, loads done, and (a hybrid model) loads that failed as a whole: vLLM
        recomputes those requests (with more than one group it cannot take failed block ids)."""
        if self.mover is None:
            return KVConnectorTransferResults()
        meta = self._connector_metadata
        plan = meta.plan if isinstance(meta, KVStoreMetadata) else None
        t = time.perf_counter()
        try:
            sending, recving, failed = self.mover.get_transfer(finished_req_ids, plan)
            return KVConnectorTransferResults(finished_sending=set(sending or ()),
                                              finished_recving=set(recving or ()) | failed, failed_recving=failed)
        finally:  # a step with nothing scheduled waits here for loads: no request waits for that
            self.clock.add(IDLE_HOOK if plan is not None and plan.idle else "get_finished", time.perf_counter() - t)

    @timed
    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.mover.take_load_errors() if self.mover is not None else set()

    # --------------------------------------------------------------- scheduler side
    @timed
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        if self.planner is None:  # off: this model is not served
            return 0, False
        tokens = request.all_token_ids if request.prompt_token_ids is not None else None
        if getattr(request, "prompt_embeds", None) is not None:
            tokens = None  # embeddings, not token ids: nothing to key on
        new = request.request_id not in self.planner.reqs
        st = self.planner.track(request.request_id, tokens, request.num_prompt_tokens, _request_extra(request),
                                _request_mm(request), arrival=float(getattr(request, "arrival_time", 0.0) or 0.0),
                                session=_session(request) if new else "")
        if new:  # retention hints (kvstore.offload.hints): a bad one is logged, the config applies
            params = getattr(request, "kv_transfer_params", None)
            st.ttl, st.store = hints.parse(params, request.request_id, self.config.hint_ttl_cap)
            st.tag = hints.word(params, "tag", request.request_id) or ""
            if self.events_on:
                self._requests[request.request_id] = request
        n = self.planner.lookup(st, num_computed_tokens)
        return n, bool(n and st.load_async)  # blocks below DRAM: the request waits, others run

    @timed
    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        st = self.planner.reqs.get(request.request_id) if self.planner is not None else None
        if st is None:
            return
        ids = None
        if st.load_async and num_external_tokens > 0:
            ids = blocks.get_block_ids()
            ids = tuple(list(t) for t in ids) if not self.groups.plain else ids[0]
        self.planner.allocated(st, num_external_tokens, ids)

    @timed
    def get_external_cache_hit_sources(self, request: "Request", num_external_tokens: int) -> dict:
        """kvstore's hit split by the tier each block was found in (vLLM calls this after
        ``update_state_after_alloc``); vLLM counts a split that does not add up as external."""
        if not num_external_tokens:
            return {}
        st = self.planner.reqs.get(request.request_id) if self.planner is not None else None
        out: dict = {}
        for t in (st.hit_tiers if st is not None else ()):
            src = HIT_SOURCES.get(t, CacheHitSource.EXTERNAL_UNSPECIFIED)
            out[src] = out.get(src, 0) + self.block_size
        if sum(out.values()) != num_external_tokens:
            return {CacheHitSource.EXTERNAL_UNSPECIFIED: num_external_tokens}
        return out

    @timed
    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        if self.planner is None:  # off: this model is not served
            return KVStoreMetadata(StepPlan())
        one = self.groups.plain

        def ids(b):  # one group's list as before, else a tuple of every group's
            return (list(b[0]) if b else []) if one else tuple(list(x) for x in b)

        new = [(r.req_id, ids(r.block_ids), r.num_computed_tokens) for r in scheduler_output.scheduled_new_reqs]
        c = scheduler_output.scheduled_cached_reqs
        resumed = set(getattr(c, "resumed_req_ids", ()) or ())
        cached = [(rid, ids(nb) if nb else None, n, rid in resumed)
                  for rid, nb, n in zip(c.req_ids, c.new_block_ids, c.num_computed_tokens)]
        state = getattr(scheduler_output, "kv_connector_block_state", None)
        handed = getattr(state, "boundary_state_offloads", None) if self.groups.state else None
        plan = self.planner.build_step(new, cached, dict(scheduler_output.num_scheduled_tokens), handed)
        if self.events_on:
            self._name_blocks(plan)
        plan.preempted = sorted(getattr(scheduler_output, "preempted_req_ids", None) or ())
        plan.idle = scheduler_output.total_num_scheduled_tokens == 0
        if self.clock is not None and not self.clock.attached:
            plan.hook_s = self.clock.take()  # the scheduler's hook time since the last plan
        return KVStoreMetadata(plan)

    def _name_blocks(self, plan: StepPlan) -> None:
        """vLLM's names of the blocks the step stores, for the KV events (kvstore.connectors.vllm.events)."""
        hbs = getattr(self._kv_cache_config, "hash_block_size", None)
        for sp in plan.stores:
            req = self._requests.get(sp.req_id)
            if req is not None:
                pos = sp.positions or list(range(sp.start, sp.start + len(sp.keys)))
                sp.meta = block_metas(req, pos, sp.groups, self.block_size, hbs)

    @timed
    def get_kv_connector_kv_cache_events(self) -> KVStoreEvents | None:
        """Worker: what became servable in, or left, each tier since the last step (rank 0 only:
        every rank stores the same blocks)."""
        if not self.events_on or self.shared is None or self.fingerprint.tp_rank != 0:
            return None
        records = self.shared.store.take_events()
        if not records:
            return None
        events = vllm_events(records, self.config.events, self.block_size)
        return KVStoreEvents(events) if events else None

    @timed
    def get_kv_connector_stats(self) -> KVStoreStats | None:
        """Worker: kvstore's counters' increments and gauges, at most once a second."""
        if self.stats is None:
            return None
        data = self.stats.take()
        return KVStoreStats(data=data) if data else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVStoreStats:
        return KVStoreStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> KVStorePromMetrics:
        return KVStorePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    @timed
    def take_events(self):
        """Scheduler: the workers' events since the last step, published with vLLM's own."""
        out, self._events = self._events, []
        return out

    def update_connector_output(self, connector_output) -> None:
        super().update_connector_output(connector_output)
        ev = getattr(connector_output, "kv_cache_events", None)
        if isinstance(ev, KVStoreEvents):
            self._events.extend(ev.get_all_events())
        failed = getattr(connector_output, "failed_recving", None)
        if failed and self.planner is not None:  # never offered the same failing hit again
            self.planner.load_failed(failed)

    @timed
    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        # True: a store of its blocks may still be copying; vLLM frees them on finished_sending
        self._requests.pop(request.request_id, None)
        delay = self.planner.finished(request.request_id) if self.planner is not None else False
        return delay, None

    @timed
    def request_finished_all_groups(self, request: "Request", block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        """Every group's blocks stay until the worker reports the request's stores done."""
        self._requests.pop(request.request_id, None)
        delay = self.planner.finished(request.request_id) if self.planner is not None else False
        return delay, None

    def reset_cache(self) -> bool | None:
        return None  # kvstore keeps its tiers across engine prefix-cache resets

    # ---------------------------------------------------------------------- shared
    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.planner is not None:
            self.planner.close()
        if self.client is not None:
            self.client.close()
        if self.shared is not None:
            summary = self.shared.metrics.summary()
            if summary is not None:
                log.info("kvstore connector summary:\n%s", "\n".join(render_engine(summary)))
            log.info("kvstore tiers at shutdown: %s", tiers_line(self.shared.store.stats()["tiers"]))
            if self.mover is not None:
                self.mover.close()  # in-flight copies complete (and commit) before the store closes
            if self.server is not None:
                self.server.close()
            release_shared(self.shared)
