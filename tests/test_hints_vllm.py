"""Per-request hints and the prefill clock through a real vLLM engine (issue 17 items 1 and 3).

* ``kv_transfer_params={"kvstore": {"store": false}}``: a one-off request; nothing of it is
  stored, and it still gets vLLM's output.
* ``{"kvstore": {"ttl_s": 7200}}``: the blocks it stores carry that idle TTL.
* A bad hint is an error in the log that names the request and the key; the request runs as
  usual, under the config.
* Hints are untrusted (issue 45, findings 6-8): a log line shows a key or a value escaped and cut
  (no forged line, no log grown by the request's size), at most ``LINES_PER_MINUTE`` a minute;
  a ``ttl_s`` above the operator's cap (``max_hint_ttl_s``) is cut to it; a tag or a session
  outside the safe alphabet is refused; all through a real engine too.
* The worker times mostly-prefill forward passes, so the store has a prefill estimate for the
  "load or recompute?" decision (the decision itself: tests/test_load_or_recompute.py).
"""

from __future__ import annotations

import logging
import time

import pytest

from kvstore.offload import hints
from kvstore.offload.prefillrate import PrefillRate

from conftest import FakeClock, prompt
from test_vllm_connector import Engine, reference

BS = 32


class _Lines(logging.Handler):
    """What a log file would get: each record formatted as a file handler formats it."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(self.format(record))


@pytest.fixture
def hint_log(monkeypatch):
    monkeypatch.setattr(hints, "limit", hints.LogLimit())  # a minute of its own: earlier tests' lines uncounted
    h, lg = _Lines(), logging.getLogger("kvstore.offload.hints")
    lg.addHandler(h)
    yield h.lines
    lg.removeHandler(h)


@pytest.mark.parametrize("params, want, logged", [
    (None, (None, True), []),
    ({"other_connector": {"x": 1}}, (None, True), []),
    ({"kvstore": {"ttl_s": 3600}}, (3600.0, True), []),
    ({"kvstore": {"store": False}}, (None, False), []),
    ({"kvstore": {"ttl_s": None, "store": True}}, (None, True), []),
    ({"kvstore": {"ttl_s": -1}}, (None, True), ["kvstore.ttl_s"]),
    ({"kvstore": {"ttl_s": "1h"}}, (None, True), ["kvstore.ttl_s"]),
    ({"kvstore": {"ttl_s": True}}, (None, True), ["kvstore.ttl_s"]),
    ({"kvstore": {"store": "no"}}, (None, True), ["kvstore.store"]),
    ({"kvstore": {"ttl": 60, "store": False}}, (None, False), ["kvstore.ttl"]),
    ({"kvstore": "keep"}, (None, True), ["'kvstore'"]),
])
def test_parse(params, want, logged, hint_log):
    assert hints.parse(params, "req-7") == want
    assert len(hint_log) == len(logged)
    for line, key in zip(hint_log, logged):
        assert "req-7" in line and key in line and "allowed" in line and "config applies" in line


FORGED = "x\nINFO kvstore.auth: admin token accepted"


def test_a_bad_hint_can_neither_forge_a_log_line_nor_grow_the_log(hint_log):
    """Finding 6: a key with a newline wrote a line of the attacker's; 5 MB of junk wrote 5 MB."""
    junk = "j" * 5_000_000
    assert hints.parse({"kvstore": {FORGED: 1, "ttl_s": "\x1b[2J" + junk}}, "req\n9") == (None, True)
    assert hints.parse({"kvstore": {junk: junk}}, "r10") == (None, True)
    assert hints.word({"kvstore": {"tag": ["\x1b[2J", junk]}}, "tag", "r11") is None
    assert hints.parse({"kvstore": [junk] * 3}, "r12") == (None, True)  # 15 MB: three requests of the issue
    assert len(hint_log) == 5
    for line in hint_log:
        assert "\n" not in line and "\r" not in line and "\x1b" not in line and len(line) < 700, line[:300]
    forged, ttl, big_key, tag, not_a_map = hint_log
    assert "\\nINFO kvstore.auth: admin token accepted" in forged and "'req\\n9'" in forged  # shown escaped
    assert "kvstore.ttl_s" in ttl and "\\x1b[2J" in ttl and "(5000004 characters)" in ttl
    assert "(5000000 characters)" in big_key and "kvstore.tag" in tag and "'kvstore'" in not_a_map


