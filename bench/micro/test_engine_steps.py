"""Per-step costs on the engine's threads, through the real planner, mover and store (issue 30, Measure).

Each benchmark times one connector hook as vLLM calls it, driving the kvstore.offload methods the
connector (connectors/vllm/connector.py) calls, with the same arguments; one call per round, its
state prepared untimed (``benchmark.pedantic`` setup). Prompts of 1k and 8k tokens at 16 tokens
per block (64 and 512 blocks), stored in DRAM, in NVMe, or nowhere (conftest.py):

scheduler thread
* ``test_lookup``             get_num_new_matched_tokens: ``Planner.track`` + ``Planner.lookup`` of a new
                              request (its chain keys, then the store's prefix walk)
* ``test_pin``                update_state_after_alloc: ``Planner.allocated`` (pins the hit: ``begin_load``
                              -> ``KVStore.pin_load``; accounts the request's tokens)
* ``test_build_connector_meta``  ``Planner.build_step`` for the step that schedules the request
                              (a miss: every full block planned for storing; a DRAM hit: its load
                              planned) or a decode step of 32 running requests
worker thread
* ``test_start_load_kv``      ``StepRunner.load`` of a DRAM hit (a synchronous load: pin taken, scatter, unpin)
* ``test_wait_for_save``      ``StepRunner.save`` of a prefill's blocks (io.async_saves: ``begin_store`` and the
                              gather enqueued; no bytes move on this thread)
* ``test_begin_store``        ``KVStore.begin_store`` alone, at 8 KiB and 128 KiB blocks: index-only, so
                              the two sizes cost the same (the reservation is aborted untimed)
* ``test_get_finished``       ``StepRunner.get_finished``: a step with nothing finished, and one where 8
                              requests with completed stores finished

Run: ``make microbench`` (pytest-benchmark; min and median are the figures to compare).
"""

from __future__ import annotations

import pytest

from conftest import BS, ROUNDS, SIZES, WARMUP, tokens
from kvstore.keys import chain_keys


def _run(benchmark, fn, setup):
    return benchmark.pedantic(fn, setup=setup, rounds=ROUNDS, warmup_rounds=WARMUP, iterations=1)


# -- scheduler thread ---------------------------------------------------------------------------

@pytest.mark.parametrize("n", SIZES, ids=lambda n: f"{n // 1024}k")
@pytest.mark.parametrize("kind", ["dram", "nvme", "miss"])
def test_lookup(benchmark, rig, kind, n):
    rig.check(kind, n)
    p = rig.planner
    expect = 0 if kind == "miss" else (n - 1) // BS * BS  # never the prompt's last token
    toks = tokens(kind, n)
    last: list[str] = []

    def setup():
        rig.finish(req_ids=last)
        last[:] = [rig.rid(kind)]
        return (last[0],), {}

    def lookup(rid):  # the connector's get_num_new_matched_tokens
        st = p.track(rid, toks, n, None, [], arrival=0.0, session="")
        return p.lookup(st, 0)

    got = _run(benchmark, lookup, setup)
    rig.finish(req_ids=last)
    assert got == expect


