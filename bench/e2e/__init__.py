"""``kvstore bench e2e``: TTFT and throughput through a real vLLM engine with KVStoreConnector.

**Designs.** Every kvstore case runs once per design (``--designs``): ``sync`` is the first
design (``io.async_saves`` and ``io.async_loads`` false: saves and loads run inline in the
engine's step), ``async`` the new one (both true). The tables show them side by side.

**TTFT table.** In ``--ttft-rounds`` rounds of a fresh engine per case (the order rotated, the
same prompts for every case of a round), for each prompt length, the median time to first token
(a 1-token generation, i.e. the prefill) of:

* ``recompute``      vLLM without prefix caching: the whole prompt is computed;
* ``vllm_prefix``    vLLM's own in-memory prefix cache hit (the same prompt again);
* ``kvstore_dram``   a kvstore hit from DRAM (vLLM's cache reset in between, and the miss's save
  ended first: a hit comes after a pause, not while its own save runs);
* ``kvstore_nvme``   a kvstore hit from NVMe (DRAM tier disabled, so every block is read from a file).

Ratios are the median of the rounds' paired ratios. Beside them, ``hooks ms``: the wall time of
kvstore's connector hooks on the engine's thread during the hit (kvstore_engine_hook_seconds_total),
and ``own x vLLM`` = (vLLM's prefix hit + hooks ms) / vLLM's prefix hit: kvstore's own cost, which
the forward pass's noise does not move (vLLM's own work for an external hit is not in it).

**Multi-turn run.** ``--mt-clients`` clients x ``--mt-turns`` turns: all clients share a system
prompt; each turn's prompt is the previous prompt + the previous output + new content, growing to
about ``--mt-max-tokens``; every client's turn is submitted at once and the engine is stepped
until all finish. Reported: throughput (prompt + output tokens per second of wall time), mean and
p90 TTFT, and the share of prompt tokens served from a cache, for ``recompute``, ``vllm_prefix``
(vLLM's own prefix cache alone) and ``kvstore`` (vLLM's cache + kvstore), in two regimes:

* ``hbm_ample``: vLLM's own cache keeps everything between turns (kvstore has little to add);
* ``hbm_pressure``: vLLM's prefix cache is reset between turns, as when other traffic has
  evicted a session's blocks from accelerator memory by the time its next turn comes.

Like the no-reuse run, it runs in ``--mt-repeats`` rounds, a fresh engine (and store) per
configuration each round, in an order rotated every round; reported are medians, and the median
of the rounds' paired ratios to recompute (the goal) and to vLLM's own cache with ample HBM (the
most a cache under pressure can give: kvstore's limit measured in the same round). One run of
this multi-turn moved by 27 % on the 2-core VM, more than the goal's margin.

**No-reuse tax.** What kvstore costs when nothing is ever reused: ``--nr-prompts`` distinct
prompts submitted as one batch, ``prefill_heavy`` (``--nr-prefill-tokens`` each, 1 output token)
and ``decode_heavy`` (``--nr-decode-prompt`` tokens each, ``--nr-decode-output`` output tokens),
with kvstore (each design; DRAM + NVMe tiers) against vLLM without any connector. Every
measured run waits for the DRAM pool's background pre-fault (a one-time start-up cost) to end.
Each of
``--nr-repeats`` rounds builds a fresh engine per configuration, in an order rotated every round
(interleaved, so a slow spell of a shared machine falls on all of them), warmed on batches of the
workloads' own shapes (other prompts) before the measured ones: an engine's first batch of a shape
is slower by a varying amount, which made single rounds swing 0.6-1.5, vLLM against itself too.
A batch is timed until kvstore's saves of it have ended (steady traffic pays for every save);
reported are the median throughput ((prompt + output tokens) / wall time) and the median of the
rounds' paired ratios.

**Goals.** Each figure with a goal is printed next to its limit, with PASS/FAIL, and the goals
are summed up per design at the end: DRAM-hit TTFT / vLLM prefix-hit TTFT <= 1.3; NVMe-hit TTFT /
recompute TTFT <= 0.15 (prompts of 4k tokens and more); multi-turn under HBM pressure, kvstore
tokens/s / recompute tokens/s >= 2.59; no-reuse throughput / vLLM's >= 0.97.

**Two engines** (``two_engines`` in ``--cases``; on by default, off with ``--quick`` unless named).
Engine A (its own process, its own DRAM/NVMe folders, the remote tier on a Redis: ``--redis-url``,
else a private password-protected ``redis-server`` started for the run, ``bench/common/redis_local.py``)
computes ``--te-repeats`` fresh prompts of each ``--lengths`` (after one warm-up prompt of that
length) and stores them (write-through to Redis); engine B (another process, its own empty
folders, the same Redis) then gets the same prompts (the warm-up one first, not measured).
Reported per length: B's TTFT on that remote hit beside recompute's (vLLM without prefix caching:
the TTFT table's figure when it ran in this invocation, else measured in A's process before A's
engine) and A's own TTFT (a miss that stores); B's cached tokens, which must be every full block
(all but the block of the last token), and whether B's greedy output tokens equal A's.
``--cases two_engines`` alone runs only this group. Skipped (with a note) where no
``redis-server`` is installed and no ``--redis-url`` is given.

**Peers.** On a machine with CUDA, and when they are installed, the same runs also drive
LMCache's connector (``LMCacheConnectorV1``, CPU backend) and vLLM's ``OffloadingConnector``
(CPU blocks). Neither runs on vLLM's CPU backend (the OffloadingConnector refuses CPU, LMCache finds
"No supported cpu connector"), so on CPU the report says so and leaves them out.

**Hybrid models** (``--arch gemma3|qwen3_next``, bench/e2e/hybrid.py): the TTFT table on a tiny
Gemma-3 style (sliding window beside full attention) or Qwen3-Next style (Gated DeltaNet beside
full attention) model, and the bytes kvstore stores per prompt against a single-group model with
the same layers (the two-engine group runs on the Llama only).

Runs on a tiny random Llama built offline (hidden 256, 4 layers by default). The engine is in
this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``); vLLM must be installed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import numpy as np

from kvstore.bench.common import harness
from kvstore.bench.common.engine import Engine
from kvstore.bench.e2e import cases as e2e_cases, hybrid as e2e_hybrid
from kvstore.bench.e2e.cases import (DESIGNS, GROUPS, KVSTORE_CASES, MT_CASES, NR_WORKLOADS, PEERS, QUICK, REGIMES,
                                     TTFT_CASES, _case_engine, _cuda, _designs, _goal, _label, _load, hook_seconds,
                                     multi_turn, no_reuse_once, no_reuse_prompts, peer_status, quiesce, settle)
from kvstore.bench.e2e.report import plot, render, tables
from kvstore.bench.e2e.two import two_engines

__all__ = ["_designs", "_goal", "add_args", "main", "plot", "render", "run"]


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lengths", default="1024,4096,8192", help="prompt lengths of the TTFT table ('' = skip it)")
    p.add_argument("--repeats", type=int, default=3,
                   help="TTFT measurements per length, case and round, after one warm-up (median; on 2 cores a "
                        "single one moves by 10-30 %%)")
    p.add_argument("--ttft-rounds", type=int, default=5,
                   help="TTFT rounds (a fresh engine per case each round, the order rotated; the ratios are the "
                        "median of the rounds' paired ratios). The rounds differ more than the repeats of one "
                        "(1k DRAM hit / vLLM hit, one run: 1.42 / 1.37 / 0.82), so rounds, not repeats, steady it")
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--model", default=None, help="a model folder (default: build the tiny model)")
    p.add_argument("--arch", default="llama", choices=e2e_hybrid.ARCHS,
                   help="the tiny model: llama (one KV cache group), gemma3 (sliding window + full attention) or "
                        "qwen3_next (Gated DeltaNet + full attention; blocks of 288 tokens); a hybrid one adds the "
                        "stored-bytes table against its single-group twin")
    p.add_argument("--window", type=int, default=512, help="--arch gemma3: the sliding window in tokens")
    p.add_argument("--dir", default=None, type=harness.folder, help="folder for the NVMe tier and the tiny model")
    p.add_argument("--designs", default="sync,async",
                   help="kvstore designs to run, each kvstore case once per design: sync (io.async_saves and "
                        "io.async_loads false: the first design), async (both true)")
    p.add_argument("--mt-repeats", type=int, default=3,
                   help="multi-turn rounds (a fresh engine per configuration each round; medians)")
    p.add_argument("--mt-clients", type=int, default=8, help="multi-turn clients (0 = skip the multi-turn run)")
    p.add_argument("--mt-turns", type=int, default=6)
    p.add_argument("--mt-max-tokens", type=int, default=4096, help="prompt length of the last turn (about)")
    p.add_argument("--mt-system", type=int, default=512, help="system-prompt tokens shared by all clients")
    p.add_argument("--mt-first", type=int, default=256, help="first user message tokens")
    p.add_argument("--mt-output", type=int, default=32, help="tokens generated per turn")
    p.add_argument("--nr-repeats", type=int, default=5,
                   help="no-reuse rounds (a fresh engine per configuration each round; 0 = skip the no-reuse run)")
    p.add_argument("--nr-prompts", type=int, default=16, help="no-reuse: distinct prompts per batch")
    p.add_argument("--nr-control", action=argparse.BooleanOptionalAction, default=True,
                   help="no-reuse: also run vLLM without a connector a second time each round (the "
                        "control row: the spread a round shows with no kvstore at all)")
    p.add_argument("--nr-prefill-tokens", type=int, default=2048, help="no-reuse prefill_heavy: tokens per prompt")
    p.add_argument("--nr-decode-prompt", type=int, default=128, help="no-reuse decode_heavy: tokens per prompt")
    p.add_argument("--nr-decode-output", type=int, default=512, help="no-reuse decode_heavy: output tokens per prompt")
    p.add_argument("--cases", default=None,
                   help="which of recompute,vllm_prefix,kvstore_dram,kvstore_nvme,two_engines to run (default: all; "
                        "with --quick all but two_engines, which starts two engine processes and a Redis). "
                        "recompute and vllm_prefix are the baselines and always run; the multi-turn and no-reuse "
                        "runs use kvstore_dram's configuration; two_engines alone runs only the two-engine group")
    p.add_argument("--redis-url", default=None,
                   help="two_engines: the Redis both engines share (its password from KVSTORE_REDIS_PASSWORD); "
                        "default: a private redis-server started for the run")
    p.add_argument("--te-repeats", type=int, default=1,
                   help="two_engines: prompts per length (each one remote hit in engine B; median)")
    p.add_argument("--remote-timeout-ms", type=int, default=1000, help="two_engines: tiers.remote.timeout_ms")
    p.add_argument("--peers", default="auto", choices=["auto", "off"],
                   help="auto: also drive LMCache / vLLM OffloadingConnector where they can run (CUDA)")
    p.add_argument("--peer-cpu-gb", type=float, default=4.0, help="CPU cache size given to each peer")
    p.add_argument("--quick", action="store_true",
                   help="toy sizes for every part (overrides the size flags: " + ", ".join(
                       f"--{k.replace('_', '-')} {v}" for k, v in QUICK.items()) + ")")
    harness.output_args(p)


def _rounds(repeats: int, configs: list, what: str, open_engine, work: str, bar, *, warm_seed: int,
            warm_batch: tuple[int, int], run, warm=None) -> None:
    """``repeats`` rounds of a fresh engine (and store) per configuration, their order rotated
    every round (a slow spell of a shared machine falls on all of them). Each engine is warmed
    (one prompt, then ``warm_batch`` = (prompts, output tokens): the batched decode, then
    ``warm(engine, round)`` if given), vLLM's cache reset, the DRAM pool settled, then
    ``run(engine, round, case, design)``."""
    for rnd in range(repeats):
        k = rnd % len(configs)
        for case, design in configs[k:] + configs[:k]:
            bar.label(f"{what}, round {rnd + 1}, {_label(case, design)}")
            store = os.path.join(work, f"{what.replace(' ', '-')}-{rnd}-{case}-{design or ''}")
            eng = open_engine(case, design, store)
            try:
                wrng = np.random.default_rng(warm_seed + rnd)
                eng.ttft([int(x) for x in wrng.integers(4, 500, size=64)])  # warm-up
                eng.batch([[int(x) for x in wrng.integers(4, 500, size=64)] for _ in range(warm_batch[0])],
                          warm_batch[1])
                if warm is not None:
                    warm(eng, rnd)
                eng.reset()
                settle()
                run(eng, rnd, case, design)
            finally:
                eng.close()
                shutil.rmtree(store, ignore_errors=True)


def run(a: argparse.Namespace) -> dict:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from kvstore.bench.common.tiny_model import build_tiny_llama

    if a.quick:
        for k, v in QUICK.items():
            setattr(a, k, v)
    t_start = time.perf_counter()
    load_start = _load()
    lengths = [int(x) for x in str(a.lengths).split(",") if x.strip()]
    designs = _designs(a.designs)
    cases_arg = a.cases if a.cases is not None else ",".join(TTFT_CASES + ([] if a.quick else GROUPS))
    named = {c.strip() for c in str(cases_arg).split(",") if c.strip()}
    bad = named - set(TTFT_CASES) - set(GROUPS)
    if bad:
        raise SystemExit(f"--cases: unknown {sorted(bad)}; choose from {TTFT_CASES + GROUPS}")
    te_lengths = lengths if "two_engines" in named and a.te_repeats > 0 and a.arch == "llama" else []
    only_groups = bool(named) and named <= set(GROUPS)  # e.g. --cases two_engines: that group alone
    if only_groups or a.ttft_rounds <= 0:  # --ttft-rounds 0: no TTFT table (the other runs alone)
        lengths = []
    do_mt = a.mt_repeats > 0 and a.mt_clients > 0 and a.mt_turns > 0 and not only_groups
    do_nr = a.nr_repeats > 0 and a.nr_prompts > 0 and not only_groups
    peers = peer_status() if a.peers == "auto" else {n: {"label": l, "available": False, "why": "--peers off"}
                                                     for n, l in PEERS.items()}
    live_peers = [n for n, s in peers.items() if s["available"]]
    work = tempfile.TemporaryDirectory(prefix="kvstore-e2e-", dir=a.dir)
    need = list(lengths) + list(te_lengths)
    if do_mt:
        need.append(a.mt_max_tokens + a.mt_output + 64)
    if do_nr:
        need += [a.nr_prefill_tokens + 1, a.nr_decode_prompt + a.nr_decode_output]
    max_len = max(need + [64]) + 64
    e2e_cases.MODEL_KW.clear()
    e2e_cases.MODEL_KW.update(e2e_hybrid.llm_kw(a.arch))
    if a.arch == "llama":
        model = a.model or build_tiny_llama(os.path.join(work.name, "model"), hidden=a.hidden, layers=a.layers,
                                            max_pos=max_len)
    else:
        model = a.model or e2e_hybrid.build(a.arch, work.name, max_len, window=a.window)
    want = (named - set(GROUPS)) | {"recompute", "vllm_prefix"}
    ttft_cases = ([c for c in TTFT_CASES if c in want] + live_peers) if lengths else []
    mt_cases = ([c for c in MT_CASES if c != "kvstore" or "kvstore_dram" in want] + live_peers) if do_mt else []

    def per_design(c: str) -> list[str | None]:
        return list(designs) if c in KVSTORE_CASES else [None]

    ttft_runs = [(c, d) for c in ttft_cases for d in per_design(c)]  # one engine each; a case's designs side by side
    mt_runs = [(c, d) for c in mt_cases for d in per_design(c)]
    # ("vllm", "again"): vLLM without a connector a second time each round, the control: its paired
    # ratios are the machine's own round-to-round spread (0.90-1.10 on the 2-core VM), beside the tax
    nr_configs = ([("vllm", None)] + ([("vllm", "again")] if a.nr_control else [])
                  + ([("kvstore", d) for d in designs] if "kvstore_dram" in want else [])
                  + [(p, None) for p in live_peers]) if do_nr else []
    times: dict[tuple, list[float]] = {}
    by_round: dict[tuple, dict[int, list[float]]] = {}  # (case, design, n) -> round -> TTFTs
    hook_ms: dict[tuple, list[float]] = {}  # (case, design, n) -> kvstore's hooks' ms on the engine thread, per hit
    cached: dict[tuple, int] = {}
    mt: dict[tuple, list[dict]] = {}
    nr: dict[tuple, list[dict]] = {}
    steps = len(ttft_runs) * len(lengths) * (a.repeats + 1) * a.ttft_rounds
    steps += sum(1 if c == "recompute" else len(REGIMES) for c, _ in mt_runs) * a.mt_turns * a.mt_repeats
    steps += len(nr_configs) * a.nr_repeats * len(NR_WORKLOADS) if do_nr else 0
    steps += 2 if te_lengths else 0
    steps += 2 * len(lengths) if a.arch != "llama" else 0
    with harness.Progress(max(1, steps), "bench e2e") as bar:
        def open_engine(case: str, design: str | None, store: str) -> Engine:
            mapped = {"kvstore": "kvstore_dram", "vllm": "vllm_prefix"}.get(case, case)
            return _case_engine(mapped, model, a, max_len, work.name, design, store=store)

        def ttft_round(eng: Engine, rnd: int, case: str, design: str | None) -> None:
            kv = case.startswith("kvstore") or case in PEERS
            prng = np.random.default_rng(500 + rnd)  # the same prompts for every case of a round
            for n in lengths:
                for r in range(a.repeats + 1):
                    p = [int(x) for x in prng.integers(4, 500, size=n)]
                    if case != "recompute":
                        eng.ttft(p)  # first sight: computes and stores
                        if kv:
                            eng.reset()
                            quiesce()  # its save ends before the hit (a hit comes after a pause)
                    h0 = hook_seconds()
                    dt, c = eng.ttft(p)
                    h = hook_seconds() - h0
                    if kv:
                        eng.reset()
                    if r > 0:  # the first repeat of each length is a warm-up
                        times.setdefault((case, design, n), []).append(dt)
                        by_round.setdefault((case, design, n), {}).setdefault(rnd, []).append(dt)
                        hook_ms.setdefault((case, design, n), []).append(h * 1e3)
                        cached[(case, design, n)] = c
                    bar.advance()

        _rounds(a.ttft_rounds if lengths else 0, ttft_runs, "ttft", open_engine, work.name, bar, warm_seed=4000,
                warm_batch=(2, 4), run=ttft_round)

        def mt_round(eng: Engine, rnd: int, case: str, design: str | None) -> None:
            for j, regime in enumerate(REGIMES):
                if case == "recompute" and j > 0:
                    continue  # without a prefix cache the regimes are one run
                # the same prompts for every configuration within a round and regime
                mt.setdefault((case, design, regime), []).append(
                    multi_turn(eng, a, seed=100 + 10 * rnd + j, pressure=regime == "hbm_pressure",
                               advance=bar.advance))

        _rounds(a.mt_repeats if do_mt else 0, mt_runs, "multi-turn", open_engine, work.name, bar, warm_seed=3000,
                warm_batch=(a.mt_clients, a.mt_output), run=mt_round)
        for regime in REGIMES[1:] if do_mt else []:  # recompute's one run stands for every regime
            mt[("recompute", None, regime)] = mt[("recompute", None, REGIMES[0])]
        # the same prompts for every configuration in a round
        nr_prompts = [no_reuse_prompts(a, seed=1000 + rnd) for rnd in range(a.nr_repeats if do_nr else 0)]

        def nr_round(eng: Engine, rnd: int, case: str, design: str | None) -> None:
            for wl in NR_WORKLOADS if rnd % 2 == 0 else NR_WORKLOADS[::-1]:
                ps, max_tokens = nr_prompts[rnd][wl]
                nr.setdefault((wl, case, design), []).append(no_reuse_once(eng, ps, max_tokens))
                bar.advance()

        def nr_warm(eng: Engine, rnd: int) -> None:
            # a fresh engine's first batch of a shape is slow, by a varying amount: 16 x 2,048-token
            # prefills took 2.5-3.8 s first, then 2.0-2.5 s (8 engines, vLLM alone); measured
            # first, it made single rounds' ratios swing 0.6-1.5 (the control's too). Each engine
            # is warmed on batches of the workloads' own shapes, other prompts (no reuse), the
            # decode-heavy one cut to 16 output tokens (the decode steps' shape is reached at once)
            # (kvstore's saves of them are waited for: the measured batch carries its own only)
            for ps, max_tokens in no_reuse_prompts(a, seed=7000 + rnd).values():
                eng.batch(ps, min(max_tokens, 16))
            quiesce()

        _rounds(len(nr_prompts), nr_configs, "no reuse", open_engine, work.name, bar, warm_seed=2000,
                warm_batch=(a.nr_prompts, 8), run=nr_round, warm=nr_warm)
        te = None
        if te_lengths:
            bar.label("two engines")
            # recompute's TTFT where the TTFT table measured it (same lengths, this run)
            known = {n: statistics.median(times[("recompute", None, n)]) for n in te_lengths
                     if ("recompute", None, n) in times}
            te = two_engines(model, a, te_lengths, designs, max_len, work.name,
                             advance=bar.advance,
                             recompute_s=known)
        stored = []
        if a.arch != "llama" and lengths:
            bar.label("stored bytes per prompt")
            twin = e2e_hybrid.build(a.arch, work.name, max_len, window=a.window, twin=True)
            stored = e2e_hybrid.stored_bytes(a.arch, {"hybrid": model, "twin": twin}, lengths, a.block_size, max_len,
                                             work.name, advance=bar.advance)
    work.cleanup()
    rows, mt_rows, nr_rows, goals = tables(a, lengths, ttft_runs, mt_runs, nr_configs, times, cached, mt, nr, do_mt,
                                           by_round, hook_ms)
    data = {"results": rows, "multi_turn": mt_rows, "no_reuse": nr_rows,
            "two_engines": te["rows"] if te else [], "two_engines_info": te["info"] if te else None,
            "goals": goals, "peers": peers, "stored": stored,
            "designs": {d: DESIGNS[d] for d in designs},
            "params": {"lengths": lengths, "repeats": a.repeats, "ttft_rounds": a.ttft_rounds, "block_size": a.block_size, "hidden": a.hidden,
                       "layers": a.layers, "arch": a.arch, "window": a.window, "designs": designs,
                       "mt_clients": a.mt_clients, "mt_turns": a.mt_turns,
                       "mt_max_tokens": a.mt_max_tokens, "mt_system": a.mt_system, "mt_first": a.mt_first,
                       "mt_output": a.mt_output, "mt_repeats": a.mt_repeats, "nr_repeats": a.nr_repeats,
                       "nr_prompts": a.nr_prompts,
                       "nr_prefill_tokens": a.nr_prefill_tokens, "nr_decode_prompt": a.nr_decode_prompt,
                       "nr_decode_output": a.nr_decode_output, "te_lengths": te_lengths,
                       "te_repeats": a.te_repeats, "device": "cuda" if _cuda() else "cpu",
                       "quick": bool(a.quick), "cpus": os.cpu_count(), "load_start": load_start,
                       "load_end": _load(), "wall_s": time.perf_counter() - t_start}}
    return harness.report(a, data, lambda d: render(d) + e2e_hybrid.render(d), plot)


def main(argv=None) -> dict:
    return harness.main(__name__, argv)
