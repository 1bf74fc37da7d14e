"""kvstore.offload.hooktime: the connector hooks' time on the engine's thread, counted per
hook and side, and exported at scrape time."""

from __future__ import annotations

import time

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from kvstore.offload.hooktime import IDLE_HOOK, HookClock, HookTotals, timed


class Hooks:
    def __init__(self, clock):
        self.clock = clock

    @timed
    def slow(self, s: float) -> str:
        time.sleep(s)
        return "done"

    @timed
    def fails(self) -> None:
        time.sleep(0.01)
        raise KeyError("bad")


def test_a_clock_without_totals_keeps_counts_until_taken():
    c = HookClock()
    h = Hooks(c)
    assert h.slow(0.02) == "done" and h.slow(0.0) == "done"
    with pytest.raises(KeyError):
        h.fails()  # a hook that raises is counted, and its error goes on
    got = c.take()
    assert set(got) == {"slow", "fails"}
    assert got["slow"][1] == 2 and 0.02 <= got["slow"][0] < 1.0
    assert got["fails"][1] == 1 and got["fails"][0] >= 0.01
    assert c.take() == {}  # taken: from zero again


def test_a_clock_with_totals_is_read_live_under_its_side():
    t = HookTotals()
    h = Hooks(HookClock(t, "worker"))
    h.slow(0.015)
    with pytest.raises(AssertionError):
        h.clock.take()  # read by the totals: taking would lose counts from the scrape
    snap = t.snapshot()
    assert list(snap) == [("worker", "slow")] and snap[("worker", "slow")][1] == 1
    assert t.seconds("worker") >= 0.015 and t.seconds("scheduler") == 0.0
    t.add("scheduler", {"build_connector_meta": (0.25, 3)})  # a plan's counts from another process
    assert t.seconds() == pytest.approx(snap[("worker", "slow")][0] + 0.25)


def test_totals_sum_the_live_clocks_of_a_side():
    t = HookTotals()
    a, b = HookClock(t, "worker"), HookClock(t, "worker")
    a.add("start_load_kv", 0.25)
    b.add("start_load_kv", 0.5)
    assert t.snapshot() == {("worker", "start_load_kv"): (0.75, 2)}
    a.add("start_load_kv", 0.25)  # counted after the first scrape: the next one sees it
    t.add("worker", {"start_load_kv": (1.0, 1)})
    assert t.snapshot() == {("worker", "start_load_kv"): (2.0, 4)}


def test_without_a_clock_nothing_is_counted():
    assert Hooks(None).slow(0.0) == "done"


def test_the_idle_wait_is_counted_apart_and_left_out_of_the_cost():
    t = HookTotals()
    c = HookClock(t, "worker")
    c.add(IDLE_HOOK, 0.5)
    c.add("get_finished", 0.001)
    assert t.seconds() == pytest.approx(0.001)
    assert t.snapshot()[("worker", IDLE_HOOK)] == (0.5, 1)


def test_a_bad_side_is_an_error():
    with pytest.raises(ValueError, match="hook side 'gpu'"):
        HookClock(None, "gpu")
    with pytest.raises(ValueError, match="hook side 'x'"):
        HookTotals().add("x", {"a": (1.0, 1)})


def test_totals_are_prometheus_counters_read_at_scrape_time():
    r = CollectorRegistry()
    t = HookTotals()
    r.register(t)
    t.add("worker", {"start_load_kv": (0.5, 2)})
    t.add("scheduler", {"get_num_new_matched_tokens": (0.125, 4)})
    text = generate_latest(r).decode()
    assert 'kvstore_engine_hook_seconds_total{hook="start_load_kv",side="worker"} 0.5' in text
    assert 'kvstore_engine_hook_calls_total{hook="get_num_new_matched_tokens",side="scheduler"} 4.0' in text
    t.add("worker", {"start_load_kv": (0.25, 1)})  # a later scrape sees the new totals
    assert 'kvstore_engine_hook_seconds_total{hook="start_load_kv",side="worker"} 0.75' in generate_latest(r).decode()
