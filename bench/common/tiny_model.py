"""Tiny models built offline with random weights (no model hub needed).

Weights are drawn wider than the default init (N(0, 0.2)) so greedy decoding is not all ties.
The tokenizer is word-level over the vocabulary ``w0 .. w{vocab-1}``; tests usually pass token
ids directly.

* :func:`build_tiny_llama`: one KV cache group (full attention).
* :func:`build_tiny_gemma3`: Gemma-3 style, sliding-window layers beside full-attention layers
  (vLLM's hybrid manager builds two groups, or more for a 5:1 pattern).
* :func:`build_tiny_qwen3_next`: Qwen3-Next style, Gated DeltaNet (linear attention, a state
  per request) beside full attention; bfloat16 only on vLLM's CPU backend, linear head dims of
  128, and vLLM enlarges the attention block to the state's page (288 tokens here).
* :func:`build_tiny_deepseek_v2`: DeepSeek-V2 style MLA (one latent of 512 + 64 rope per token).

The configs are the smallest that vLLM 0.32's CPU backend ran (measured; the notes of issue 31).
"""

from __future__ import annotations

import json
import os

COMMON = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)


def _built(path: str, spec: dict) -> bool:
    marker = os.path.join(path, "kvstore-tiny.json")
    if os.path.exists(marker):
        with open(marker) as f:
            return json.load(f) == spec
    return False


def _tokenizer(path: str, vocab: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab_map = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    for i in range(4, vocab):
        vocab_map[f"w{i}"] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab_map, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<pad>")
    fast.save_pretrained(path)


def _save(path: str, spec: dict, cfg, model_cls, *, seed: int, std: float, vocab: int) -> str:
    import torch

    os.makedirs(path, exist_ok=True)
    torch.manual_seed(seed)
    model = model_cls(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or p.dim() < 2:  # norms (and 1-D gates, biases) keep their init
                continue
            p.normal_(0.0, std)
    model.save_pretrained(path, safe_serialization=True)
    _tokenizer(path, vocab)
    with open(os.path.join(path, "kvstore-tiny.json"), "w") as f:
        json.dump(spec, f)
    return path


def build_tiny_llama(path: str, *, hidden: int = 256, layers: int = 4, heads: int = 4, kv_heads: int = 2,
                     vocab: int = 512, max_pos: int = 16384, seed: int = 0, std: float = 0.2) -> str:
    """Write a tiny random Llama (config, safetensors weights, tokenizer) into ``path``."""
    spec = dict(hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads, vocab=vocab, max_pos=max_pos,
                seed=seed, std=std)
    if _built(path, spec):
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    os.makedirs(path, exist_ok=True)
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab,
                      max_position_embeddings=max_pos, torch_dtype="float32", **COMMON)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                continue
            p.normal_(0.0, std)
    model.save_pretrained(path, safe_serialization=True)
    _tokenizer(path, vocab)
    with open(os.path.join(path, "kvstore-tiny.json"), "w") as f:
        json.dump(spec, f)
    return path


def build_tiny_gemma3(path: str, *, window: int = 64, layer_types: tuple[str, ...] | None = None,
                      hidden: int = 128, vocab: int = 512, seed: int = 0, std: float = 0.2, max_pos: int = 4096) -> str:
    """A Gemma-3 style model: ``layer_types`` (default sliding, full, sliding, full) with a sliding
    window of ``window`` tokens; float32."""
    types = list(layer_types or ("sliding_attention", "full_attention") * 2)
    spec = dict(arch="gemma3", window=window, types=types, hidden=hidden, vocab=vocab, seed=seed, std=std,
                max_pos=max_pos)
    if _built(path, spec):
        return path
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    cfg = Gemma3TextConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=len(types),
                           num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                           max_position_embeddings=max_pos, sliding_window=window, query_pre_attn_scalar=32,
                           layer_types=types, vocab_size=vocab, torch_dtype="float32", **COMMON)
    cfg.architectures = ["Gemma3ForCausalLM"]
    return _save(path, spec, cfg, Gemma3ForCausalLM, seed=seed, std=std, vocab=vocab)


def build_tiny_qwen3_next(path: str, *, layer_types: tuple[str, ...] | None = None, hidden: int = 128,
                          vocab: int = 512, seed: int = 0, std: float = 0.2, max_pos: int = 4096) -> str:
    """A Qwen3-Next style model: Gated DeltaNet (``linear_attention``) beside full attention;
    bfloat16 (vLLM's CPU GDN kernel needs it)."""
    types = list(layer_types or ("linear_attention", "full_attention") * 2)
    spec = dict(arch="qwen3_next", types=types, hidden=hidden, vocab=vocab, seed=seed, std=std, max_pos=max_pos)
    if _built(path, spec):
        return path
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    cfg = Qwen3NextConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=len(types),
                          num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=max_pos,
                          linear_num_value_heads=2, linear_num_key_heads=1, linear_key_head_dim=128,
                          linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=4,
                          num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64,
                          decoder_sparse_step=1, full_attention_interval=2, layer_types=types,
                          vocab_size=vocab, torch_dtype="bfloat16", **COMMON)
    cfg.architectures = ["Qwen3NextForCausalLM"]
    return _save(path, spec, cfg, Qwen3NextForCausalLM, seed=seed, std=std, vocab=vocab)


def build_tiny_deepseek_v2(path: str, *, vocab: int = 512, seed: int = 0, std: float = 0.2) -> str:
    """A DeepSeek-V2 style MLA model (latent 512 + rope 64: the CPU MLA kernel's head of 576;
    dense layers only)."""
    spec = dict(arch="deepseek_v2", vocab=vocab, seed=seed, std=std)
    if _built(path, spec):
        return path
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    cfg = DeepseekV2Config(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=4, max_position_embeddings=4096, kv_lora_rank=512,
                           q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32,
                           n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                           n_shared_experts=1, first_k_dense_replace=2, vocab_size=vocab,
                           torch_dtype="float32", **COMMON)
    cfg.architectures = ["DeepseekV2ForCausalLM"]
    return _save(path, spec, cfg, DeepseekV2ForCausalLM, seed=seed, std=std, vocab=vocab)
