"""The cases of ``kvstore bench e2e`` (bench/e2e/): designs, goals, peers, the engine of each
case, and the multi-turn and no-reuse workloads driven through an engine."""

from __future__ import annotations

import importlib.util
import os
import statistics
import threading
import time

import numpy as np

from kvstore.bench.common import engine
from kvstore.bench.common.engine import Engine

TTFT_CASES = ["recompute", "vllm_prefix", "kvstore_dram", "kvstore_nvme"]
GROUPS = ["two_engines"]  # case groups beside the TTFT cases (``--cases``)
TE_OUTPUT = 8  # greedy tokens each two-engine request generates (compared between A and B)
MT_CASES = ["recompute", "vllm_prefix", "kvstore"]
KVSTORE_CASES = ("kvstore", "kvstore_dram", "kvstore_nvme")
PEERS = {"lmcache": "LMCache (LMCacheConnectorV1, CPU backend)",
         "vllm_offloading": "vLLM OffloadingConnector (CPU blocks)"}
REGIMES = ["hbm_ample", "hbm_pressure"]
# the connector's io section per design (kvstore/config.py IoConfig)
DESIGNS = {"sync": {"async_saves": False, "async_loads": False},
           "async": {"async_saves": True, "async_loads": True}}
NR_WORKLOADS = ["prefill_heavy", "decode_heavy"]
# issue 13's goals: (metric, op, limit); a figure passes when ``value op limit``
GOALS = {
    "dram_hit": {"label": "DRAM-hit TTFT / vLLM prefix-hit TTFT", "op": "<=", "limit": 1.3},
    "nvme_hit": {"label": "NVMe-hit TTFT / recompute TTFT", "op": "<=", "limit": 0.15, "min_tokens": 4096},
    "multi_turn": {"label": "multi-turn, HBM pressure: tokens/s / recompute's", "op": ">=", "limit": 2.59},
    "no_reuse": {"label": "no reuse: tokens/s / vLLM's (no connector)", "op": ">=", "limit": 0.97},
}


# ``--quick``: the whole path at toy sizes (tests; a smoke check of a new machine)
QUICK = {"lengths": "128", "repeats": 1, "ttft_rounds": 1, "te_repeats": 1, "hidden": 128, "layers": 2, "mt_repeats": 1,
         "mt_clients": 2, "mt_turns": 2,
         "mt_max_tokens": 256, "mt_system": 64, "mt_first": 64, "mt_output": 4, "nr_repeats": 1, "nr_prompts": 2,
         "nr_prefill_tokens": 128, "nr_decode_prompt": 32, "nr_decode_output": 8}


# -- peers ---------------------------------------------------------------------------------------

def _cuda() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


def peer_status() -> dict[str, dict]:
    """Which peer connectors can run here, and why not."""
    cuda = _cuda()
    out = {}
    for name, label in PEERS.items():
        why = None
        if not cuda:
            why = ("does not run on vLLM's CPU backend (OffloadingConnector: 'CPU Offloading is currently only "
                   "supported on CUDA-alike and XPU GPUs')" if name == "vllm_offloading" else
                   "does not run on vLLM's CPU backend (LMCacheConnectorV1: 'No supported cpu connector found')")
        elif name == "lmcache" and importlib.util.find_spec("lmcache") is None:
            why = "not installed (pip install lmcache)"
        elif name == "vllm_offloading" and importlib.util.find_spec(
                "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector") is None:
            why = "this vLLM has no OffloadingConnector"
        out[name] = {"label": label, "available": why is None, "why": why}
    return out


def _kv_transfer(connector: str | None, store: str | None, dram_gb: float, peer_cpu_gb: float,
                 design: str | None = None, remote: dict | None = None):
    """The KVTransferConfig of a case (None: no connector)."""
    if connector is None:
        return None
    if connector == "kvstore":
        return engine.kv_transfer(engine.connector_config(store, dram_gb=dram_gb, nvme_gb=8, remote=remote,
                                                          io=DESIGNS[design] if design is not None else None))
    if connector == "lmcache":  # LMCache reads its config from the environment
        os.environ.setdefault("LMCACHE_LOCAL_CPU", "True")
        os.environ.setdefault("LMCACHE_MAX_LOCAL_CPU_SIZE", str(peer_cpu_gb))
        os.environ.setdefault("LMCACHE_CHUNK_SIZE", "256")
        return engine.kv_transfer(connector="LMCacheConnectorV1")
    if connector == "vllm_offloading":
        return engine.kv_transfer({"cpu_bytes_to_use": int(peer_cpu_gb * (1 << 30))}, connector="OffloadingConnector")
    raise ValueError(connector)


# vLLM engine arguments the bench's model needs (bench/e2e/hybrid.py: bfloat16 for Qwen3-Next)
MODEL_KW: dict = {}


