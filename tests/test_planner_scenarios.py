"""The scheduler-side planner, scenario by scenario, without vLLM (issue 16 item 5): driven as the
connector drives it (track + lookup, allocated, build_step per engine step, finished) over a real
KVStore behind the real LocalClient. A spy records the planner's calls (and raises from one where a
test injects a store failure); ``World.worker`` stands in for the mover: it stores what a plan says
and ends the loads it pinned. Blocks of 16 tokens (conftest's FP): 83 tokens = 5 full blocks + 3.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.keys import chain_keys
from kvstore.offload import hints
from kvstore.offload.client import LocalClient
from kvstore.offload.metrics import OffloadMetrics
from kvstore.offload.planner import LoadPlan, Planner
from kvstore.offload.shared import SharedStore

from conftest import FP, blocks_for, check_store

BS = FP.block_size


def toks(n: int, seed: int = 0) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(1, 50_000, n)]


def keys_of(t) -> list[bytes]:
    return chain_keys(FP, t, BS)


class Spy:
    """The real client, with every call recorded; an op named in ``fail`` raises instead."""

    def __init__(self, inner: LocalClient):
        self.inner, self.calls, self.fail = inner, [], set()

    def __getattr__(self, op):
        fn = getattr(self.inner, op)

        def call(*a, **kw):
            self.calls.append((op, a, kw))
            if op in self.fail:
                raise ConnectionError(f"kvstore rpc: {op}: store unreachable")
            return fn(*a, **kw)
        return call

    def of(self, op) -> list[tuple]:
        return [(a, kw) for name, a, kw in self.calls if name == op]

    def outcomes(self) -> list:
        return [a[0] for a, _ in self.of("record_request")]


class World:
    def __init__(self, store, **planner_kw):
        self.store = store
        self.shared = SharedStore(store, OffloadMetrics(store.metrics.registry))
        self.client = Spy(LocalClient(self.shared))
        self.p = Planner(self.client, FP, BS, **planner_kw)

    def request(self, rid, t, computed=0, params=None):
        """vLLM's get_num_new_matched_tokens: track the request (hints parsed), look it up."""
        new = rid not in self.p.reqs
        st = self.p.track(rid, t, len(t))
        if new:  # as the connector does: hints are read once, when the request is first seen
            st.ttl, st.store = hints.parse(params, rid)
        return st, self.p.lookup(st, computed)

    def step(self, new=(), cached=(), sched=None):
        """One engine step; returns the plan and its loads and stores as (req, first block, engine ids)."""
        plan = self.p.build_step(list(new), list(cached), sched or {})
        return (plan, [(lp.req_id, lp.first, lp.block_ids) for lp in plan.loads],
                [(sp.req_id, sp.start, sp.block_ids) for sp in plan.stores])

    def worker(self, plan):
        """The mover's part: store the planned blocks, then end the loads pinned for the step."""
        for sp in plan.stores:
            self.store.put(sp.keys, blocks_for(sp.keys), ttl_s=sp.ttl)
        for lp in plan.loads + plan.async_loads:
            self.client.inner.end_load(lp.handle_id)

    def metric(self, name, **labels):  # a counter of the engine metrics (OffloadMetrics)
        return self.store.metrics.registry.get_sample_value(name, labels) or 0


@pytest.fixture
def world(make_store):
    def make(store_kw=None, **planner_kw):
        return World(make_store(**{"dram_blocks": 16, **(store_kw or {})}), **planner_kw)
    return make


def test_cold_prompt_stores_each_full_block_once_and_decode_completes_the_next(world):
    """83-token prompt, nothing stored: lookup 0, prefill stores [0..4], decode stores block 5 when it fills."""
    w, t = world(), toks(83)
    st, hit = w.request("a", t)
    assert hit == 0 and st.miss_reason == "never_stored"
    w.p.allocated(st, 0)
    ids = [7, 3, 9, 4, 8, 6]  # the engine's block table, in its own order
    plan, loads, stores = w.step(new=[("a", ids, 0)], sched={"a": 83})
    assert (loads, stores) == ([], [("a", 0, [7, 3, 9, 4, 8])])
    assert plan.stores[0].keys == keys_of(t)[:5] and plan.stores[0].prior_ids == []
    w.worker(plan)
    for computed in range(83, 98):  # each step computes the token sampled by the one before
        t.append(computed % 97 + 1)
        _, loads, stores = w.step(cached=[("a", [12] if computed == 96 else None, computed, False)], sched={"a": 1})
        assert stores == ([("a", 5, [6])] if computed == 95 else []), computed  # tokens 80..95: block 5
    assert w.p.reqs["a"].keys[:6] == keys_of(t)[:6] and w.p.rollbacks == 0
    assert w.store.contains_prefix(keys_of(t)[:5], record=False).num_blocks == 5  # the planner's keys are the store's


