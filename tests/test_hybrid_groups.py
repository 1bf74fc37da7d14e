"""Hybrid models without vLLM (issue 31): several KV cache groups, scenario by scenario, as the
connector drives the planner and the mover (vLLM's tables per group, nulls where a group needs
nothing), over a real store, the real copy extension and torch "engine" caches.

Blocks of 4 tokens; a sliding window of 8 tokens needs the 2 blocks before a hit's end
(``first_needed(k) = (4k - 7) // 4``); a state group needs the one block ``k - 1``.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from kvstore import kvcopy
from kvstore.config import from_dict
from kvstore.keys import ModelFingerprint, chain_keys
from kvstore.offload import LocalClient, StepRunner, acquire_shared, release_shared
from kvstore.offload.groups import MAX_PROBES, Group, KVGroups
from kvstore.offload.jobs import CopyJobs
from kvstore.offload.planner import Planner
from kvstore.offload.ranks import RankedClient
from kvstore.store import PrefixMatch

BS, H, D, NB = 4, 2, 8, 64
SW_FA = KVGroups([Group(0, "sliding_window", BS, 8, 2), Group(1, "full_attention", BS, 0, 2)])
STATE_FA = KVGroups([Group(0, "mamba", BS, 0, 2), Group(1, "full_attention", BS, 0, 2)])
PAGE = 2 * BS * H * D * 2  # an attention layer's page (float16 K and V): the state page is padded to it


def toks(n: int, seed: int = 0) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(1, 1000, n)]


class FakeClient:
    """The scheduler's store calls over a set of keys (the lookup rules alone)."""

    def __init__(self, stored=()):
        self.stored, self.calls = set(stored), 0

    def contains_prefix(self, keys, record=False, num_tokens=None, held=0):
        self.calls += 1
        n = next((i for i, k in enumerate(keys) if k not in self.stored), len(keys))
        return PrefixMatch(n, ("dram",) * n, None if n == len(keys) else "never_stored")

    def begin_load(self, keys, session=None, ttl_s=None):
        n = next((i for i, k in enumerate(keys) if k not in self.stored), len(keys))
        return 1, n, ("dram",) * n

    def end_load(self, hid):
        pass

    def record_request(self, o):
        pass

    def close(self):
        pass


def fp_of(groups: KVGroups, rank: int = 0, size: int = 1) -> ModelFingerprint:
    return ModelFingerprint(model="hybrid-test", dtype="float16", layout="x.vllm_cpu", packing="vllm_cpu",
                            block_size=BS, num_layers=4, num_kv_heads=H, head_size=D, tp_rank=rank, tp_size=size,
                            extra=(("groups", groups.describe()),))


def keys_for(planner: Planner, tokens, g: int, n: int) -> list[bytes]:
    st = planner.track("__keys__", tokens, len(tokens))
    out = planner.group_keys(st, g, n)
    planner.reqs.pop("__keys__")
    return out


# -- the rules -------------------------------------------------------------------------------------
def test_group_keys_carry_the_group_and_one_group_keeps_the_plain_chain():
    t = toks(40)
    plain = KVGroups([Group(0, "full_attention", BS)])
    p1 = Planner(FakeClient(), fp_of(plain), BS, groups=plain)
    assert p1.groups is None  # one full-attention group: today's planner, today's keys
    p2 = Planner(FakeClient(), fp_of(SW_FA), BS, groups=SW_FA)
    base = chain_keys(fp_of(SW_FA), t, BS)
    k0, k1 = keys_for(p2, t, 0, 10), keys_for(p2, t, 1, 10)
    assert len(set(k0) | set(k1) | set(base)) == 30  # one block per group per prefix, none shared
    other = KVGroups([Group(0, "sliding_window", BS, 16, 2), Group(1, "full_attention", BS, 0, 2)])
    assert keys_for(Planner(FakeClient(), fp_of(SW_FA), BS, groups=other), t, 0, 10) != k0  # the window counts