def new_engine(model: str, block_size: int, max_len: int, connector: str | None = None, store: str | None = None,
               dram_gb: float = 1.0, prefix_caching: bool = True, peer_cpu_gb: float = 4.0,
               design: str | None = None, remote: dict | None = None, **llm_kw) -> Engine:
    """An engine of the bench (a step takes a whole prompt: max_num_batched_tokens = max_len)."""
    return Engine(model, block_size=block_size, max_len=max_len, prefix_caching=prefix_caching,
                  batched_tokens=max_len,
                  kv_transfer=_kv_transfer(connector, store, dram_gb, peer_cpu_gb, design, remote),
                  **{**MODEL_KW, **llm_kw})


def _label(case: str, design: str | None) -> str:
    return case if not design else f"{case} ({design})"


def _case_engine(case: str, model: str, a, max_len: int, work: str, design: str | None = None,
                 store: str | None = None) -> Engine:
    connector, dram_gb, prefix = None, 1.0, True
    if case == "recompute":
        prefix = False
    elif case in KVSTORE_CASES:
        connector = "kvstore"
        dram_gb = 0.0 if case == "kvstore_nvme" else 1.0
    elif case in PEERS:
        connector = case
    if connector == "kvstore" and store is None:
        store = os.path.join(work, f"store-{case}" + (f"-{design}" if design else ""))
    return new_engine(model, a.block_size, max_len, connector, store, dram_gb, prefix, a.peer_cpu_gb,
                      design if connector == "kvstore" else None)


def settle() -> None:
    """Wait until the DRAM pools of the stores open in this process are fully prepared. The
    pool's background pre-fault is a one-time start-up cost (0.13-0.16 s of CPU for 0.75 GiB on
    the 2-core VM, read per thread from /proc) that otherwise landed in the first measured run:
    3-5 % of a 5 s no-reuse batch, charged to kvstore as a steady-state tax."""
    from kvstore.offload import shared

    for sh in shared.live():
        sh.store.wait_ready(120)


def quiesce(timeout: float = 60.0) -> None:
    """Wait until the stores of this process have no work in flight: the worker's copy jobs (the
    gathers of asynchronous saves, asynchronous loads), then the store's own background work
    (demotions, NVMe writes, write-through). A TTFT hit measured right after the miss that
    stored it otherwise shares the 2 cores with that miss's save; a hit comes back after a pause
    (a human's turn, an agent's tool call), when it has long ended."""
    from kvstore.offload import shared

    for sh in shared.live():
        if sh.jobs is not None:
            sh.jobs.wait_idle(timeout)
        sh.store.flush()


def hook_seconds() -> float:
    """Wall seconds kvstore's connector hooks have spent on the engine's thread so far, over the
    stores of this process (``kvstore_engine_hook_seconds_total``; the idle steps' load waits left
    out). kvstore's direct cost to the engine: what every request of a step waits for."""
    from kvstore.offload import shared

    return sum(sh.metrics.hooks.seconds() for sh in shared.live())


# the prefixes of every thread kvstore starts (Python and native), and the kernel's io_uring workers
# (threads of this process; only kvstore's NVMe engine uses io_uring here)
OWN_THREADS = ("kvstore-", "kvs-", "iou-wrk")


