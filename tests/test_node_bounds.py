"""The node daemon's bounds, found by a review (each test failed before its fix): what one engine's
report, a detached engine's figures, a reader's first read, a block's name and a call not sent
whole may cost the daemon or the other engines. The daemon is real, in this process where a test
only needs it to serve, a ``kvstore serve`` process where a test freezes it.
"""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest
from prometheus_client import Counter

from conftest import blocks_for, make_keys
from kvstore.node import metrics
from kvstore.node.metrics import MAX_SAMPLES, check_report
from test_node import _answers, _state, _wait, daemon, engine, load, served, store, BB  # noqa: F401

TAG = "kvstore_engine_tag_prompt_tokens"


def attachment(d, name: str):
    return next(a for a in d.engines.values() if a.name == name)


def skipped_samples(d) -> float:
    fam = next(f for f in d.metrics.collect() if f.name == "kvstore_node_report_skipped_samples")
    return fam.samples[0].value


# -- one long tag refused an engine's whole report -------------------------------------------------

def test_a_report_keeps_its_good_samples_and_counts_the_bad(daemon):
    """Request tags are up to 256 characters, labels were refused past 128: one such tag refused
    the engine's whole report, so none of its figures reached the daemon."""
    d, cfg = daemon()
    e = engine(cfg, "e")
    try:
        Counter("kvstore_engine_prompt_tokens", "", registry=e.metrics.registry).inc(100)
        Counter(TAG, "", ["tag"], registry=e.metrics.registry).labels("t" * 256).inc(7)  # a tag's longest
        Counter("kvstore_engine_bogus_tokens", "", ["tag"], registry=e.metrics.registry).labels("x" * 257).inc()
        e._report(force=True)
        a = attachment(d, "e")
        _wait(lambda: a.report and skipped_samples(d) == 1, "the report was refused whole")
        assert a.report == {("kvstore_engine_prompt_tokens_total", ()): 100.0,
                            (f"{TAG}_total", (("tag", "t" * 256),)): 7.0}
        fam = next(f for f in d.metrics.collect() if f.name == TAG)
        assert [(s.labels["tag"], s.labels["engine"], s.value) for s in fam.samples] == [("t" * 256, "e", 7.0)]
    finally:
        e.close()


def test_a_report_that_is_not_a_list_of_samples_is_still_refused_whole():
    good = ["kvstore_engine_requests_total", {}, 1]
    assert check_report([good, ["kvstore_engine_requests_total", {"engine": "forged"}, 1]])[0] == \
        {("kvstore_engine_requests_total", ()): 1.0}
    for bad in ("not a list", {"a": 1}, [good] * (MAX_SAMPLES + 1)):
        with pytest.raises(ValueError, match="report: a list"):
            check_report(bad)


# -- a detached engine's label sets grew without bound ---------------------------------------------

def _lifetime(d, cfg, name: str, tags: list[str]) -> None:
    """An engine named ``name`` reports one count per tag, then detaches; back once the daemon retired it."""
    e = engine(cfg, name)
    try:
        c = Counter(TAG, "", ["tag"], registry=e.metrics.registry)
        for t in tags:
            c.labels(t).inc()
    finally:
        e.close()  # its last report, then its detach
    _wait(lambda: name in d.metrics.retired and (TAG + "_total", (("tag", tags[-1]),)) in d.metrics.retired[name][1],
          f"{name} was not retired")


def test_a_detached_engines_figures_keep_the_newest_label_sets_per_name_and_in_all(daemon, monkeypatch):
    """Each lifetime of an engine name added its label sets (request tags come and go) to the
    name's figures, kept for the daemon's life."""
    monkeypatch.setattr(metrics, "MAX_RETIRED_SERIES_PER_NAME", 6)
    monkeypatch.setattr(metrics, "MAX_RETIRED_SERIES", 10)
    d, cfg = daemon()
    for i in range(3):
        _lifetime(d, cfg, "e", [f"{i}-{j}" for j in range(4)])
    kept = [dict(labels)["tag"] for _, labels in d.metrics.retired["e"][1]]
    assert kept == ["1-2", "1-3", "2-0", "2-1", "2-2", "2-3"]  # the newest 6; lifetime 0's went first
    _lifetime(d, cfg, "f", ["f0", "f1", "f2", "f3"])
    assert d.metrics.series == 10 and list(d.metrics.retired) == ["e", "f"]
    _lifetime(d, cfg, "g", ["g0", "g1", "g2", "g3"])
    assert list(d.metrics.retired) == ["f", "g"] and d.metrics.series == 8  # the oldest name went


# -- a call not waited for kept its connection after it was cut short ------------------------------

def test_a_cast_not_sent_whole_closes_its_connection_and_is_counted(served):
    """The end of a handle and a report (sent, not waited for) kept using their connection after
    a send that timed out part way: the daemon then read the next frame from the middle of the cut one."""
    s = served(timeout_ms=200)
    a, b = engine(s.cfg, "a"), engine(s.cfg, "b")
    try:
        keys = make_keys(2, seed=10)
        data = blocks_for(keys, BB)
        assert store(a, keys, data) == 2 and _answers(b)  # each has its thread's connection
        la, lb = a._tls.link, b._tls.link
        tags = Counter(TAG, "", ["tag"], registry=b.metrics.registry)
        for i in range(MAX_SAMPLES):
            tags.labels(f"{i:03d}" + "t" * 250).inc()  # a report of ~140 KiB
        os.kill(s.proc.pid, signal.SIGSTOP)
        _wait(lambda: _state(s.proc.pid) == "T", "the daemon did not stop")
        for e, link, cast in ((a, la, lambda: a._end(a._gen, ["end_store!", 12345, [False] * 50_000])),
                              (b, lb, lambda: b._report(force=True))):
            for _ in range(50):  # the daemon reads nothing: the connection fills, then a send times out
                if link.sock is None:
                    break
                cast()
            assert link.sock is None, "the connection of a send cut short is still used"
        assert a.metrics.value("kvstore_engine_node_failed_calls_total", op="end_store") == 1
        assert b.metrics.value("kvstore_engine_node_failed_calls_total", op="report") == 1
        os.kill(s.proc.pid, signal.SIGCONT)
        _wait(lambda: _answers(a) and _answers(b), "the engines never answered again", timeout=40)
        got = load(b, keys)
        assert len(got) == 2 and all(np.array_equal(g, x) for g, x in zip(got, data))
    finally:
        os.kill(s.proc.pid, signal.SIGCONT)
        a.close()
        b.close()
