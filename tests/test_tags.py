"""Request tags (issue 32, ``kv_transfer_params: {"kvstore": {"tag": ...}}``): a bounded label set
in the metrics, the top tags by name in ``kvstore stats``; through the engine:
tests/test_vllm_sessions.py. Tags are untrusted (issue 45, finding 7): a safe alphabet, and label
slots held by the most recently used tags (a flood of junk tags took the 20 slots for good)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from kvstore.offload import hints
from kvstore.offload.metrics import MAX_TAGS, OffloadMetrics, RequestOutcome
from kvstore.offload.readout import SHOWN_TAGS, render_engine, summarize, values


def _labels(m: OffloadMetrics) -> dict[str, float]:
    """tag -> prompt tokens, from every tag series; the other two tag counters have the same labels."""
    out = {}
    for fam in m.registry.collect():
        for s in fam.samples:
            if s.name.startswith("kvstore_engine_tag_") and s.name.endswith("_total"):
                out.setdefault(s.name, {})[s.labels["tag"]] = s.value
    assert len(out) == 3 and len({frozenset(v) for v in out.values()}) == 1
    return out["kvstore_engine_tag_prompt_tokens_total"]


def test_labels_are_bounded_and_stats_show_the_top_tags():
    m = OffloadMetrics(CollectorRegistry())
    for i in range(MAX_TAGS + 5):  # tag i: (i + 1) requests of 100 tokens, 10 local, 45 pinned
        for _ in range(i + 1):
            m.record(RequestOutcome(f"r{i}", 100, 10, 45, 45, tag=f"t{i:02d}"))
    labels = _labels(m)  # the 20 most recently used; the 5 oldest aged out into "other"
    assert set(labels) == {f"t{i:02d}" for i in range(5, MAX_TAGS + 5)} | {"other"}
    assert labels["other"] == 100 * sum(range(1, 6))
    e = summarize(values(m.registry))["engine"]
    named = [t for t in e["tags"] if t != "other"]
    assert named == [f"t{i:02d}" for i in range(MAX_TAGS + 4, MAX_TAGS + 4 - SHOWN_TAGS, -1)]  # most tokens first
    assert list(e["tags"])[-1] == "other"
    total = sum(d["prompt_tokens"] for d in e["tags"].values())
    assert total == 100 * sum(range(1, MAX_TAGS + 6))  # every tagged token, in a named series or "other"
    assert all(d["hit_rate"] == 0.5 for d in e["tags"].values())
    assert any(line.strip().startswith("t24") for line in render_engine(e))


def test_label_slots_go_to_the_most_recently_used_tags():
    """Finding 7: after 21 junk tags a real tenant's tag was "other" for the life of the process."""
    m = OffloadMetrics(CollectorRegistry())
    for i in range(MAX_TAGS + 1):
        m.record(RequestOutcome(f"j{i}", 10, 0, 0, 0, tag=f"junk-{i}"))
    m.record(RequestOutcome("t", 100, 0, 50, 50, tag="tenant-a"))
    labels = _labels(m)
    assert labels["tenant-a"] == 100 and len(labels) == MAX_TAGS + 1  # 20 slots and "other"
    assert "junk-0" not in labels and "junk-1" not in labels and labels["other"] == 20  # aged out, kept in other
    for i in range(10 * MAX_TAGS):  # a flood of new tags, while the tenant keeps sending
        m.record(RequestOutcome(f"f{i}", 10, 0, 0, 0, tag=f"flood-{i}"))
        if i % (MAX_TAGS // 2) == 0:
            m.record(RequestOutcome("t", 100, 0, 50, 50, tag="tenant-a"))
    labels = _labels(m)
    assert labels["tenant-a"] == 100 * 21 and len(labels) == MAX_TAGS + 1
    assert sum(labels.values()) == 10 * (MAX_TAGS + 1) + 100 * 21 + 10 * 10 * MAX_TAGS
    m.record(RequestOutcome("o", 7, 0, 0, 0, tag="other"))  # a client's tag "other" takes no slot
    assert _labels(m)["other"] == labels["other"] + 7 and len(_labels(m)) == MAX_TAGS + 1


@pytest.mark.parametrize("tag", ["\x1b[2J", "a\nb", "tab\there", "rtl\u202eevil", "zero\u200bwidth", "", "x" * 257])
def test_a_tag_outside_the_safe_alphabet_is_refused(tag):
    """Finding 7: an ESC in a tag cleared the operator's screen in ``kvstore stats``."""
    assert hints.word({"kvstore": {"tag": tag}}, "tag", "r1") is None  # logged; the request goes on untagged
    o = RequestOutcome("r", 10, 0, 0, 0, tag=tag)
    assert RequestOutcome.from_json(o.to_json()).tag == ""  # nor over the scheduler's socket


@pytest.mark.parametrize("tag, want", [("search", "search"), ("tenant a/tool:grep", "tenant a/tool:grep"),
                                       ("检索", "检索"), (42, "42"), ("x" * 256, "x" * 256)])
def test_a_tag_inside_it_is_kept(tag, want):
    assert hints.word({"kvstore": {"tag": tag}}, "tag", "r1") == want


def test_tags_from_requests_and_over_the_socket():
    assert hints.word({"kvstore": {"tag": "search", "ttl_s": 60}}, "tag", "r1") == "search"
    assert hints.parse({"kvstore": {"tag": "search"}}, "r1") == (None, True)  # not an unknown key
    assert hints.word({"kvstore": {"tag": ["x"]}}, "tag", "r1") is None  # a bad one: logged, ignored
    assert hints.word({"kvstore": {"tag": "x" * 257}}, "tag", "r1") is None
    o = RequestOutcome("r", 10, 0, 0, 0, tag="search")
    assert RequestOutcome.from_json(o.to_json()) == o
