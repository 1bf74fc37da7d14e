"""How much of a model's KV a config keeps: the sizing rule of thumb, as code.

    KV bytes per token = 2 (K and V) x layers x KV heads x head size x bytes per element
    tokens a tier keeps = capacity / (KV bytes per block) x tokens per block

A 7B-class GQA model in bf16 (32 layers, 8 KV heads, head size 128) takes 128 KiB per token:
a 16-token block is 2 MiB, and 8 GiB of DRAM keeps 4,096 blocks = 65,536 tokens of it.

:func:`sizing_line` is the start-up line a connector logs once it knows the engine's block
(``kvstore size`` prints the same for a model folder or a ``--model-shape``); the tuner takes its
block size from a :class:`ModelShape` too. Pure: no I/O but reading a model's ``config.json``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from kvstore.config import StoreConfig
from kvstore.tiers.dram.tier import headroom_slots
from kvstore.tiers.fileformat import round_up
from kvstore.tiers.registry import SPECS

DTYPE_BYTES = {"float32": 4, "fp32": 4, "float": 4, "float16": 2, "fp16": 2, "half": 2, "bfloat16": 2, "bf16": 2,
               "fp8": 1, "float8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "float8_e4m3fn": 1, "float8_e5m2": 1, "int8": 1}
SHAPE_FORMAT = "layers,kv_heads,head_dim,dtype (e.g. 32,8,128,bfloat16)"


@dataclass(frozen=True)
class ModelShape:
    layers: int
    kv_heads: int
    head_dim: int
    dtype: str

    @property
    def bytes_per_token(self) -> int:
        """KV bytes of one token across all layers: K and V, every KV head."""
        return 2 * self.layers * self.kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]

    def block_bytes(self, block_tokens: int) -> int:
        return self.bytes_per_token * block_tokens

    def describe(self) -> str:
        return (f"{self.layers} layers x {self.kv_heads} KV heads x head size {self.head_dim} x 2 (K, V) x "
                f"{DTYPE_BYTES[self.dtype]} B ({self.dtype}) = {fmt_bytes(self.bytes_per_token)} per token")

    @classmethod
    def parse(cls, text: str) -> "ModelShape":
        """``"32,8,128,bfloat16"``; a ValueError names what is wrong and the format."""
        parts = [p.strip() for p in str(text).split(",")]
        if len(parts) != 4:
            raise ValueError(f"--model-shape {text!r}: expected {SHAPE_FORMAT}")
        try:
            layers, heads, dim = (int(p) for p in parts[:3])
        except ValueError:
            raise ValueError(f"--model-shape {text!r}: layers, kv_heads and head_dim must be integers; "
                             f"expected {SHAPE_FORMAT}") from None
        dtype = parts[3].lower().removeprefix("torch.")
        if min(layers, heads, dim) <= 0:
            raise ValueError(f"--model-shape {text!r}: layers, kv_heads and head_dim must be > 0")
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"--model-shape {text!r}: unknown dtype {parts[3]!r}; known: "
                             f"{', '.join(sorted(DTYPE_BYTES))}")
        return cls(layers, heads, dim, dtype)

    @classmethod
    def from_model_dir(cls, path: str | os.PathLike, dtype: str | None = None) -> "ModelShape":
        """From a Hugging Face model folder's ``config.json`` (``num_hidden_layers``,
        ``num_key_value_heads``, ``head_dim`` or hidden size / attention heads, ``torch_dtype``)."""
        f = os.path.join(os.fspath(path), "config.json")
        try:
            with open(f) as fh:
                c = json.load(fh)
        except (OSError, ValueError) as e:
            raise ValueError(f"--model {path}: cannot read {f} ({getattr(e, 'strerror', None) or e})") from None
        c = c.get("text_config", c)  # multimodal configs keep the language model's shape there
        try:
            layers = int(c["num_hidden_layers"])
            heads = int(c.get("num_key_value_heads") or c["num_attention_heads"])
            dim = int(c.get("head_dim") or int(c["hidden_size"]) // int(c["num_attention_heads"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"--model {path}: {f} lacks {e} (give --model-shape {SHAPE_FORMAT})") from None
        dt = dtype or auto_dtype(str(c.get("torch_dtype") or c.get("dtype") or "bfloat16"))
        return cls.parse(f"{layers},{heads},{dim},{dt}")


def auto_dtype(config_dtype: str) -> str:
    """The dtype vLLM's ``--dtype auto`` runs a model of ``config_dtype`` in: a float32 model is
    downcast to the platform's first dtype, bfloat16 on x86/aarch64 CPUs and Ampere or later GPUs
    (vllm.config.model._resolve_auto_dtype)."""
    dt = config_dtype.lower().removeprefix("torch.")
    return "bfloat16" if dt in ("float32", "float") else dt


def default_block_tokens() -> tuple[int, str]:
    """(tokens per block, why): vLLM's own default block size where ``kvstore size`` runs: 16
    on a GPU, 128 on its CPU backend (vllm.platforms.cpu)."""
    try:
        import torch

        gpu = torch.cuda.is_available()
    except ImportError:  # pragma: no cover - torch is a dependency
        gpu = False
    return (16, "vLLM's default on a GPU") if gpu else (128, "vLLM's default on its CPU backend")


def fmt_bytes(n: float) -> str:
    for unit, s in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= s:
            v = n / s
            return f"{v:.3g} {unit}" if v != int(v) else f"{int(v)} {unit}"
    return f"{int(n)} B"


def tiers_line(tiers: dict) -> str:
    """``dram 12 blocks (1.5 MiB of 2 GiB), nvme 7 blocks (...)``: a store's ``stats()["tiers"]``
    for a log line."""
    return ", ".join(f"{name} {t.get('blocks', 0)} blocks ({fmt_bytes(t.get('bytes', 0))} of "
                     f"{fmt_bytes(t.get('capacity_bytes', 0))})" for name, t in tiers.items()) or "no local tier"


def tier_blocks(capacity_bytes: int, block_bytes: int) -> int:
    """Blocks a DRAM or NVMe tier of ``capacity_bytes`` holds (each one padded to 4 KiB)."""
    return capacity_bytes // round_up(block_bytes) if block_bytes > 0 else 0


def tier_lines(cfg: StoreConfig, block_bytes: int, block_tokens: int) -> list[str]:
    """One phrase per tier, in chain order: ``dram 8 GiB = 4,096 blocks = 65,536 tokens`` for a
    local tier (its slots held back for write-backs, if it keeps some), a shared one's block size
    (its server sizes it), ``<name> off``."""
    out = []
    specs = [s for s in SPECS if s.local or getattr(cfg.tiers, s.name).enabled]  # a shared tier off: unsaid
    for i, spec in enumerate(specs):
        name, t = spec.name, getattr(cfg.tiers, spec.name)
        if not t.enabled:
            out.append(f"{name} off")
            continue
        if not spec.local:
            out.append(f"{name} {fmt_bytes(block_bytes)} per block (sized by its server)")
            continue
        blocks = tier_blocks(t.capacity_bytes, block_bytes)
        s = f"{name} {fmt_bytes(t.capacity_bytes)} = {blocks:,} blocks = {blocks * block_tokens:,} tokens"
        below = next((b.name for b in specs[i + 1:] if b.local and getattr(cfg.tiers, b.name).enabled), None)
        if below is not None and hasattr(t, "headroom_blocks"):
            h = headroom_slots(blocks, t.headroom_blocks)
            if h:
                s += f" ({h:,} blocks kept free for write-backs to {below})"
        out.append(s)
    return out


def sizing_line(cfg: StoreConfig, block_bytes: int, block_tokens: int, model: str = "this model") -> str:
    """The start-up line: what each tier keeps of ``model`` in its own unit (blocks, tokens)."""
    return (f"kvstore sizing: {', '.join(tier_lines(cfg, block_bytes, block_tokens))} of {model} "
            f"({fmt_bytes(block_bytes)} blocks of {block_tokens} tokens, "
            f"{fmt_bytes(block_bytes / max(1, block_tokens))} of KV per token)")
