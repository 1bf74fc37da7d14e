"""``kvstore bench e2e``: TTFT and throughput through a real vLLM engine with KVStoreConnector.

**Designs.** Every kvstore case runs once per design (``--designs``): ``sync`` is the first
design (``io.async_saves`` and ``io.async_loads`` false: saves and loads run inline in the
engine's step), ``async`` the new one (both true). The tables show them side by side.

**TTFT table.** For each prompt length, the median time to first token (a 1-token generation,
i.e. the prefill) of:

* ``recompute``      vLLM without prefix caching: the whole prompt is computed;
* ``vllm_prefix``    vLLM's own in-memory prefix cache hit (the same prompt again);
* ``kvstore_dram``   a kvstore hit from DRAM (vLLM's cache reset in between);
* ``kvstore_nvme``   a kvstore hit from NVMe (DRAM tier disabled, so every block is read from a file).

**Multi-turn run.** ``--mt-clients`` clients x ``--mt-turns`` turns: all clients share a system
prompt; each turn's prompt is the previous prompt + the previous output + new content, growing to
about ``--mt-max-tokens``; every client's turn is submitted at once and the engine is stepped
until all finish. Reported: throughput (prompt + output tokens per second of wall time), mean and
p90 TTFT, and the share of prompt tokens served from a cache, for ``recompute``, ``vllm_prefix``
(vLLM's own prefix cache alone) and ``kvstore`` (vLLM's cache + kvstore), in two regimes:

* ``hbm_ample``: vLLM's own cache keeps everything between turns (kvstore has little to add);
* ``hbm_pressure``: vLLM's prefix cache is reset between turns, as when other traffic has
  evicted a session's blocks from accelerator memory by the time its next turn comes.

**No-reuse tax.** What kvstore costs when nothing is ever reused: ``--nr-prompts`` distinct
prompts submitted as one batch, ``prefill_heavy`` (``--nr-prefill-tokens`` each, 1 output token)
and ``decode_heavy`` (``--nr-decode-prompt`` tokens each, ``--nr-decode-output`` output tokens),
with kvstore (each design; DRAM + NVMe tiers) against vLLM without any connector. Each of
``--nr-repeats`` rounds builds a fresh engine per configuration, in an order rotated every round
(interleaved, so a slow spell of a shared machine falls on all of them); reported are the median
throughput ((prompt + output tokens) / wall time) and the median of the rounds' paired ratios.

**Goals.** Each figure with a goal is printed next to its limit, with PASS/FAIL, and the goals
are summed up per design at the end: DRAM-hit TTFT / vLLM prefix-hit TTFT <= 1.3; NVMe-hit TTFT /
recompute TTFT <= 0.15 (prompts of 4k tokens and more); multi-turn under HBM pressure, kvstore
tokens/s / recompute tokens/s >= 2.59; no-reuse throughput / vLLM's >= 0.97.

**Two engines** (``two_engines`` in ``--cases``; on by default, off with ``--quick`` unless named).
Engine A (its own process, its own DRAM/NVMe folders, the remote tier on a Redis: ``--redis-url``,
else a private password-protected ``redis-server`` started for the run, ``bench/redis_local.py``)
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
(CPU blocks). Neither runs on vLLM's CPU backend (DESIGN.md section 7), so on CPU the report
says so and leaves them out.

Runs on a tiny random Llama built offline (hidden 256, 4 layers by default). The engine is in
this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``); vLLM must be installed.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import os
import shutil
import statistics
import tempfile
import time

import numpy as np

from bench.report import markdown_table, progress, write_json

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
QUICK = {"lengths": "128", "repeats": 1, "te_repeats": 1, "hidden": 128, "layers": 2, "mt_clients": 2, "mt_turns": 2,
         "mt_max_tokens": 256, "mt_system": 64, "mt_first": 64, "mt_output": 4, "nr_repeats": 1, "nr_prompts": 2,
         "nr_prefill_tokens": 128, "nr_decode_prompt": 32, "nr_decode_output": 8}


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lengths", default="1024,4096,8192", help="prompt lengths of the TTFT table ('' = skip it)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--model", default=None, help="a model folder (default: build the tiny model)")
    p.add_argument("--dir", default=None, help="folder for the NVMe tier and the tiny model")
    p.add_argument("--designs", default="sync,async",
                   help="kvstore designs to run, each kvstore case once per design: sync (io.async_saves and "
                        "io.async_loads false: the first design), async (both true)")
    p.add_argument("--mt-clients", type=int, default=8, help="multi-turn clients (0 = skip the multi-turn run)")
    p.add_argument("--mt-turns", type=int, default=6)
    p.add_argument("--mt-max-tokens", type=int, default=4096, help="prompt length of the last turn (about)")
    p.add_argument("--mt-system", type=int, default=512, help="system-prompt tokens shared by all clients")
    p.add_argument("--mt-first", type=int, default=256, help="first user message tokens")
    p.add_argument("--mt-output", type=int, default=32, help="tokens generated per turn")
    p.add_argument("--nr-repeats", type=int, default=3,
                   help="no-reuse rounds (a fresh engine per configuration each round; 0 = skip the no-reuse run)")
    p.add_argument("--nr-prompts", type=int, default=16, help="no-reuse: distinct prompts per batch")
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
    p.add_argument("--json", default=None)
    p.add_argument("--plots", default=None)


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
    from vllm.config import KVTransferConfig

    if connector == "kvstore":
        extra = {"tiers": {"dram": {"capacity_gb": dram_gb, "ttl_s": None},
                           "nvme": {"path": store, "capacity_gb": 8, "ttl_s": None}}}
        if design is not None:
            extra["io"] = dict(DESIGNS[design])
        if remote:  # the shared tier (credentials from KVSTORE_REDIS_PASSWORD in the environment)
            extra["tiers"]["remote"] = dict(remote)
        return KVTransferConfig(kv_connector="KVStoreConnector", kv_role="kv_both", kv_connector_extra_config=extra)
    if connector == "lmcache":  # LMCache reads its config from the environment
        os.environ.setdefault("LMCACHE_LOCAL_CPU", "True")
        os.environ.setdefault("LMCACHE_MAX_LOCAL_CPU_SIZE", str(peer_cpu_gb))
        os.environ.setdefault("LMCACHE_CHUNK_SIZE", "256")
        return KVTransferConfig(kv_connector="LMCacheConnectorV1", kv_role="kv_both")
    if connector == "vllm_offloading":
        return KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both",
                                kv_connector_extra_config={"cpu_bytes_to_use": int(peer_cpu_gb * (1 << 30))})
    raise ValueError(connector)


class _Engine:
    def __init__(self, model: str, block_size: int, max_len: int, connector: str | None = None,
                 store: str | None = None, dram_gb: float = 1.0, prefix_caching: bool = True,
                 peer_cpu_gb: float = 4.0, design: str | None = None, remote: dict | None = None):
        from vllm import LLM

        kw = dict(enforce_eager=True, block_size=block_size, max_model_len=max_len, dtype="float32", seed=0,
                  enable_prefix_caching=prefix_caching, max_num_batched_tokens=max_len)
        ktc = _kv_transfer(connector, store, dram_gb, peer_cpu_gb, design, remote)
        if ktc is not None:
            kw["kv_transfer_config"] = ktc
        self.llm = LLM(model, **kw)

    def ttft(self, tokens: list[int]) -> tuple[float, int]:
        from vllm import SamplingParams

        t = time.perf_counter()
        out = self.llm.generate([{"prompt_token_ids": tokens}], SamplingParams(max_tokens=1, temperature=0),
                                use_tqdm=False)
        return time.perf_counter() - t, out[0].num_cached_tokens

    def batch(self, prompts: list[list[int]], max_tokens: int) -> dict:
        """Submit all prompts at once; step until done. Per request: TTFT, output ids, cached tokens."""
        from vllm import SamplingParams

        eng = self.llm.llm_engine
        sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        base = f"b{time.perf_counter_ns()}-"
        t0 = time.perf_counter()
        for i, p in enumerate(prompts):
            eng.add_request(f"{base}{i}", {"prompt_token_ids": p}, sp)
        first: dict[str, float] = {}
        final: dict[str, object] = {}
        while eng.has_unfinished_requests():
            for o in eng.step():
                now = time.perf_counter()
                if o.request_id not in first and o.outputs and len(o.outputs[0].token_ids) > 0:
                    first[o.request_id] = now - t0
                if o.finished:
                    final[o.request_id] = o
        wall = time.perf_counter() - t0
        ids = [f"{base}{i}" for i in range(len(prompts))]
        return {"wall_s": wall, "ttft_s": [first[i] for i in ids],
                "outputs": [list(final[i].outputs[0].token_ids) for i in ids],
                "cached": [int(final[i].num_cached_tokens or 0) for i in ids]}

    def close(self) -> None:
        from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

        self.llm.llm_engine.engine_core.shutdown()
        del self.llm
        gc.collect()
        destroy_model_parallel()
        destroy_distributed_environment()


# -- the multi-turn run ------------------------------------------------------------------------------

def _new_per_turn(a) -> int:
    if a.mt_turns <= 1:
        return 0
    grow = (a.mt_max_tokens - a.mt_system - a.mt_first) / (a.mt_turns - 1)
    return max(1, int(grow) - a.mt_output)


def multi_turn(eng: _Engine, a, seed: int, pressure: bool, advance=None) -> dict:
    """``a.mt_clients`` clients x ``a.mt_turns`` append-only turns through one engine."""
    rng = np.random.default_rng(seed)

    def toks(n: int) -> list[int]:
        return [int(x) for x in rng.integers(4, 500, size=n)]

    system = toks(a.mt_system)
    prompts = [system + toks(a.mt_first) for _ in range(a.mt_clients)]
    new = _new_per_turn(a)
    ttft, cached, prompt_tok, out_tok, wall = [], 0, 0, 0, 0.0
    per_turn = []
    longest = 0
    for turn in range(a.mt_turns):
        longest = max(longest, max(len(p) for p in prompts))
        r = eng.batch(prompts, a.mt_output)
        ttft += r["ttft_s"]
        cached += sum(r["cached"])
        n_prompt = sum(len(p) for p in prompts)
        prompt_tok += n_prompt
        out_tok += sum(len(o) for o in r["outputs"])
        wall += r["wall_s"]
        per_turn.append({"turn": turn + 1, "prompt_tokens": n_prompt, "wall_s": r["wall_s"],
                         "mean_ttft_ms": 1e3 * statistics.mean(r["ttft_s"]), "cached_tokens": sum(r["cached"])})
        if pressure:
            eng.llm.reset_prefix_cache()
        prompts = [p + o + toks(new) for p, o in zip(prompts, r["outputs"])]
        if advance:
            advance()
    return {"wall_s": wall, "prompt_tokens": prompt_tok, "output_tokens": out_tok, "cached_tokens": cached,
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


def no_reuse_once(eng: _Engine, prompts: list[list[int]], max_tokens: int) -> dict:
    r = eng.batch(prompts, max_tokens)
    n_prompt = sum(len(p) for p in prompts)
    n_out = sum(len(o) for o in r["outputs"])
    return {"wall_s": r["wall_s"], "prompt_tokens": n_prompt, "output_tokens": n_out,
            "cached_tokens": sum(r["cached"]), "throughput_tok_s": (n_prompt + n_out) / r["wall_s"]}


# -- two engines sharing one Redis -------------------------------------------------------------------

def _full_blocks(n: int, block_size: int) -> int:
    """Tokens a prefix hit can supply: every full block but the block of the last token (vLLM computes it)."""
    return (n - 1) // block_size * block_size


def _engine_job(job: dict) -> dict:
    """The body of one two-engine child process (``python -m bench.e2e --_engine-job JOB.json``).

    ``job["recompute"]``: each prompt once on vLLM without prefix caching and no connector (TTFT,
    output tokens). Then the kvstore engine (own folders, ``job["remote"]``): each of
    ``job["prompts"]`` once in order (TTFT, output tokens, cached tokens; the caller drops the
    warm-up ones). The engine's background writes are flushed before it closes (A's blocks are
    all in Redis when its process exits)."""
    bs, max_len, k = job["block_size"], job["max_len"], job["max_tokens"]
    out: dict = {"recompute": [], "runs": [], "counters": {}, "phase_s": {}}
    t0 = time.perf_counter()
    if job.get("recompute"):
        eng = _Engine(job["model"], bs, max_len, prefix_caching=False)
        try:
            eng.batch([job["warmup"]], 1)
            for p in job["recompute"]:
                r = eng.batch([p], k)
                out["recompute"].append({"tokens": len(p), "ttft_s": r["ttft_s"][0], "outputs": r["outputs"][0]})
        finally:
            eng.close()
        out["phase_s"]["recompute"] = time.perf_counter() - t0
        t0 = time.perf_counter()
    eng = _Engine(job["model"], bs, max_len, "kvstore", job["store"], job["dram_gb"], True, 0.0, job["design"],
                  remote=job["remote"])
    try:
        from kvstore.offload import shared as shared_mod

        eng.batch([job["warmup"]], 1)
        for sh in shared_mod.live():  # the DRAM pool's background preparation would compete with the runs
            sh.store.wait_ready(120)
        out["phase_s"]["kvstore_start"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        for p in job["prompts"]:
            r = eng.batch([p], k)
            out["runs"].append({"tokens": len(p), "ttft_s": r["ttft_s"][0], "cached": r["cached"][0],
                                "outputs": r["outputs"][0]})
        for sh in shared_mod.live():  # in-process engine: the connector's store
            sh.store.flush()  # write-through to Redis done before this process reports
            m = sh.store.metrics
            out["counters"] = {
                "remote_written_bytes": m.value("kvstore_tier_written_bytes_total", tier="remote"),
                "remote_read_bytes": m.value("kvstore_tier_read_bytes_total", tier="remote"),
                "served_remote_tokens": sh.metrics.registry.get_sample_value(
                    "kvstore_engine_served_tokens_total", {"tier": "remote"}) or 0.0}
    finally:
        eng.close()
    out["phase_s"]["kvstore_runs"] = time.perf_counter() - t0
    return out


def _engine_job_main(path: str) -> dict:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import json

    with open(path) as f:
        job = json.load(f)
    res = _engine_job(job)
    with open(job["result"] + ".tmp", "w") as f:
        json.dump(res, f)
    os.replace(job["result"] + ".tmp", job["result"])
    return res


def _spawn_job(name: str, job: dict, folder: str, password: str | None) -> dict:
    """Run one engine job in a fresh Python process (its output in ``folder/NAME.log``); its result.
    A failure raises with the tail of that log. (A and B run one after the other: started
    together, the two start-ups took longer on a 2-core machine than in turn, 46 s vs 34 s.)"""
    import json
    import subprocess
    import sys

    from bench.redis_local import die_with_parent

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", HF_HUB_OFFLINE="1",
               PYTHONPATH=os.pathsep.join([root] + [x for x in [os.environ.get("PYTHONPATH")] if x]))
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    if password:
        env["KVSTORE_REDIS_PASSWORD"] = password
    path, log_path = os.path.join(folder, f"{name}.job.json"), os.path.join(folder, f"{name}.log")
    with open(path, "w") as f:
        json.dump(job, f)
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        p = subprocess.Popen([sys.executable, "-m", "bench.e2e", "--_engine-job", path], cwd=root, env=env,
                             stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                             preexec_fn=die_with_parent)  # no orphan engine if the bench is killed
        try:
            rc = p.wait(timeout=3600)
        except BaseException:
            p.kill()
            p.wait()
            raise
    if rc != 0 or not os.path.exists(job["result"]):
        with open(log_path, errors="replace") as f:
            tail = f.read()[-4000:]
        raise RuntimeError(f"two_engines: engine {name} failed (exit {rc}):\n{tail}")
    with open(job["result"]) as f:
        res = json.load(f)
    res["process_wall_s"] = time.perf_counter() - t0
    return res


def two_engines(model: str, a, lengths: list[int], designs: list[str], max_len: int, work: str,
                advance=None, recompute_s: dict[int, float] | None = None) -> dict:
    """Engine A (a process) computes ``a.te_repeats`` fresh prompts per length and stores them,
    written through to Redis; engine B (another process, empty folders, same Redis) gets them.
    ``recompute_s``: recompute's TTFT per length measured in this run already (the TTFT table);
    lengths it lacks are measured in A's process, before A's engine."""
    import secrets

    design = "async" if "async" in designs else designs[0]
    info = {"design": design, "output_tokens": TE_OUTPUT, "block_size": a.block_size, "repeats": a.te_repeats,
            "timeout_ms": a.remote_timeout_ms, "skipped": None}
    server, password = None, None
    if a.redis_url:
        url, password = a.redis_url, os.environ.get("KVSTORE_REDIS_PASSWORD") or None
        info["redis"] = "--redis-url"
    else:
        from bench import redis_local

        info["redis"] = "private redis-server (password)"
        if not redis_local.available():
            info["skipped"] = "no redis-server on PATH (install it, or pass --redis-url)"
            return {"rows": [], "info": info}
        password = secrets.token_hex(16)
        server = redis_local.start(os.path.join(work, "redis"), password=password)
        url = server.url
    rng = np.random.default_rng(4242)

    def toks(n: int) -> list[int]:
        return [int(x) for x in rng.integers(4, 500, size=n)]

    # per length: a warm-up prompt (every engine's first prompt of a length is slower: dropped; in B
    # it is a remote hit too), then te_repeats measured ones; A computes and stores them all
    prompts, measured = [], []
    for n in lengths:
        for j in range(a.te_repeats + 1):
            prompts.append(toks(n))
            measured.append(j > 0)
    # recompute (no prefix cache, no connector): the warm-up and the first measured prompt of a length
    known = recompute_s or {}
    recompute = [p for n in lengths if n not in known for p in [q for q in prompts if len(q) == n][:2]]
    # DRAM: one 256 MiB chunk, ready when the store opens (a larger pool is prepared in the background)
    base = {"model": model, "block_size": a.block_size, "max_len": max_len, "max_tokens": TE_OUTPUT,
            "dram_gb": 0.25, "design": design, "remote": {"url": url, "timeout_ms": a.remote_timeout_ms},
            "prompts": prompts}
    try:
        ra = _spawn_job("a", dict(base, store=os.path.join(work, "te-a"), recompute=recompute, warmup=toks(64),
                                  result=os.path.join(work, "a.result.json")), work, password)
        if advance:
            advance()
        # B starts after A's process is gone: every block A computed is in Redis
        rb = _spawn_job("b", dict(base, store=os.path.join(work, "te-b"), recompute=[], warmup=toks(64),
                                  result=os.path.join(work, "b.result.json")), work, password)
        if advance:
            advance()
    finally:
        if server is not None:
            server.stop()
    info["counters"] = {"a": ra["counters"], "b": rb["counters"]}
    info["process_wall_s"] = {"a": ra["process_wall_s"], "b": rb["process_wall_s"]}
    info["phase_s"] = {"a": ra.get("phase_s"), "b": rb.get("phase_s")}
    info["warmup_cached_b"] = [rb["runs"][i]["cached"] for i, m in enumerate(measured) if not m]
    rows = []
    for n in lengths:
        rec = [r for r in ra["recompute"] if r["tokens"] == n][1:]  # past the warm-up
        if n in known:
            rec = [{"ttft_s": known[n], "outputs": None}]
        ia = [i for i, p in enumerate(prompts) if len(p) == n and measured[i]]
        ta = [ra["runs"][i]["ttft_s"] for i in ia]
        tb = [rb["runs"][i]["ttft_s"] for i in ia]
        cached_b = [rb["runs"][i]["cached"] for i in ia]
        full = _full_blocks(n, a.block_size)
        same = [rb["runs"][i]["outputs"] == ra["runs"][i]["outputs"] for i in ia]
        t_rec = statistics.median(r["ttft_s"] for r in rec)
        t_b = statistics.median(tb)
        rows.append({"prompt_tokens": n, "design": design, "recompute_ttft_ms": 1e3 * t_rec,
                     "recompute_source": "TTFT table" if n in known else "engine A's process",
                     "a_ttft_ms": 1e3 * statistics.median(ta), "b_ttft_ms": 1e3 * t_b, "x_recompute": t_b / t_rec,
                     "a_x_recompute": statistics.median(ta) / t_rec, "b_runs_ms": [1e3 * t for t in tb],
                     "cached_tokens": min(cached_b), "cached_runs": cached_b, "a_cached": [ra["runs"][i]["cached"]
                                                                                         for i in ia],
                     "full_block_tokens": full, "cached_ok": all(c == full for c in cached_b),
                     "outputs_equal": all(same), "outputs_equal_runs": same,
                     # the same prompt recomputed (no prefix cache, no connector): information only
                     "recompute_outputs_equal": (rb["runs"][ia[0]]["outputs"] == rec[0]["outputs"]
                                                 if rec[0]["outputs"] is not None else None)})
    return {"rows": rows, "info": info}


def _render_two_engines(rows: list[dict], info: dict) -> str:
    head = (f"\nTwo engines, one Redis ({info.get('redis', '')}; design {info['design']}, block "
            f"{info['block_size']}): engine A (its own process and folders) computes {info['repeats']} fresh "
            f"prompt(s) per length and writes them through to Redis; engine B (another process, empty folders) "
            f"then gets the same prompts: a remote hit. Each engine's first prompt of a length is a warm-up, "
            f"dropped. TTFT medians; recompute = vLLM without prefix caching (the TTFT table's when it ran, "
            f"else measured in A's process before A's engine); cached = B's cached tokens, which must be every "
            f"full block; "
            f"outputs = B's {info['output_tokens']} greedy tokens equal A's.\n")
    if info.get("skipped"):
        return head + f"\nnot run: {info['skipped']}"
    table = [{**r, "cached": f"{r['cached_tokens']}/{r['full_block_tokens']} "
                              f"{'ok' if r['cached_ok'] else 'SHORT'}",
              "same": "yes" if r["outputs_equal"] else "NO"} for r in rows]
    c = info.get("counters", {})
    tail = ""
    if c:
        tail = (f"\nRedis: A wrote {c['a'].get('remote_written_bytes', 0) / 2**20:.1f} MiB; B read "
                f"{c['b'].get('remote_read_bytes', 0) / 2**20:.1f} MiB and served "
                f"{c['b'].get('served_remote_tokens', 0):.0f} tokens from it.")
    return head + "\n" + markdown_table(
        table, ["prompt_tokens", "recompute_ttft_ms", "a_ttft_ms", "b_ttft_ms", "x_recompute", "cached", "same"],
        ["prompt tokens", "recompute TTFT ms", "A TTFT ms (miss, stores)", "B TTFT ms (remote hit)",
         "B x recompute", "B cached tokens", "B outputs = A's"]) + tail


# -- the command ---------------------------------------------------------------------------------------

def _label(case: str, design: str | None) -> str:
    return case if not design else f"{case} ({design})"


def _case_engine(case: str, model: str, a, max_len: int, work: str, design: str | None = None,
                 store: str | None = None) -> _Engine:
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
    return _Engine(model, a.block_size, max_len, connector, store, dram_gb, prefix, a.peer_cpu_gb,
                   design if connector == "kvstore" else None)


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


def run(a: argparse.Namespace) -> dict:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from bench.tiny_model import build_tiny_llama

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
    te_lengths = lengths if "two_engines" in named and a.te_repeats > 0 else []
    only_groups = bool(named) and named <= set(GROUPS)  # e.g. --cases two_engines: that group alone
    if only_groups:
        lengths = []
    do_mt = a.mt_clients > 0 and a.mt_turns > 0 and not only_groups
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
    model = a.model or build_tiny_llama(os.path.join(work.name, "model"), hidden=a.hidden, layers=a.layers,
                                        max_pos=max_len)
    rng = np.random.default_rng(0)

    def fresh(n: int) -> list[int]:
        return [int(x) for x in rng.integers(4, 500, size=n)]

    want = (named - set(GROUPS)) | {"recompute", "vllm_prefix"}
    ttft_cases = ([c for c in TTFT_CASES if c in want] + live_peers) if lengths else []
    mt_cases = ([c for c in MT_CASES if c != "kvstore" or "kvstore_dram" in want] + live_peers) if do_mt else []
    cases = list(dict.fromkeys([c for c in ttft_cases] + [("kvstore_dram" if c == "kvstore" else c) for c in mt_cases]))

    def per_design(c: str) -> list[str | None]:
        return list(designs) if c in KVSTORE_CASES else [None]

    runs = [(c, d) for c in cases for d in per_design(c)]  # one engine each; a case's designs side by side
    ttft_runs = [(c, d) for c in ttft_cases for d in per_design(c)]
    mt_runs = [(c, d) for c in mt_cases for d in per_design(c)]
    nr_configs = ([("vllm", None)] + ([("kvstore", d) for d in designs] if "kvstore_dram" in want else [])
                  + [(p, None) for p in live_peers]) if do_nr else []
    times: dict[tuple, list[float]] = {}
    cached: dict[tuple, int] = {}
    mt: dict[tuple, dict] = {}
    nr: dict[tuple, list[dict]] = {}
    steps = len(ttft_runs) * len(lengths) * (a.repeats + 1)
    steps += sum(1 if c == "recompute" else len(REGIMES) for c, _ in mt_runs) * a.mt_turns
    steps += len(nr_configs) * a.nr_repeats * len(NR_WORKLOADS) if do_nr else 0
    steps += 2 if te_lengths else 0
    bar, task = progress(max(1, steps), "bench e2e")
    with bar:
        for case, design in runs:
            bar.update(task, description=f"bench e2e: {_label(case, design)}")
            eng = _case_engine(case, model, a, max_len, work.name, design)
            kv = case.startswith("kvstore") or case in PEERS
            try:
                eng.ttft(fresh(64))  # warm-up
                if case in ttft_cases:
                    for n in lengths:
                        for r in range(a.repeats + 1):
                            p = fresh(n)
                            if case != "recompute":
                                eng.ttft(p)  # first sight: computes and stores
                                if kv:
                                    eng.llm.reset_prefix_cache()
                            dt, c = eng.ttft(p)
                            if kv:
                                eng.llm.reset_prefix_cache()
                            if r > 0:  # the first repeat of each length is a warm-up
                                times.setdefault((case, design, n), []).append(dt)
                                cached[(case, design, n)] = c
                            bar.advance(task)
                mt_name = "kvstore" if case == "kvstore_dram" else case
                if mt_name in mt_cases:
                    eng.batch([fresh(64) for _ in range(a.mt_clients)], a.mt_output)  # warm the batched decode
                    eng.llm.reset_prefix_cache()
                    for j, regime in enumerate(REGIMES):
                        if mt_name == "recompute" and j > 0:
                            mt[("recompute", None, regime)] = mt[("recompute", None, REGIMES[0])]
                            continue
                        # the same prompts for every case within a regime (seed by regime)
                        mt[(mt_name, design, regime)] = multi_turn(eng, a, seed=100 + j,
                                                                   pressure=regime == "hbm_pressure",
                                                                   advance=lambda: bar.advance(task))
            finally:
                eng.close()
        # no reuse: rounds of fresh engines, the configurations' order rotated each round
        for rnd in range(a.nr_repeats if do_nr else 0):
            prompts = no_reuse_prompts(a, seed=1000 + rnd)  # the same prompts for every configuration in a round
            k = rnd % len(nr_configs)
            for case, design in nr_configs[k:] + nr_configs[:k]:
                bar.update(task, description=f"bench e2e: no reuse, round {rnd + 1}, {_label(case, design)}")
                store = os.path.join(work.name, f"nr-{rnd}-{case}-{design or ''}")
                eng = _case_engine("vllm_prefix" if case == "vllm" else case, model, a, max_len, work.name,
                                   design, store=store)
                try:
                    wrng = np.random.default_rng(2000 + rnd)
                    eng.ttft([int(x) for x in wrng.integers(4, 500, size=64)])  # warm-up (and the DRAM pool)
                    eng.batch([[int(x) for x in wrng.integers(4, 500, size=64)] for _ in range(a.nr_prompts)], 8)
                    order = NR_WORKLOADS if rnd % 2 == 0 else NR_WORKLOADS[::-1]
                    for wl in order:
                        ps, max_tokens = prompts[wl]
                        nr.setdefault((wl, case, design), []).append(no_reuse_once(eng, ps, max_tokens))
                        bar.advance(task)
                finally:
                    eng.close()
                    shutil.rmtree(store, ignore_errors=True)
        te = None
        if te_lengths:
            bar.update(task, description="bench e2e: two engines")
            # recompute's TTFT where the TTFT table measured it (same lengths, this run)
            known = {n: statistics.median(times[("recompute", None, n)]) for n in te_lengths
                     if ("recompute", None, n) in times}
            te = two_engines(model, a, te_lengths, designs, max_len, work.name,
                             advance=lambda: bar.advance(task),
                             recompute_s=known)
    work.cleanup()
    goals: list[dict] = []
    rows = []
    for n in lengths:
        base = statistics.median(times[("recompute", None, n)])
        vp = statistics.median(times[("vllm_prefix", None, n)])
        for case, design in ttft_runs:
            t = statistics.median(times[(case, design, n)])
            row = {"prompt_tokens": n, "case": case, "design": design or "", "ttft_ms": t * 1e3,
                   "cached_tokens": cached[(case, design, n)], "vs_recompute": t / base, "vs_vllm_prefix": t / vp,
                   "goal": None}
            if case == "kvstore_dram":
                row["goal"] = _goal("dram_hit", t / vp, f"{n} tokens", design)
            elif case == "kvstore_nvme" and n >= GOALS["nvme_hit"]["min_tokens"]:
                row["goal"] = _goal("nvme_hit", t / base, f"{n} tokens", design)
            if row["goal"]:
                goals.append(row["goal"])
            rows.append(row)
    mt_rows = []
    for regime in REGIMES if do_mt else []:
        base = mt[("recompute", None, regime)]
        for case, design in mt_runs:
            r = mt[(case, design, regime)]
            x = r["throughput_tok_s"] / base["throughput_tok_s"]
            goal = _goal("multi_turn", x, regime, design) if case == "kvstore" and regime == "hbm_pressure" else None
            if goal:
                goals.append(goal)
            mt_rows.append({"regime": regime, "case": case, "design": design or "", "turns": a.mt_turns,
                            "clients": a.mt_clients, "max_prompt_tokens": r["max_prompt_tokens"],
                            "prompt_tokens": r["prompt_tokens"],
                            "cached_share": r["cached_tokens"] / max(1, r["prompt_tokens"]),
                            "mean_ttft_ms": r["mean_ttft_ms"], "p90_ttft_ms": r["p90_ttft_ms"], "wall_s": r["wall_s"],
                            "throughput_tok_s": r["throughput_tok_s"], "x_recompute": x, "goal": goal,
                            "per_turn": r["per_turn"]})
    nr_rows = []
    for wl in NR_WORKLOADS if nr_configs else []:
        base = nr[(wl, "vllm", None)]
        for case, design in nr_configs:
            runs_ = nr[(wl, case, design)]
            # paired: each round's ratio to vLLM's run of the same round, then the median
            ratios = [r["throughput_tok_s"] / b["throughput_tok_s"] for r, b in zip(runs_, base)]
            x = statistics.median(ratios)
            goal = _goal("no_reuse", x, wl, design) if case == "kvstore" else None
            if goal:
                goals.append(goal)
            first = runs_[0]
            nr_rows.append({"workload": wl, "case": case, "design": design or "", "prompts": a.nr_prompts,
                            "prompt_tokens": first["prompt_tokens"], "output_tokens": first["output_tokens"],
                            "cached_tokens": max(r["cached_tokens"] for r in runs_),
                            "wall_s": statistics.median(r["wall_s"] for r in runs_),
                            "throughput_tok_s": statistics.median(r["throughput_tok_s"] for r in runs_),
                            "x_vllm": x, "x_vllm_runs": ratios,
                            "throughput_runs": [r["throughput_tok_s"] for r in runs_], "goal": goal})
    data = {"results": rows, "multi_turn": mt_rows, "no_reuse": nr_rows,
            "two_engines": te["rows"] if te else [], "two_engines_info": te["info"] if te else None,
            "goals": goals, "peers": peers,
            "designs": {d: DESIGNS[d] for d in designs},
            "params": {"lengths": lengths, "repeats": a.repeats, "block_size": a.block_size, "hidden": a.hidden,
                       "layers": a.layers, "designs": designs, "mt_clients": a.mt_clients, "mt_turns": a.mt_turns,
                       "mt_max_tokens": a.mt_max_tokens, "mt_system": a.mt_system, "mt_first": a.mt_first,
                       "mt_output": a.mt_output, "nr_repeats": a.nr_repeats, "nr_prompts": a.nr_prompts,
                       "nr_prefill_tokens": a.nr_prefill_tokens, "nr_decode_prompt": a.nr_decode_prompt,
                       "nr_decode_output": a.nr_decode_output, "te_lengths": te_lengths,
                       "te_repeats": a.te_repeats, "device": "cuda" if _cuda() else "cpu",
                       "quick": bool(a.quick), "cpus": os.cpu_count(), "load_start": load_start,
                       "load_end": _load(), "wall_s": time.perf_counter() - t_start}}
    print(render(data))
    write_json(a.json, data)
    if a.plots:
        plot(data, a.plots)
    return data


def _goal_text(g: dict | None) -> str:
    if not g:
        return ""
    return f"{g['op']} {g['limit']:g}: {'PASS' if g['pass'] else 'FAIL'}"


def render(data: dict) -> str:
    out = []
    p = data["params"]
    designs = p.get("designs") or []
    if designs:
        out.append("Designs: " + "; ".join(f"{d} = io.async_saves {v['async_saves']}, io.async_loads "
                                           f"{v['async_loads']}" for d, v in data.get("designs", {}).items()) + "\n")
    if data["results"]:
        out.append("TTFT of one prompt (median; a 1-token generation). Goals: kvstore_dram x vLLM prefix hit "
                   f"{GOALS['dram_hit']['op']} {GOALS['dram_hit']['limit']:g}; kvstore_nvme x recompute "
                   f"{GOALS['nvme_hit']['op']} {GOALS['nvme_hit']['limit']:g} from "
                   f"{GOALS['nvme_hit']['min_tokens']} tokens.\n")
        rows = [{**r, "goal": _goal_text(r.get("goal"))} for r in data["results"]]
        out.append(markdown_table(rows, ["prompt_tokens", "case", "design", "ttft_ms", "cached_tokens",
                                         "vs_recompute", "vs_vllm_prefix", "goal"],
                                  ["prompt tokens", "case", "design", "TTFT ms", "cached tokens", "x recompute",
                                   "x vLLM prefix hit", "goal"]))
    if data["multi_turn"]:
        out.append(f"\nMulti-turn: {p['mt_clients']} clients x {p['mt_turns']} turns, shared {p['mt_system']}-token "
                   f"system prompt, prompts growing to ~{p['mt_max_tokens']} tokens, {p['mt_output']} output tokens "
                   "a turn. hbm_pressure = vLLM's prefix cache reset between turns. Throughput = (prompt + output "
                   f"tokens) / wall time. Goal: kvstore under hbm_pressure x recompute {GOALS['multi_turn']['op']} "
                   f"{GOALS['multi_turn']['limit']:g}.\n")
        rows = [{**r, "cached": f"{100 * r['cached_share']:.1f}%", "goal": _goal_text(r.get("goal"))}
                for r in data["multi_turn"]]
        out.append(markdown_table(rows, ["regime", "case", "design", "max_prompt_tokens", "prompt_tokens", "cached",
                                         "mean_ttft_ms", "p90_ttft_ms", "wall_s", "throughput_tok_s", "x_recompute",
                                         "goal"],
                                  ["regime", "case", "design", "last prompt tokens", "prompt tokens", "from cache",
                                   "mean TTFT ms", "p90 TTFT ms", "wall s", "tokens/s", "x recompute", "goal"]))
    if data.get("no_reuse"):
        out.append(f"\nNo reuse: {p['nr_prompts']} distinct prompts as one batch; prefill_heavy "
                   f"{p['nr_prefill_tokens']} tokens each, 1 output token; decode_heavy {p['nr_decode_prompt']} "
                   f"tokens each, {p['nr_decode_output']} output tokens. {p['nr_repeats']} rounds, a fresh engine "
                   "per configuration each round, the order rotated; medians; x vLLM = median of the rounds' "
                   f"paired ratios. Goal: kvstore x vLLM {GOALS['no_reuse']['op']} {GOALS['no_reuse']['limit']:g}.\n")
        rows = [{**r, "goal": _goal_text(r.get("goal")),
                 "per_round": " / ".join(f"{x:.3f}" for x in r["x_vllm_runs"])} for r in data["no_reuse"]]
        out.append(markdown_table(rows, ["workload", "case", "design", "prompt_tokens", "output_tokens",
                                         "cached_tokens", "wall_s", "throughput_tok_s", "x_vllm", "per_round", "goal"],
                                  ["workload", "case", "design", "prompt tokens", "output tokens", "cached tokens",
                                   "wall s", "tokens/s", "x vLLM", "x vLLM per round", "goal"]))
    info = data.get("two_engines_info")
    if info:
        out.append(_render_two_engines(data.get("two_engines") or [], info))
    if data.get("goals"):
        out.append("\nGoals (issue 13), per design:\n")
        keys = list(dict.fromkeys((g["goal"], g["where"]) for g in data["goals"]))
        by = {(g["goal"], g["where"], g["design"]): g for g in data["goals"]}
        rows = []
        for name, where in keys:
            row = {"label": GOALS[name]["label"], "where": where,
                   "limit": f"{GOALS[name]['op']} {GOALS[name]['limit']:g}"}
            for d in designs:
                g = by.get((name, where, d))
                row[d] = "" if g is None else f"{g['value']:.3f} {'PASS' if g['pass'] else 'FAIL'}"
            rows.append(row)
        out.append(markdown_table(rows, ["label", "where", "limit"] + designs, ["goal", "where", "limit"] + designs))
        met = [f"{d} {sum(g['pass'] for g in data['goals'] if g['design'] == d)}/"
               f"{sum(1 for g in data['goals'] if g['design'] == d)}" for d in designs]
        out.append("\nGoals met: " + ", ".join(met))
    notes = [f"- {s['label']}: {'driven in this run' if s['available'] else 'not run: ' + s['why']}"
             for s in data["peers"].values()]
    out.append("\nPeers (device: " + p["device"] + "):\n" + "\n".join(notes))
    if "wall_s" in p:
        load = ""
        if p.get("load_start") is not None:
            load = (f"; 1-min load average {p['load_start']:.1f} at the start, {p['load_end']:.1f} at the end, "
                    f"{p['cpus']} CPUs")
            if max(p["load_start"], p["load_end"]) > p["cpus"] + 0.5:
                load += ": other work was running on this machine, so every figure is skewed"
        out.append(f"\n(bench e2e took {p['wall_s']:.0f} s{load})")
    return "\n".join(out)


def plot(data: dict, folder: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(folder, exist_ok=True)
    paths = []
    rows = data["results"]
    if rows:
        fig, ax = plt.subplots(figsize=(7, 4))
        for key in dict.fromkeys((r["case"], r.get("design", "")) for r in rows):
            pts = [(r["prompt_tokens"], r["ttft_ms"]) for r in rows if (r["case"], r.get("design", "")) == key]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=_label(*key))
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("TTFT (ms)")
        ax.set_title(f"TTFT: recompute vs. prefix hits (tiny model, {data['params']['device'].upper()})")
        ax.legend()
        fig.tight_layout()
        path = os.path.join(folder, "e2e_ttft.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    if data["multi_turn"]:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        regimes = list(dict.fromkeys(r["regime"] for r in data["multi_turn"]))
        cases = list(dict.fromkeys((r["case"], r.get("design", "")) for r in data["multi_turn"]))
        x = np.arange(len(regimes))
        w = 0.8 / max(1, len(cases))
        for k, key in enumerate(cases):
            by = {r["regime"]: r for r in data["multi_turn"] if (r["case"], r.get("design", "")) == key}
            axes[0].bar(x + k * w, [by[g]["throughput_tok_s"] for g in regimes], w, label=_label(*key))
            axes[1].bar(x + k * w, [by[g]["mean_ttft_ms"] for g in regimes], w, label=_label(*key))
        for ax, yl in zip(axes, ("tokens/s (prompt + output)", "mean TTFT (ms)")):
            ax.set_xticks(x + w * (len(cases) - 1) / 2, regimes)
            ax.set_ylabel(yl)
            ax.legend(fontsize=8)
        axes[0].set_title("multi-turn throughput")
        axes[1].set_title("multi-turn TTFT")
        fig.tight_layout()
        path = os.path.join(folder, "e2e_multi_turn.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    if data.get("no_reuse"):
        fig, ax = plt.subplots(figsize=(7, 4))
        wls = list(dict.fromkeys(r["workload"] for r in data["no_reuse"]))
        cases = list(dict.fromkeys((r["case"], r["design"]) for r in data["no_reuse"]))
        x = np.arange(len(wls))
        w = 0.8 / max(1, len(cases))
        for k, key in enumerate(cases):
            by = {r["workload"]: r for r in data["no_reuse"] if (r["case"], r["design"]) == key}
            ax.bar(x + k * w, [by[g]["x_vllm"] for g in wls], w, label=_label(*key))
        ax.axhline(GOALS["no_reuse"]["limit"], color="k", linestyle="--", linewidth=1, label="goal")
        ax.set_xticks(x + w * (len(cases) - 1) / 2, wls)
        ax.set_ylabel("tokens/s / vLLM's (no connector)")
        ax.set_title("no-reuse tax")
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = os.path.join(folder, "e2e_no_reuse.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def main(argv=None) -> dict:
    import sys

    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--_engine-job"]:  # a child process of two_engines (not a user flag)
        return _engine_job_main(argv[1])
    p = argparse.ArgumentParser(prog="kvstore bench e2e", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    main()