@pytest.mark.parametrize("n, hit_blocks, stored_again", [
    (83, 5, []),  # 5 full blocks + 3: all 5 hit, the 3 tokens computed
    (80, 4, [("b", 4, [54])]),  # exactly 5 blocks: block 4 holds the last token, never offered; recomputed, stored
])
def test_the_same_prompt_again_loads_all_but_the_last_token(world, n, hit_blocks, stored_again):
    """A replay of a stored prompt: hit up to the last token, pinned, one LoadPlan, no store of loaded blocks."""
    w, t = world(), toks(n, 1)
    st, _ = w.request("a", t)
    w.p.allocated(st, 0)
    w.worker(w.step(new=[("a", [1, 2, 3, 4, 5, 6], 0)], sched={"a": n})[0])
    w.p.finished("a")
    st, hit = w.request("b", list(t))
    assert hit == hit_blocks * BS and st.replay
    w.p.allocated(st, hit)
    [(args, kw)] = w.client.of("begin_load")
    assert args[0] == keys_of(t)[:hit_blocks] and kw == {"session": "b", "ttl_s": None}
    assert all(w.store.dram.index.entries[k].pins == 1 for k in keys_of(t)[:hit_blocks])  # pinned until loaded
    ids = [50, 51, 52, 53, 54, 55]
    plan, loads, stores = w.step(new=[("b", ids, hit)], sched={"b": n - hit})
    hid = plan.loads[0].handle_id
    assert hid in w.shared.handles  # the pinned LoadHandle the worker will take
    assert plan.loads == [LoadPlan("b", ids[:hit_blocks], hid, hit, 0, ("dram",) * hit_blocks, "replay")]
    assert stores == stored_again
    assert w.client.outcomes()[-1].unsupplied == {"partial_block": n - hit}
    w.worker(plan)
    check_store(w.store)  # the load ended: no pin left


@pytest.mark.parametrize("async_loads", [False, True])
def test_blocks_the_engine_holds_are_never_read(world, async_loads):
    """Engine holds 2 blocks: held=2 is passed to contains_prefix, only blocks 2..4 are pinned and loaded."""
    w, t = world(async_loads=async_loads), toks(83, 2)
    w.store.put(keys_of(t)[:5], blocks_for(keys_of(t)[:5]))
    st, hit = w.request("a", t, computed=2 * BS)
    assert hit == 3 * BS
    assert w.client.of("contains_prefix")[-1][1]["held"] == 2
    w.p.allocated(st, hit)
    assert w.client.of("begin_load")[0][0][0] == keys_of(t)[2:5]
    ids = [20, 21, 22, 23, 24, 25]
    _, loads, stores = w.step(new=[("a", ids, 5 * BS)], sched={"a": 3})
    assert (loads, stores) == ([("a", 2, [22, 23, 24])], [])
    o = w.client.outcomes()[-1]
    assert (o.local, o.promised, o.held, o.unsupplied) == (32, 48, {"dram": 32}, {"partial_block": 3})
    assert w.metric("kvstore_engine_held_tokens_total", tier="dram") == 32
    assert w.metric("kvstore_engine_local_hit_tokens_total") == 32


def test_a_prefix_diverging_at_block_3_hits_3_blocks_and_accounts_every_token(world):
    """Stored A; B shares 3 blocks: hit 48, miss 'diverged', blocks 3..4 stored after the load."""
    w, a = world(), toks(83, 3)
    w.store.put(keys_of(a)[:5], blocks_for(keys_of(a)[:5]))
    b = a[:3 * BS] + toks(35, 4)
    st, hit = w.request("b", b)
    assert (hit, st.found, st.miss_reason) == (48, 3, "diverged")
    w.p.allocated(st, hit)
    o = w.client.outcomes()[-1]
    assert (o.prompt, o.local, o.promised, o.got) == (83, 0, 48, 48)
    assert o.unsupplied == {"diverged": 32, "partial_block": 3}
    assert o.local + o.promised + sum(o.unsupplied.values()) == o.prompt  # every prompt token, once
    assert w.metric("kvstore_engine_unsupplied_tokens_total", reason="diverged") == 32
    ids = [40, 41, 42, 43, 44, 45]
    plan, loads, stores = w.step(new=[("b", ids, hit)], sched={"b": 35})
    assert (loads, stores) == ([("b", 0, [40, 41, 42])], [("b", 3, [43, 44])])
    assert plan.stores[0].prior_ids == [40, 41, 42] and plan.stores[0].keys == keys_of(b)[3:5]
    assert plan.loads[0].kind == "genuine"


