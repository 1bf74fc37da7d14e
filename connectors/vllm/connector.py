"""KVStoreConnector: vLLM's KV connector API (``KVConnectorBase_V1``) onto kvstore.

Translation only: the scheduler half turns vLLM requests and scheduler outputs into
:class:`kvstore.offload.Planner` calls, the worker half hands the step's plan and the paged KV
tensors to :class:`kvstore.offload.Mover`. Loads are synchronous within the step (the
blocks are already in pinned DRAM: NVMe blocks are prefetched before the request is
scheduled), stores gather new full blocks after the forward pass.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvstore import kvcopy
from kvstore.config import load_config
from kvstore.keys import ModelFingerprint
from kvstore.ops.stats import render_engine
from kvstore.trace import TraceWriter
from kvstore.offload import (LocalClient, Mover, Planner, RemoteClient, StepPlan, StoreServer, acquire_shared,
                             find, hints, release_shared)
from kvstore.offload.hooktime import IDLE_HOOK, HookClock, timed
from kvstore.offload.prefillrate import PrefillRate

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


class KVStoreMetadata(KVConnectorMetadata):
    def __init__(self, plan: StepPlan):
        self.plan = plan


def _tp_rank(vllm_config: "VllmConfig", role: KVConnectorRole) -> tuple[int, int]:
    """(rank, size). A worker must know its tensor-parallel rank (its keys carry it): failing to
    get it is an error at start-up, never a silent rank 0 that would mix ranks' blocks. The
    scheduler side asks rank 0's store, so its fingerprint says rank 0."""
    size = vllm_config.parallel_config.tensor_parallel_size
    if role != KVConnectorRole.WORKER:
        return 0, size
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        rank = int(get_tensor_model_parallel_rank())
    except Exception as e:
        if size == 1:
            return 0, 1  # no TP group is needed to know the only rank
        raise RuntimeError(f"kvstore: cannot get this worker's tensor-parallel rank (size {size}): {e}") from e
    if not 0 <= rank < size:
        raise RuntimeError(f"kvstore: tensor-parallel rank {rank} is outside 0..{size - 1}")
    return rank, size


def block_packing(vllm_config: "VllmConfig", spec) -> tuple[str, str]:
    """How the engine packs a block's bytes (the store keeps pages byte for byte), and its
    variant: vLLM's CPU backend packs per ISA (K transposed etc.), every GPU backend uses the
    standard order."""
    try:
        from vllm.platforms import current_platform

        on_cpu = current_platform.is_cpu()
    except Exception:  # pragma: no cover
        on_cpu = True
    if not on_cpu:
        return "std", ""
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        isa = _get_attn_isa(vllm_config.model_config.dtype, spec.block_size, spec.head_size,
                            vllm_config.cache_config.cache_dtype)
    except Exception:  # a vLLM without that helper: still never mix with GPU blocks
        isa = "unknown"
    return "vllm_cpu", isa


def model_fingerprint(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig", codec: str,
                      role: KVConnectorRole = KVConnectorRole.WORKER) -> tuple[ModelFingerprint, int, list[str]]:
    """(fingerprint, bytes per block across layers, layer names in order)."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ValueError(f"KVStoreConnector supports one KV cache group, got {len(groups)} "
                         "(hybrid models need --disable-hybrid-kv-cache-manager)")
    spec = groups[0].kv_cache_spec
    layers = list(groups[0].layer_names)
    mc = vllm_config.model_config
    rank, size = _tp_rank(vllm_config, role)
    packing, variant = block_packing(vllm_config, spec)
    fp = ModelFingerprint(
        model=str(mc.model), revision=str(mc.revision or ""), dtype=str(spec.dtype),
        layout=f"kvblock-v{kvcopy.STORE_FORMAT_VERSION}.{packing}" + (f"-{variant}" if variant else ""),
        packing=packing,
        block_size=int(spec.block_size),
        num_layers=len(layers), num_kv_heads=int(spec.num_kv_heads), head_size=int(spec.head_size),
        tp_rank=rank, tp_size=size, codec=codec,
        extra=(("kv_cache_dtype", str(vllm_config.cache_config.cache_dtype)),
               ("head_size_v", int(getattr(spec, "head_size_v", spec.head_size))),
               ("tokenizer", str(mc.tokenizer)), ("quantization", str(mc.quantization))),
    )
    return fp, int(spec.page_size_bytes) * len(layers), layers


def _request_extra(request: "Request"):
    """Everything besides token ids that changes a request's KV: LoRA and cache salt."""
    lora = request.lora_request
    lora_key = (lora.lora_name, str(getattr(lora, "lora_path", "") or "")) if lora is not None else None
    salt = getattr(request, "cache_salt", None)
    if lora_key is None and salt is None:
        return None
    return ("lora", lora_key, "salt", salt)


def _request_mm(request: "Request") -> list[tuple[int, int, str]]:
    out = []
    for f in getattr(request, "mm_features", None) or []:
        pos = f.mm_position
        out.append((int(pos.offset), int(pos.offset + pos.length), str(f.identifier)))
    return out


