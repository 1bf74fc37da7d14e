"""Per-request hints and the prefill clock through a real vLLM engine (issue 17 items 1 and 3).

* ``kv_transfer_params={"kvstore": {"store": false}}``: a one-off request; nothing of it is
  stored, and it still gets vLLM's output.
* ``{"kvstore": {"ttl_s": 7200}}``: the blocks it stores carry that idle TTL.
* A bad hint is an error in the log that names the request and the key; the request runs as
  usual, under the config.
* The worker times mostly-prefill forward passes, so the store has a prefill estimate for the
  "load or recompute?" decision (the decision itself: tests/test_load_or_recompute.py).
"""

from __future__ import annotations

import logging
import time

import pytest

from kvstore.offload import hints
from kvstore.offload.prefillrate import PrefillRate

from conftest import prompt
from test_vllm_connector import Engine, reference

BS = 32


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.fixture
def hint_log():
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