def kvstore_thread_cpu() -> float:
    """CPU seconds used so far by this process's kvstore threads, from /proc: the Python threads
    named ``kvstore*`` (copy jobs, NVMe I/O, demotion, pre-fault, RPC) and the native copy pool
    (``kvstore-copy``). Work beside the engine's thread, which takes a core from it when every
    core is busy."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    tck = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for tid in os.listdir("/proc/self/task"):
        try:
            name = names.get(int(tid)) or open(f"/proc/self/task/{tid}/comm").read().strip()
            # "kvstore-..." / "kvs-..." only: a thread nobody named carries the process's own name,
            # "kvstore" when the bench runs as `kvstore bench e2e`, and vLLM's OpenMP threads were
            # counted as kvstore's (99 % of the wall time, vLLM alone included)
            if not name.startswith(OWN_THREADS):
                continue
            f = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()
        except (OSError, ValueError):  # the thread ended meanwhile
            continue
        total += (int(f[11]) + int(f[12])) / tck  # utime + stime
    return total


def _goal(name: str, value: float, where: str, design: str | None) -> dict:
    g = GOALS[name]
    ok = value <= g["limit"] if g["op"] == "<=" else value >= g["limit"]
    return {"goal": name, "label": g["label"], "where": where, "design": design or "", "value": value,
            "op": g["op"], "limit": g["limit"], "pass": bool(ok)}


def _load() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def _designs(text: str) -> list[str]:
    designs = list(dict.fromkeys(d.strip() for d in str(text).split(",") if d.strip()))
    bad = [d for d in designs if d not in DESIGNS]
    if bad or not designs:
        raise SystemExit(f"--designs: unknown {bad or 'none given'}; choose from {list(DESIGNS)}")
    return designs


# -- the multi-turn run ------------------------------------------------------------------------------

def _new_per_turn(a) -> int:
    if a.mt_turns <= 1:
        return 0
    grow = (a.mt_max_tokens - a.mt_system - a.mt_first) / (a.mt_turns - 1)
    return max(1, int(grow) - a.mt_output)


def multi_turn(eng: Engine, a, seed: int, pressure: bool, advance=None) -> dict:
    """``a.mt_clients`` clients x ``a.mt_turns`` append-only turns through one engine."""
    rng = np.random.default_rng(seed)

    def toks(n: int) -> list[int]:
        return [int(x) for x in rng.integers(4, 500, size=n)]

    system = toks(a.mt_system)
    prompts = [system + toks(a.mt_first) for _ in range(a.mt_clients)]
    new = _new_per_turn(a)
    ttft, cached, prompt_tok, out_tok, wall, cpu = [], 0, 0, 0, 0.0, 0.0
    per_turn = []
    longest = 0
    hook0, bg0 = hook_seconds(), kvstore_thread_cpu()
    for turn in range(a.mt_turns):
        longest = max(longest, max(len(p) for p in prompts))
        r = eng.batch(prompts, a.mt_output)
        ttft += r["ttft_s"]
        cached += sum(r["cached"])
        n_prompt = sum(len(p) for p in prompts)
        prompt_tok += n_prompt
        out_tok += sum(len(o) for o in r["outputs"])
        wall += r["wall_s"]
        cpu += r["cpu_s"]
        per_turn.append({"turn": turn + 1, "prompt_tokens": n_prompt, "wall_s": r["wall_s"],
                         "mean_ttft_ms": 1e3 * statistics.mean(r["ttft_s"]), "cached_tokens": sum(r["cached"])})
        if pressure:
            eng.reset()
        prompts = [p + o + toks(new) for p, o in zip(prompts, r["outputs"])]
        if advance:
            advance()
    return {"wall_s": wall, "cpu_s": cpu, "prompt_tokens": prompt_tok, "output_tokens": out_tok,
            "cached_tokens": cached, "hook_s": hook_seconds() - hook0, "bg_cpu_s": kvstore_thread_cpu() - bg0,
            "mean_ttft_ms": 1e3 * statistics.mean(ttft), "p90_ttft_ms": 1e3 * float(np.percentile(ttft, 90)),
            "throughput_tok_s": (prompt_tok + out_tok) / wall, "output_tok_s": out_tok / wall,
            "max_prompt_tokens": longest,
            "per_turn": per_turn}


# -- the no-reuse run ----------------------------------------------------------------------------------

def no_reuse_prompts(a, seed: int) -> dict[str, tuple[list[list[int]], int]]:
    """Per workload: ``a.nr_prompts`` distinct prompts and the output tokens each."""
    rng = np.random.default_rng(seed)

    def toks(n: int) -> list[int]:
        return [int(x) for x in rng.integers(4, 500, size=n)]

    return {"prefill_heavy": ([toks(a.nr_prefill_tokens) for _ in range(a.nr_prompts)], 1),
            "decode_heavy": ([toks(a.nr_decode_prompt) for _ in range(a.nr_prompts)], a.nr_decode_output)}


def no_reuse_once(eng: Engine, prompts: list[list[int]], max_tokens: int) -> dict:
    """One batch, timed until kvstore's saves of it have ended too (``save_tail_s``: what the
    asynchronous saves still had to do once the last output came). Steady traffic pays for every
    save; untimed, a batch's tail fell on the next measurement (the other workload) or on none."""
    from kvstore.offload import shared

    hook0, bg0 = hook_seconds(), kvstore_thread_cpu()
    r = eng.batch(prompts, max_tokens)
    tail = tail_cpu = 0.0  # vLLM alone: no store, no save to wait for (timing a no-op call only
    if shared.live():      # measured the machine's noise: 1.1 % of a tiny batch once, in CI)
        t, c = time.perf_counter(), time.process_time()
        quiesce()
        tail, tail_cpu = time.perf_counter() - t, time.process_time() - c
    wall = r["wall_s"] + tail
    n_prompt = sum(len(p) for p in prompts)
    n_out = sum(len(o) for o in r["outputs"])
    return {"wall_s": wall, "cpu_s": r["cpu_s"] + tail_cpu, "save_tail_s": tail, "prompt_tokens": n_prompt,
            "output_tokens": n_out, "hook_s": hook_seconds() - hook0, "bg_cpu_s": kvstore_thread_cpu() - bg0,
            "cached_tokens": sum(r["cached"]), "throughput_tok_s": (n_prompt + n_out) / wall}
