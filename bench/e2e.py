"""``kvstore bench e2e``: time to first token through a real vLLM engine with KVStoreConnector.

For each prompt length, the median TTFT (a 1-token generation, i.e. the prefill) of:

* ``recompute``      vLLM without prefix caching: the whole prompt is computed;
* ``vllm_prefix``    vLLM's own in-memory prefix cache hit (the same prompt again);
* ``kvstore_dram``   a kvstore hit from DRAM (vLLM's cache reset in between);
* ``kvstore_nvme``   a kvstore hit from NVMe (DRAM tier disabled, so every block is read from a file).

Runs on a tiny random Llama built offline (hidden 256, 4 layers by default). The engine is in
this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``); vLLM must be installed.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import tempfile
import time

import numpy as np

from bench.report import markdown_table, progress, write_json


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lengths", default="1024,4096,8192", help="prompt lengths in tokens")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--model", default=None, help="a model folder (default: build the tiny model)")
    p.add_argument("--dir", default=None, help="folder for the NVMe tier and the tiny model")
    p.add_argument("--json", default=None)
    p.add_argument("--plots", default=None)


class _Engine:
    def __init__(self, model: str, block_size: int, max_len: int, store: str | None, dram_gb: float,
                 prefix_caching: bool = True):
        from vllm import LLM
        from vllm.config import KVTransferConfig

        kw = dict(enforce_eager=True, block_size=block_size, max_model_len=max_len, dtype="float32", seed=0,
                  enable_prefix_caching=prefix_caching, max_num_batched_tokens=max_len)
        if store is not None:
            extra = {"tiers": {"dram": {"capacity_gb": dram_gb, "ttl_s": None},
                               "nvme": {"path": store, "capacity_gb": 8, "ttl_s": None}}}
            kw["kv_transfer_config"] = KVTransferConfig(kv_connector="KVStoreConnector", kv_role="kv_both",
                                                        kv_connector_extra_config=extra)
        self.llm = LLM(model, **kw)

    def ttft(self, tokens: list[int]) -> tuple[float, int]:
        from vllm import SamplingParams

        t = time.perf_counter()
        out = self.llm.generate([{"prompt_token_ids": tokens}], SamplingParams(max_tokens=1, temperature=0),
                                use_tqdm=False)
        return time.perf_counter() - t, out[0].num_cached_tokens

    def close(self) -> None:
        from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

        self.llm.llm_engine.engine_core.shutdown()
        del self.llm
        gc.collect()
        destroy_model_parallel()
        destroy_distributed_environment()


def run(a: argparse.Namespace) -> dict:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from bench.tiny_model import build_tiny_llama

    lengths = [int(x) for x in a.lengths.split(",") if x]
    work = tempfile.TemporaryDirectory(prefix="kvstore-e2e-", dir=a.dir)
    model = a.model or build_tiny_llama(os.path.join(work.name, "model"), hidden=a.hidden, layers=a.layers,
                                        max_pos=max(lengths) + 64)
    max_len = max(lengths) + 64
    rng = np.random.default_rng(0)

    def fresh(n: int) -> list[int]:
        return [int(x) for x in rng.integers(4, 500, size=n)]

    cases = ["recompute", "vllm_prefix", "kvstore_dram", "kvstore_nvme"]
    times: dict[tuple[str, int], list[float]] = {}
    cached: dict[tuple[str, int], int] = {}
    bar, task = progress(len(cases) * len(lengths) * (a.repeats + 1), "bench e2e")
    with bar:
        for case in cases:
            store = None if case in ("recompute", "vllm_prefix") else os.path.join(work.name, f"store-{case}")
            eng = _Engine(model, a.block_size, max_len, store, dram_gb=0.0 if case == "kvstore_nvme" else 1.0,
                          prefix_caching=case != "recompute")
            try:
                eng.ttft(fresh(64))  # warm-up
                for n in lengths:
                    for r in range(a.repeats + 1):
                        p = fresh(n)
                        if case != "recompute":
                            eng.ttft(p)  # first sight: computes and stores
                            if case.startswith("kvstore"):
                                eng.llm.reset_prefix_cache()
                        dt, c = eng.ttft(p)
                        if case.startswith("kvstore"):
                            eng.llm.reset_prefix_cache()
                        if r > 0:  # the first repeat of each length is a warm-up
                            times.setdefault((case, n), []).append(dt)
                            cached[(case, n)] = c
                        bar.advance(task)
            finally:
                eng.close()
    work.cleanup()
    rows = []
    for n in lengths:
        base = statistics.median(times[("recompute", n)])
        vp = statistics.median(times[("vllm_prefix", n)])
        for case in cases:
            t = statistics.median(times[(case, n)])
            rows.append({"prompt_tokens": n, "case": case, "ttft_ms": t * 1e3, "cached_tokens": cached[(case, n)],
                         "vs_recompute": t / base, "vs_vllm_prefix": t / vp})
    data = {"results": rows, "params": {"lengths": lengths, "repeats": a.repeats, "block_size": a.block_size,
                                        "hidden": a.hidden, "layers": a.layers}}
    print(markdown_table(rows, ["prompt_tokens", "case", "ttft_ms", "cached_tokens", "vs_recompute", "vs_vllm_prefix"],
                         ["prompt tokens", "case", "TTFT ms", "cached tokens", "x recompute", "x vLLM prefix hit"]))
    write_json(a.json, data)
    if a.plots:
        plot(data, a.plots)
    return data


def plot(data: dict, folder: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(folder, exist_ok=True)
    rows = data["results"]
    fig, ax = plt.subplots(figsize=(7, 4))
    for case in ("recompute", "vllm_prefix", "kvstore_dram", "kvstore_nvme"):
        pts = [(r["prompt_tokens"], r["ttft_ms"]) for r in rows if r["case"] == case]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=case)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("TTFT (ms)")
    ax.set_title("TTFT: recompute vs. prefix hits (tiny model, CPU)")
    ax.legend()
    fig.tight_layout()
    path = os.path.join(folder, "e2e_ttft.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]
