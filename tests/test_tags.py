"""Request tags (issue 32, ``kv_transfer_params: {"kvstore": {"tag": ...}}``): a bounded label set
in the metrics, the top tags by name in ``kvstore stats``; through the engine:
tests/test_vllm_sessions.py."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from kvstore.offload import hints
from kvstore.offload.metrics import MAX_TAGS, OffloadMetrics, RequestOutcome
from kvstore.offload.readout import SHOWN_TAGS, render_engine, summarize, values


def test_labels_are_bounded_and_stats_show_the_top_tags():
    m = OffloadMetrics(CollectorRegistry())
    for i in range(MAX_TAGS + 5):  # tag i: (i + 1) requests of 100 tokens, 10 local, 45 pinned
        for _ in range(i + 1):
            m.record(RequestOutcome(f"r{i}", 100, 10, 45, 45, tag=f"t{i:02d}"))
    labels = {s.labels["tag"] for fam in m.registry.collect() for s in fam.samples
              if s.name == "kvstore_engine_tag_prompt_tokens_total"}
    assert labels == {f"t{i:02d}" for i in range(MAX_TAGS)} | {"other"}
    e = summarize(values(m.registry))["engine"]
    named = [t for t in e["tags"] if t != "other"]
    assert named == [f"t{i:02d}" for i in range(MAX_TAGS - 1, MAX_TAGS - 1 - SHOWN_TAGS, -1)]  # most tokens first
    assert list(e["tags"])[-1] == "other"
    total = sum(d["prompt_tokens"] for d in e["tags"].values())
    assert total == 100 * sum(range(1, MAX_TAGS + 6))
    assert all(d["hit_rate"] == 0.5 for d in e["tags"].values())
    assert any(line.strip().startswith("t19") for line in render_engine(e))


def test_tags_from_requests_and_over_the_socket():
    assert hints.word({"kvstore": {"tag": "search", "ttl_s": 60}}, "tag", "r1") == "search"
    assert hints.parse({"kvstore": {"tag": "search"}}, "r1") == (None, True)  # not an unknown key
    assert hints.word({"kvstore": {"tag": ["x"]}}, "tag", "r1") is None  # a bad one: logged, ignored
    assert hints.word({"kvstore": {"tag": "x" * 257}}, "tag", "r1") is None
    o = RequestOutcome("r", 10, 0, 0, 0, tag="search")
    assert RequestOutcome.from_json(o.to_json()) == o