def test_a_hit_is_offered_only_where_every_group_can_supply_it():
    t = toks(42)  # 10 full blocks, 10 offerable ((42 - 1) // 4)
    c = FakeClient()
    p = Planner(c, fp_of(SW_FA), BS, groups=SW_FA)
    fa, sw = keys_for(p, t, 1, 10), keys_for(p, t, 0, 10)
    c.stored = set(fa) | set(sw[7:10])  # the window before block 10, and one more
    st = p.track("a", t, len(t))
    assert p.lookup(st, 0) == 40 and st.load_async  # hybrid hits always load asynchronously
    c.stored.discard(sw[8])  # the window before 10 is broken: the next boundary whose window is stored
    st = p.track("b", t, len(t))
    assert p.lookup(st, 0) == 0  # 10 needs 8, 9 needs [7, 9): 8 missing again; 8 needs [6, 8): 6 missing
    c.stored |= set(sw[5:7])
    st = p.track("c", t, len(t))
    assert p.lookup(st, 0) == 32  # [6, 8) stored
    c.stored -= set(fa[4:])  # the full-attention prefix ends at 4: [2, 4) of the window is not stored
    st = p.track("d", t, len(t))
    assert p.lookup(st, 0) == 0 and st.junction == 4  # a stored prefix ended there: its window will be stored
    st = p.track("e", t, len(t))
    assert p.lookup(st, 20) == 0  # the engine holds 5 blocks itself: nothing beyond


def test_a_state_group_needs_the_state_at_the_hits_end():
    t = toks(42)
    c = FakeClient()
    p = Planner(c, fp_of(STATE_FA), BS, groups=STATE_FA)
    fa, state = keys_for(p, t, 1, 10), keys_for(p, t, 0, 10)
    c.stored = set(fa) | {state[5]}  # the state after block 5 only (a boundary vLLM handed off)
    st = p.track("a", t, len(t))
    assert p.lookup(st, 0) == 24
    c.stored.add(state[9])
    st = p.track("b", t, len(t))
    assert p.lookup(st, 0) == 40
    c.stored = set(fa) | {state[0]}  # too far back: not found within the probes a lookup may make
    st, before = p.track("c", t, len(t)), c.calls
    assert p.lookup(st, 0) == 0 and c.calls - before == 1 + MAX_PROBES  # the full groups' call, then the probes


def test_each_group_stores_what_a_hit_needs_sliding_window_only_its_window():
    p = Planner(FakeClient(), fp_of(SW_FA), BS, groups=SW_FA)
    t = toks(42)
    st = p.track("a", t, len(t))
    p.lookup(st, 0)
    p.allocated(st, 0)
    sw_ids, fa_ids = list(range(1, 12)), list(range(21, 32))
    plan = p.build_step([("a", (sw_ids, fa_ids), 0)], [], {"a": 42})
    (sp,) = plan.stores
    by_group = {g: [b for b, x in zip(sp.block_ids, sp.groups) if x == g] for g in (0, 1)}
    assert by_group[1] == fa_ids[:10]  # every full block
    assert by_group[0] == sw_ids[8:10]  # the window before the last offerable boundary (10)
    assert sorted(plan.fresh) == sorted(sw_ids + fa_ids)  # given out in this step: fenced at the worker
    t += [5, 6]  # decode: block 10 becomes full; a later turn's hit may end there
    plan = p.build_step([], [("a", ([12], [32]), 42, False)], {"a": 2})
    (sp,) = plan.stores
    assert list(zip(sp.groups, sp.block_ids)) == [(0, 11), (1, 31)]
    assert plan.fresh == [12, 32]


def test_mamba_states_are_stored_from_vllms_hand_offs():
    p = Planner(FakeClient(), fp_of(STATE_FA), BS, groups=STATE_FA)
    t = toks(42)
    st = p.track("a", t, len(t))
    p.lookup(st, 0)
    p.allocated(st, 0)
    plan = p.build_step([("a", ([7], list(range(21, 32))), 0)], [], {"a": 40},
                        states={"a": [(0, 7, 40), (0, 8, 30), (1, 9, 40), (0, 0, 40)], "zz": [(0, 3, 8)]})
    state = [sp for sp in plan.stores if sp.groups == [0]]
    assert len(state) == 1 and state[0].block_ids == [7]  # not a block boundary, not a state group, null: skipped
    assert state[0].keys == [keys_for(p, t, 0, 10)[9]]
    fa = [sp for sp in plan.stores if sp.groups and sp.groups[0] == 1]
    assert fa and fa[0].block_ids == list(range(21, 31))  # the state group is never stored from its table