def test_a_hit_the_engine_does_not_take_is_not_loaded_and_stored_again(world):
    """Lookup offers 5 blocks, vLLM allocates none of them: nothing pinned, 80 tokens 'not_loaded'."""
    w, t = world(), toks(83, 18)
    w.store.put(keys_of(t)[:5], blocks_for(keys_of(t)[:5]))
    st, hit = w.request("a", t)
    w.p.allocated(st, 0)
    assert hit == 80 and w.client.of("begin_load") == []
    assert w.client.outcomes()[-1].unsupplied == {"not_loaded": 80, "partial_block": 3}
    assert w.step(new=[("a", [1, 2, 3, 4, 5, 6], 0)], sched={"a": 83})[1:] == ([], [("a", 0, [1, 2, 3, 4, 5])])


def test_async_load_of_an_nvme_hit_is_planned_in_the_next_step_while_the_request_waits(world):
    """Hit on DRAM+NVMe with async_loads: load_async, the LoadPlan rides StepPlan.async_loads once."""
    w, t = world({"dram_blocks": 2}, async_loads=True), toks(83, 5)
    w.store.put(keys_of(t)[:4], blocks_for(keys_of(t)[:4]))  # a big put keeps its head in DRAM
    st, hit = w.request("a", t)
    assert hit == 64 and st.load_async and st.origin == ("dram", "dram", "nvme", "nvme")
    ids = [20, 21, 22, 23, 24, 25]
    w.p.allocated(st, hit, ids)  # vLLM: WAITING_FOR_REMOTE_KVS, the whole block table given
    sb, _ = w.request("b", toks(40, 6))
    w.p.allocated(sb, 0)
    plan, loads, stores = w.step(new=[("b", [30, 31, 32], 0)], sched={"b": 40})  # "a" is not scheduled
    hid = plan.async_loads[0].handle_id
    assert plan.async_loads == [LoadPlan("a", [20, 21, 22, 23], hid, 64, 0, st.origin, "genuine")]
    assert (loads, stores) == ([], [("b", 0, [30, 31])]) and plan.stores[0].prior_ids == []
    w.worker(plan)
    w.p.allocated(st, 0)  # vLLM allocates again once the load is done, without a lookup: nothing to pin
    assert len(w.client.of("begin_load")) == 1 and len(w.client.outcomes()) == 2
    plan, loads, stores = w.step(new=[("a", ids, 64)], sched={"a": 19})
    assert (plan.async_loads, loads, stores) == ([], [], [("a", 4, [24])])


def test_a_dram_only_hit_stays_synchronous_with_async_loads(world):
    """async_loads on, every block in DRAM: no load_async, the load is in plan.loads of its own step."""
    w, t = world(async_loads=True), toks(83, 7)
    w.store.put(keys_of(t)[:4], blocks_for(keys_of(t)[:4]))
    st, hit = w.request("a", t)
    assert hit == 64 and not st.load_async
    w.p.allocated(st, hit, [9, 8, 7, 6, 5, 4])  # (the connector gives none then; the planner decides)
    plan, loads, stores = w.step(new=[("a", [9, 8, 7, 6, 5, 4], 64)], sched={"a": 19})
    assert plan.async_loads == [] and loads == [("a", 0, [9, 8, 7, 6])] and stores == [("a", 4, [5])]


