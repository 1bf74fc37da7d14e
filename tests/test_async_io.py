"""The data path off the forward pass (issue 13), through a real vLLM engine.

* The first (inline) design and the asynchronous one give the same greedy outputs as vLLM itself,
  cold, from DRAM and from NVMe (an asynchronous load: the request waits in
  ``WAITING_FOR_REMOTE_KVS`` while another one runs).
* A block whose save is in flight is never freed and reused before its copy completes: the
  gather is held on purpose (failpoint ``mover.gather=hold``) while other requests need every
  block of a tiny KV space; the held request's blocks stay allocated (vLLM's delayed free) until
  the copy is done, so what was stored under its keys is its own KV.
* An asynchronous load completes before the forward pass reads it: the load is held on purpose
  (``mover.scatter=hold``) while another request runs; the held one is computed over its loaded
  KV only after the load, with the same output.
* The hook clock (``kvstore_engine_hook_seconds_total``) counts what the engine's thread waited
  for: a held DRAM load (synchronous in both designs) shows in ``start_load_kv``, a held
  asynchronous load does not.
"""

from __future__ import annotations

import threading

import pytest

from kvstore import failpoints

from conftest import prompt
from test_vllm_connector import Engine, loaded, reference

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

SYNC = {"io": {"async_saves": False, "async_loads": False}}
ASYNC = {"io": {"async_saves": True, "async_loads": True}}


def _open_gate_after(seconds: float) -> threading.Timer:
    t = threading.Timer(seconds, failpoints.open_gate)
    t.start()
    return t


@pytest.mark.parametrize("design", ["sync", "async"])
def test_both_designs_give_vllms_outputs(tiny_model, tmp_path, design):
    extra = SYNC if design == "sync" else ASYNC
    store = str(tmp_path / "s")
    prompts = [prompt(300, 1), prompt(650, 2)]
    other = prompt(200, 3)
    ref = reference(tiny_model, prompts + [other])
    with Engine(tiny_model, store, extra=extra) as e:
        assert e.generate(prompts) == (ref[:2], [0, 0])
        hooks = e.shared.metrics.hooks
        before = hooks.snapshot().get(("worker", "start_load_kv"), (0.0, 0))[0]
        failpoints.close_gate()
        failpoints.arm("mover.scatter=hold*1")  # the DRAM hits' copy waits for the gate
        try:
            timer = _open_gate_after(0.5)  # counts from before the request is scheduled
            assert e.generate(prompts) == (ref[:2], [288, 640])  # DRAM hits (vLLM's own cache was reset)
            timer.join()
        finally:
            failpoints.clear()
        assert loaded(e.shared, "dram") == 288 + 640
        # DRAM hits load on the engine's thread in both designs, and the hook clock saw the wait
        # (a copy of 928 tokens takes about 1 ms)
        assert hooks.snapshot()[("worker", "start_load_kv")][0] - before >= 0.3
        jobs = e.shared.jobs
        assert (jobs is not None) == (design == "async")
        if jobs is not None:
            # the prompts were stored in one step (the hits are never offered again); DRAM hits stay synchronous
            assert jobs.counts["stores"] >= 1 and jobs.counts["loads"] == 0
    with Engine(tiny_model, store, extra=extra) as e:  # empty DRAM: NVMe hits, with another request beside
        out, cached = e.generate(prompts + [other])
        assert out == ref and cached == [288, 640, 0]
        assert loaded(e.shared, "nvme") == 288 + 640
        if design == "async":
            assert e.shared.jobs.counts["loads"] == 2  # both waited in WAITING_FOR_REMOTE_KVS
        out, cached = e.generate(prompts)  # promoted to DRAM by the first read
        assert out == ref[:2] and cached == [288, 640]


def test_a_block_whose_save_is_in_flight_is_never_reused_before_its_copy(tiny_model, tmp_path):
    a = prompt(600, 11)  # 18 full blocks of 32 tokens
    others = [prompt(600, 12 + i) for i in range(2)]
    ref = reference(tiny_model, [a] + others, max_tokens=4)
    with Engine(tiny_model, str(tmp_path / "s"), extra=ASYNC, num_gpu_blocks_override=48, max_num_seqs=4,
                max_model_len=1024, dram_gb=0.2) as e:
        failpoints.close_gate()
        failpoints.arm("mover.gather=hold*1")  # a's gather waits for the gate
        gathers = failpoints.fired("mover.gather")  # counted over the process
        try:
            out, _ = e.generate([a], max_tokens=4, reset=False)
            assert out == ref[:1]
            jobs = e.shared.jobs
            assert jobs.counts["delayed_frees"] == 1  # a finished while its copy was held: blocks kept
            # the others need 2 x 19 blocks of 48; a still holds 19 of them: they wait for a's copy,
            # which the gate releases later (if a's blocks had been freed they would run over them now)
            timer = _open_gate_after(2.0)
            out, _ = e.generate(others, max_tokens=4, reset=False)
            timer.join()
            assert out == ref[1:]
            assert failpoints.fired("mover.gather") == gathers + 1
        finally:
            failpoints.clear()
        e.generate([prompt(20, 99)], max_tokens=1, reset=False)  # one more step: delayed frees are reported
        assert e.llm.reset_prefix_cache()
        out, cached = e.generate([a], max_tokens=4)  # from kvstore: a's own KV, not another request's
        assert cached == [576] and loaded(e.shared, "dram") >= 576
        assert out == ref[:1]


def test_an_async_load_completes_before_the_forward_pass_reads_it(tiny_model, tmp_path):
    store = str(tmp_path / "s")
    a, b = prompt(640, 21), prompt(300, 22)
    ref = reference(tiny_model, [a, b], max_tokens=8)
    with Engine(tiny_model, store, extra=ASYNC) as e:
        e.generate([a], max_tokens=8)
    with Engine(tiny_model, store, extra=ASYNC, dram_gb=0) as e:  # NVMe only: a's hit loads asynchronously
        failpoints.close_gate()
        failpoints.arm("mover.scatter=hold*1")
        hooks = e.shared.metrics.hooks
        before, fired = hooks.seconds(), failpoints.fired("mover.scatter")
        try:
            timer = _open_gate_after(1.5)
            out, cached = e.generate([a, b], max_tokens=8)  # b runs while a waits for its KV
            timer.join()
            assert failpoints.fired("mover.scatter") == fired + 1
        finally:
            failpoints.clear()
        assert out == ref and cached == [608, 0]
        # the engine's thread never waited for the held load: its hooks took far less than 1.5 s
        # (the idle steps' short waits for the load, when nothing else could run, are counted apart)
        assert hooks.seconds() - before < 0.5, hooks.snapshot()
        assert e.shared.jobs.counts["loads"] == 1 and loaded(e.shared, "nvme") == 608
