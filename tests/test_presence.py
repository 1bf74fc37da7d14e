"""The remote tier's presence memo (kvstore.tiers.redis.presence): answers reused for ttl_s, a probe
before the whole walk, bounded size, writes and failed reads folded in. Pure: a fake clock and
an ``ask`` that records what it was asked."""

from __future__ import annotations

from kvstore.tiers.redis.presence import Presence

from conftest import FakeClock

KEYS = [bytes([i]) * 16 for i in range(40)]


class Ask:
    def __init__(self, present: set[bytes]):
        self.present, self.asked = present, []

    def __call__(self, keys):
        self.asked.append(len(keys))
        return [k in self.present for k in keys]


def test_probe_then_the_rest_then_the_memo():
    clock = FakeClock()
    p = Presence(clock, probe=16)
    ask = Ask(set(KEYS[:30]))
    assert p.walk(KEYS, ask) == 30 and ask.asked == [16, 24]  # 16 present: all the rest in one go
    assert p.walk(KEYS, ask) == 30 and ask.asked == [16, 24]  # answered from the memo
    assert p.walk(KEYS[5:], ask) == 25 and len(ask.asked) == 2
    clock.advance(1.01)  # stale: asked again
    assert p.walk(KEYS, ask) == 30 and ask.asked == [16, 24, 16, 24]


def test_a_miss_asks_only_the_probe():
    p = Presence(FakeClock(), probe=16)
    ask = Ask(set())
    assert p.walk(KEYS, ask) == 0 and ask.asked == [16]
    assert p.walk(KEYS, ask) == 0 and ask.asked == [16]  # the first key's "absent" is remembered


def test_stored_and_forget():
    p = Presence(FakeClock(), probe=4)
    ask = Ask(set())
    p.stored(KEYS[:3])
    assert p.walk(KEYS[:3], ask) == 3 and ask.asked == []
    p.forget(KEYS[1:2])  # a read found it gone: asked again (and now absent)
    assert p.walk(KEYS[:3], ask) == 1 and ask.asked == [2]


def test_bounded():
    p = Presence(FakeClock(), max_keys=10)
    p.stored(KEYS)
    assert len(p) == 10
    ask = Ask(set(KEYS))
    assert p.walk(KEYS[:5], ask) == 5 and ask.asked == [5]  # the oldest were dropped
