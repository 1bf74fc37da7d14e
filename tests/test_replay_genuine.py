"""Replay vs genuine reuse, live: the planner names each exact prompt, the worker counts what it
served by kind, a failed load counts nothing, ``kvstore stats`` shows the split, and the trace
records what each request's first lookup found. A real store, the real copy extension, a numpy
"engine" (the real-engine check is in tests/test_explain.py)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvstore.keys import ModelFingerprint, chain_keys
from kvstore.offload.planner import Planner
from kvstore.offload.replay import ReplayMemory

BS = 4


def toks(n, seed=0):
    return [int(x) for x in np.random.default_rng(seed).integers(1, 1000, n)]


def test_replay_memory_is_a_bounded_lru():
    m = ReplayMemory(capacity=2)
    assert [m.see(x) for x in (1, 2, 1)] == [False, False, True]  # 1 refreshed: 2 is the oldest
    assert m.see(3) is False and len(m) == 2
    assert m.see(2) is False  # forgotten: a replay this old counts as genuine
    assert m.see(3) is True
    with pytest.raises(ValueError, match="capacity"):
        ReplayMemory(0)


@pytest.fixture
def worker(tmp_path):
    """A real store on NVMe (DRAM off), a StepRunner over a numpy engine cache, a Planner."""
    from kvstore import kvcopy
    from kvstore.config import from_dict
    from kvstore.offload import LocalClient, acquire_shared, release_shared
    from kvstore.offload.runner import StepRunner

    def make(async_loads: bool = False, trace=None, trace_tokens=False):
        cache = np.zeros((64, 1, BS, 16), np.float16)  # vLLM CPU layout, one layer
        layout = kvcopy.KVLayout.from_vllm([cache])
        i = len(made)  # each call its own store
        cfg = from_dict({"tiers": {"dram": {"capacity_gb": 0}, "nvme": {"path": str(tmp_path / f"s{i}"),
                                                                         "capacity_gb": 0.01, "header": "inline"}}})
        fp = ModelFingerprint(model="replay-test", dtype="float16", block_size=BS, num_layers=1, num_kv_heads=1,
                              head_size=8, layout=f"x.{layout.packing}")
        shared = acquire_shared(f"replay-test-{i}/tp0", cfg, fp, layout.block_bytes, BS)
        made.append(shared)
        mover = StepRunner(shared, async_loads=async_loads)
        mover.register([cache], layout)
        planner = Planner(LocalClient(shared), fp, BS, prefetch=False, async_loads=async_loads, trace=trace,
                          trace_tokens=trace_tokens)
        return planner, mover, shared

    made: list = []
    yield make
    for s in made:
        if s.jobs is not None:
            s.jobs.close()
        release_shared(s)


def served(shared, kind=None, tier="nvme") -> float:
    reg = shared.metrics.registry
    if kind is None:
        return reg.get_sample_value("kvstore_engine_served_tokens_total", {"tier": tier}) or 0.0
    return reg.get_sample_value("kvstore_engine_served_tokens_by_kind_total", {"tier": tier, "kind": kind}) or 0.0


def run_request(planner, mover, rid, tokens, ids):
    st = planner.track(rid, tokens, len(tokens))
    hit = planner.lookup(st, 0)
    planner.allocated(st, hit, ids if st.load_async else None)
    plan = planner.build_step([(rid, ids, hit)], [], {rid: len(tokens) - hit})
    mover.load(plan)
    mover.save(plan)
    planner.finished(rid)
    return st, hit, plan


def test_the_digest_names_the_exact_prompt(worker):
    planner, _, _ = worker()
    t = toks(18, 1)  # 4 full blocks and 2 tokens

    def kind(tokens, extra=None, mm=None, rid=[0]):
        rid[0] += 1
        return planner.track(f"r{rid[0]}", tokens, len(tokens), extra, mm).replay

    assert kind(t) is False and kind(t) is True  # the exact prompt again
    assert kind(t[:16] + [t[16], t[17] + 1]) is False  # same full blocks, other partial block
    assert kind(t[:17]) is False  # a prefix of a seen prompt is a new prompt
    assert kind(t, extra=("salt", "tenant-b")) is False  # other extra keys (cache salt, LoRA)
    assert kind(t, mm=[(16, 18, "img-1")]) is False and kind(t, mm=[(16, 18, "img-2")]) is False
    assert kind(t, mm=[(16, 18, "img-2")]) is True
    assert kind(t[:16]) is False and kind(t[:16]) is True  # block-aligned prompts too
    n = len(planner.replays)
    st = planner.track("r1", t, len(t))  # asked again (a preempted request): not seen again
    assert len(planner.replays) == n and st.replay is False
    st2 = planner.track("fresh", t + [5], 18)  # a resumed request's live tokens include its output
    assert planner._digest(st2) == planner._digest(planner.reqs["r2"])


def test_served_tokens_split_by_kind_and_a_failed_load_counts_nothing(worker):
    from kvstore import failpoints

    planner, mover, shared = worker()
    store = shared.store
    prefix = toks(16, 2)  # 4 blocks, stored by another request
    store.put(chain_keys(store.root, prefix, BS), np.random.default_rng(0).integers(
        0, 255, (4, store.block_bytes), dtype=np.uint8))
    a = prefix + toks(6, 3)  # a new prompt sharing the 4 blocks: genuine
    st, hit, plan = run_request(planner, mover, "a", a, list(range(0, 6)))
    assert hit == 16 and [lp.kind for lp in plan.loads] == ["genuine"] and not st.replay
    assert (served(shared, "genuine"), served(shared, "replay"), served(shared)) == (16, 0, 16)
    st, hit, plan = run_request(planner, mover, "b", a, list(range(10, 16)))  # the exact prompt again
    assert hit == 20 and plan.loads[0].kind == "replay"  # a's 5th block was stored meanwhile
    assert (served(shared, "genuine"), served(shared, "replay"), served(shared)) == (16, 20, 36)
    failpoints.arm("mover.scatter=raise*1")  # the copy fails: vLLM recomputes every block
    try:
        run_request(planner, mover, "c", a, list(range(20, 26)))
    finally:
        failpoints.clear()
    assert mover.take_load_errors() == set(range(20, 25))
    assert (served(shared, "genuine"), served(shared, "replay"), served(shared)) == (16, 20, 36)
    f = store.nvme.path_of(chain_keys(store.root, a, BS)[2])  # a damaged file: served up to block 2
    data = bytearray(f.read_bytes())
    data[4096 + 10] ^= 0xFF
    f.write_bytes(bytes(data))
    run_request(planner, mover, "d", a, list(range(30, 36)))
    assert mover.take_load_errors() == set(range(32, 35))
    assert (served(shared, "genuine"), served(shared, "replay"), served(shared)) == (16, 28, 44)


def test_asynchronous_loads_are_counted_when_done(worker):
    planner, mover, shared = worker(async_loads=True)
    store = shared.store
    t = toks(22, 4)
    store.put(chain_keys(store.root, t, BS)[:5], np.zeros((5, store.block_bytes), np.uint8))
    for rid, kind in (("a", "genuine"), ("b", "replay")):
        st = planner.track(rid, t, len(t))
        assert planner.lookup(st, 0) == 20 and st.load_async
        planner.allocated(st, 20, list(range(8)))
        plan = planner.build_step([], [], {})
        assert [(lp.req_id, lp.kind) for lp in plan.async_loads] == [(rid, kind)]
        mover.load(plan)
        deadline = time.monotonic() + 10
        done: set = set()
        while rid not in done and time.monotonic() < deadline:
            done |= mover.get_finished(set())[1] or set()
            time.sleep(0.005)
        assert rid in done and mover.take_load_errors() == set()
        planner.finished(rid)
    assert (served(shared, "genuine"), served(shared, "replay"), served(shared)) == (20, 20, 40)


def test_the_trace_records_the_first_lookup_and_tokens_only_when_asked(worker, tmp_path):
    from kvstore.trace import TraceWriter, read_trace

    for trace_tokens in (False, True):
        path = tmp_path / f"trace-{trace_tokens}.jsonl"
        planner, mover, shared = worker(trace=TraceWriter(path), trace_tokens=trace_tokens)
        t = toks(22, 5)
        run_request(planner, mover, "a", t, list(range(6)))  # a miss: stores 5 blocks
        run_request(planner, mover, "b", t, list(range(10, 16)))  # the same prompt: a replay, 20 tokens
        run_request(planner, mover, "c", [7] + t[1:], list(range(20, 26)))  # a new head: diverged at once
        planner.close()
        recs = list(read_trace(path))
        assert [(r.hit_tokens, r.local_tokens, r.miss_reason, r.replay) for r in recs] == [
            (0, 0, "never_stored", False), (20, 0, None, True), (0, 0, "never_stored", False)]
        assert [r.tokens for r in recs] == ([tuple(t), tuple(t), tuple([7] + t[1:])] if trace_tokens else [None] * 3)
        assert [len(r.blocks) for r in recs] == [5, 5, 5] and recs[0].blocks == recs[1].blocks != recs[2].blocks


def test_stats_shows_the_split():
    from kvstore.offload import readout as stats
    from kvstore.store.metrics import StoreMetrics
    from kvstore.offload.metrics import OffloadMetrics, RequestOutcome

    m = StoreMetrics()
    om = OffloadMetrics(m.registry)
    om.record(RequestOutcome("r", 1000, 0, 0, 0))
    om.served_tokens.labels("dram").inc(300)
    om.served_tokens.labels("nvme").inc(100)
    m.served_by_kind.labels("dram", "replay").inc(300)
    m.served_by_kind.labels("nvme", "genuine").inc(100)
    s = stats.parse(m.text())
    e = s["engine"]
    from kvstore.tiers.registry import NAMES

    none = dict.fromkeys(NAMES, 0)  # every registered medium, 0 where it served nothing
    assert e["served_tokens_by_kind"] == {"replay": none | {"dram": 300}, "genuine": none | {"nvme": 100}}
    assert e["hit_rate_by_kind"] == {"replay": 0.3, "genuine": 0.1} and e["replay_share_of_served"] == 0.75
    assert e == om.summary()
    text = stats.render(s)
    lines = {ln.split()[0]: ln for ln in text.splitlines() if ln.startswith("  re") or ln.startswith("  ge")}
    assert "30.0%  (300 tokens: dram 300)" in lines["replay"] and "10.0%  (100 tokens: nvme 100)" in lines["genuine"]
    assert "75.0% of served" in text
    # a store without the split (an older one) shows no replay line
    m2 = StoreMetrics()
    OffloadMetrics(m2.registry).record(RequestOutcome("r", 10, 0, 0, 0))
    assert "replay" not in stats.render(stats.parse(m2.text()))
