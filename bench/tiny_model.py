"""A tiny Llama-style model built offline with random weights (no model hub needed).

Weights are drawn wider than the default init (N(0, 0.2)) so greedy decoding is not all ties.
The tokenizer is word-level over the vocabulary ``w0 .. w{vocab-1}``; tests usually pass token
ids directly.
"""

from __future__ import annotations

import json
import os


def build_tiny_llama(path: str, *, hidden: int = 256, layers: int = 4, heads: int = 4, kv_heads: int = 2,
                     vocab: int = 512, max_pos: int = 16384, seed: int = 0, std: float = 0.2) -> str:
    """Write a tiny random Llama (config, safetensors weights, tokenizer) into ``path``."""
    marker = os.path.join(path, "kvstore-tiny.json")
    spec = dict(hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads, vocab=vocab, max_pos=max_pos,
                seed=seed, std=std)
    if os.path.exists(marker):
        with open(marker) as f:
            if json.load(f) == spec:
                return path
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    os.makedirs(path, exist_ok=True)
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab,
                      max_position_embeddings=max_pos, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                      tie_word_embeddings=False, torch_dtype="float32")
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                continue
            p.normal_(0.0, std)
    model.save_pretrained(path, safe_serialization=True)
    vocab_map = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    for i in range(4, vocab):
        vocab_map[f"w{i}"] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab_map, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<pad>")
    fast.save_pretrained(path)
    with open(marker, "w") as f:
        json.dump(spec, f)
    return path
