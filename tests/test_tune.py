"""kvstore tune: the simulator against a real KVStore, the recommendation on traces of known
structure, the outputs (YAML, JSON, PNG), TTL classes (ttl_shared_s), and a trace recorded by
a real vLLM engine."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from kvstore.config import ConfigError, GiB, from_dict, load_config
from kvstore.tiers.index import TierIndex
from kvstore.tiers.policy import make_policy
from kvstore.trace import TraceError
from kvstore.tune import Simulator, from_records, load_trace, synth_records
from kvstore.tune import grid as G
from kvstore.tune.cli import main as tune_main
from kvstore.tune.trace_memory import write_records
from kvstore.tune.recommend import setting
from kvstore.tune.simulate import LOWER, TOP
from kvstore.tune.tuner import MIN_SAMPLED_SESSIONS, SCREEN_LIMIT, candidates, choose, tune
from store_replay import replay_store

from conftest import FP, dram_gb, make_keys

BB = 4096  # small blocks: one DRAM slot, one NVMe file page


def cfg_blocks(dram_blocks, dram_ttl, nvme_blocks, nvme_ttl, policy="lru", shared=None, write_mode="write_back",
               nvme_policy=None, headroom=0, admit_after=0):
    """``dram_blocks`` held by the DRAM index, plus ``headroom`` slots (none: exact scenarios)."""
    return from_dict({"tiers": {
        "dram": {"capacity_gb": (dram_blocks + headroom) * BB / GiB, "ttl_s": dram_ttl, "ttl_shared_s": shared,
                 "policy": policy, "pin_memory": False, "headroom_blocks": headroom},
        "nvme": {"capacity_gb": nvme_blocks * (BB + 4096) / GiB, "ttl_s": nvme_ttl, "ttl_shared_s": shared,
                 "policy": nvme_policy or policy, "header": "inline", "io_threads": 1, "write_mode": write_mode,
                 "admit_after": admit_after}}})


@pytest.fixture(scope="module")
def mixed_trace():
    """Sessions with agent-like and human-like pauses, a shared system prompt and retries."""
    def think(r):
        return float(r.uniform(5, 40)) if r.random() < 0.7 else float(r.uniform(60, 900))
    return from_records(synth_records(sessions=50, turns=8, think=think, arrival_s=900, replay_prob=0.1,
                                      system_blocks=3, seed=3))


# -- the simulator is the store's accounting ----------------------------------------------------


@pytest.mark.parametrize("dram,dttl,nvme,nttl,policy,shared,mode", [
    (48, 60, 200, 600, "lru", None, "write_back"),
    (24, None, 80, None, "lru", None, "write_back"),
    (40, 120, 120, 300, "lru_shared", 1200, "write_back"),
    (16, None, 64, 900, "fifo", None, "write_through"),
    (150, 30, 0, None, "lru", None, "write_back"),  # DRAM only
    (0, None, 150, 120, "lru", None, "write_back"),  # NVMe only
])
def test_simulated_hit_rate_equals_the_real_store(mixed_trace, dram, dttl, nvme, nttl, policy, shared, mode, tmp_path):
    cfg = cfg_blocks(dram, dttl, nvme, nttl, policy, shared, mode)
    sim = Simulator.from_config(cfg, BB)
    for r in mixed_trace.requests():
        sim.request(*r)
    a = sim.result()
    b = replay_store(mixed_trace, cfg, BB, nvme_path=str(tmp_path))
    assert 0.05 < b["hit_rate"] < 0.95  # a trace where the settings matter
    assert abs(a["hit_rate"] - b["hit_rate"]) <= 0.01
    for tier in ("dram", "nvme"):
        assert abs(a["hit_rate_by_tier"][tier] - b["hit_rate_by_tier"][tier]) <= 0.01
    # in fact identical, miss reasons included
    assert a["hit_rate"] == pytest.approx(b["hit_rate"], abs=1e-12)
    assert {k: v for k, v in a["misses_by_reason"].items() if v} == b["misses_by_reason"]
    assert a["replay_hit_tokens"] == b["replay_hit_tokens"]


@pytest.mark.parametrize("dram,nvme,mode", [(12, 0, "write_through"), (10, 30, "write_through"),
                                            (12, 0, "write_back"), (10, 30, "write_back")])
def test_a_shared_folder_is_modelled_as_the_store_serves_it(mixed_trace, dram, nvme, mode, tmp_path):
    """A shared folder below the local tiers (found after them; written through, or given the
    last local tier's victims): the stand-in's hits are the real tier's, block for block, where
    its sweeper never has to act (a capacity and a TTL the trace stays within: the sweeper runs
    on the wall clock, the replay on the trace's)."""
    base = cfg_blocks(dram, None, nvme, None)
    cfg = from_dict({**base.to_dict(), "tiers": {**base.to_dict()["tiers"], "sharedfs": {
        "path": str(tmp_path / "shared"), "capacity_gb": 1, "ttl_s": None, "write_mode": mode}}})
    (tmp_path / "shared").mkdir(mode=0o700)
    sim = Simulator.from_config(cfg, BB)
    assert [t.name for t in sim.chain.tiers] == ["dram"] + ["nvme"] * bool(nvme) + ["sharedfs"]
    for r in mixed_trace.requests():
        sim.request(*r)
    a = sim.result()
    b = replay_store(mixed_trace, cfg, BB, nvme_path=str(tmp_path / "nvme"))
    assert a["hit_rate_by_tier"]["sharedfs"] > 0.2  # the local tiers are small: most hits are the folder's
    assert a["hit_rate_by_tier"] == pytest.approx(b["hit_rate_by_tier"], abs=1e-12)
    assert {k: v for k, v in a["misses_by_reason"].items() if v} == b["misses_by_reason"]


def test_the_shared_folder_stand_in_keeps_its_capacity_and_ttl():
    from kvstore.tiers.nobytes import NoBytesSharedTier

    now = [0.0]
    t = NoBytesSharedTier("sharedfs", capacity_bytes=3 * 8192, ttl_s=100.0, entry_bytes=8192, block_bytes=BB,
                          clock=lambda: now[0])
    k = [bytes([i]) * 16 for i in range(5)]
    t.stored(k[:3])
    assert t.leading(k) == 3 and t.used_bytes == 3 * 8192
    now[0] = 50.0
    t.acquire(k[:1])  # a read refreshes its time: the least recent is k[1] now
    t.stored(k[3:4])
    assert t.holds(k[:4]) == [True, False, True, True] and t.stats["evicted"] == 1
    now[0] = 120.0  # k[2] idle 120 s: past its TTL; k[0] read at 50, k[3] stored at 50: not
    assert t.holds(k[:4]) == [True, False, False, True] and t.index.consulted["ttl"]
    t.stored(k[4:5])
    assert t.leading([k[0], k[3], k[4]]) == 3 and len(t) <= 3
    # in a replay, what it evicts is counted (the store never sees a shared medium's evictions)
    cfg = from_dict({"tiers": {"dram": {"capacity_gb": 4 * BB / GiB, "pin_memory": False, "headroom_blocks": 0},
                               "nvme": {"capacity_gb": 0},
                               "sharedfs": {"path": "/nonexistent", "capacity_gb": 6 * (BB + 4096) / GiB}}})
    sim = Simulator.from_config(cfg, BB)
    for i in range(4):
        sim.request(float(i), "s", make_keys(5, seed=i), 5 * 16, 16)
    written = sim.counts.written["sharedfs"]  # (what DRAM stored, written through)
    assert written > 6 and sim.result()["evicted_for_capacity"]["sharedfs"] == written - 6


def test_tune_models_a_shared_folder_of_the_base_config(mixed_trace, tmp_path):
    p = tmp_path / "t.jsonl"
    write_records(p, synth_records(sessions=30, turns=6, think=(20, 200), arrival_s=600, system_blocks=3, seed=4))
    base = tmp_path / "base.yaml"
    base.write_text(f"tiers:\n  sharedfs:\n    path: {tmp_path}\n    capacity_gb: 0.01\n    ttl_s: 3600\n")
    out = tmp_path / "out.json"
    assert tune_main(["--trace", str(p), "--base", str(base), "--dram-gb", str(20 * BB / GiB), "--nvme-gb", "0",
                      "--block-bytes", str(BB), "--json", str(out), "--quiet", "--jobs", "1"]) == 0
    res = json.loads(out.read_text())
    assert res["modelled_as_configured"]["sharedfs"]["capacity_gb"] == 0.01
    rec = res["recommended"]
    assert rec["hit_tokens_by_tier"]["sharedfs"] > 0 and rec["bytes_held"]["sharedfs"]["capacity"] == int(0.01 * GiB)
    again = tmp_path / "plain.json"
    assert tune_main(["--trace", str(p), "--dram-gb", str(20 * BB / GiB), "--nvme-gb", "0", "--block-bytes",
                      str(BB), "--json", str(again), "--quiet", "--jobs", "1"]) == 0
    plain = json.loads(again.read_text())["recommended"]
    assert plain["hit_tokens_by_tier"]["sharedfs"] == 0 and rec["hit_rate"] > plain["hit_rate"]


def test_reused_grid_points_equal_their_own_replay(mixed_trace):
    """A point copied from a smaller one (capacity or TTL never consulted) is what its replay gives."""
    c = G.Common(block_bytes=BB)
    gb = BB / GiB
    axes = ([40 * gb, 400 * gb, 4000 * gb], [30, 600, None], [0.0, 400 * gb, 4000 * gb], [300, None])
    pts = [(a, b, c_, d) for a in axes[0] for b in axes[1] for c_ in axes[2] for d in axes[3]]
    with G.Evaluator(mixed_trace, c, axes, jobs=1) as ev:
        got = ev.evaluate(pts)
        assert ev.copied > 0
    skip = {"sim_seconds", "simulated", "capacity_consulted", "ttl_consulted", "sim_requests"}
    for s, r in zip(pts, got):
        if r["simulated"]:
            continue
        direct = G.run_point(mixed_trace, s, c)
        assert {k: v for k, v in r.items() if k not in skip} == {k: v for k, v in direct.items() if k not in skip}, s


def test_replays_ahead_on_idle_processes_give_the_same_grid(mixed_trace, monkeypatch):
    """With 2 processes, a wave of one replay (the TTL axis is a chain) takes the next wave's
    likely replay along: fewer rounds, the same figures, and the same rounds on every run."""
    c = G.Common(block_bytes=BB)
    gb = BB / GiB
    axes = ([40 * gb, 4000 * gb], [30, 120, 600, 1800, None], [0.0], [None])
    pts = [(a, b, 0.0, None) for a in axes[0] for b in axes[1]]

    def grid(jobs):
        rounds = []
        real = G.Evaluator._map
        monkeypatch.setattr(G.Evaluator, "_map", lambda self, todo: rounds.append(len(todo)) or real(self, todo))
        with G.Evaluator(mixed_trace, c, axes, jobs=jobs) as ev:
            got = ev.evaluate(pts)
        monkeypatch.undo()
        return got, rounds

    one, r1 = grid(1)
    two, r2 = grid(2)
    assert len(r2) < len(r1), (r1, r2)
    assert grid(2)[1] == r2
    skip = {"sim_seconds", "simulated", "capacity_consulted", "ttl_consulted", "sim_requests"}
    for s, a, b in zip(pts, one, two):
        assert {k: v for k, v in a.items() if k not in skip} == {k: v for k, v in b.items() if k not in skip}, s


# -- recommendations on traces of known structure -----------------------------------------------


def _tune(tmp_path, trace_recs, *args):
    tp = tmp_path / "t.jsonl"
    write_records(tp, trace_recs)
    out, js = tmp_path / "rec.yaml", tmp_path / "res.json"
    rc = tune_main(["--trace", str(tp), "--out", str(out), "--json", str(js), "--jobs", "2", "--quiet",
                    "--allow-temp-nvme", *args])
    assert rc == 0
    return out, json.loads(js.read_text())


def test_think_times_under_a_minute_need_a_one_minute_ttl(tmp_path, capsys):
    recs = synth_records(sessions=120, turns=8, think=(10.0, 59.0), arrival_s=1800, seed=1, replay_prob=0.05)
    out, res = _tune(tmp_path, recs, "--dram-gb", "2", "--nvme-gb", "20", "--dram-ttls", "30,60,2m,5m,1h,none",
                     "--nvme-ttls", "10m,1h,none", "--plots", str(tmp_path / "plots"))
    rec = res["recommended"]
    assert rec["tiers"]["dram"]["ttl_s"] == 60  # the smallest TTL above every think time
    assert rec["hit_rate_by_tier"]["dram"] == pytest.approx(rec["hit_rate"])  # all hits from DRAM
    # (every hit is a DRAM hit, so the NVMe admission filter loses none: the pick takes it, and
    # the DRAM TTL slice was searched without it)
    assert rec["tiers"]["nvme"]["admit_after"] == 2
    by_ttl = {p["tiers"]["dram"]["ttl_s"]: p for p in res["grid"]
              if p["tiers"]["nvme"] == {**rec["tiers"]["nvme"], "admit_after": 0} and
              p["tiers"]["dram"]["capacity_gb"] == rec["tiers"]["dram"]["capacity_gb"]}
    assert by_ttl[30]["hit_rate_by_tier"]["dram"] < rec["hit_rate_by_tier"]["dram"] - 0.05
    assert by_ttl[None]["hit_rate"] == pytest.approx(rec["hit_rate"])
    assert by_ttl[None]["bytes_held"]["dram"]["p50"] > rec["bytes_held"]["dram"]["p50"]
    assert rec["nvme_written_bytes_per_hour"] < _twin(res, rec, 0)["nvme_written_bytes_per_hour"]
    assert res["capacity_binding"] == {"dram": False, "nvme": False}
    # the JSON: every grid point, with the fields the issue names
    assert len(res["grid"]) == 3 * 6 * 3 * 3 + 3 * 3  # + the NVMe slice at the pick with admit_after 2
    p = res["grid"][0]
    for k in ("tiers", "hit_rate", "hit_rate_by_tier", "saved_prefill_tokens", "replay_hit_tokens",
              "genuine_hit_tokens", "bytes_held", "misses_by_reason"):
        assert k in p
    assert set(p["bytes_held"]["dram"]) >= {"p50", "p99", "max"}
    assert rec["replay_hit_tokens"] > 0 and rec["genuine_hit_tokens"] > 0
    # the YAML is a config the store and connector load
    cfg = load_config(out, environ={})
    assert cfg.tiers.dram.ttl_s == 60 and cfg.tiers.dram.capacity_gb == rec["tiers"]["dram"]["capacity_gb"]
    assert cfg.tiers.nvme.admit_after == 2
    assert cfg.tiers.nvme.ttl_s == rec["tiers"]["nvme"]["ttl_s"]
    assert sorted(os.listdir(tmp_path / "plots")) == ["tune_dram.png", "tune_nvme.png"]
    md = capsys.readouterr().out
    assert "## Recommended" in md and "| **→** |" in md


def test_a_budget_too_small_for_any_ttl_reports_capacity_binding(tmp_path):
    recs = synth_records(sessions=120, turns=8, think=(10.0, 59.0), arrival_s=1800, seed=1)
    # ~20 sessions active at a time, ~15 blocks of 2 MiB each: 100 blocks hold a third of it
    _, res = _tune(tmp_path, recs, "--dram-gb", "0.2", "--nvme-gb", "0")
    a = res["analysis"]["dram"]
    assert res["capacity_binding"]["dram"] and a["binding_at_every_ttl"]
    assert "too small for any TTL" in a["detail"]
    assert res["recommended"]["evicted_for_capacity"]["dram"] > 0


def test_cost_model_trades_dram_for_nvme(tmp_path):
    recs = synth_records(sessions=120, turns=8, think=(10.0, 59.0), arrival_s=1800, seed=1)
    args = ["--dram-gb", "2", "--nvme-gb", "20", "--dram-ttls", "30,60,none", "--nvme-ttls", "10m,none"]
    _, free = _tune(tmp_path, recs, *args)
    _, priced = _tune(tmp_path, recs, *args, "--gb-hour-price-dram", "100", "--gb-hour-price-nvme", "0.01",
                      "--prefill-token-price", "0.001")
    f, p = free["recommended"], priced["recommended"]
    assert p["tiers"]["dram"]["ttl_s"] == 30 and f["tiers"]["dram"]["ttl_s"] == 60
    assert p["bytes_held"]["dram"]["mean"] < f["bytes_held"]["dram"]["mean"]
    assert p["hit_rate"] == pytest.approx(f["hit_rate"], abs=0.01)  # NVMe catches what DRAM drops
    assert "value" in p and priced["cost_model"]["prefill_token_price"] == 0.001


def _twin(res, r, admit):
    """The grid point with ``r``'s setting and ``admit_after`` = ``admit``."""
    want = {**r["tiers"]["nvme"], "admit_after": admit}
    return next(p for p in res["grid"] if p["tiers"]["dram"] == r["tiers"]["dram"] and p["tiers"]["nvme"] == want)


def test_admission_that_costs_hits_is_not_recommended_and_writes_per_hour_are_reported(tmp_path, capsys):
    """Human pauses (2-15 min): a session's blocks leave DRAM before its next turn, so with
    admit_after 2 most never reach NVMe and that turn misses (measured: 78.4% -> 76.3% hit rate,
    NVMe writes 789 -> 623 MB/h at the pick); the tuner keeps every block (admit_after 0)."""
    recs = synth_records(sessions=60, turns=6, think=(120.0, 900.0), arrival_s=1800, seed=2)
    args = ["--dram-gb", "1", "--nvme-gb", "10", "--dram-ttls", "30,none", "--nvme-ttls", "1h,none"]
    _, res = _tune(tmp_path, recs, *args)
    rec = res["recommended"]
    assert res["admit_after_tried"] == [0, 2] and rec["tiers"]["nvme"]["admit_after"] == 0
    on = _twin(res, rec, 2)
    assert on["hit_rate"] < rec["hit_rate"] - 0.01 and on["misses_by_reason"]["not_admitted"] > 0
    assert 0 < on["nvme_written_bytes"] < rec["nvme_written_bytes"] and on["nvme_not_admitted"] > 0
    for r in (rec, on):  # block bytes written to NVMe per hour of trace
        assert r["nvme_written_bytes_per_hour"] == pytest.approx(r["nvme_written_bytes"] * 3600 / r["duration_s"])
    # the admission stage: the NVMe slice (3 capacities x 2 TTLs) at the pick, with admit_after 2
    assert sum(p["tiers"]["nvme"]["admit_after"] == 2 for p in res["grid"]) == 3 * 2
    md = capsys.readouterr().out
    assert "| NVMe admit after | hit % | NVMe written / h |" in md and "not admitted" in md
    assert f"| 0 | {rec['hit_rate'] * 100:.1f} | " in md and f"| 2 | {on['hit_rate'] * 100:.1f} | " in md
    # admit_after 0 only: today's grid, point for point the admit_after 0 points of the search above
    _, off = _tune(tmp_path, recs, *args, "--admit-after", "0")
    skip = {"sim_seconds", "simulated"}
    assert [{k: v for k, v in p.items() if k not in skip} for p in off["grid"]] == \
        [{k: v for k, v in p.items() if k not in skip} for p in res["grid"] if p["tiers"]["nvme"]["admit_after"] == 0]
    assert off["recommended"]["tiers"] == rec["tiers"]


def test_sampled_screening_then_whole_trace(mixed_trace):
    # 100,000 agent requests of 15 blocks, the default 24 settings: screened on a sample of SCREEN_LIMIT's worth
    assert choose(100_000, 10_000, 24, 24, n_visits=1_500_000) == ("full", round(SCREEN_LIMIT / (24 * 1_500_000), 4))
    # a sample keeps at least MIN_SAMPLED_SESSIONS sessions
    assert choose(1_000_000, 100_000, 504, 45, n_visits=50_000_000) == ("staged", MIN_SAMPLED_SESSIONS / 100_000)
    assert choose(2000, 200, 504, 45) == ("full", 1.0)  # within SCREEN_LIMIT: every setting on the whole trace
    assert choose(20_000, 100, 24, 24, n_visits=1_500_000)[1] == 1.0  # a sample of over half: the whole trace
    sm = mixed_trace.sample_sessions(0.5)
    assert 10 < sm.n_sessions < 40 and set(sm.session) <= set(mixed_trace.session)
    gb = BB / GiB
    axes = ([20 * gb, 80 * gb], [30, 300, None], [200 * gb], [600, None])
    res = tune(mixed_trace, G.Common(block_bytes=BB), axes, sample=0.5, confirm=3, jobs=1)
    assert res["sample_rate"] == 0.5 and len(res["confirmed"]) == 3
    assert res["recommended"] in res["confirmed"] and res["recommended"]["sample_rate"] == 1.0
    scaled = [p for p in res["grid"] if p["sample_rate"] == 0.5 and p["nvme_written_bytes"]]
    assert scaled and all(p["nvme_written_bytes_per_hour"] == pytest.approx(p["nvme_written_bytes"] * 3600 / p["duration_s"])
                          for p in scaled)  # counts scaled back up, the rate recomputed from them


def test_the_whole_trace_replays_the_screens_pick_and_its_best():
    """A sampled screen sends its pick and its best setting to the whole trace: the pick is the
    smallest within the tolerance, and on a sample that one can fall short of the best."""
    def point(gb: float, saved: int) -> dict:
        return {"prompt_tokens": 100_000, "saved_prefill_tokens": saved, "hit_tokens_by_tier": {TOP: saved, LOWER: 0},
                "bytes_held": {TOP: {"mean": gb * GiB}, LOWER: {"mean": 0.0}}, "nvme_written_bytes": 0,
                "tiers": {TOP: {"capacity_gb": gb, "ttl_s": 600}, LOWER: {"capacity_gb": 0.0, "ttl_s": None, "admit_after": 0}}}

    a, b, c = point(8, 99_950), point(16, 99_920), point(32, 100_000)  # within 0.1 % of the prompt tokens: all three
    pts = [c, b, a]
    assert candidates(pts, None, 0.1, 1) == [setting(a)]  # the pick: the smallest
    assert candidates(pts, None, 0.1, 2) == [setting(a), setting(c)]  # the pick's runner-up gives way to the best
    assert candidates(pts, None, 0.1, 3) == [setting(a), setting(b), setting(c)]
    assert candidates([a, c], None, 0.1, 2) == [setting(a), setting(c)]


# -- traces ------------------------------------------------------------------------------------


def test_trace_loading(tmp_path):
    a, b = "ab" * 16, "cd" * 16
    lines = [
        {"t": 5.0, "session": "x", "blocks": [a, b], "block_tokens": 16, "prompt_tokens": 40, "output_tokens": 3},
        {"t": 1.0, "session": "y", "blocks": [a], "block_tokens": 16, "prompt_tokens": 20, "extra": [1, 2]},
        {"t": 9.0, "session": "y", "blocks": [a, b], "block_tokens": 16, "prompt_tokens": 33, "output_tokens": 0},
    ]
    p = tmp_path / "t.jsonl"
    p.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    tr = load_trace(p)
    assert tr.t == [1.0, 5.0, 9.0]  # time order (the connector writes at finish)
    assert tr.replay == [False, False, True]  # same block list as an earlier request
    assert tr.keys[1] == tr.keys[2] and tr.keys[0] == tr.keys[1][:1]
    assert tr.n_sessions == 2 and tr.n_keys == 2
    p.write_text(json.dumps(lines[0]) + "\n{\"t\": 1}\n")
    with pytest.raises(TraceError, match="line 2"):
        load_trace(p)
    assert tune_main(["--trace", str(p), "--quiet"]) == 2


def test_trace_keys_get_ids_by_first_appearance_whatever_the_session_does(tmp_path):
    """Loading reuses a session's last ids when its prompt extends the last one (append-only):
    an edited history, a shorter prompt, upper-case digits and another session's keys must get
    the ids a plain dict of every key gives."""
    a, b, c, d, e = (ch * 32 for ch in "abcde")
    rows = [("x", [a, b]), ("x", [a, b, c]), ("x", [a, c]), ("x", [a, c, d]), ("x", [a]),
            ("y", [a.upper(), e]), ("y", [a, e, b.upper()]), ("x", [a, b, c, d, e])]
    p = tmp_path / "t.jsonl"
    p.write_text("".join(json.dumps({"t": float(i), "session": s, "blocks": bl, "block_tokens": 16,
                                     "prompt_tokens": 16 * len(bl)}) + "\n" for i, (s, bl) in enumerate(rows)))
    tr = load_trace(p)
    ids: dict = {}
    want = [tuple(ids.setdefault(k.lower(), len(ids)) for k in bl) for _, bl in rows]
    assert tr.keys == want and tr.n_keys == 5
    assert tr.replay == [False] * 8
    # records of keys of any length and type (a joined string would take "0x1" + ... for "0x12" + ...)
    from kvstore.tune.trace_memory import TraceRecord

    recs = [TraceRecord(float(i), s, bl, 16, 16 * len(bl), 0) for i, (s, bl) in enumerate(
        [("x", ["0x1"]), ("x", ["0x12", "0x5"]), ("x", ["0x12", "0x5", b"k"]), ("x", ["0X12", "0x5", b"k", "0xA"])])]
    ids = {}
    assert from_records(recs).keys == [tuple(ids.setdefault(k.lower() if isinstance(k, str) else k, len(ids))
                                             for k in r.blocks) for r in recs]


# -- TTL classes: ttl_shared_s ------------------------------------------------------------------


def test_index_ttl_shared_after_two_sessions():
    ix = TierIndex(100, 10.0, make_policy("lru"), ttl_shared_s=100.0)
    es = {}
    for k in ("shared", "own"):
        es[k], _ = ix.reserve(k, 10, 0.0)
        ix.commit(es[k], 0.0)
    ix.touch(es["shared"], 1.0, "a")
    ix.touch(es["own"], 1.0, "a")
    assert es["shared"].expire_at == 11.0
    ix.touch(es["shared"], 2.0, "b")  # a second session: the shared class
    ix.touch(es["own"], 2.0, "a")  # the same session again: not shared
    assert es["shared"].shared and es["shared"].expire_at == 102.0
    assert not es["own"].shared and es["own"].expire_at == 12.0
    assert [e.key for e in ix.expire(50.0)] == ["own"]
    ix.check()
    plain = TierIndex(100, 10.0, make_policy("lru"))  # no TTL class: sessions are not tracked
    e, _ = plain.reserve("k", 10, 0.0)
    plain.commit(e, 0.0)
    plain.touch(e, 1.0, "a")
    plain.touch(e, 2.0, "b")
    assert not e.shared and e.first_session is None and e.expire_at == 12.0


def test_config_ttl_shared_s(tmp_path):
    c = from_dict({})
    assert c.tiers.dram.ttl_shared_s is None and c.tiers.nvme.ttl_shared_s is None
    c = from_dict({"tiers": {"dram": {"ttl_s": 60, "ttl_shared_s": 3600}, "nvme": {"ttl_shared_s": None}}})
    assert c.tiers.dram.ttl_shared_s == 3600.0
    with pytest.raises(ConfigError) as ei:
        from_dict({"tiers": {"nvme": {"ttl_shared_s": -1}}})
    assert ei.value.key == "tiers.nvme.ttl_shared_s"
    assert load_config(os.path.join(os.path.dirname(__file__), "..", "configs", "default.yaml"),
                       environ={}).tiers.dram.ttl_shared_s is None


def test_store_honors_ttl_shared(clock, tmp_path):
    from kvstore.store import KVStore

    cfg = from_dict({"tiers": {"dram": {"capacity_gb": dram_gb(16, BB), "ttl_s": 10, "ttl_shared_s": 1000,
                                        "pin_memory": False},
                               "nvme": {"capacity_gb": 0}}})
    keys = make_keys(4, seed=5)
    rows = np.zeros((4, BB), np.uint8)
    with KVStore(cfg, block_bytes=BB, fingerprint=FP, clock=clock) as s:
        assert s.dram.index.ttl_shared == 1000
        s.put(keys, rows)
        clock.advance(1)
        assert s.get(keys[:2], rows, session="a") == 2  # the system prompt ...
        assert s.get(keys, rows, session="b") == 4  # ... hit by a second session; its tail by one
        clock.advance(50)
        m = s.contains_prefix(keys)
        assert m.num_blocks == 2 and m.miss_reason == "expired"


# -- a trace recorded by a real vLLM engine -----------------------------------------------------


@pytest.mark.vllm
def test_a_trace_recorded_by_vllm_can_be_tuned(tmp_path):
    pytest.importorskip("vllm")
    import test_vllm_connector as V  # noqa: E402  (sets the vLLM environment for this process)
    from kvstore.bench.common.tiny_model import build_tiny_llama

    model = build_tiny_llama(str(tmp_path / "m"), hidden=256, layers=4, seed=0)
    trace = tmp_path / "trace.jsonl"
    turn1 = V.prompt(300, 70)
    turn2 = turn1 + V.prompt(40, 71)
    with V.Engine(model, str(tmp_path / "s"), extra={"trace_path": str(trace)}) as e:
        for p in (turn1, turn2, V.prompt(200, 72)):
            e.generate([p], max_tokens=8)
        block_bytes = e.shared.store.block_bytes
    recs = list(load_trace(trace).requests())
    assert len(recs) == 3
    js = tmp_path / "res.json"
    rc = tune_main(["--trace", str(trace), "--block-bytes", str(block_bytes), "--dram-gb", "0.05", "--nvme-gb", "1",
                    "--out", str(tmp_path / "rec.yaml"), "--json", str(js), "--quiet", "--jobs", "1",
                    "--nvme-path", str(tmp_path / "nvme")])
    assert rc == 0
    res = json.loads(js.read_text())
    rec = res["recommended"]
    # turn 2 extends turn 1: its first 9 blocks (of 32 tokens) are genuine prefix reuse
    assert rec["saved_prefill_tokens"] == 9 * 32 and rec["genuine_hit_tokens"] == 9 * 32
    assert rec["hit_rate"] == pytest.approx(288 / (300 + 340 + 200))
    assert rec["misses_by_reason"]["never_stored"] == (9 + 6) * 32 and rec["misses_by_reason"]["diverged"] == 32
    assert load_config(tmp_path / "rec.yaml", environ={}).tiers.dram.capacity_gb > 0


# -- the placement rules, step by step (simulator and real store) ---------------------------------


def _state(sim):
    d = sorted(k for k, e in sim.D.entries.items())
    n = sorted(k for k, e in sim.N.entries.items())
    return d, n


def test_placement_scenario_step_by_step(tmp_path):
    """A 2-slot DRAM over a 4-file NVMe, write-back, LRU. Each step spells out what the rules of
    kvstore.store.placement do; the real store (replay_store) must agree on every hit and miss."""
    from kvstore.store import placement

    def rec(t, s, blocks):
        return {"t": t, "session": s, "blocks": [b.to_bytes(16, "little").hex() for b in blocks],
                "block_tokens": 16, "prompt_tokens": 16 * len(blocks)}

    records = [rec(0, "a", [1, 2]), rec(1, "b", [3]), rec(2, "a", [1, 2]), rec(3, "c", [4]),
               rec(4, "c", [4, 5, 6])]
    trace = from_records(records)
    cfg = cfg_blocks(2, None, 4, None)
    sim = Simulator.from_config(cfg, BB)
    reqs = list(trace.requests())
    k = {i: reqs[j][2][p] for j, p, i in ((0, 0, 1), (0, 1, 2), (1, 0, 3), (3, 0, 4), (4, 1, 5), (4, 2, 6))}

    # 1. cold: never stored; both blocks admitted to DRAM (2 slots)
    assert sim.request(*reqs[0]) == (0, 0, "never_stored")
    assert _state(sim) == (sorted([k[1], k[2]]), []) and sim.free_slots == 0
    # 2. DRAM full: the LRU victim (2: a chain is committed tail first, so its head ends most
    #    recent) is demoted (placement.DEMOTE) and holds its slot until its write is done; block 3
    #    finds no free slot (LocalTier.attach), is skipped in DRAM and written to NVMe by put
    assert placement.demote_action(0.0, 1.0, has_lower=True, lower_holds=False, lower_ttl=None) == placement.DEMOTE
    assert sim.request(*reqs[1]) == (0, 0, "never_stored")
    assert _state(sim) == ([k[1]], sorted([k[2], k[3]]))
    assert (sim.demotions, sim.skipped, sim.free_slots) == (1, 1, 1)
    # 3. 1 from DRAM, 2 from NVMe; 2 is promoted into the free slot (no eviction); NVMe keeps its copy
    assert sim.request(*reqs[2]) == (1, 1, None)
    assert _state(sim) == (sorted([k[1], k[2]]), sorted([k[2], k[3]])) and sim.promotions == 1
    # 4. DRAM full again: victim 1 (LRU) is demoted; 4 is skipped in DRAM, written to NVMe
    assert sim.request(*reqs[3]) == (0, 0, "never_stored")
    assert _state(sim) == ([k[2]], sorted([k[1], k[2], k[3], k[4]]))
    assert (sim.demotions, sim.skipped) == (2, 2)
    # 5. 4 hits on NVMe and is promoted into the free slot; the put skips 4 (placement.admit:
    #    NVMe holds it) and stores 5 and 6, evicting 2 and 4: both already on NVMe
    #    (placement.ALREADY_LOWER), so their slots are freed at once, no write, nothing skipped
    assert placement.admit(lower_holds=True) is False
    assert placement.demote_action(0.0, 4.0, has_lower=True, lower_holds=True, lower_ttl=None) == placement.ALREADY_LOWER
    assert sim.request(*reqs[4]) == (0, 1, "diverged")
    assert _state(sim) == (sorted([k[5], k[6]]), sorted([k[1], k[2], k[3], k[4]]))
    assert (sim.demotions, sim.skipped, sim.promotions, sim.free_slots) == (2, 2, 2, 0)
    r = sim.result()
    real = replay_store(trace, cfg, BB, nvme_path=str(tmp_path))
    assert r["hit_rate"] == real["hit_rate"] and r["hit_rate_by_tier"] == real["hit_rate_by_tier"]
    assert {x: v for x, v in r["misses_by_reason"].items() if v} == real["misses_by_reason"]
