"""A small subset of the CUDA copy checks, for ``compute-sanitizer --tool memcheck`` (issue 15).

    compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m kvstore.bench.copy.gpu_sanitize

Every layout, both modes, bf16 and fp8, odd and aligned geometries, block counts 1 and 37, on the
default and a side stream: gather and scatter, each checked byte for byte against the CPU
reference. Data is made on the CPU and copied over, so almost no kernel but ours runs under the
checker. Exits 1 on a mismatch (the sanitizer's own exit code 9 on a memory error).
"""

from __future__ import annotations

import sys

import torch

from kvstore import kvcopy
from kvstore.kvcopy import reference
from kvstore.kvcopy.layout import named_layout

LAYOUTS = ("vllm_cpu", "flash_attn", "flashinfer", "flashinfer_hnd", "cross_layer", "vllm_LBNHC", "vllm_BLNHC",
           "mla")
DIMS = {"aligned": (3, 16, 4, 64), "odd": (3, 5, 3, 7)}  # layers, tokens, heads, head size


def _cache(lay, dtype, gen):
    extent = 1 + sum((n - 1) * s for n, s in zip(lay.stacked_shape, lay.stacked_strides))
    raw = torch.randint(0, 256, (extent * lay.elem_size,), dtype=torch.uint8, generator=gen)
    st = raw.to("cuda").view(dtype).as_strided(lay.stacked_shape, lay.stacked_strides)
    return [st[:, l] for l in range(lay.num_layers)] if lay.kind == "cross_layer" else \
        [st[l] for l in range(lay.num_layers)]


def _cpu(kv):
    base = torch.tensor([], dtype=torch.uint8, device="cuda").set_(kv[0].untyped_storage()).cpu()
    return [base.view(t.dtype).as_strided(t.shape, t.stride(), t.storage_offset()) for t in kv]


def _bytes(kv):
    return torch.tensor([], dtype=torch.uint8, device=kv[0].device).set_(kv[0].untyped_storage()).cpu()


def main() -> int:
    gen = torch.Generator().manual_seed(9)
    side = torch.cuda.Stream()
    cases = bad = 0
    for name in LAYOUTS:
        for dims, (L, N, H, D) in DIMS.items():
            for dtype in (torch.bfloat16, torch.float8_e4m3fn):
                for n in (1, 37):
                    lay = named_layout(name, n + 5, L, N, H, D, dtype)
                    kv = _cache(lay, dtype, gen)
                    for mode in ("kernel", "dma"):
                        for stream in (None, side):
                            cases += 1
                            ids = torch.randperm(lay.num_blocks, generator=gen)[:n].numpy()
                            expect = torch.empty(n, lay.block_bytes, dtype=torch.uint8)
                            reference.gather(_cpu(kv), lay, ids, expect)
                            dst = torch.full((n, lay.block_bytes), 0x5A, dtype=torch.uint8).pin_memory()
                            kvcopy.gather(kv, lay, ids, dst, mode=mode, stream=stream).synchronize()
                            src = torch.randint(0, 256, (n, lay.block_bytes), dtype=torch.uint8,
                                                generator=gen).pin_memory()
                            cpu_kv = _cpu(kv)
                            reference.scatter(src, lay, ids, cpu_kv)
                            kvcopy.scatter(src, lay, ids, kv, mode=mode, stream=stream).synchronize()
                            ok = torch.equal(dst, expect) and torch.equal(_bytes(kv), _bytes(cpu_kv))
                            if not ok:
                                bad += 1
                                print(f"MISMATCH {name}/{dims}/{dtype}/{n}/{mode}/{'side' if stream else 'default'}")
    torch.cuda.synchronize()
    print(f"gpu_sanitize: {cases} cases, {bad} mismatches")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
