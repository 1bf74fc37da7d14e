"""``kvstore bench e2e --arch gemma3|qwen3_next``: the TTFT table on a hybrid model (issue 31),
and what kvstore stores for one prompt against a single-group model with the same layers.

* ``gemma3``: a Gemma-3 style model, sliding-window layers (``--window`` tokens) beside full
  attention, 1:1 over 4 layers (vLLM: two KV cache groups of 2 layers); its twin: the same 4
  layers, all full attention (one group of 4 layers).
* ``qwen3_next``: a Qwen3-Next style model, Gated DeltaNet (linear attention, one state per
  request) beside full attention, 1:1 over 4 layers, bfloat16 (vLLM's CPU kernel needs it; the
  attention block becomes 288 tokens, the state's page); its twin: the same 4 layers, all full
  attention.

**Stored bytes per prompt.** For each prompt length, one prompt through a fresh kvstore engine
(DRAM only, its save ended), the store's bytes and blocks after it, for the hybrid model and its
twin: a sliding-window layer costs its window (and the blocks after the prompt's last boundary),
a state layer one state per prompt, where the twin's layers cost every block.
"""

from __future__ import annotations

import os
import shutil

import numpy as np

from kvstore.bench.common.report import markdown_table

ARCHS = ("llama", "gemma3", "qwen3_next")


def llm_kw(arch: str) -> dict:
    """vLLM engine arguments the model needs."""
    return {"dtype": "bfloat16"} if arch == "qwen3_next" else {}


def build(arch: str, folder: str, max_pos: int, *, window: int, twin: bool = False) -> str:
    """The tiny ``arch`` model (``twin``: every layer full attention) in ``folder``."""
    from kvstore.bench.common import tiny_model as tm

    path = os.path.join(folder, f"{arch}{'-twin' if twin else ''}")
    if arch == "gemma3":
        types = ("full_attention",) * 4 if twin else None
        return tm.build_tiny_gemma3(path, window=window, layer_types=types, max_pos=max_pos)
    if arch == "qwen3_next":
        types = ("full_attention",) * 4 if twin else None
        return tm.build_tiny_qwen3_next(path, layer_types=types, max_pos=max_pos)
    raise ValueError(f"--arch {arch!r}: one of {ARCHS}")


def stored_bytes(arch: str, models: dict[str, str], lengths: list[int], block_size: int, max_len: int, work: str,
                 advance=lambda: None) -> list[dict]:
    """Per length and model ("hybrid", "twin"): the bytes and blocks kvstore stored for one fresh
    prompt (a 1-token generation; DRAM only), the cached tokens of the same prompt again."""
    from kvstore.bench.e2e.cases import new_engine, quiesce, settle
    from kvstore.offload import shared

    rows = []
    for which, model in models.items():
        store = os.path.join(work, f"stored-{which}")
        eng = new_engine(model, block_size, max_len, "kvstore", store, 1.0, True, 0.0, "async", **llm_kw(arch))
        try:
            settle()
            (sh,) = shared.live()
            block_bytes = sh.store.block_bytes
            for n in lengths:
                p = [int(x) for x in np.random.default_rng(700 + n).integers(4, 500, size=n)]
                before = sh.store.stats()["tiers"]["dram"]
                eng.ttft(p)
                quiesce()
                after = sh.store.stats()["tiers"]["dram"]
                eng.reset()
                _, cached = eng.ttft(p)
                eng.reset()
                rows.append({"prompt_tokens": n, "model": which, "bytes": after["bytes"] - before["bytes"],
                             "blocks": after["blocks"] - before["blocks"], "block_bytes": block_bytes,
                             "cached_tokens": cached})
                advance()
        finally:
            eng.close()
            shutil.rmtree(store, ignore_errors=True)
    for r in rows:
        twin = next((t for t in rows if t["model"] == "twin" and t["prompt_tokens"] == r["prompt_tokens"]), None)
        r["x_twin"] = r["bytes"] / twin["bytes"] if twin and twin["bytes"] else None
    return rows


def render(data: dict) -> str:
    rows = data.get("stored") or []
    if not rows:
        return ""
    p = data["params"]
    out = [f"\nStored per prompt, {p.get('arch')} (hybrid) against its twin (the same layers, all full attention, "
           "one KV cache group): one fresh prompt each (a 1-token generation, DRAM only), the store's bytes and "
           "blocks after its save; cached = the same prompt again (vLLM's cache reset).\n"]
    out.append(markdown_table([{**r, "kib": f"{r['bytes'] / 1024:.0f}",
                                "x": f"{r['x_twin']:.3f}" if r.get("x_twin") is not None else ""} for r in rows],
                              ["prompt_tokens", "model", "kib", "blocks", "block_bytes", "cached_tokens", "x"],
                              ["prompt tokens", "model", "KiB stored", "blocks", "bytes/block", "cached tokens",
                               "x twin"]))
    return "\n".join(out)
