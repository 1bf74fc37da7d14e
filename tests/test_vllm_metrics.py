"""kvstore's metrics on vLLM's own Prometheus metrics (issue 32): every counter and gauge of the
store as ``vllm:kvstore_*``, through vLLM's connector stats hooks (no port of kvstore's own)."""

from __future__ import annotations

import time

import pytest

from conftest import in_process_vllm  # noqa: E402

vllm = in_process_vllm()

from kvstore.bench.common.engine import Engine, connector_config, kv_transfer  # noqa: E402
from kvstore.offload import shared as shared_mod  # noqa: E402
from conftest import prompt  # noqa: E402

pytestmark = [pytest.mark.vllm]

BS = 32


def vllm_side(eng: Engine, name: str, **labels) -> float:
    return sum(m.value for m in eng.llm.get_metrics()
               if m.name == name and all(m.labels.get(k) == v for k, v in labels.items()))


def test_store_metrics_on_vllms_metrics(tiny_model, tmp_path):
    cfg = connector_config(str(tmp_path / "s"), dram_gb=0.05, nvme_gb=1)
    eng = Engine(tiny_model, block_size=BS, max_len=2048, kv_transfer=kv_transfer(cfg), disable_log_stats=False)
    try:
        p = prompt(5 * BS + 3, 1)
        eng.generate([p], 2)
        eng.reset()
        eng.generate([p], 2)  # 5 blocks from DRAM
        time.sleep(1.1)  # the worker hands its counters on at most once a second, at a step
        eng.generate([prompt(9, 2)], 2)
        reg = shared_mod.live()[0].metrics.registry
        served = reg.get_sample_value("kvstore_engine_served_tokens_total", {"tier": "dram"})
        assert served == 5 * BS
        assert vllm_side(eng, "vllm:kvstore_engine_served_tokens", tier="dram") == served
        assert vllm_side(eng, "vllm:kvstore_engine_stored_blocks") >= 5
        assert vllm_side(eng, "vllm:kvstore_tier_blocks", tier="dram") >= 5  # a gauge
        names = {m.name for m in eng.llm.get_metrics() if m.name.startswith("vllm:kvstore_")}
        assert {"vllm:kvstore_tier_written_bytes", "vllm:kvstore_engine_unsupplied_tokens"} <= names
    finally:
        eng.close()
