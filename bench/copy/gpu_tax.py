"""The no-reuse tax on a GPU: does kvstore's save path slow the engine it rides on (issue 34)?

    python -m kvstore.bench.copy.gpu_tax --dir DIR --out OUT       # OUT/gpu_tax.json and OUT/gpu_tax.md

vLLM's own no-reuse run (``kvstore bench e2e``) needs a vLLM built for the GPU, which the lent GPU
machines do not have. This is its stand-in, with the parts of the connector that run on the
worker, unchanged: an "engine" runs prefill steps of a Llama-3-8B-shaped model (per layer: the QKV,
output, gate+up and down matmuls of ``--tokens`` tokens in bf16, its K and V written into a paged
FlashAttention-layout cache, and at the step's end the host reads a value back, as sampling does),
every step a new prompt. As in vLLM's model runner, once a step's forward pass is queued (before
the host read) the connector's ``StepRunner`` saves the step's blocks into a ``KVStore`` (pinned DRAM,
demoted to NVMe files in the background), as ``wait_for_save`` does (``--save-after-sync``: after
the host read instead, the order of the first runs, which leaves the GPU idle while the save's host
part runs):
``sync`` gathers and commits on the engine's thread; ``async`` enqueues the gather on a side stream
that waits for the forward pass's event, and a store thread commits it; ``asyncN`` caps that
gather's grid at N thread blocks (``async0``: the kernel's default, 8 per SM; plain ``async``: the
StepRunner's default, ``SIDE_GATHER_CTAS``). Nothing is ever read back: all of it is overhead.

Rounds rotate ``off`` (no connector), ``sync`` and ``async``; each round is ``--steps`` prompts,
timed from the first launch to the last step's host read plus the store's queue draining
(``async``: the last gathers and commits are counted). Background demotions to NVMe that outlast a
round are finished, untimed, before the next round, so an ``off`` round runs alone. The figure is the
issue's: the ``off`` round's time over the variant's next to it (1.0 = no tax), every round and the
median. The store's counters say how much it really moved (blocks stored, demoted, skipped for want
of a slot).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from kvstore import kvcopy
from kvstore.bench.common.report import write_outputs
from kvstore.config import from_dict
from kvstore.keys import ModelFingerprint, chain_keys
from kvstore.offload import StepRunner, StepPlan, StorePlan, acquire_shared, release_shared


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kvstore.bench.copy.gpu_tax", description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", required=True, help="the NVMe tier's folder (on the disk to measure)")
    p.add_argument("--out", default=None, help="folder for gpu_tax.json and gpu_tax.md")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--steps", type=int, default=16, help="prompts (prefill steps) a round")
    p.add_argument("--tokens", type=int, default=2048, help="prompt tokens a step")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--ffn", type=int, default=14336)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--block-tokens", type=int, default=16)
    p.add_argument("--dram-gb", type=float, default=8.0)
    p.add_argument("--nvme-gb", type=float, default=24.0)
    p.add_argument("--designs", default="sync,async",
                   help="sync, async (the StepRunner's default grid for side-stream gathers: "
                        "kvstore.offload.runner.SIDE_GATHER_CTAS), asyncN (that grid at most N thread blocks)")
    p.add_argument("--save-after-sync", action="store_true",
                   help="save after the step's host read (the order of the first H200 runs, which exposes "
                        "the save's host time) instead of vLLM's: wait_for_save once the forward pass is "
                        "queued, then sampling")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                   help="float32 for a smoke run on a CPU (torch's bf16 matmuls there are ~1000x slower)")
    return p


class Engine:
    """Prefill steps of a dense decoder's matmuls (weights shared by all layers: only the shapes and
    the bytes they move matter), each writing its K and V into the next free blocks of a paged cache."""

    def __init__(self, a, device: str):
        g = torch.Generator(device="cpu").manual_seed(34)
        dt = getattr(torch, a.dtype)
        kv = a.kv_heads * a.head_size

        def w(r, c):
            return (torch.randn(r, c, generator=g, dtype=torch.float32) / r ** 0.5).to(device, dt)

        self.a, self.device, self.kv = a, device, kv
        self.wqkv, self.wo = w(a.hidden, a.hidden + 2 * kv), w(a.hidden, a.hidden)
        self.wup, self.wdown = w(a.hidden, 2 * a.ffn), w(a.ffn, a.hidden)
        self.x = torch.randn(a.tokens, a.hidden, generator=g, dtype=torch.float32).to(device, dt)
        self.per_step = a.tokens // a.block_tokens
        self.nb = self.per_step * a.steps
        self.layout = kvcopy.KVLayout.flash_attn(self.nb, a.layers, a.block_tokens, a.kv_heads, a.head_size, dt)
        stacked = torch.zeros(a.layers, 2, self.nb, a.block_tokens, a.kv_heads, a.head_size, dtype=dt, device=device)
        self.caches = [stacked[i] for i in range(a.layers)]

    def flops(self) -> float:
        a = self.a
        return 2.0 * a.tokens * a.layers * (a.hidden * (a.hidden + 2 * self.kv) + a.hidden * a.hidden
                                            + a.hidden * 2 * a.ffn + a.ffn * a.hidden)

    def launch(self, i: int) -> list[int]:
        """Queue prompt ``i`` of a round, into blocks ``[i * per_step, (i + 1) * per_step)``; returns them."""
        a, x = self.a, self.x
        r0 = i * self.per_step
        shape = (self.per_step, a.block_tokens, a.kv_heads, a.head_size)
        for c in self.caches:
            qkv = x @ self.wqkv
            c[0, r0:r0 + self.per_step] = qkv[:, a.hidden:a.hidden + self.kv].reshape(shape)
            c[1, r0:r0 + self.per_step] = qkv[:, a.hidden + self.kv:].reshape(shape)
            h = x @ self.wo
            up = h @ self.wup
            h = up[:, :a.ffn] @ self.wdown
        self.h = h
        return list(range(r0, r0 + self.per_step))

    def finish(self) -> None:
        float(self.h[-1, :8].float().sum())  # the host waits for the step, as sampling does


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if a.tokens % a.block_tokens:
        raise SystemExit(f"--tokens ({a.tokens}) must be a multiple of --block-tokens ({a.block_tokens})")
    designs = [d for d in a.designs.split(",") if d]
    bad = [d for d in designs if d != "sync" and not (d.startswith("async") and (d[5:] == "" or d[5:].isdigit()))]
    if bad:
        raise SystemExit(f"--designs: {bad} not allowed; allowed: sync, async, asyncN (the side-stream "
                         f"gather's grid at most N thread blocks)")
    eng = Engine(a, a.device)
    bb = eng.layout.block_bytes
    cfg = from_dict({"tiers": {
        "dram": {"capacity_gb": a.dram_gb, "pin_memory": a.device == "cuda"},
        "nvme": {"path": str(Path(a.dir) / "gpu_tax"), "capacity_gb": a.nvme_gb}}})
    fp = ModelFingerprint(model="gpu-tax", dtype=a.dtype, block_size=a.block_tokens, num_layers=a.layers,
                          num_kv_heads=a.kv_heads, head_size=a.head_size, layout=eng.layout.fingerprint())
    movers, shareds = {}, {}
    for d in designs:
        shareds[d] = acquire_shared(f"gpu-tax/{d}", cfg, fp, bb, a.block_tokens)
        grid = {"save_ctas": int(d[5:]) or None} if d[5:].isdigit() else {}  # async0: 8 blocks per SM
        m = movers[d] = StepRunner(shareds[d], async_saves=d.startswith("async"), async_loads=False, **grid)
        m.register(eng.caches, eng.layout)
    serial = [0]

    def run(design: str) -> float:
        m = movers.get(design)
        reqs = set()
        if a.device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(a.steps):
            keys = None
            if m is not None:  # the scheduler side names the prompt's blocks before the step runs
                serial[0] += 1
                req = f"r{serial[0]}"
                toks = list(range(serial[0] * a.tokens, (serial[0] + 1) * a.tokens))  # a prompt never seen
                keys = chain_keys(m.store.root, toks, a.block_tokens)
            ids = eng.launch(i)
            if a.save_after_sync:
                eng.finish()
            if m is not None:  # wait_for_save: vLLM calls it once the forward pass is queued
                m.save(StepPlan(stores=[StorePlan(req, ids, keys)], step=serial[0]))
                reqs.add(req)
            if not a.save_after_sync:
                eng.finish()  # sampling
            if m is not None and m.jobs is not None:  # vLLM asks every step; blocks are freed once stored
                m.get_finished(set())
        if m is not None and m.jobs is not None:
            assert m.jobs.wait_idle(600), "the store queue did not drain"
            m.get_finished(reqs)
        if a.device == "cuda":
            torch.cuda.synchronize()
        s = time.perf_counter() - t0
        if m is not None:
            m.store.flush()  # demotions still running: finished before the next round, untimed
        return s

    for d in ["off", *designs]:  # warm-up: kernels, the pinned slab's first touch, the tier's folders
        run(d)
    order = ["off", *designs]
    times: dict[str, list[float]] = {d: [] for d in order}
    for r in range(a.rounds):
        rot = order[r % len(order):] + order[:r % len(order)]
        for d in rot:
            times[d].append(run(d))
        print(f"round {r}: " + "  ".join(f"{d} {times[d][-1] * 1e3:.1f} ms" for d in order), file=sys.stderr)
    rows = []
    for d in designs:
        ratios = [o / t for o, t in zip(times["off"], times[d])]
        st = movers[d].store.metrics
        rows.append({
            "design": d, "ratios": ratios, "median": statistics.median(ratios), "min": min(ratios),
            "ms_median": statistics.median(times[d]) * 1e3,
            "stored_blocks": st.value("kvstore_tier_written_bytes_total", tier="dram") / bb,
            "demoted_blocks": st.value("kvstore_demoted_blocks_total"),
            "skipped": {s.labels["reason"]: s.value for mf in st.registry.collect()
                        if mf.name == "kvstore_tier_skipped_blocks" for s in mf.samples
                        if s.name.endswith("_total") and s.labels.get("tier") == "dram"},
        })
    off_ms = statistics.median(times["off"]) * 1e3
    tflops = eng.flops() * a.steps / (off_ms / 1e3) / 1e12
    dev = torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu"
    res = {"device": dev, "args": vars(a), "block_bytes": bb, "off_ms_median": off_ms, "off_tflops": tflops,
           "times_s": times, "rows": rows}
    lines = [f"# No-reuse tax on {dev}: {a.steps} prompts of {a.tokens} tokens a round, {a.rounds} rounds, "
             f"{bb / 2**20:.1f} MiB blocks ({eng.per_step} a step)", "",
             f"Engine alone: {off_ms:.1f} ms a round (median), {tflops:.0f} TFLOP/s.", "",
             "| design | off ÷ with, median | min | every round | stored (DRAM) | demoted | skipped (DRAM, all reasons) |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['design']} | {r['median']:.3f} | {r['min']:.3f} | "
                     f"{' '.join(f'{x:.3f}' for x in r['ratios'])} | {r['stored_blocks']:.0f} | "
                     f"{r['demoted_blocks']:.0f} | {sum(r['skipped'].values()):.0f} |")
    md = "\n".join(lines) + "\n"
    print(md)
    if a.out:
        write_outputs(a.out, "gpu_tax", res, md)
    for d in designs:
        movers[d].close()
        release_shared(shareds[d])
    return 0


if __name__ == "__main__":
    sys.exit(main())
