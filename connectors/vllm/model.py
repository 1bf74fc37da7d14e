"""What kvstore makes of the model vLLM serves: its KV cache groups (:func:`kv_groups`), and the
fingerprint its blocks' keys grow from (:func:`model_fingerprint`). Read from vLLM's configs
only; no tensors.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from kvstore import kvcopy
from kvstore.keys import ModelFingerprint
from kvstore.offload.groups import ROLES, Group, KVGroups

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


def _tp_rank(vllm_config: "VllmConfig", role: KVConnectorRole) -> tuple[int, int]:
    """(rank, size). A worker must know its tensor-parallel rank (its keys carry it): failing to
    get it is an error at start-up, never a silent rank 0 that would mix ranks' blocks. The
    scheduler side asks rank 0's store, so its fingerprint says rank 0."""
    size = vllm_config.parallel_config.tensor_parallel_size
    if role != KVConnectorRole.WORKER:
        return 0, size
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        rank = int(get_tensor_model_parallel_rank())
    except Exception as e:
        if size == 1:
            return 0, 1  # no TP group is needed to know the only rank
        raise RuntimeError(f"kvstore: cannot get this worker's tensor-parallel rank (size {size}): {e}") from e
    if not 0 <= rank < size:
        raise RuntimeError(f"kvstore: tensor-parallel rank {rank} is outside 0..{size - 1}")
    return rank, size


def block_packing(vllm_config: "VllmConfig", spec) -> tuple[str, str]:
    """How the engine packs a block's bytes (the store keeps pages byte for byte), and its
    variant: vLLM's CPU backend packs per ISA (K transposed etc.), every GPU backend uses the
    standard order."""
    try:
        from vllm.platforms import current_platform

        on_cpu = current_platform.is_cpu()
    except Exception:  # pragma: no cover
        on_cpu = True
    if not on_cpu:
        return "std", ""
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        isa = _get_attn_isa(vllm_config.model_config.dtype, spec.block_size, spec.head_size,
                            vllm_config.cache_config.cache_dtype)
    except Exception:  # a vLLM without that helper: still never mix with GPU blocks
        isa = "unknown"
    return "vllm_cpu", isa


def kv_groups(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig") -> tuple[KVGroups | None, str | None]:
    """The model's KV cache groups as kvstore serves them, or (None, why not)."""
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs, get_kv_cache_spec_kind

    out = []
    for i, g in enumerate(kv_cache_config.kv_cache_groups):
        spec = g.kv_cache_spec
        kind = get_kv_cache_spec_kind(spec).value
        if kind not in ROLES or isinstance(spec, UniformTypeKVCacheSpecs):
            return None, f"KV cache group {i} is {kind} ({type(spec).__name__}), which kvstore does not serve"
        if getattr(g, "is_eagle_group", False) or not getattr(g, "enable_kv_transfer", True):
            return None, f"KV cache group {i} is a draft model's or not transferable"
        window = 0
        if kind in ("sliding_window", "sliding_window_mla"):
            window = int(spec.sliding_window) + int(getattr(spec, "extra_retained_tokens", 0) or 0)
        elif kind == "chunked_local_attention":
            window = int(spec.attention_chunk_size)
        elif kind == "mamba" and getattr(spec, "mamba_cache_mode", "") != "align":
            return None, (f"KV cache group {i} keeps Mamba states without prefix caching "
                          f"(mamba_cache_mode {getattr(spec, 'mamba_cache_mode', None)!r}: no state at a block boundary)")
        out.append(Group(i, kind, int(spec.block_size), window, len(g.layer_names)))
    if any("mla" in g.kind for g in out) and _on_cpu():
        return None, ("MLA on vLLM's CPU backend: loads there gave wrong greedy output even with blocks byte "
                      "for byte vLLM's own (measured on vLLM 0.32)")
    try:
        return KVGroups(out), None
    except ValueError as e:
        return None, str(e)


def _on_cpu() -> bool:
    try:
        from vllm.platforms import current_platform

        return bool(current_platform.is_cpu())
    except Exception:  # pragma: no cover
        return True


def _group_desc(spec) -> tuple:
    """What in a group's spec determines its blocks' bytes (for the fingerprint)."""
    if hasattr(spec, "shapes"):  # Mamba: its state tensors
        return ("state", tuple(tuple(int(x) for x in s) for s in spec.shapes), tuple(str(d) for d in spec.dtypes),
                int(spec.page_size_bytes), str(getattr(spec, "mamba_type", "")))
    return ("attn", int(spec.num_kv_heads), int(spec.head_size), int(getattr(spec, "head_size_v", spec.head_size)),
            str(spec.dtype))


def model_fingerprint(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig", codec: str,
                      role: KVConnectorRole = KVConnectorRole.WORKER, groups: KVGroups | None = None
                      ) -> tuple[ModelFingerprint, int, list[str]]:
    """(fingerprint, bytes of a store block, layer names in order). A model of one full-attention
    group keeps the fingerprint it always had; any other carries its groups (kind, window,
    layers, shapes): a block's key then never matches another group layout's."""
    specs = [g.kv_cache_spec for g in kv_cache_config.kv_cache_groups]
    plain = groups is None or groups.plain
    if plain and len(specs) != 1:
        raise ValueError(f"KVStoreConnector: {len(specs)} KV cache groups without their kvstore groups")
    attn = next((s for s in specs if hasattr(s, "num_kv_heads")), specs[0])
    layers = [n for g in kv_cache_config.kv_cache_groups for n in g.layer_names]
    mc = vllm_config.model_config
    rank, size = _tp_rank(vllm_config, role)
    packing, variant = block_packing(vllm_config, attn)
    extra = (("kv_cache_dtype", str(vllm_config.cache_config.cache_dtype)),
             ("head_size_v", int(getattr(attn, "head_size_v", getattr(attn, "head_size", 0)))),
             ("tokenizer", str(mc.tokenizer)), ("quantization", str(mc.quantization)))
    if not plain:
        extra += (("groups", groups.describe()), ("group_specs", tuple(_group_desc(s) for s in specs)))
    fp = ModelFingerprint(
        model=str(mc.model), revision=str(mc.revision or ""), dtype=str(getattr(attn, "dtype", mc.dtype)),
        layout=f"kvblock-v{kvcopy.STORE_FORMAT_VERSION}.{packing}" + (f"-{variant}" if variant else ""),
        packing=packing,
        block_size=int(specs[0].block_size),
        num_layers=len(layers), num_kv_heads=int(getattr(attn, "num_kv_heads", 0)),
        head_size=int(getattr(attn, "head_size", 0)),
        tp_rank=rank, tp_size=size, codec=codec, extra=extra,
    )
    block_bytes = max(int(s.page_size_bytes) * len(g.layer_names)
                      for s, g in zip(specs, kv_cache_config.kv_cache_groups))
    return fp, block_bytes, layers
