"""The reports of the GPU copy checks: ``bench/copy/gpu_bench.py``'s markdown (copy kernels vs
cudaMemcpyAsync, the DRAM slab, mode=dma) and the files gpu_bench.py and gpu_native.py leave."""

from __future__ import annotations

import statistics

from kvstore.bench.common.report import write_outputs


def markdown(rows: list, header: str) -> str:
    out = [header, ""]
    copy = [r for r in rows if r["section"] == "copy"]
    if copy:
        out += ["## Copy kernels vs cudaMemcpyAsync of the same bytes (same pinned memory)", "",
                "| layout | block tokens | blocks/call | MiB | op | mode | under | GB/s | limit GB/s | ratio |",
                "|---|---|---|---|---|---|---|---|---|---|"]
        out += [f"| {r['layout']} | {r['block_tokens']} | {r['blocks_per_call']} | {r['mib']} | {r['op']} | "
                f"{r['mode']} | {r['under']}{'' if r['overlapped'] in (None, True) else ' (not overlapped)'} | "
                f"{r['gbps']} | {r['limit_gbps']} | {r['ratio']} |" for r in copy]
        for under in ("idle", "matmul"):
            best = {}
            for r in copy:
                if r["under"] == under and r["blocks_per_call"] >= 16 and r["overlapped"] in (None, True):
                    k = (r["layout"], r["block_tokens"], r["blocks_per_call"], r["op"])
                    best[k] = max(best.get(k, 0.0), r["ratio"])
            if best:
                worst = min(best, key=best.get)
                out += ["", f"{under}: from 16 blocks per call, best mode per cell: min ratio {best[worst]:.3f} "
                            f"({' '.join(map(str, worst))}), median {statistics.median(best.values()):.3f} "
                            f"over {len(best)} cells (goal >= 0.9)."]
    slab = [r for r in rows if r["section"] == "slab"]
    if slab:
        out += ["", "## DRAM slab", "", "| memory | capacity GiB | RSS GiB | RSS / capacity | pinned | prepare s |",
                "|---|---|---|---|---|---|"]
        out += [f"| {r['what']} | {r['capacity_gib']} | {r['rss_gib']} | {r['rss_over_capacity']} | "
                f"{r['pinned']} | {r['prepare_s']} |" for r in slab]
    sc = [r for r in rows if r["section"] == "slab_copy"]
    if sc:
        out += ["", "| from/to slab slots (256 x 16-token blocks) | GB/s | limit GB/s | ratio |", "|---|---|---|---|"]
        out += [f"| {r['op']} | {r['gbps']} | {r['limit_gbps']} | {r['ratio']} |" for r in sc]
    dm = [r for r in rows if r["section"] == "dma"]
    if dm:
        out += ["", "## mode=dma: cudaMemcpyBatchAsync vs a cudaMemcpyAsync loop (16 x 16-token blocks)", "",
                "| layout | op | run bytes | copies | GB/s | limit GB/s | ratio | us per copy |",
                "|---|---|---|---|---|---|---|---|"]
        out += [f"| {r['layout']} | {r['op']} | {r['run_bytes']} | {r['copies']} | {r['gbps']} | "
                f"{r['limit_gbps']} | {r['ratio']} | {r['us_per_copy']} |" for r in dm]
    return "\n".join(out) + "\n"


def write_run(out: str, name: str, a, rows: list, errors: list, md: str, device: str) -> str:
    """OUT/NAME.json (the flags, the rows, the errors, the device) and OUT/NAME.md (``md`` and a
    FAILED line per error), rewritten after each part of gpu_bench.py and gpu_native.py so a run
    cut short keeps what it measured; returns the markdown written."""
    md += "".join(f"\nFAILED {e}\n" for e in errors)
    write_outputs(out, name, {"config": vars(a), "rows": rows, "errors": errors, "device": device}, md)
    return md
