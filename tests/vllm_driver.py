"""Run a real vLLM engine with KVStoreConnector in a fresh process; print results as JSON.

    python tests/vllm_driver.py '{"model": DIR, "store": DIR, "prompts": [[ids...]], "rounds": 2}'

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


def main() -> None:
    job = json.loads(sys.argv[1])
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    extra = {"tiers": {"dram": {"capacity_gb": job.get("dram_gb", 0.05), "ttl_s": None},
                       "nvme": {"path": job["store"], "capacity_gb": job.get("nvme_gb", 1), "ttl_s": None}}}
    if job.get("remote"):  # the shared tier (credentials from KVSTORE_REDIS_PASSWORD in the environment)
        extra["tiers"]["remote"] = job["remote"]
    ktc = {"kv_connector": "KVStoreConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra}
    if job.get("module_path"):
        ktc["kv_connector_module_path"] = "connectors.vllm.connector"
    llm = LLM(job["model"], enforce_eager=True, block_size=job.get("block_size", 32), max_model_len=2048,
              dtype="float32", seed=0, kv_transfer_config=KVTransferConfig(**ktc))
    sp = SamplingParams(max_tokens=job.get("max_tokens", 16), temperature=0)
    rounds = []
    for _ in range(job.get("rounds", 1)):
        outs = llm.generate([{"prompt_token_ids": p} for p in job["prompts"]], sp, use_tqdm=False)
        rounds.append({"tokens": [list(o.outputs[0].token_ids) for o in outs],
                       "cached": [o.num_cached_tokens for o in outs]})
        llm.reset_prefix_cache()
    counters = {}
    from kvstore.offload import shared as shared_mod

    for sh in shared_mod.live():  # in-process mode: the connector's counters
        m = sh.store.metrics
        counters = {**sh.metrics.summary(), "nvme": sh.store.stats()["tiers"].get("nvme", {}),
                    "remote_read_bytes": m.value("kvstore_tier_read_bytes_total", tier="remote"),
                    "remote_written_bytes": m.value("kvstore_tier_written_bytes_total", tier="remote"),
                    "served_remote_tokens": sh.metrics.registry.get_sample_value(
                        "kvstore_engine_served_tokens_total", {"tier": "remote"}) or 0.0}
    print("RESULT " + json.dumps({"rounds": rounds, "counters": counters}), flush=True)
    llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main()
