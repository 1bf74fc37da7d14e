"""One vLLM engine (the offline ``LLM``) for the benchmarks and the tests, and its shutdown.

Every engine here runs the same way: eager, float32, seed 0, greedy sampling; with
KVStoreConnector (:func:`connector_config`, :func:`kv_transfer`), another connector, or none.
:meth:`Engine.close` is the one shutdown sequence: the engine core first (its worker, and
with the connector the store's last writes), then the model-parallel groups, so that the next
engine of the same process starts clean.
"""

from __future__ import annotations

import gc
import time


def connector_config(store: str | None, *, dram_gb: float, nvme_gb: float, remote: dict | None = None,
                     io: dict | None = None, dram: dict | None = None) -> dict:
    """KVStoreConnector's ``kv_connector_extra_config``: DRAM and NVMe (in ``store``) without TTL;
    ``remote`` (tiers.remote), ``io`` and more ``dram`` keys when given."""
    extra: dict = {"tiers": {"dram": {"capacity_gb": dram_gb, "ttl_s": None, **(dram or {})},
                             "nvme": {"path": store, "capacity_gb": nvme_gb, "ttl_s": None}}}
    if io:
        extra["io"] = dict(io)
    if remote:  # the shared tier (credentials from KVSTORE_REDIS_PASSWORD in the environment)
        extra["tiers"]["remote"] = dict(remote)
    return extra


def kv_transfer(extra: dict | None = None, *, connector: str = "KVStoreConnector", module_path: str | None = None):
    """vLLM's KVTransferConfig of ``connector`` (kv_both), with ``extra`` as its extra config."""
    from vllm.config import KVTransferConfig

    kw: dict = {"kv_connector": connector, "kv_role": "kv_both"}
    if extra is not None:
        kw["kv_connector_extra_config"] = extra
    if module_path:
        kw["kv_connector_module_path"] = module_path
    return KVTransferConfig(**kw)


class Engine:
    """``LLM(model)`` with ``kv_transfer`` (None: no connector). ``mp``: vLLM's multiprocess
    executor (the worker, and so the store, in its own process)."""

    def __init__(self, model: str, *, block_size: int, max_len: int, kv_transfer=None, prefix_caching: bool = True,
                 batched_tokens: int | None = None, mp: bool = False, **llm_kw):
        from vllm import LLM

        kw = dict(enforce_eager=True, block_size=block_size, max_model_len=max_len, dtype="float32", seed=0,
                  enable_prefix_caching=prefix_caching)
        kw.update(llm_kw)  # e.g. dtype="bfloat16" (a Qwen3-Next model on vLLM's CPU backend)
        if batched_tokens:
            kw["max_num_batched_tokens"] = batched_tokens
        if mp:
            kw["distributed_executor_backend"] = "mp"
        if kv_transfer is not None:
            kw["kv_transfer_config"] = kv_transfer
        self.llm = LLM(model, **kw)

    def generate(self, prompts: list[list[int]], max_tokens: int, *, reset: bool = False
                 ) -> tuple[list[list[int]], list[int]]:
        """Greedy outputs and cached tokens of ``prompts`` (one batch); ``reset``: then empty
        vLLM's own prefix cache (a later hit can only come from the connector)."""
        from vllm import SamplingParams

        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts],
                                 SamplingParams(max_tokens=max_tokens, temperature=0), use_tqdm=False)
        if reset:
            self.reset()
        return [list(o.outputs[0].token_ids) for o in outs], [int(o.num_cached_tokens or 0) for o in outs]

    def ttft(self, tokens: list[int]) -> tuple[float, int]:
        """Seconds to the first token of one prompt (a 1-token generation), and its cached tokens."""
        from vllm import SamplingParams

        t = time.perf_counter()
        out = self.llm.generate([{"prompt_token_ids": tokens}], SamplingParams(max_tokens=1, temperature=0),
                                use_tqdm=False)
        return time.perf_counter() - t, out[0].num_cached_tokens

    def batch(self, prompts: list[list[int]], max_tokens: int) -> dict:
        """Submit all prompts at once; step until done. Per request: TTFT, output ids, cached tokens."""
        from vllm import SamplingParams

        eng = self.llm.llm_engine
        sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        base = f"b{time.perf_counter_ns()}-"
        t0, c0 = time.perf_counter(), time.process_time()
        for i, p in enumerate(prompts):
            eng.add_request(f"{base}{i}", {"prompt_token_ids": p}, sp)
        first: dict[str, float] = {}
        final: dict[str, object] = {}
        while eng.has_unfinished_requests():
            for o in eng.step():
                now = time.perf_counter()
                if o.request_id not in first and o.outputs and len(o.outputs[0].token_ids) > 0:
                    first[o.request_id] = now - t0
                if o.finished:
                    final[o.request_id] = o
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        ids = [f"{base}{i}" for i in range(len(prompts))]
        return {"wall_s": wall, "cpu_s": cpu, "ttft_s": [first[i] for i in ids],
                "outputs": [list(final[i].outputs[0].token_ids) for i in ids],
                "cached": [int(final[i].num_cached_tokens or 0) for i in ids]}

    def reset(self) -> None:
        """Empty vLLM's own prefix cache."""
        self.llm.reset_prefix_cache()

    def close(self) -> None:
        from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

        self.llm.llm_engine.engine_core.shutdown()
        del self.llm
        gc.collect()
        destroy_model_parallel()
        destroy_distributed_environment()