def test_failed_load_and_preemption_roll_the_saved_mark_back(world):
    """Table: load 4 + compute 1; block 0 fails (recompute all); decode; preempted, resumed on a 3-block local hit."""
    w, t = world(), toks(83, 8)
    w.store.put(keys_of(t)[:4], blocks_for(keys_of(t)[:4]))
    st, hit = w.request("a", t)
    w.p.allocated(st, hit)
    ids = [30, 31, 32, 33, 34, 35]
    rows = [  # (new, cached, scheduled, expected loads, expected stores, rollbacks so far)
        ([("a", ids, 64)], [], 19, [("a", 0, ids[:4])], [("a", 4, ids[4:5])], 0),
        ([], [("a", None, 0, False)], 83, [], [("a", 0, ids[:5])], 1),  # vLLM rewinds to the bad block 0
        ([], [("a", None, 83, False)], 1, [], [], 1),
    ]
    for new, cached, n, want_loads, want_stores, rollbacks in rows:
        plan, loads, stores = w.step(new, cached, {"a": n})
        assert (loads, stores, w.p.rollbacks) == (want_loads, want_stores, rollbacks)
        assert [sp.keys for sp in plan.stores] == [keys_of(t)[s:s + len(b)] for _, s, b in stores]
        w.worker(plan)
        t.append(1)
    # preempted; back in the queue its blocks 0..2 are still in the engine's cache, 3..4 in kvstore
    st, hit = w.request("a", t, computed=3 * BS)
    assert hit == 2 * BS
    w.p.allocated(st, hit)
    new_ids = [60, 61, 62, 63, 64, 65]
    plan, loads, stores = w.step(cached=[("a", new_ids, 5 * BS, True)], sched={"a": len(t) - 5 * BS})
    assert (loads, stores, w.p.rollbacks) == ([("a", 3, [63, 64])], [], 1)  # at the saved mark: nothing again
    w.worker(plan)
    check_store(w.store)


def test_a_closed_store_is_a_miss_and_the_request_still_runs(world):
    """The real store closed under the planner: lookup 0, the error counted, the prompt accounted as store_error."""
    w, t = world(), toks(83, 9)
    w.store.close()
    st, hit = w.request("a", t)
    assert (hit, st.failed, w.p.errors) == (0, True, 1)
    w.p.allocated(st, 0)
    o = w.client.outcomes()[-1]
    assert (o.unsupplied, o.errors) == ({"store_error": 83}, 1)
    assert w.metric("kvstore_engine_store_errors_total", op="scheduler") == 1
    _, loads, stores = w.step(new=[("a", [1, 2, 3, 4, 5, 6], 0)], sched={"a": 83})
    assert (loads, stores) == ([], [("a", 0, [1, 2, 3, 4, 5])])  # planned all the same: the worker reports its failure


def test_a_failed_report_is_carried_by_the_next_one(world):
    """Lookup and report both fail: no exception, and the next request's outcome carries both errors."""
    w = world()
    w.client.fail = {"contains_prefix", "record_request"}
    st, _ = w.request("a", toks(40, 10))
    w.p.allocated(st, 0)
    assert w.p.errors == 2 and w.metric("kvstore_engine_requests_total") == 0
    w.client.fail = set()
    st, _ = w.request("b", toks(40, 11))
    w.p.allocated(st, 0)
    assert w.client.outcomes()[-1].errors == 2 and w.metric("kvstore_engine_store_errors_total", op="scheduler") == 2


@pytest.mark.parametrize("broken", [False, True])
def test_an_aborted_request_drops_its_pin(world, broken):
    """Pinned, then finished before it was scheduled: end_load releases the pin; if that call fails, it is counted."""
    w, t = world(), toks(83, 12)
    w.store.put(keys_of(t)[:5], blocks_for(keys_of(t)[:5]))
    st, hit = w.request("a", t)
    w.p.allocated(st, hit)
    w.client.fail = {"end_load"} if broken else set()
    assert w.p.finished("a") is False
    assert len(w.client.of("end_load")) == 1 and w.p.errors == int(broken)
    assert len(w.shared.handles) == int(broken)  # a lost end_load: the handle ages out (HANDLE_MAX_AGE_S)
    if not broken:
        check_store(w.store)


@pytest.mark.parametrize("n, broken, keep_blocks, asked", [(40, False, False, 1), (40, True, True, 1),
                                                          (10, True, False, 0)])  # 10 tokens: no store, no ask
def test_async_saves_keep_blocks_only_when_the_stores_are_not_known_done(world, n, broken, keep_blocks, asked):
    """async_saves: saves_done answers (no jobs: done) frees at once; a failed saves_done keeps the blocks."""
    w, t = world(async_saves=True), toks(n, 13)
    st, _ = w.request("a", t)
    w.p.allocated(st, 0)
    w.step(new=[("a", [1, 2, 3], 0)], sched={"a": n})
    w.client.fail = {"saves_done"} if broken else set()
    assert w.p.finished("a") is keep_blocks and w.p.errors == int(broken and asked)
    assert len(w.client.of("saves_done")) == asked


