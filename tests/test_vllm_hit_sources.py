"""kvstore's hits on vLLM's own metric of where cached prompt tokens came from (issue 32):
``vllm:prompt_tokens_cached_by_source{source=host|disk|external_unspecified}``, filled through the
connector's ``get_external_cache_hit_sources`` (DRAM -> host, NVMe -> disk, Redis -> external)."""

from __future__ import annotations


import pytest

from conftest import in_process_vllm  # noqa: E402

vllm = in_process_vllm()

from kvstore.bench.common.engine import Engine, connector_config, kv_transfer  # noqa: E402
from kvstore.bench.e2e.cases import quiesce  # noqa: E402
from conftest import prompt  # noqa: E402

pytestmark = [pytest.mark.vllm]

BS = 32


def by_source(eng: Engine) -> dict[str, float]:
    out: dict[str, float] = {}
    for m in eng.llm.get_metrics():
        if m.name == "vllm:prompt_tokens_cached_by_source":
            src = m.labels["source"]
            out[src] = out.get(src, 0) + m.value
    return out


def test_hits_by_source(tiny_model, tmp_path):
    cfg = connector_config(str(tmp_path / "s"), dram_gb=8 * 128 * 1024 / 2**30, nvme_gb=1)  # DRAM: 8 blocks
    eng = Engine(tiny_model, block_size=BS, max_len=2048, kv_transfer=kv_transfer(cfg), disable_log_stats=False)
    try:
        p1, p2 = prompt(4 * BS + 10, 1), prompt(7 * BS + 5, 2)
        eng.generate([p1], 2)
        eng.generate([p2], 2)  # 4 + 7 blocks in 8 DRAM slots: p1 goes down to NVMe
        # its blocks stay servable in their DRAM slots while they are written down: asked for before
        # the write ended, p1 was a host hit (1 of 2 fresh-clone CI runs, 2026-11-30); a hit comes after a pause
        quiesce()
        for source in ("disk", "host"):  # from NVMe (the load promotes it), then from DRAM
            before = by_source(eng)
            eng.reset()  # vLLM forgets p1: its hit can only come from kvstore
            _, cached = eng.generate([p1], 2)
            assert cached == [4 * BS]
            after = by_source(eng)
            got = {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}
            assert got == {source: 4 * BS}, got
    finally:
        eng.close()


def test_hits_from_redis_are_external(tiny_model, tmp_path):
    """A second engine (its own empty DRAM and NVMe) finds the first engine's blocks in the shared
    Redis tier: vLLM counts them as ``external_unspecified`` (its name for a remote store)."""
    from kvstore.bench.common import redis_local

    p1 = prompt(4 * BS + 10, 3)
    with redis_local.start() as r:
        remote = {"url": r.url, "timeout_ms": 2000}
        a = Engine(tiny_model, block_size=BS, max_len=2048, disable_log_stats=False,
                   kv_transfer=kv_transfer(connector_config(str(tmp_path / "a"), dram_gb=0.05, nvme_gb=1,
                                                            remote=remote)))
        try:
            a.generate([p1], 2)
        finally:
            a.close()  # its writes to Redis are done by the end of close
        b = Engine(tiny_model, block_size=BS, max_len=2048, disable_log_stats=False,
                   kv_transfer=kv_transfer(connector_config(str(tmp_path / "b"), dram_gb=0.05, nvme_gb=1,
                                                            remote=remote)))
        try:
            before = by_source(b)
            _, cached = b.generate([p1], 2)
            assert cached == [4 * BS]
            got = {k: v - before.get(k, 0) for k, v in by_source(b).items() if v - before.get(k, 0)}
            assert got == {"external_unspecified": 4 * BS}, got
        finally:
            b.close()
