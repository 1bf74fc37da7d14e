"""Run a real vLLM engine with KVStoreConnector in a fresh process; print results as JSON.

    python tests/vllm_driver.py '{"model": DIR, "store": DIR, "prompts": [[ids...]], "rounds": 2}'

Optional keys: "extra" (more kv_connector_extra_config, e.g. ``{"mode": "node"}``), "signal" (a
file made once the first round is done) and "wait_for" (a file to wait for before the first
round: another engine's signal), "mp" (vLLM's multiprocess executor: the worker, and the store, in another process
than the scheduler, which reaches it over the RPC socket), "tp" (tensor-parallel ranks; their
workers are always processes of their own), "dtype", "block_size", "max_tokens".

Each round generates every prompt greedily, then resets vLLM's own prefix cache, so a hit in a
later round can only come from kvstore. The last line printed is ``RESULT <json>``.
Used by the tests that need a second process (a store written by a previous process, vLLM's
multiprocess engine mode).
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo: bench.engine


def main() -> None:
    job = json.loads(sys.argv[1])
    from kvstore.bench.common.engine import Engine, connector_config, kv_transfer

    extra = connector_config(job["store"], dram_gb=job.get("dram_gb", 0.05), nvme_gb=job.get("nvme_gb", 1),
                             remote=job.get("remote"))
    extra.update(job.get("extra") or {})  # e.g. {"mode": "node", "node": {...}}: the host's daemon
    eng = Engine(job["model"], block_size=job.get("block_size", 32), max_len=2048,
                 kv_transfer=kv_transfer(extra, module_path="kvstore.connectors.vllm.connector" if job.get("module_path")
                                         else None),
                 mp=bool(job.get("mp")), **({"dtype": job["dtype"]} if job.get("dtype") else {}),
                 **({"tensor_parallel_size": job["tp"]} if job.get("tp") else {}))
    rounds = []
    if job.get("wait_for"):  # another engine's first round done: the two run side by side
        import time

        end = time.monotonic() + 600
        while not os.path.exists(job["wait_for"]) and time.monotonic() < end:
            time.sleep(0.05)
    for i in range(job.get("rounds", 1)):
        tokens, cached = eng.generate(job["prompts"], job.get("max_tokens", 16), reset=True)
        rounds.append({"tokens": tokens, "cached": cached})
        if i == 0 and job.get("signal"):
            open(job["signal"], "w").close()
    counters = {}
    from kvstore.offload import shared as shared_mod

    for sh in shared_mod.live():  # in-process mode: the connector's counters
        m = sh.store.metrics
        counters = {**sh.metrics.summary(), "nvme": sh.store.stats()["tiers"].get("nvme", {}),
                    "remote_read_bytes": m.value("kvstore_tier_read_bytes_total", tier="remote"),
                    "remote_written_bytes": m.value("kvstore_tier_written_bytes_total", tier="remote"),
                    "served_remote_tokens": sh.metrics.registry.get_sample_value(
                        "kvstore_engine_served_tokens_total", {"tier": "remote"}) or 0.0,
                    "served_dram_tokens": sh.metrics.registry.get_sample_value(
                        "kvstore_engine_served_tokens_total", {"tier": "dram"}) or 0.0,
                    "stored_blocks": sh.metrics.registry.get_sample_value("kvstore_engine_stored_blocks_total") or 0.0}
    print("RESULT " + json.dumps({"rounds": rounds, "counters": counters}), flush=True)
    eng.close()


if __name__ == "__main__":
    main()
