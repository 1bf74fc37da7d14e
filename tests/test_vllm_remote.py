"""The remote tier through real vLLM engines (issue 14): KV computed by one engine is a hit on another
engine in another process, with its own DRAM and NVMe folders, through one real Redis (password
protected); the outputs are vLLM's own prefix-cache outputs. A server killed mid-run costs hits,
never an engine error or a wrong output, and sharing resumes after a restart."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed", allow_module_level=True)

from redis_servers import redis_launcher  # noqa: E402,F401
from conftest import prompt  # noqa: E402
from test_vllm_connector import Engine  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
BS = 32


def _drive(job: dict, password: str, mp: bool = False) -> dict:
    env = dict(os.environ, KVSTORE_REDIS_PASSWORD=password, VLLM_ENABLE_V1_MULTIPROCESSING="1" if mp else "0")
    p = subprocess.run([sys.executable, os.path.join(HERE, "vllm_driver.py"), json.dumps(job)], capture_output=True,
                       text=True, timeout=600, env=env, cwd=ROOT)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert p.returncode == 0 and lines, p.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT "):])


def _own_prefix_hit(model: str, prompts: list[list[int]]) -> list[list[int]]:
    """vLLM's outputs when its own prefix cache holds the prompts (no connector), in a fresh
    process (as the engines under test)."""
    script = (
        "import json, sys\n"
        "from vllm import LLM, SamplingParams\n"
        "job = json.loads(sys.argv[1])\n"
        "llm = LLM(job['model'], enforce_eager=True, block_size=job['bs'], max_model_len=4096, dtype='float32',"
        " seed=0, enable_prefix_caching=True)\n"
        "sp = SamplingParams(max_tokens=16, temperature=0)\n"
        "ps = [{'prompt_token_ids': p} for p in job['prompts']]\n"
        "llm.generate(ps, sp, use_tqdm=False)\n"
        "outs = llm.generate(ps, sp, use_tqdm=False)\n"
        "print('RESULT ' + json.dumps({'tokens': [list(o.outputs[0].token_ids) for o in outs],"
        " 'cached': [o.num_cached_tokens for o in outs]}), flush=True)\n"
        "llm.llm_engine.engine_core.shutdown()\n")
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1")
    p = subprocess.run([sys.executable, "-c", script, json.dumps({"model": model, "bs": BS, "prompts": prompts})],
                       capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert p.returncode == 0 and lines, p.stderr[-4000:]
    r = json.loads(lines[-1][len("RESULT "):])
    assert all(c > 0 for c in r["cached"])  # the second pass hit vLLM's own prefix cache
    return r["tokens"]


def test_a_second_engine_hits_what_the_first_computed(tiny_model, tmp_path, redis_launcher):  # noqa: F811
    srv = redis_launcher.single(password="pw-two-engines")
    prompts = [prompt(300, 41), prompt(520, 42)]
    remote = {"url": srv.url, "timeout_ms": 1000}
    a = _drive({"model": tiny_model, "store": str(tmp_path / "a"), "prompts": prompts, "block_size": BS,
                "remote": remote}, srv.password)
    assert a["rounds"][0]["cached"] == [0, 0]
    assert a["counters"]["remote_written_bytes"] > 0
    # engine b in vLLM's multiprocess mode: its worker reads Redis, its scheduler asks over RPC
    b = _drive({"model": tiny_model, "store": str(tmp_path / "b"), "prompts": prompts, "block_size": BS,
                "remote": remote, "module_path": True}, srv.password, mp=True)
    full = [(len(p) - 1) // BS * BS for p in prompts]
    # every full block but the last token's: b's own prefix cache and folders were empty, so
    # they can only have come from Redis
    assert b["rounds"][0]["cached"] == full
    assert b["rounds"][0]["tokens"] == a["rounds"][0]["tokens"] == _own_prefix_hit(tiny_model, prompts)


def test_server_killed_mid_run(tiny_model, tmp_path, redis_launcher, monkeypatch):  # noqa: F811
    srv = redis_launcher.single(password="pw-kill-run")
    monkeypatch.setenv("KVSTORE_REDIS_PASSWORD", srv.password)
    remote = {"url": srv.url, "timeout_ms": 200}
    p1, p2, p3 = [prompt(260, 51)], [prompt(260, 52)], [prompt(260, 53)]
    r = _own_prefix_hit(tiny_model, p1 + p2 + p3)
    ref = {0: r[:1], 1: r[1:2], 2: r[2:]}
    tiers = {"dram": {"capacity_gb": 0.05, "ttl_s": None},
             "nvme": {"path": str(tmp_path / "a"), "capacity_gb": 1, "ttl_s": None}, "remote": remote}
    with Engine(tiny_model, str(tmp_path / "a"), block_size=BS, extra={"tiers": tiers}) as e:
        assert e.generate(p1)[0] == ref[0]
        srv.kill()
        # the local tiers still serve p1; p2 is computed; nothing fails
        outs, cached = e.generate(p1)
        assert outs == ref[0] and cached[0] > 0
        outs, cached = e.generate(p2)
        assert outs == ref[1] and cached == [0]
        sh = e.shared
        assert sh.store.metrics.value("kvstore_remote_up") == 0
        srv.restart()  # empty: what the engine stores from now on is shared again
        deadline = time.monotonic() + 60
        while not sh.store.remote.client.available and time.monotonic() < deadline:
            time.sleep(0.1)  # the tier's backoff (0.5 s doubling per failure)
        outs, cached = e.generate(p3)
        assert outs == ref[2] and cached == [0]
        served = sh.metrics.registry.get_sample_value("kvstore_engine_served_tokens_total", {"tier": "remote"})
        assert not served  # this engine served everything from its own tiers
        sh.store.flush()  # write-through on the I/O pool
        assert srv.client().dbsize() == (len(p3[0]) - 1) // BS
    b = _drive({"model": tiny_model, "store": str(tmp_path / "b"), "prompts": p3, "block_size": BS,
                "remote": remote}, srv.password)
    assert b["rounds"][0]["cached"] == [(len(p3[0]) - 1) // BS * BS]
    assert b["rounds"][0]["tokens"] == ref[2]
