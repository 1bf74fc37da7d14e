"""kvstore's tiers on vLLM's own KV-event stream (issue 32): ``BlockStored`` when a block becomes
servable in a tier, ``BlockRemoved`` when it stops being servable there, each with the tier's
``medium`` and ``locality`` (config ``events:``) and vLLM's own block hashes, so a router that
reads vLLM's GPU events (llm-d, Dynamo) matches kvstore's blocks to the same prompts.

Worker side, not scheduler side: the store lives in the worker's process (rank 0 announces;
every rank stores the same blocks), so the records are drained there each step at no RPC
(``get_kv_connector_kv_cache_events``), travel in vLLM's ``KVConnectorOutput`` (multiprocess and
TP > 1 alike) and are published with vLLM's own events by the scheduler (``take_events``).

* Names: for block ``i`` of a request, vLLM's ``request.block_hashes[i]`` (at the block size,
  ``resolve_block_hashes``), converted as vLLM converts its own (``maybe_convert_block_hash``:
  the low 64 bits as an int by default), parent ``block_hashes[i-1]``, the block's token ids,
  LoRA, extra keys (``generate_block_hash_extra_keys`` -> ``to_event_extra_keys``) and the KV cache
  group. They are built on the scheduler (:func:`block_metas`, only with events on) and kept by
  the store, in each block file too (a restart announces what the scan found).
* Cost (``python -m kvstore.bench.route.events_cost on|off``, tiny model, 8 requests x 640 prompt + 64
  output tokens, DRAM + NVMe write-through so both tiers announce every block, 195 steps, busy
  2-core VM, 2026-11-24): naming the stored blocks in ``build_connector_meta`` +12 to +19 us a step,
  ``take_events`` 1 us (the scheduler's thread: 0.2 % of the mean 9.5-9.9 ms step); draining the
  journals and making vLLM's events in the worker's hook 40-47 us a step; all of it 0.6-0.7 %.
* ``AllBlocksCleared`` carries no medium in vLLM 0.32 (a router would drop the engine's GPU blocks
  too), so a tier that empties is announced as ``BlockRemoved`` of each of its blocks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent, KVConnectorKVEvents
from vllm.v1.core.kv_cache_utils import (generate_block_hash_extra_keys, maybe_convert_block_hash,
                                         resolve_block_hashes, to_event_extra_keys)

from kvstore.store.events import STORED, BlockMeta

if TYPE_CHECKING:
    from kvstore.config import EventsConfig
    from vllm.v1.request import Request


OWNERSHIP = "kvstore"  # BlockStored/BlockRemoved.ownership: "secondary offloading tier identifier"


class KVStoreEvents(KVConnectorKVEvents):
    """One worker's events of a step (rank 0's only: nothing to aggregate across ranks)."""

    def __init__(self, events: list[KVCacheEvent] | None = None, workers: int = 1):
        self._events = list(events or [])
        self._workers = workers

    def add_events(self, events: list[KVCacheEvent]) -> None:
        self._events.extend(events)

    def aggregate(self) -> "KVStoreEvents":
        return self

    def increment_workers(self, count: int = 1) -> None:
        self._workers += count

    def get_all_events(self) -> list[KVCacheEvent]:
        return self._events

    def get_number_of_workers(self) -> int:
        return self._workers

    def clear_events(self) -> None:
        self._events = []


def block_metas(request: "Request", positions: list[int], groups: list[int], block_size: int,
                hash_block_size: int | None) -> list[BlockMeta | None]:
    """vLLM's names of ``request``'s blocks at ``positions`` (None where vLLM has no hash yet)."""
    hashes = resolve_block_hashes(request.block_hashes, hash_block_size or block_size, block_size)
    toks = request.all_token_ids
    lora = request.lora_request
    lid, lname = (lora.adapter_id, lora.name) if lora is not None else (None, None)
    out: list[BlockMeta | None] = []
    for j, i in enumerate(positions):
        if i >= len(hashes):
            out.append(None)
            continue
        lo, hi = i * block_size, (i + 1) * block_size
        extra, _ = generate_block_hash_extra_keys(request, lo, hi, 0)
        ev = to_event_extra_keys([extra]) if extra else None
        out.append(BlockMeta(bytes(hashes[i]), bytes(hashes[i - 1]) if i > 0 else None, tuple(toks[lo:hi]),
                             groups[j] if groups else 0, lid, lname, ev[0] if ev else None))
    return out


def _chains(run: list[BlockMeta]) -> list[list[BlockMeta]]:
    """A run of stored blocks as prefix chains, parents first (a tier commits a batch last block
    first; a router resolves a block through its parent)."""
    by_parent: dict = {}
    hashes = {m.block_hash for m in run}
    for m in run:
        by_parent.setdefault(m.parent, []).append(m)
    out = []
    for head in (m for m in run if m.parent not in hashes):
        chain, m = [head], head
        while True:
            nxt = [c for c in by_parent.get(m.block_hash, ()) if c.group == head.group]
            if not nxt:
                break
            m = nxt[0]
            chain.append(m)
        out.append(chain)
    seen = {id(m) for c in out for m in c}
    out.extend([m] for m in run if id(m) not in seen)  # (a cycle cannot happen; nothing is dropped)
    return out


def vllm_events(records: list[tuple[bool, str, BlockMeta]], config: "EventsConfig", block_size: int
                ) -> list[KVCacheEvent]:
    """vLLM's events of the store's records (:meth:`kvstore.store.events.TierEvents.take`): like
    vLLM's own, a chain of blocks stored together is one ``BlockStored``."""
    out: list[KVCacheEvent] = []
    run: list[BlockMeta] = []
    run_tier = None

    def flush() -> None:
        cfg = getattr(config, run_tier, None) if run_tier else None
        if run and cfg is not None and cfg.medium is not None:
            for chain in _chains(run):
                first = chain[0]
                extra = [m.extra_keys for m in chain]
                out.append(BlockStored(
                    block_hashes=[maybe_convert_block_hash(m.block_hash) for m in chain],
                    parent_block_hash=maybe_convert_block_hash(first.parent) if first.parent else None,
                    token_ids=[t for m in chain for t in m.token_ids], block_size=block_size,
                    lora_id=first.lora_id, medium=cfg.medium, lora_name=first.lora_name,
                    extra_keys=extra if any(x is not None for x in extra) else None, group_idx=first.group,
                    locality=cfg.locality, ownership=OWNERSHIP))
        run.clear()

    for stored, tier, m in records:
        if not stored or tier != run_tier:
            flush()
            run_tier = tier
        if stored:
            run.append(m)
            continue
        cfg = getattr(config, tier, None)
        if cfg is not None and cfg.medium is not None:
            out.append(BlockRemoved(block_hashes=[maybe_convert_block_hash(m.block_hash)], medium=cfg.medium,
                                    group_idx=m.group, locality=cfg.locality, ownership=OWNERSHIP))
    flush()
    return out


def events_enabled(vllm_config: Any) -> bool:
    """vLLM publishes KV events (``--kv-events-config`` with ``enable_kv_cache_events``)."""
    ev = getattr(vllm_config, "kv_events_config", None)
    return bool(ev is not None and getattr(ev, "enable_kv_cache_events", False))


__all__ = ["KVStoreEvents", "block_metas", "vllm_events", "events_enabled", "STORED"]