# -- through the store and the copy extension ------------------------------------------------------
class Rig:
    """A store, a planner and a mover over torch caches: per group a list of per-layer tensors
    (attention: vLLM's CPU layout; state: a raw int8 page with padding, as vLLM registers it)."""

    def __init__(self, tmp_path, groups: KVGroups, *, layers=(2, 2), rank=0, size=1, client=None, shared=None,
                 async_io=False, dram_gb=0.01):
        self.groups = groups
        self.fp = fp_of(groups, rank, size)
        self.caches, layouts = [], []
        for g, n in zip(groups.groups, layers):
            if g.role == "state":
                raw = torch.zeros(n, NB, PAGE, dtype=torch.int8)
                ts = [raw[i].as_strided((NB, 1, 1, PAGE - 40), (PAGE, PAGE - 40, PAGE - 40, 1)) for i in range(n)]
                layouts.append(kvcopy.KVLayout.from_tensor("mla", ts))
            else:
                ts = [torch.zeros(NB, H, BS, 2 * D, dtype=torch.float16) for _ in range(n)]
                layouts.append(kvcopy.KVLayout.from_vllm(ts))
            self.caches.append(ts)
        block_bytes = max(lay.block_bytes for lay in layouts)
        cfg = from_dict({"tiers": {"dram": {"capacity_gb": dram_gb, "ttl_s": None},
                                   "nvme": {"path": str(tmp_path / f"s{rank}"), "capacity_gb": 0.02}}})
        self.shared = shared or acquire_shared(f"hybrid-test/tp{rank}", cfg, self.fp, block_bytes, BS)
        self.mover = StepRunner(self.shared, async_saves=async_io, async_loads=async_io, rank=rank)
        self.mover.register_groups(list(zip(self.caches, layouts)))
        self.planner = Planner(client or LocalClient(self.shared), self.fp, BS, groups=groups)

    def fill(self, g: int, ids, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for t in self.caches[g]:
            for b in ids:
                t[b] = torch.randint(-100, 100, t[b].shape, generator=gen).to(t.dtype)

    def block(self, g: int, b: int) -> list:
        return [t[b].clone() for t in self.caches[g]]

    def close(self):
        self.mover.close()
        release_shared(self.shared)


@pytest.fixture
def rigs(tmp_path):
    made = []

    def make(*a, **kw):
        r = Rig(tmp_path, *a, **kw)
        made.append(r)
        return r
    yield make
    for r in made:
        r.close()


def run_turn(r: Rig, rid: str, t, tables, states=None):
    """A cold request: lookup, allocate, one step computing the whole prompt, its stores."""
    st = r.planner.track(rid, t, len(t))
    assert r.planner.lookup(st, 0) == 0
    r.planner.allocated(st, 0)
    plan = r.planner.build_step([(rid, tables, 0)], [], {rid: len(t)}, states)
    r.mover.load(plan)
    r.mover.save(plan)
    return plan


def test_hybrid_round_trip_every_group_in_its_own_blocks(rigs):
    """A group with fewer layers than the store slot (vLLM pads groups to equal layer counts) and
    a state page with padding: each group's blocks come back bit for bit into the blocks vLLM gave."""
    r = rigs(STATE_FA, layers=(1, 2))
    t = toks(42, 1)
    r.fill(0, [5], 1)
    r.fill(1, range(21, 32), 2)
    run_turn(r, "a", t, ([5], list(range(21, 32))), states={"a": [(0, 5, 40)]})
    want = [r.block(0, 5)] + [r.block(1, b) for b in range(21, 31)]
    for g in (0, 1):
        for c in r.caches[g]:
            c.zero_()
    st = r.planner.track("b", t, len(t))
    assert r.planner.lookup(st, 0) == 40
    tables = ([0] * 9 + [40], list(range(41, 52)))  # vLLM: the state only at index 9
    r.planner.allocated(st, 40, tables)
    plan = r.planner.build_step([], [], {})
    (lp,) = plan.async_loads
    assert sorted(zip(lp.groups, lp.block_ids)) == [(0, 40)] + [(1, b) for b in range(41, 51)]
    r.mover.load(plan)
    sending, recving, failed = r.mover.get_transfer(set())
    assert recving == {"b"} and not failed
    got = [r.block(0, 40)] + [r.block(1, b) for b in range(41, 51)]
    assert all(torch.equal(x, y) for a, b in zip(want, got) for x, y in zip(a, b))
    assert r.shared.metrics.registry.get_sample_value("kvstore_engine_served_tokens_total", {"tier": "dram"}) == 40


@pytest.mark.parametrize("async_io", [False, True], ids=["inline", "load_thread"])
def test_sleep_and_wake_copy_into_the_memory_the_caches_have_after_the_wake(rigs, async_io):
    """vLLM 0.33's sleep mode (issue 49): ``unregister_kv_caches`` ends the copies in flight and
    drops every table that points into the KV cache; the caches' memory is then re-allocated under
    the same tensors; after ``restore_kv_caches`` a hit lands in the new memory, never the old."""
    r = rigs(SW_FA, async_io=async_io)
    t = toks(42, 2)
    r.fill(0, range(1, 12), 3)
    r.fill(1, range(21, 32), 4)
    run_turn(r, "a", t, (list(range(1, 12)), list(range(21, 32))))  # its saves may still be in flight
    want = [r.block(1, b) for b in range(21, 31)]
    r.mover.unregister()
    assert r.mover.copier is None and r.mover.copiers == []
    assert r.mover.jobs is None or r.mover.jobs.wait_idle(0)  # nothing in flight once it returns
    r.mover.unregister()  # idempotent
    old = [c.view(c.shape) for g in r.caches for c in g]  # the memory the caches had before the sleep
    for g in r.caches:
        for c in g:
            c.set_(torch.zeros_like(c))  # the wake-up's memory: new, under the same tensors
    before = [o.clone() for o in old]
    r.mover.restore()
    r.mover.restore()  # idempotent
    assert len(r.mover.copiers) == 2
    st = r.planner.track("b", t, len(t))
    assert r.planner.lookup(st, 0) == 40
    r.planner.allocated(st, 40, ([0] * 8 + [33, 34, 35], list(range(41, 52))))
    r.mover.load(r.planner.build_step([], [], {}))
    _, recving, failed = r.mover.get_transfer(set())
    if async_io and not recving:
        r.mover.jobs.wait_idle()
        _, recving, failed = r.mover.get_transfer(set())
    assert recving == {"b"} and not failed and not r.mover.take_load_errors()
    assert all(torch.equal(x, y) for a, b in zip(want, [r.block(1, b) for b in range(41, 51)]) for x, y in zip(a, b))
    assert all(torch.equal(o, b) for o, b in zip(old, before))  # the old memory: not one byte written


@pytest.mark.parametrize("fault", ["scatter_error", "file_deleted"])
@pytest.mark.parametrize("async_io", [False, True], ids=["inline", "load_thread"])
def test_a_failed_load_fails_the_request_and_its_hit_is_never_offered_again(rigs, fault, async_io):
    from kvstore import failpoints

    r = rigs(SW_FA, async_io=async_io, dram_gb=0 if fault == "file_deleted" else 0.01)
    t = toks(42, 2)
    r.fill(0, range(1, 12), 3)
    r.fill(1, range(21, 32), 4)
    run_turn(r, "a", t, (list(range(1, 12)), list(range(21, 32))))
    if r.mover.jobs is not None:
        r.mover.jobs.wait_idle()
    r.shared.store.flush()
    st = r.planner.track("b", t, len(t))
    assert r.planner.lookup(st, 0) == 40
    r.planner.allocated(st, 40, ([0] * 8 + [33, 34, 35], list(range(41, 52))))
    plan = r.planner.build_step([], [], {})
    # one block of twelve: a copy error, or a file gone under a pinned entry (read short)
    failpoints.arm("mover.scatter=raise*1" if fault == "scatter_error" else "store.read=unlink*1")
    try:
        r.mover.load(plan)
        if r.mover.jobs is not None:
            r.mover.jobs.wait_idle()
    finally:
        failpoints.clear()
    _, recving, failed = r.mover.get_transfer(set())
    assert failed == {"b"} and recving == {"b"} and not r.mover.take_load_errors()  # per request, never per block
    r.planner.load_failed(failed)  # the connector: update_connector_output(failed_recving)
    assert r.planner.lookup(st, 0) == 0  # vLLM asks again: the same failing hit would loop
    assert r.shared.metrics.registry.get_sample_value("kvstore_engine_unsupplied_tokens_total",
                                                      {"reason": "load_failed"}) == 40
    assert r.shared.metrics.registry.get_sample_value("kvstore_engine_served_tokens_total", {"tier": "dram"}) \
        in (None, 0.0)
    if fault == "file_deleted":  # a short read is a failed request, never a copy of what was not read
        assert not r.shared.metrics.registry.get_sample_value("kvstore_engine_store_errors_total", {"op": "load"})


def test_ranked_client_answers_the_fewest_and_pins_every_rank():
    a, b = FakeClient([b"k%d" % i for i in range(6)]), FakeClient([b"k%d" % i for i in range(3)])
    ends = []
    for c in (a, b):
        c.end_load = lambda hid, c=c: ends.append((c, hid))
    r = RankedClient([a, b])
    keys = [b"k%d" % i for i in range(6)]
    m = r.contains_prefix(keys)
    assert m.num_blocks == 3 and m.miss_reason == "never_stored"
    hid, got, tiers = r.begin_load(keys)
    assert hid == (1, 1) and got == 3 and tiers == ("dram",) * 3
    r.end_load(hid)
    assert ends == [(a, 1), (b, 1)]
    b.begin_load = lambda *a, **k: (_ for _ in ()).throw(ConnectionError("rank 1 unreachable"))
    with pytest.raises(ConnectionError):
        r.begin_load(keys)
    assert ends[-1] == (a, 1)  # rank 0's pin is not left behind


def test_a_load_or_a_step_waits_for_a_gather_still_reading_its_blocks():
    """A sliding-window block freed while its request runs may go to another request in the next
    step: a gather still reading it finishes first."""
    jobs = CopyJobs("fence-test")
    gate, order = threading.Event(), []
    try:
        jobs.submit_store(["a"], lambda: (gate.wait(5), order.append("gathered")), sources=[7, 8])
        assert jobs.wait_sources([1, 2], timeout=0)  # other blocks: no wait
        assert not jobs.wait_sources([8], timeout=0.05)
        t = threading.Thread(target=lambda: (jobs.wait_sources([8]), order.append("written")))
        t.start()
        t.join(0.1)
        assert order == []
        gate.set()
        t.join(5)
        assert order == ["gathered", "written"] and jobs.counts["fenced"] >= 2
    finally:
        gate.set()
        jobs.close()


def test_tensor_parallel_ranks_answer_what_every_rank_holds(rigs):
    """Two simulated ranks, each with its own store (its namespace comes from its fingerprint,
    which carries the rank) and its own slice of the KV: the scheduler offers only what both
    hold, pins on both, and each rank loads its own bytes through its own handle."""
    r0, r1 = rigs(SW_FA, rank=0, size=2), rigs(SW_FA, rank=1, size=2)
    assert r0.fp.digest() != r1.fp.digest() and r0.shared.store.namespace != r1.shared.store.namespace
    ranked = RankedClient([LocalClient(r0.shared), LocalClient(r1.shared)])
    t = toks(42, 3)
    # one full-attention group first: rank 1 holds the first 5 of rank 0's 10 blocks
    plain = Planner(ranked, r0.fp, BS)
    keys = plain.keys_upto(plain.track("x", t, len(t)), 10)
    r0.shared.store.put(keys, np.zeros((10, r0.shared.store.block_bytes), np.uint8))
    r1.shared.store.put(keys[:5], np.zeros((5, r1.shared.store.block_bytes), np.uint8))
    st = plain.track("y", t, len(t))
    assert plain.lookup(st, 0) == 20 and plain.errors == 0  # what both ranks hold, not rank 0's 40
    plain.allocated(st, 20)
    assert st.load is not None and isinstance(st.load[0], tuple) and len(r0.shared.handles) == 1 == len(
        r1.shared.handles)  # pinned on both ranks
    plain.finished("y")  # a request that goes before its load: both pins end
    assert not r0.shared.handles and not r1.shared.handles
    # a hybrid model: each rank stores and loads its own bytes
    p = Planner(ranked, r0.fp, BS, groups=SW_FA)  # the scheduler: rank 0's fingerprint, as the connector gives it
    tables = (list(range(1, 12)), list(range(21, 32)))
    for r, seed in ((r0, 10), (r1, 20)):  # each rank its own slice of the heads: other bytes
        r.fill(0, tables[0], seed)
        r.fill(1, tables[1], seed + 1)
    st = p.track("a", t, len(t))
    assert p.lookup(st, 0) == 0
    p.allocated(st, 0)
    plan = p.build_step([("a", tables, 0)], [], {"a": 42})
    r0.mover.save(plan)
    (sp,) = plan.stores
    full = (sp.block_ids, sp.keys, sp.groups)
    keep = [i for i, g in enumerate(sp.groups) if g == 1]  # rank 1 lost its sliding-window blocks
    sp.block_ids, sp.keys, sp.groups = ([x[i] for i in keep] for x in full)
    r1.mover.save(plan)
    st = p.track("b", t, len(t))
    assert p.lookup(st, 0) == 0 and p.errors == 0  # rank 1 lacks the window: nothing for both
    assert r0.planner.lookup(r0.planner.track("b", t, len(t)), 0) == 40  # (rank 0 alone would offer 40)
    sp.block_ids, sp.keys, sp.groups = full
    r1.mover.save(plan)  # now rank 1 holds it all too
    st = p.track("c", t, len(t))
    assert p.lookup(st, 0) == 40
    p.allocated(st, 40, ([0] * 8 + [33, 34, 35], list(range(41, 52))))
    plan = p.build_step([], [], {})
    (lp,) = plan.async_loads
    assert isinstance(lp.handle_id, tuple) and len(lp.handle_id) == 2
    for r in (r0, r1):
        r.mover.load(plan)  # each worker takes its own rank's handle
        assert r.mover.get_transfer(set())[1:] == ({"c"}, set())
        assert torch.equal(r.caches[1][0][41], r.caches[1][0][21]) and torch.equal(r.caches[0][1][34],
                                                                                    r.caches[0][1][10])
        assert not r.shared.handles  # its pin was taken and ended
    assert not torch.equal(r0.caches[1][0][41], r1.caches[1][0][41])  # each rank got its own bytes


def test_what_kvstore_makes_of_vllms_groups():
    """Every group kind vLLM builds: served with its rule, or the reason the model is not (logged
    once by the connector, which then stores nothing): never an error at start-up."""
    pytest.importorskip("vllm")
    from vllm.v1.kv_cache_interface import (ChunkedLocalAttentionSpec, CrossAttentionSpec, FullAttentionSpec,
                                            KVCacheConfig, KVCacheGroupSpec, MambaSpec, MLAAttentionSpec,
                                            SlidingWindowSpec)

    from kvstore.connectors.vllm.model import kv_groups

    attn = dict(num_kv_heads=2, head_size=32, dtype=torch.float32)

    def groups(*specs):
        cfg = KVCacheConfig(num_blocks=8, kv_cache_tensors=[],
                            kv_cache_groups=[KVCacheGroupSpec([f"l{i}"], s) for i, s in enumerate(specs)])
        return kv_groups(None, cfg)

    g, why = groups(SlidingWindowSpec(32, sliding_window=64, extra_retained_tokens=4, **attn),
                    FullAttentionSpec(32, **attn))
    assert why is None and g.describe() == (("sliding_window", 68, 1), ("full_attention", 0, 1))
    assert [x.first_needed(10) for x in g.groups] == [(320 - 68 + 1) // 32, 0]
    g, why = groups(ChunkedLocalAttentionSpec(32, attention_chunk_size=128, **attn), FullAttentionSpec(32, **attn))
    assert why is None and g.groups[0].first_needed(10) == 8  # token 320 is in the chunk of 256..383
    state = dict(shapes=((3, 512), (2, 128, 128)), dtypes=(torch.bfloat16, torch.bfloat16))
    g, why = groups(MambaSpec(288, mamba_cache_mode="align", **state), FullAttentionSpec(288, **attn))
    assert why is None and [x.role for x in g.groups] == ["state", "full"]
    assert groups(FullAttentionSpec(32, **attn))[0].plain
    for specs, words in [((MambaSpec(288, mamba_cache_mode="none", **state), FullAttentionSpec(288, **attn)),
                          "without prefix caching"),
                         ((MLAAttentionSpec(16, num_kv_heads=1, head_size=576, dtype=torch.float32),), "MLA"),
                         ((CrossAttentionSpec(32, **attn), FullAttentionSpec(32, **attn)), "cross_attention"),
                         ((), "at least one")]:
        g, why = groups(*specs)
        assert g is None and words in why, why
