"""kvstore.kvcopy: gather/scatter between vLLM's paged KV cache and store blocks.

On save, :func:`gather` copies the chosen blocks of every layer (K and V) out of
the engine's paged cache into contiguous store blocks; on a prefix hit,
:func:`scatter` copies them back into the blocks the engine allocated.  Both take
the cache as a list of per-layer tensors or one stacked tensor, described by a
:class:`KVLayout` (layout is data: strides, not assumptions)::

    layout = KVLayout.vllm_cpu(num_blocks, num_layers, block_size, heads, head_size, torch.bfloat16)
    layout = KVLayout.from_vllm(kv_caches)                  # read off vLLM's live tensors
    dst = torch.empty(len(ids), layout.block_bytes, dtype=torch.uint8)  # or a list of 1-D slots
    gather(kv_caches, layout, ids, dst)
    scatter(dst, layout, new_ids, kv_caches)

Layouts (constructors of :class:`KVLayout`): ``vllm_cpu`` (vLLM CPU backend,
``[B, H, N, 2D]`` per layer, per head a K section then a V section), ``vllm`` (vLLM >= 0.2x
GPU backends, logical ``[B, H, N, 2D]`` views in any of the LBNHC/LBHNC/LHBNC/
BLNHC/BLHNC/BHLNC physical orders), ``flash_attn`` (``[2, B, N, H, D]``),
``flashinfer`` (``[B, 2, N, H, D]`` or HND ``[B, 2, H, N, D]``), ``cross_layer``
(one ``[B, L, 2, N, H, D]`` tensor), ``mla`` (``[B, N, latent]``).  Any dtype:
the copy moves raw bytes (fp16, bf16, fp32, fp8, int8, ...).

Store block format (fixed, version 1), raw bytes of the cache dtype, C order::

    packing "std" (GPU layouts):  [layer][token][head][kv][dim]
    packing "vllm_cpu":           [layer][head][kv][section]   (vLLM CPU page as is)
    MLA:                          [layer][token][latent]
    block_bytes = layers * 2 * block_size * heads * head_size * elem_size

"std" is the page of vLLM's default GPU layout (LBNHC) byte for byte, so there a
(block, layer) is one contiguous run (a whole block with the cross-layer BLNHC);
"vllm_cpu" is vLLM's CPU page, whose K and V sections the CPU kernel packs its
own (ISA-dependent) way, one memcpy per (block, layer).  Blocks move between
layouts of the same ``KVLayout.packing``; put ``layout.fingerprint()`` in the
model fingerprint.  For vLLM caches use ``KVLayout.from_vllm(tensors)``, which
picks ``vllm_cpu`` or ``vllm`` by device.  See csrc/README.md for the reasons
and the measured speeds.

Backends: the compiled ``kvstore._kvcopy_cpu`` (multi-threaded C++, releases the
GIL; threads: :func:`set_num_threads` or ``KVSTORE_COPY_THREADS``, default
min(cores, 4)) and ``kvstore._kvcopy_cuda`` (one kernel launch for all layers and
blocks, or batched DMA; ``mode="auto"|"kernel"|"dma"``; asynchronous on the
caller's stream, returns a :class:`CopyEvent`).  Without them the slow
:mod:`~kvstore.kvcopy.reference` runs, with a logged warning
(``KVSTORE_KVCOPY_REFERENCE=1`` forces it).
"""

from . import reference
from ._copy import (
    CopyEvent,
    KVCopier,
    cpu_module,
    cuda_module,
    gather,
    get_num_threads,
    native_error,
    scatter,
    set_num_threads,
)
from .layout import (
    CPU_PAGE_ORDER,
    KINDS,
    STORE_FORMAT_VERSION,
    STORE_ORDER,
    VLLM_LAYOUTS,
    KVLayout,
    dtype_info,
)


def native_available(device: str = "cpu") -> bool:
    """True when the compiled module for ``device`` ("cpu" or "cuda") imports."""
    return (cpu_module() if device == "cpu" else cuda_module()) is not None


__all__ = [
    "KVLayout",
    "KVCopier",
    "CopyEvent",
    "gather",
    "scatter",
    "reference",
    "set_num_threads",
    "get_num_threads",
    "native_available",
    "native_error",
    "cpu_module",
    "cuda_module",
    "dtype_info",
    "KINDS",
    "STORE_ORDER",
    "CPU_PAGE_ORDER",
    "STORE_FORMAT_VERSION",
    "VLLM_LAYOUTS",
]
