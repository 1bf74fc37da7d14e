"""A bad kvstore config fails vLLM's start-up before any model loads (the plugin's check,
``kvstore.connectors.vllm.register``): where vLLM builds its config, with the ConfigError's text
as the last line, every bad key logged. Before it, the error came from the worker after the
model had loaded (42 s in, line 99 of 270 with the tiny model)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm")

pytestmark = [pytest.mark.vllm]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from kvstore.bench.common.tiny_model import build_tiny_llama

    return build_tiny_llama(str(tmp_path_factory.mktemp("model") / "tiny"), hidden=128, layers=2)


def engine_config(model: str, extra: dict, **kw):
    """What ``LLM(...)`` and the API server do first: vLLM's own config (no engine, no model)."""
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model=model, enforce_eager=True, max_model_len=1024, block_size=32,
                      kv_transfer_config=KVTransferConfig(kv_connector="KVStoreConnector", kv_role="kv_both",
                                                          kv_connector_extra_config=extra), **kw)
    return args.create_engine_config()


class _Records(logging.Handler):
    """What the plugin logs, read from its logger (vLLM's handler keeps the stream it found when it
    was made, which pytest's capture fixtures do not see once an earlier test made it). Added after
    vLLM configured its logging: its dictConfig empties the handlers of existing ``vllm.*`` loggers."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def test_the_config_is_checked_where_vllm_builds_its_config(tiny_model, tmp_path):
    from kvstore.connectors.vllm import KVStoreConfigError

    seen = _Records()
    try:
        _check_the_config(tiny_model, tmp_path, seen, KVStoreConfigError)
    finally:
        logging.getLogger("vllm.kvstore").removeHandler(seen)


def _check_the_config(tiny_model, tmp_path, seen, KVStoreConfigError):

    with pytest.raises(KVStoreConfigError) as e:
        engine_config(tiny_model, {"config": "agnet"})
    assert e.value.error.key == "config" and "agent, default" in str(e.value)
    assert not isinstance(e.value, ValueError)  # else pydantic would wrap it in a ValidationError
    logging.getLogger("vllm.kvstore").addHandler(seen)  # vLLM's logging is configured by now
    bad = {"config": "agent", "tiers": {"dram": {"capacity_gb": 100000, "polcy": "lru"}, "nvme": {"ttl_s": 0}}}
    with pytest.raises(KVStoreConfigError) as e:
        engine_config(tiny_model, bad)
    assert {x.key for x in e.value.errors} == {"tiers.dram.polcy", "tiers.nvme.ttl_s", "tiers.dram.capacity_gb"}
    assert sum("kvstore: config key 'tiers." in x for x in seen.lines) == 3  # every bad key logged, not only the first
    for flag in (True, False):  # told either way, vLLM does not resolve the class while building its config
        with pytest.raises(KVStoreConfigError, match="tiers.nvme.ttl_s"):
            engine_config(tiny_model, {"tiers": {"nvme": {"ttl_s": -1 if flag else -2}}},
                          disable_hybrid_kv_cache_manager=flag)
    good = {"config": "agent", "tiers": {"dram": {"capacity_gb": 0.01}, "nvme": {"path": str(tmp_path / "n")}}}
    cfg = engine_config(tiny_model, good)  # a good config passes, and nothing is created by the check
    assert cfg.kv_transfer_config.kv_connector == "KVStoreConnector" and not (tmp_path / "n").exists()


def test_the_api_server_fails_before_the_model_loads(tiny_model, tmp_path):
    extra = {"config": "agent", "tiers": {"dram": {"capacity_gb": 100000}}}
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1", HOME=str(tmp_path))
    p = subprocess.run([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", tiny_model,
                        "--port", "1", "--kv-transfer-config",
                        json.dumps({"kv_connector": "KVStoreConnector", "kv_role": "kv_both",
                                    "kv_connector_extra_config": extra})],
                       capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    out = (p.stdout + p.stderr).strip().splitlines()
    assert p.returncode != 0
    assert out[-1].startswith("kvstore.connectors.vllm.KVStoreConfigError: config key 'tiers.dram.capacity_gb': "
                              "invalid value 100000"), out[-5:]
    assert "more than this machine's available memory" in out[-1] and "allowed: a number of GiB up to" in out[-1]
    text = "\n".join(out)
    assert "EngineCore" not in text and "Loading weights" not in text  # no engine process, no model loaded