def test_bad_hint_lines_are_rate_limited_and_the_rest_counted(hint_log, monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(hints, "limit", hints.LogLimit(clock=clock))
    for i in range(100):  # a client sending a bad hint with every request
        assert hints.parse({"kvstore": {"ttl_s": -i}}, f"r{i}") == (None, True)  # each request still runs
    n = hints.LINES_PER_MINUTE
    assert len(hint_log) == n + 1 and "next are counted, not logged" in hint_log[-1]
    clock.advance(60)
    hints.parse({"kvstore": {"ttl_s": -1}}, "r100")
    assert f"{100 - n} more bad kv_transfer_params hints were not logged" in hint_log[n + 1]
    assert "r100" in hint_log[n + 2] and len(hint_log) == n + 3


@pytest.mark.parametrize("cap, ttl, want, cut", [
    (600.0, 1e12, 600.0, True),  # ~31,700 years asked: the operator's cap
    (600.0, 1e300, 600.0, True),  # (Redis refused its PX: the blocks were not shared)
    (600.0, 600, 600.0, False),
    (600.0, 60, 60.0, False),
    (None, 1e12, 1e12, False),  # no cap: a tier that never expires (then Redis's PX is clamped)
])
def test_a_ttl_hint_above_the_cap_is_cut_to_it(hint_log, cap, ttl, want, cut):
    """Finding 8: any API client kept its KV (its prompt) past the retention the operator set."""
    assert hints.parse({"kvstore": {"ttl_s": ttl}}, "r1", cap) == (want, True)
    assert len(hint_log) == cut
    if cut:
        assert "max_hint_ttl_s" in hint_log[0] and "cut to 600 s" in hint_log[0] and "r1" in hint_log[0]


def test_an_integer_past_a_float_is_a_bad_hint_not_an_error(hint_log):
    """``1`` and 400 zeros as a Python int: float() of it raised OverflowError, which parse did not
    catch. vLLM refuses extra_args integers past 64 bits itself (0.32); a direct caller did not."""
    assert hints.parse({"kvstore": {"ttl_s": 10 ** 400}}, "r1", 600.0) == (None, True)
    assert hints.word({"kvstore": {"tag": 10 ** 400}}, "tag", "r2") is None
    assert len(hint_log) == 2 and "an integer of 1329 bits" in hint_log[0] and "kvstore.tag" in hint_log[1]


def test_prefill_rate_counts_prefill_steps_only():
    seen = []
    r = PrefillRate(lambda t, s, p: seen.append((t, s, p)), min_tokens=128)
    r.start(prefill_tokens=512, total_tokens=520, pairs=70_000)
    r.stop()
    r.start(prefill_tokens=64, total_tokens=64)  # too few to measure a rate
    r.stop()
    r.start(prefill_tokens=300, total_tokens=600)  # half decode
    r.stop()
    r.stop()  # no start: nothing
    assert len(seen) == 1 and seen[0][0] == 520 and seen[0][1] > 0 and seen[0][2] == 70_000


def test_prefill_rate_leaves_out_synchronous_loads():
    """vLLM binds the metadata, runs a step's synchronous loads (start_load_kv), then the forward
    pass: the clock restarts after the loads."""
    seen = []
    r = PrefillRate(lambda t, s, p: seen.append(s), min_tokens=128)
    r.start(prefill_tokens=512, total_tokens=512)
    time.sleep(0.2)  # the loads
    r.loaded()
    r.stop()
    assert len(seen) == 1 and seen[0] < 0.2


def _generate(e: Engine, prompts, params):
    from vllm import SamplingParams

    outs = e.llm.generate([{"prompt_token_ids": p} for p in prompts],
                          [SamplingParams(max_tokens=8, temperature=0, extra_args={"kv_transfer_params": kp})
                           for kp in params], use_tqdm=False)
    assert e.llm.reset_prefix_cache()
    return [list(o.outputs[0].token_ids) for o in outs], [o.num_cached_tokens for o in outs]


def _ttls(store) -> list:
    ix = store.dram.index
    return sorted((e.ttl for e in ix.entries.values()), key=lambda t: (t is not None, t or 0))


@pytest.mark.vllm
def test_hints_through_the_engine(tiny_model, tmp_path, hint_log, monkeypatch):
    from kvstore.store.stepcost import StepCost

    once, kept, bad = prompt(300, 41), prompt(300, 42), prompt(300, 43)
    ref = reference(tiny_model, [once, kept, bad], max_tokens=8)
    steps = []  # (tokens, seconds) of each timed forward pass
    observe = StepCost.observe
    monkeypatch.setattr(StepCost, "observe", lambda self, n, p, t: (steps.append((n, t)), observe(self, n, p, t)))
    with Engine(tiny_model, str(tmp_path / "s"), dram_gb=0.2) as e:
        store = e.shared.store
        t0 = time.perf_counter()
        out, cached = _generate(e, [once], [{"kvstore": {"store": False}}])
        cold_s = time.perf_counter() - t0
        assert out == ref[:1] and cached == [0] and len(store.dram) == 0  # nothing stored
        out, cached = _generate(e, [kept], [{"kvstore": {"ttl_s": 7200}}])
        assert out == ref[1:2] and _ttls(store) == [7200.0] * 9  # its 9 full blocks, with the hint
        out, cached = _generate(e, [bad], [{"kvstore": {"ttl_s": -5, "bogus": 1}}])
        assert out == ref[2:] and _ttls(store) == [None] * 9 + [7200.0] * 9  # the config's TTL
        assert any("kvstore.ttl_s" in ln for ln in hint_log) and any("kvstore.bogus" in ln for ln in hint_log)
        # the one-off prompt again: still not stored, so not a hit; the others are
        out, cached = _generate(e, [once, kept, bad], [{"kvstore": {"store": False}}, None, None])
        assert out == ref and cached == [0, 288, 288]
        fit = store.rates.prefill.fit()  # timed forward passes, each its real length
        assert fit is not None and fit.seconds(0, 300) >= 0.05 * cold_s, (fit, cold_s)
        # every timed step is a whole forward pass of >= 128 tokens: milliseconds here, never the
        # microseconds between vLLM's start_load_kv and wait_for_save on a step without loads
        assert len(steps) >= 4 and min(t for _, t in steps) > 1e-3, steps


@pytest.mark.vllm
def test_untrusted_hints_through_the_engine(tiny_model, tmp_path, hint_log):
    """Findings 6-8 through the connector: a 1e12 s hint is held to ``max_hint_ttl_s`` in the
    tier's entries; a tag with an ESC and a vLLM ``session_id`` with a newline are refused (the
    request goes on untagged, its session the kvstore.session hint); a forged key is one escaped
    line. Every request gets vLLM's output."""
    from vllm import SamplingParams

    from kvstore.trace import read_trace

    a, b = prompt(300, 44), prompt(300, 45)
    ref = reference(tiny_model, [a, b], max_tokens=8)
    trace = tmp_path / "trace.jsonl"
    e = Engine(tiny_model, str(tmp_path / "s"), dram_gb=0.2, extra={"max_hint_ttl_s": 600, "trace_path": str(trace)})
    outs = []

    def run(rid: str, p: list[int], kv: dict, session_id: str | None = None) -> None:
        eng = e.llm.llm_engine
        eng.add_request(rid, {"prompt_token_ids": p}, SamplingParams(max_tokens=8, temperature=0, extra_args={
            "kv_transfer_params": {"kvstore": kv}}), session_id=session_id)
        while eng.has_unfinished_requests():
            outs.extend(list(o.outputs[0].token_ids) for o in eng.step() if o.finished)

    try:
        store = e.shared.store
        run("ra", a, {"ttl_s": 1e12, "tag": "\x1b[2J", "session": "conv-a"}, session_id="forged\nid")
        assert _ttls(store) == [600.0] * 9  # its 9 full blocks: the operator's cap, not ~31,700 years
        run("rb", b, {FORGED: 1, "tag": "tenant-a"})
        reg = e.shared.metrics.registry
        tags = {s.labels["tag"] for fam in reg.collect() for s in fam.samples if "tag" in s.labels}
    finally:
        e.close()
    assert outs == ref and tags == {"tenant-a"}
    recs = list(read_trace(trace))
    assert [(r.session[:3], r.tag) for r in recs] == [("con", None), ("rb-", "tenant-a")]  # vLLM's "rb-<suffix>"
    assert recs[0].session == "conv-a"
    assert all("\n" not in ln and "\x1b" not in ln for ln in hint_log)
    assert [k for k in ("max_hint_ttl_s", "session_id", "'kvstore.tag'", "admin token") if
            any(k in ln for ln in hint_log)] == ["max_hint_ttl_s", "session_id", "'kvstore.tag'", "admin token"]