@pytest.mark.parametrize("n", SIZES, ids=lambda n: f"{n // 1024}k")
@pytest.mark.parametrize("kind", ["dram", "nvme", "miss"])
def test_pin(benchmark, rig, kind, n):
    rig.check(kind, n)
    p = rig.planner
    ids = rig.block_table(n)
    last: list = []

    def setup():
        rig.finish([p.build_step([], [], {})], [st.req_id for st, _ in last])
        last[:] = [rig.new_request(kind, n)]
        return last[0], {}

    def allocated(st, hit):  # the connector's update_state_after_alloc
        p.allocated(st, hit, ids if st.load_async and hit > 0 else None)
        return st

    st = _run(benchmark, allocated, setup)
    assert st.first_hit[1] == (0 if kind == "miss" else (n - 1) // BS * BS)  # the hit was pinned whole
    rig.finish([p.build_step([], [], {})], [st.req_id])


@pytest.mark.parametrize("n", SIZES, ids=lambda n: f"{n // 1024}k")
@pytest.mark.parametrize("case", ["miss", "dram_hit", "decode32"])
def test_build_connector_meta(benchmark, rig, case, n):
    p = rig.planner
    kind = "dram" if case == "dram_hit" else "miss"
    rig.check(kind, n)
    state: dict = {"plans": [], "reqs": []}

    def setup():
        if case == "decode32":  # 32 running requests past their prefill, one token each this step
            if not state["reqs"]:
                for i in range(32):
                    st, hit = rig.new_request("decode", n, seed=i)
                    p.allocated(st, hit)
                    rig.finish([p.build_step([(st.req_id, rig.block_table(n, i * (n // BS + 1)), 0)],
                                             [], {st.req_id: n})])
                    state["reqs"].append(st.req_id)
                state["decode"] = [(r, None, n, False) for r in state["reqs"]]
            return ([], state["decode"], {r: 1 for r in state["reqs"]}), {}
        rig.finish(state["plans"], state["reqs"])
        st, hit = rig.new_request(kind, n)
        p.allocated(st, hit)
        state["reqs"] = [st.req_id]
        return ([(st.req_id, rig.block_table(n), hit)], [], {st.req_id: n - hit}), {}

    def build(new, cached, scheduled):  # the connector's build_connector_meta
        plan = p.build_step(new, cached, scheduled)
        state["plans"] = [plan]
        return plan

    plan = _run(benchmark, build, setup)
    if case == "decode32":
        assert not plan.loads and not plan.stores and plan.tokens == 32
    elif case == "dram_hit":  # the hit loaded, the block holding the last token stored
        assert len(plan.loads) == 1 and len(plan.loads[0].block_ids) == (n - 1) // BS
    else:
        assert not plan.loads and sum(len(s.block_ids) for s in plan.stores) == n // BS
    rig.finish(state["plans"], state["reqs"])
    state["reqs"] = []


# -- worker thread ------------------------------------------------------------------------------

@pytest.mark.parametrize("n", SIZES, ids=lambda n: f"{n // 1024}k")
def test_start_load_kv(benchmark, rig, n):
    rig.check("dram", n)
    p, mover = rig.planner, rig.mover
    last: list = []

    def setup():
        rig.finish(req_ids=last)
        st, hit = rig.new_request("dram", n)
        p.allocated(st, hit)
        plan = p.build_step([(st.req_id, rig.block_table(n), hit)], [], {st.req_id: n - hit})
        last[:] = [st.req_id]
        return (plan,), {}

    def load(plan):  # the connector's start_load_kv
        mover.load(plan)
        return plan

    plan = _run(benchmark, load, setup)
    assert not mover.take_load_errors() and len(plan.loads[0].block_ids) == (n - 1) // BS
    rig.finish(req_ids=last)


@pytest.mark.parametrize("n", SIZES, ids=lambda n: f"{n // 1024}k")
def test_wait_for_save(benchmark, rig, n):
    p, mover = rig.planner, rig.mover
    last: list[str] = []
    seed = iter(range(1, 1 << 30))

    def setup():
        for r in last:  # the previous round's gather: done before the next is timed
            rig.client.saves_done(r, 30.0)
        rig.finish(req_ids=last)
        st, hit = rig.new_request("save", n, seed=next(seed))  # fresh blocks every round
        p.allocated(st, hit)
        plan = p.build_step([(st.req_id, rig.block_table(n), 0)], [], {st.req_id: n})
        last[:] = [st.req_id]
        return (plan,), {}

    def save(plan):  # the connector's wait_for_save
        mover.save(plan)
        return plan

    plan = _run(benchmark, save, setup)
    rig.client.saves_done(last[0], 30.0)
    rig.finish(req_ids=last)
    ks = plan.stores[0].keys
    m = rig.store.contains_prefix(ks, record=False)
    assert m.num_blocks == len(ks) == n // BS and set(m.tiers) == {"dram"}


@pytest.mark.parametrize("n", SIZES, ids=lambda n: f"{n // 1024}k")
@pytest.mark.parametrize("geometry", ["small", "large"])
def test_begin_store(benchmark, request, geometry, n):
    r = request.getfixturevalue("rig" if geometry == "small" else "rig_large")
    store = r.store
    benchmark.extra_info["block_bytes"] = r.block_bytes
    held: list = []
    seed = iter(range(1, 1 << 30))

    def setup():
        for h in held:
            store.end_store(h, False)  # abandoned: the slots go back, nothing is stored
        held.clear()
        return (chain_keys(r.root, tokens("store", n, next(seed)), BS),), {}

    def begin(keys):
        h = store.begin_store(keys)
        held.append(h)
        return h

    h = _run(benchmark, begin, setup)
    assert sum(v is not None for v in h.views) == n // BS  # every block got a slot
    store.end_store(h, False)
    held.clear()


@pytest.mark.parametrize("finished", [0, 8])
def test_get_finished(benchmark, rig, finished):
    p, mover = rig.planner, rig.mover
    idle = p.build_step([], [], {})
    state: dict = {"reqs": []}
    seed = iter(range(1, 1 << 30))

    def setup():
        reqs = []
        if finished:  # 8 requests whose stores completed; vLLM reports them finished in this step
            new, sched = [], {}
            for i in range(finished):
                st, hit = rig.new_request("finished", 2 * BS, seed=next(seed))
                p.allocated(st, hit)
                new.append((st.req_id, rig.block_table(2 * BS, 4 * i), 0))
                sched[st.req_id] = 2 * BS
                reqs.append(st.req_id)
            mover.save(p.build_step(new, [], sched))
            rig.shared.jobs.wait_idle(30)
        state["reqs"] = reqs
        return (set(reqs), idle), {}

    def get_finished(finished_req_ids, plan):  # the connector's get_finished
        return mover.get_finished(finished_req_ids, plan)

    sending, recving = _run(benchmark, get_finished, setup)
    assert recving is None and (sending or set()) == set(state["reqs"])
    rig.finish(req_ids=state["reqs"])
