"""kvstore bench soak (issue 47): the traffic's order, the phases, and a short soak through every
fault on the real server (vLLM's OpenAI server with kvstore, a real Redis, a tmpfs disk where
this machine lets the test mount one), with every answer checked against vLLM's own."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from kvstore.bench.soak import _phases
from kvstore.bench.soak.workload import Spec, Traffic

HAVE_VLLM = importlib.util.find_spec("vllm") is not None


def _answers(spec: Spec) -> dict:
    return {"agent": [[[[1, s, t], [9]] for t in range(spec.turns)] for s in range(spec.agents)],
            "chat": [[[[2, s, t], [8]] for t in range(spec.turns)] for s in range(spec.chats)],
            "once": [[[3, i], [7]] for i in range(spec.once)]}


def test_traffic_sends_the_turns_due_first_then_one_offs_and_chats_come_back_after_their_pause():
    spec = Spec(agents=1, chats=1, turns=2, once=2, think_s=0.5, chat_pause_s=25.0, rerun_pause_s=5.0)
    tr = Traffic(spec, _answers(spec), now=0.0)  # agent 0 due at 0, chat 0 at 0.5
    a0 = tr.next(0.0)
    assert (a0.name, a0.prompt, a0.expect) == ("agent0.t0", [1, 0, 0], [9])
    assert tr.next(0.1).name == "once0"  # nothing due: a one-off keeps the engine busy
    assert tr.next(0.2, fill=False) is None
    c0 = tr.next(0.6)
    assert c0.name == "chat0.t0"
    tr.done(a0, 1.0)
    tr.done(c0, 1.0)
    assert tr.next(1.2).name == "once1"
    a1 = tr.next(1.5)
    assert a1.name == "agent0.t1"  # after its think time
    tr.done(a1, 2.0)  # its last turn: the session starts over after the rerun pause
    assert tr.next(6.9).name == "once0"  # the one-offs cycle
    assert tr.next(7.0).name == "agent0.t0"
    assert tr.next(25.9).name == "once1"
    assert tr.next(26.0).name == "chat0.t1"  # back after the pause (longer than the DRAM TTL)


def test_the_fault_free_phases_leave_each_fault_and_its_settling_out():
    faults = [{"start": 100.0, "end": 110.0}, {"start": 130.0, "end": 200.0}, {"start": 400.0, "end": 401.0}]
    assert _phases(faults, 600.0) == [(0.0, 100.0), (230.0, 400.0), (431.0, 600.0)]
    assert _phases([], 50.0) == [(0.0, 50.0)]


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_VLLM, reason="needs vLLM")
def test_a_three_minute_soak_through_every_fault_answers_right(tmp_path):
    """CI's soak: every fault of the embedded store (the engine restarted and killed -9, Redis
    killed and flushed, block files deleted and damaged, the disk filled) on a 3-minute schedule;
    every answer equal to vLLM's own, every fault followed by right answers, nothing growing."""
    out = tmp_path / "out"
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1")
    # The latency limit is the hour-long soak's (1.5x, bench/results/soak_60min_node_cpu.md), not a
    # test's: a 3-minute run's phases hold ~250 answers, and their p99 on 2 loaded cores went 1.88x
    # the first phase's in stop 53's CI with nothing wrong. 4x still fails a store that stalls.
    p = subprocess.run([sys.executable, "-m", "kvstore.bench.soak", "--minutes", "3", "--out", str(out), "--json",
                        "--once", "60", "--ttft-ratio", "4"], capture_output=True, text=True, env=env, timeout=1500)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    res = json.loads((out / "soak.json").read_text())
    assert res["wrong"] == 0 and not res["problems"], res["problems"]
    ran = {f["name"] for f in res["faults"] if f["ran"]}
    assert ran == {"engine_restart", "engine_kill", "redis_kill", "redis_flush", "nvme_delete", "nvme_damage",
                   "disk_full"}
    # every fault followed by a right answer (within the soak's RECOVER_S, else it is a problem
    # above) and no wrong one in the minute after it. Not "a right answer within 60 s": on a loaded
    # machine the engine's restart takes 60-68 s, and a fault that ends just before it gets none
    assert all(f["recovered_s"] is not None and f["after_60s"]["wrong"] == 0 for f in res["faults"])
    assert res["requests"] > 200 and res["by_kind"].get("chat") and res["by_kind"].get("agent")
    assert sum(v or 0 for v in res["hit_rate"].values()) > 0.05  # the store served through it all (0.16-0.6 here)
    assert (out / "soak.png").stat().st_size > 10_000
