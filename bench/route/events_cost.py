"""The KV events' cost on the engine's thread (issue 32): one in-process vLLM engine on the tiny
model, kvstore's hook times (kvstore.offload.hooktime) per engine step with vLLM's KV events on
(a ZMQ publisher) or off, beside the mean step. Run twice, once per mode:

    python -m kvstore.bench.route.events_cost on
    python -m kvstore.bench.route.events_cost off
"""

from __future__ import annotations

import os
import sys
import tempfile

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


from kvstore.bench.common.ports import free_port as _port  # noqa: E402


def _hooks(reg, name: str) -> dict:
    return {(s.labels["side"], s.labels["hook"]): s.value for mf in reg.collect() if mf.name == name
            for s in mf.samples if s.name.endswith("_total")}


def main(mode: str = "on", batches: int = 3, requests: int = 8, tokens: int = 64) -> dict:
    import numpy as np
    from vllm.config import KVEventsConfig

    from kvstore.bench.common.engine import Engine, connector_config, kv_transfer
    from kvstore.bench.common.tiny_model import build_tiny_llama
    from kvstore.offload import shared as shared_mod

    d = tempfile.mkdtemp(prefix="kvstore-events-")
    model = build_tiny_llama(os.path.join(d, "m"), hidden=256, layers=4, seed=0)
    cfg = connector_config(os.path.join(d, "s"), dram_gb=0.05, nvme_gb=1)
    cfg["tiers"]["nvme"]["write_mode"] = "write_through"  # both tiers announce every block
    kw = {"kv_events_config": KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                             endpoint=f"tcp://*:{_port()}", topic="kv")} if mode == "on" else {}
    eng = Engine(model, block_size=32, max_len=4096, kv_transfer=kv_transfer(cfg), **kw)

    def prompts(seed: int):
        rng = np.random.default_rng(seed)
        return [[int(x) for x in rng.integers(4, 500, size=640 + i)] for i in range(requests)]

    try:
        eng.batch(prompts(0)[:2], 8)  # warm-up
        reg = shared_mod.live()[0].metrics.registry
        s0, c0 = _hooks(reg, "kvstore_engine_hook_seconds"), _hooks(reg, "kvstore_engine_hook_calls")
        wall = 0.0
        for b in range(batches):
            eng.reset()
            wall += eng.batch(prompts(1 + b), tokens)["wall_s"]
        s1, c1 = _hooks(reg, "kvstore_engine_hook_seconds"), _hooks(reg, "kvstore_engine_hook_calls")
    finally:
        eng.close()
    steps = c1[("scheduler", "build_connector_meta")] - c0.get(("scheduler", "build_connector_meta"), 0)
    per = {f"{side}.{hook}": (s1[k] - s0.get(k, 0)) / steps * 1e6 for k in s1 for side, hook in [k]}
    out = {"mode": mode, "steps": steps, "step_us": wall / steps * 1e6, "hook_us_per_step": per}
    events_us = per.get("worker.get_kv_connector_kv_cache_events", 0) + per.get("scheduler.take_events", 0)
    print(f"{mode}: {steps} steps, mean step {out['step_us']:.0f} us; events hooks {events_us:.1f} us/step "
          f"({100 * events_us / out['step_us']:.2f} %)")
    for k, v in sorted(per.items()):
        print(f"  {k:45s} {v:8.1f} us/step")
    return out


if __name__ == "__main__":
    main(*(sys.argv[1:2] or ["on"]))
