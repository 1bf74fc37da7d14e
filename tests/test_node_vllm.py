"""The node cache through real vLLM engines (issue 46): one ``kvstore serve``, engines in processes of
their own attached to it with ``mode: node``. What one engine computed is a DRAM hit on the next
(another engine, or the same after a restart), with vLLM's own prefix-cache outputs; the daemon's
DRAM holds the prompt once."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import uuid

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed", allow_module_level=True)

from conftest import prompt  # noqa: E402
from kvstore.bench.common.ports import free_port  # noqa: E402
from kvstore.ops.stats import fetch  # noqa: E402
from node_servers import Served  # noqa: E402
from test_vllm_remote import BS, _drive, _own_prefix_hit  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_an_engine_hits_in_dram_what_another_computed(tiny_model, tmp_path):
    name, port = f"v-{uuid.uuid4().hex[:10]}", free_port()
    cfg = {"tiers": {"dram": {"capacity_gb": 0.25, "pin_memory": False},
                     "nvme": {"path": str(tmp_path / "nvme"), "capacity_gb": 1}},
           "mode": "node", "node": {"name": name}, "metrics": {"port": port}}
    daemon = Served(tmp_path, cfg)
    try:
        prompts = [prompt(300, 61), prompt(520, 62)]
        node = {"mode": "node", "node": {"name": name}}
        # engine a in vLLM's multiprocess mode: its worker process attaches and gathers into the slab
        a = _drive({"model": tiny_model, "store": str(tmp_path / "a"), "prompts": prompts, "block_size": BS,
                    "extra": node}, "", mp=True)
        assert a["rounds"][0]["cached"] == [0, 0]
        # engine b, a new process (a restart, or another replica): everything but the last token's
        # block is a DRAM hit in the daemon, which only engine a can have put there
        b = _drive({"model": tiny_model, "store": str(tmp_path / "b"), "prompts": prompts, "block_size": BS,
                    "extra": node}, "")
        full = [(len(p) - 1) // BS * BS for p in prompts]
        assert b["rounds"][0]["cached"] == full
        assert b["counters"]["served_dram_tokens"] == sum(full)
        assert b["counters"]["stored_blocks"] == 0  # nothing to store: the host holds it once
        assert b["rounds"][0]["tokens"] == _own_prefix_hit(tiny_model, prompts)
        assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()  # the engines keep no tier
        # the operator's view (kvstore stats --url on the daemon): each engine's figures, as it
        # counted them and reported them to the daemon, and the host's
        url = f"http://127.0.0.1:{port}/metrics"
        s = fetch(url)
        assert sorted(e["served_tokens"]["dram"] for e in s["engines"].values()) == [0, sum(full)]
        assert s["engine"]["served_tokens"]["dram"] == sum(full)
        assert s["engine"]["prompt_tokens"] == 2 * sum(len(p) for p in prompts)
        out = subprocess.run([sys.executable, "-m", "kvstore.ops.cli", "stats", "--url", url], capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 0 and "engines (2" in out.stdout, out.stdout + out.stderr
    finally:
        out = daemon.stop()
    assert "engine" in out and "detached" in out
