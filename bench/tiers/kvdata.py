"""KV-like block contents for benchmarks that run codecs (a codec's ratio and error depend on the bytes).

* ``tiny-llama``: K and V captured from a forward pass of the tiny random-weight Llama of
  ``bench/common/tiny_model.py`` (same recipe: weights N(0, 0.2), RMSNorm weights 1, RoPE), built in
  memory with the bench's KV heads and head size (``heads = kv_heads``, 2 layers) over a random
  prompt. Each block of the bench takes its layers from successive token windows of the capture,
  so no block repeats rows inside itself (which would flatter zstd). What random weights cannot
  show: trained models have outlier channels, attention sinks and per-head magnitudes that differ
  by orders of magnitude; here every head has about the same spread. Figures on this data are a
  floor for zstd over fp16 mantissas and an honest figure for the fixed-size int8/fp8 ratios
  (those do not depend on values), not a forecast of a trained model's error.
* ``synthetic``: N(0, 1) scaled per (layer, head, K/V) by a log-uniform factor over 3 decades,
  one outlier channel per head x 20, every 7th row zero. Cheap, no model.

Block layout ("std" packing, what the store's codecs assume): ``[layer][token][head][K/V][dim]``,
so one scale group (``head_size`` elements) is one token's K or V row of one head.
"""

from __future__ import annotations

import numpy as np

KINDS = ("tiny-llama", "synthetic")


def capture_tiny_llama(kv_heads: int, head_size: int, tokens: int = 2048, layers: int = 2, seed: int = 0,
                       std: float = 0.2) -> np.ndarray:
    """K/V of a tiny random Llama: float32 ``[layers, 2, kv_heads, tokens, head_size]``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    g = torch.Generator().manual_seed(seed)
    hidden = kv_heads * head_size
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
                      num_attention_heads=kv_heads, num_key_value_heads=kv_heads, vocab_size=512,
                      max_position_embeddings=max(16384, tokens), bos_token_id=1, eos_token_id=2, pad_token_id=0,
                      tie_word_embeddings=False)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(cfg).eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" not in name:
                    p.normal_(0.0, std, generator=g)
            ids = torch.randint(4, 500, (1, tokens), generator=g)
            cache = model(ids, use_cache=True).past_key_values
    out = np.empty((layers, 2, kv_heads, tokens, head_size), np.float32)
    for i in range(layers):
        if hasattr(cache, "layers"):
            k, v = cache.layers[i].keys, cache.layers[i].values
        else:
            k, v = cache[i]
        out[i, 0] = k[0].float().numpy()
        out[i, 1] = v[0].float().numpy()
    return out


def _synthetic_block(rng: np.random.Generator, layers: int, tokens: int, heads: int, head_size: int) -> np.ndarray:
    x = rng.standard_normal((layers, tokens, heads, 2, head_size), dtype=np.float32)
    x *= (10.0 ** rng.uniform(-2, 1, size=(layers, 1, heads, 2, 1))).astype(np.float32)
    x[..., 3] *= 20
    x[:, ::7] = 0
    return x


def fill(src: np.ndarray, kind: str, *, layers: int, tokens: int, kv_heads: int, head_size: int,
         dtype: str) -> str:
    """Fill ``src`` (uint8 ``[n, block_bytes]``) with KV-like blocks; returns a one-line description."""
    n, bb = src.shape
    np_dtype = {"float16": np.float16, "float32": np.float32}[dtype]
    shape = (layers, tokens, kv_heads, 2, head_size)
    if bb != int(np.prod(shape)) * np.dtype(np_dtype).itemsize:
        raise ValueError(f"block of {bb} bytes is not {shape} x {dtype}")
    if kind == "synthetic":
        rng = np.random.default_rng(0)
        pool = [_synthetic_block(rng, *shape[:3], head_size).astype(np_dtype) for _ in range(min(n, 4))]
        for i in range(n):
            src[i] = pool[i % len(pool)].reshape(-1).view(np.uint8)
        return (f"synthetic KV ({dtype}): N(0,1) x per-head log-uniform scale over 3 decades, an outlier "
                f"channel, zero rows; {len(pool)} distinct blocks")
    if kind != "tiny-llama":
        raise ValueError(f"unknown KV data {kind!r}; known: {', '.join(KINDS)}")
    m_layers = 2
    ctx = tokens * max(-(-1024 // tokens), -(-layers // m_layers))  # no block repeats a row
    cap = capture_tiny_llama(kv_heads, head_size, tokens=ctx, layers=m_layers)  # [Lm, 2, H, P, D]
    cap = np.ascontiguousarray(cap.transpose(0, 3, 2, 1, 4)).astype(np_dtype)  # [Lm, P, H, 2, D]
    windows = ctx // tokens
    for i in range(n):
        blk = src[i].view(np_dtype).reshape(shape)
        for layer in range(layers):
            j = i * layers + layer
            m, w = j % m_layers, (j // m_layers) % windows
            blk[layer] = cap[m, w * tokens:(w + 1) * tokens]
    return (f"KV captured from a tiny random-weight Llama (N(0,0.2) weights, {m_layers} layers, {kv_heads} KV heads "
            f"x {head_size}, {ctx}-token random prompt, cast to {dtype}); random weights lack a trained model's "
            f"outlier channels and per-head scale spread")