class KVStoreConnector(KVConnectorBase_V1):
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
        codec = f"dram={self.config.tiers.dram.codec},nvme={self.config.tiers.nvme.codec}"  # lossy never serves lossless
        self.fingerprint, block_bytes, self.layer_names = model_fingerprint(vllm_config, kv_cache_config, codec, role)
        self.block_size = self.fingerprint.block_size
        engine = str(ktc.engine_id)
        self.planner: Planner | None = None
        self.mover: Mover | None = None
        self.prefill: PrefillRate | None = None  # the engine's prefill tokens/s (worker side)
        self.shared = None
        self.server: StoreServer | None = None
        self.client = None
        self.clock: HookClock | None = None  # the hooks' time on the engine's thread (kvstore.offload.hooktime)
        if role == KVConnectorRole.WORKER:
            # the worker owns the store (bytes and index) and serves the scheduler's lookups
            name = f"{engine}/tp{self.fingerprint.tp_rank}"
            self.shared = acquire_shared(name, self.config, self.fingerprint, block_bytes, self.block_size)
            self.mover = Mover(self.shared, async_saves=self.config.io.async_saves,
                               async_loads=self.config.io.async_loads)
            self.server = StoreServer(self.shared, name)
            self.clock = HookClock(self.shared.metrics.hooks, "worker")
        else:
            # the scheduler asks rank 0's store: in this process if it is here, else over a socket
            name = f"{engine}/tp0"
            local = find(name)
            self.client = LocalClient(local) if local is not None else RemoteClient(name)
            # in the store's process the counts go straight to its totals; else in each step's plan
            self.clock = HookClock(local.metrics.hooks if local is not None else None, "scheduler")
            trace = TraceWriter(self.config.trace_path) if self.config.trace_path else None
            self.planner = Planner(self.client, self.fingerprint, self.block_size,
                                   # a prefetch promotes NVMe blocks into DRAM; without a DRAM tier there
                                   # is nothing to wait for, so the lookup need not "ask again"
                                   prefetch=self.config.tiers.nvme.enabled and self.config.tiers.dram.enabled,
                                   trace=trace, trace_tokens=self.config.trace_tokens,
                                   async_loads=self.config.io.async_loads,
                                   async_saves=self.config.io.async_saves,
                                   # over RPC (another process, or TP > 1): no call per finished
                                   # request; the engine core keeps stepping while a free is
                                   # delayed, and the worker reports it (get_finished)
                                   always_delay=self.fingerprint.tp_size > 1 or not isinstance(self.client,
                                                                                                LocalClient))
        self._closed = False
        log.info("kvstore connector (%s): %s, %d bytes/block, dram %.2f GiB, nvme %s%s", role.name,
                 self.fingerprint.model, block_bytes, self.config.tiers.dram.capacity_gb,
                 self.config.tiers.nvme.path or "temp folder",
                 "" if role == KVConnectorRole.WORKER else f", store {type(self.client).__name__}")

    @property
    def requires_kv_delivery(self) -> bool:  # a best-effort cache: a dropped save is a later miss
        return False

    # ------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        assert self.mover is not None
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
        self.prefill = PrefillRate(self.mover.store.rates.observe_prefill, min_tokens=4 * self.block_size,
                                   device=self.mover.copier.device, device_index=self.mover.copier.device_index)
        log.info("kvstore: KV layout %s", layout.describe())

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
        if self.mover is None:
            return None, None
        meta = self._connector_metadata
        plan = meta.plan if isinstance(meta, KVStoreMetadata) else None
        t = time.perf_counter()
        try:
            return self.mover.get_finished(finished_req_ids, plan)
        finally:  # a step with nothing scheduled waits here for loads: no request waits for that
            self.clock.add(IDLE_HOOK if plan is not None and plan.idle else "get_finished", time.perf_counter() - t)

    @timed
    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.mover.take_load_errors() if self.mover is not None else set()

    # --------------------------------------------------------------- scheduler side
    @timed
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self.planner is not None
        tokens = request.all_token_ids if request.prompt_token_ids is not None else None
        if getattr(request, "prompt_embeds", None) is not None:
            tokens = None  # embeddings, not token ids: nothing to key on
        new = request.request_id not in self.planner.reqs
        st = self.planner.track(request.request_id, tokens, request.num_prompt_tokens, _request_extra(request),
                                _request_mm(request), arrival=float(getattr(request, "arrival_time", 0.0) or 0.0),
                                session=str(getattr(request, "cache_salt", None) or ""))
        if new:  # retention hints (kvstore.offload.hints): a bad one is logged, the config applies
            st.ttl, st.store = hints.parse(getattr(request, "kv_transfer_params", None), request.request_id)
        n = self.planner.lookup(st, num_computed_tokens)
        return n, bool(n and st.load_async)  # blocks below DRAM: the request waits, others run

    @timed
    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        assert self.planner is not None
        st = self.planner.reqs.get(request.request_id)
        if st is None:
            return
        ids = blocks.get_block_ids()[0] if st.load_async and num_external_tokens > 0 else None
        self.planner.allocated(st, num_external_tokens, ids)

    @timed
    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        assert self.planner is not None
        new = [(r.req_id, list(r.block_ids[0]) if r.block_ids else [], r.num_computed_tokens)
               for r in scheduler_output.scheduled_new_reqs]
        c = scheduler_output.scheduled_cached_reqs
        resumed = set(getattr(c, "resumed_req_ids", ()) or ())
        cached = []
        for i, rid in enumerate(c.req_ids):
            nb = c.new_block_ids[i]
            cached.append((rid, list(nb[0]) if nb else None, c.num_computed_tokens[i], rid in resumed))
        plan = self.planner.build_step(new, cached, dict(scheduler_output.num_scheduled_tokens))
        plan.preempted = sorted(getattr(scheduler_output, "preempted_req_ids", None) or ())
        plan.idle = scheduler_output.total_num_scheduled_tokens == 0
        if self.clock is not None and not self.clock.attached:
            plan.hook_s = self.clock.take()  # the scheduler's hook time since the last plan
        return KVStoreMetadata(plan)

    @timed
    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        # True: a store of its blocks may still be copying; vLLM frees them on finished_sending
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
            log.info("kvstore tiers: %s", self.shared.store.stats()["tiers"])
            if self.mover is not None:
                self.mover.close()  # in-flight copies complete (and commit) before the store closes
            if self.server is not None:
                self.server.close()
            release_shared(self.shared)