def test_ttl_hint_rides_store_plans_and_pins(world, clock):
    """kvstore.ttl_s=600: StorePlans carry ttl 600, begin_load gets ttl_s=600, the hit blocks outlive the config TTL."""
    w, t = world({"dram_ttl": 60, "nvme_ttl": 60}), toks(83, 14)
    plain = keys_of(toks(32, 15))
    w.store.put(keys_of(t)[:3], blocks_for(keys_of(t)[:3]))
    w.store.put(plain, blocks_for(plain))
    st, hit = w.request("a", t, params={"kvstore": {"ttl_s": 600}})
    assert (st.ttl, st.store, hit) == (600.0, True, 48)
    w.p.allocated(st, hit)
    assert w.client.of("begin_load")[0][1]["ttl_s"] == 600
    plan, loads, stores = w.step(new=[("a", [1, 2, 3, 4, 5, 6], hit)], sched={"a": 35})
    assert stores == [("a", 3, [4, 5])] and [sp.ttl for sp in plan.stores] == [600]
    w.worker(plan)
    clock.advance(120)  # past the config's 60 s, not the hint's 600 s
    assert w.store.contains_prefix(keys_of(t)[:5], record=False).num_blocks == 5
    assert w.store.contains_prefix(plain, record=False).num_blocks == 0


def test_store_false_hint_never_stores_but_may_hit(world):
    """kvstore.store=false: the hit loads, no StorePlan through prefill or decode."""
    w, t = world(), toks(83, 16)
    w.store.put(keys_of(t)[:2], blocks_for(keys_of(t)[:2]))
    st, hit = w.request("a", t, params={"kvstore": {"store": False}})
    assert hit == 32 and st.store is False
    w.p.allocated(st, hit)
    ids = [1, 2, 3, 4, 5, 6, 7]
    _, loads, stores = w.step(new=[("a", ids, hit)], sched={"a": 51})
    assert (loads, stores) == ([("a", 0, [1, 2])], [])
    for computed in range(83, 100):
        t.append(5)
        assert w.step(cached=[("a", None, computed, False)], sched={"a": 1})[2] == []
    assert w.store.contains_prefix(keys_of(t), record=False).num_blocks == 2


def test_step_token_accounting_splits_prefill_from_decode(world):
    """StepPlan.tokens counts every scheduled token, prefill_tokens only those of prompts."""
    w = world()
    for rid, n in (("d", 20), ("p", 83)):
        st, _ = w.request(rid, toks(n, 17))
        w.p.allocated(st, 0)
    rows = [  # (new, cached, scheduled, tokens, prefill_tokens)
        ([("d", [1, 2], 0)], [], {"d": 20}, 20, 20),
        ([("p", [3, 4, 5, 6, 7, 8], 0)], [("d", None, 20, False)], {"p": 32, "d": 1}, 33, 32),  # chunk + decode
        ([], [("p", None, 32, False), ("d", None, 21, False)], {"p": 51, "d": 1}, 52, 51),
        ([], [("d", [9, 10], 0, True), ("p", None, 83, False)], {"d": 22, "p": 1}, 23, 20),  # d resumed: recompute
    ]
    for new, cached, sched, tokens, prefill in rows:
        plan = w.step(new, cached, sched)[0]
        assert (plan.tokens, plan.prefill_tokens) == (tokens, prefill)


@pytest.mark.parametrize("rid", ["r" * 5_000_000, "cmpl-1\nINFO admin token accepted", "\x1b[2J"])
def test_a_request_id_a_session_name_could_not_be_is_named_by_its_digest(world, rid):
    """An OpenAI client chooses the request id; a request without a session is its own, and its
    id went raw into the trace and ``kvstore explain`` (a 5 MB id: 5 MB a trace line)."""
    w = world()
    st, _ = w.request(rid, toks(83))
    assert st.session.startswith("req-") and len(st.session) == 20 and st.session.isprintable()
    assert w.request(rid + "x", toks(83))[0].session != st.session
    assert w.request("cmpl-42", toks(83, 1))[0].session == "cmpl-42"  # a plain id stays itself
