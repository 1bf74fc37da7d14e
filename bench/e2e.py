"""``kvstore bench e2e``: TTFT and throughput through a real vLLM engine with KVStoreConnector.

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
import statistics
import tempfile
import time

import numpy as np

from bench.report import markdown_table, progress, write_json

TTFT_CASES = ["recompute", "vllm_prefix", "kvstore_dram", "kvstore_nvme"]
MT_CASES = ["recompute", "vllm_prefix", "kvstore"]
PEERS = {"lmcache": "LMCache (LMCacheConnectorV1, CPU backend)",
         "vllm_offloading": "vLLM OffloadingConnector (CPU blocks)"}
REGIMES = ["hbm_ample", "hbm_pressure"]


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lengths", default="1024,4096,8192", help="prompt lengths of the TTFT table ('' = skip it)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--model", default=None, help="a model folder (default: build the tiny model)")
    p.add_argument("--dir", default=None, help="folder for the NVMe tier and the tiny model")
    p.add_argument("--mt-clients", type=int, default=8, help="multi-turn clients (0 = skip the multi-turn run)")
    p.add_argument("--mt-turns", type=int, default=6)
    p.add_argument("--mt-max-tokens", type=int, default=4096, help="prompt length of the last turn (about)")
    p.add_argument("--mt-system", type=int, default=512, help="system-prompt tokens shared by all clients")
    p.add_argument("--mt-first", type=int, default=256, help="first user message tokens")
    p.add_argument("--mt-output", type=int, default=32, help="tokens generated per turn")
    p.add_argument("--cases", default=",".join(TTFT_CASES),
                   help="which of recompute,vllm_prefix,kvstore_dram,kvstore_nvme to run (recompute and "
                        "vllm_prefix are the baselines and always run; the multi-turn run uses kvstore_dram's engine)")
    p.add_argument("--peers", default="auto", choices=["auto", "off"],
                   help="auto: also drive LMCache / vLLM OffloadingConnector where they can run (CUDA)")
    p.add_argument("--peer-cpu-gb", type=float, default=4.0, help="CPU cache size given to each peer")
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


def _kv_transfer(connector: str | None, store: str | None, dram_gb: float, peer_cpu_gb: float):
    """The KVTransferConfig of a case (None: no connector)."""
    if connector is None:
        return None
    from vllm.config import KVTransferConfig

    if connector == "kvstore":
        extra = {"tiers": {"dram": {"capacity_gb": dram_gb, "ttl_s": None},
                           "nvme": {"path": store, "capacity_gb": 8, "ttl_s": None}}}
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
                 peer_cpu_gb: float = 4.0):
        from vllm import LLM

        kw = dict(enforce_eager=True, block_size=block_size, max_model_len=max_len, dtype="float32", seed=0,
                  enable_prefix_caching=prefix_caching, max_num_batched_tokens=max_len)
        ktc = _kv_transfer(connector, store, dram_gb, peer_cpu_gb)
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


# -- the command ---------------------------------------------------------------------------------------

def _case_engine(case: str, model: str, a, max_len: int, work: str) -> _Engine:
    connector, dram_gb, prefix = None, 1.0, True
    if case == "recompute":
        prefix = False
    elif case in ("kvstore", "kvstore_dram", "kvstore_nvme"):
        connector = "kvstore"
        dram_gb = 0.0 if case == "kvstore_nvme" else 1.0
    elif case in PEERS:
        connector = case
    store = os.path.join(work, f"store-{case}") if connector == "kvstore" else None
    return _Engine(model, a.block_size, max_len, connector, store, dram_gb, prefix, a.peer_cpu_gb)


def run(a: argparse.Namespace) -> dict:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from bench.tiny_model import build_tiny_llama

    lengths = [int(x) for x in str(a.lengths).split(",") if x.strip()]
    do_mt = a.mt_clients > 0 and a.mt_turns > 0
    peers = peer_status() if a.peers == "auto" else {n: {"label": l, "available": False, "why": "--peers off"}
                                                     for n, l in PEERS.items()}
    live_peers = [n for n, s in peers.items() if s["available"]]
    work = tempfile.TemporaryDirectory(prefix="kvstore-e2e-", dir=a.dir)
    max_len = max(lengths + ([a.mt_max_tokens + a.mt_output + 64] if do_mt else [0])) + 64
    model = a.model or build_tiny_llama(os.path.join(work.name, "model"), hidden=a.hidden, layers=a.layers,
                                        max_pos=max_len)
    rng = np.random.default_rng(0)

    def fresh(n: int) -> list[int]:
        return [int(x) for x in rng.integers(4, 500, size=n)]

    want = {c.strip() for c in str(a.cases).split(",") if c.strip()} | {"recompute", "vllm_prefix"}
    bad = want - set(TTFT_CASES)
    if bad:
        raise SystemExit(f"--cases: unknown {sorted(bad)}; choose from {TTFT_CASES}")
    ttft_cases = ([c for c in TTFT_CASES if c in want] + live_peers) if lengths else []
    mt_cases = ([c for c in MT_CASES if c != "kvstore" or "kvstore_dram" in want] + live_peers) if do_mt else []
    cases = list(dict.fromkeys([c for c in ttft_cases] + [("kvstore_dram" if c == "kvstore" else c) for c in mt_cases]))
    times: dict[tuple[str, int], list[float]] = {}
    cached: dict[tuple[str, int], int] = {}
    mt: dict[tuple[str, str], dict] = {}
    steps = len(ttft_cases) * len(lengths) * (a.repeats + 1)
    steps += sum(1 if c == "recompute" else len(REGIMES) for c in mt_cases) * a.mt_turns
    bar, task = progress(max(1, steps), "bench e2e")
    with bar:
        for case in cases:
            bar.update(task, description=f"bench e2e: {case}")
            eng = _case_engine(case, model, a, max_len, work.name)
            try:
                eng.ttft(fresh(64))  # warm-up
                if case in ttft_cases:
                    for n in lengths:
                        for r in range(a.repeats + 1):
                            p = fresh(n)
                            if case != "recompute":
                                eng.ttft(p)  # first sight: computes and stores
                                if case.startswith("kvstore") or case in PEERS:
                                    eng.llm.reset_prefix_cache()
                            dt, c = eng.ttft(p)
                            if case.startswith("kvstore") or case in PEERS:
                                eng.llm.reset_prefix_cache()
                            if r > 0:  # the first repeat of each length is a warm-up
                                times.setdefault((case, n), []).append(dt)
                                cached[(case, n)] = c
                            bar.advance(task)
                mt_name = "kvstore" if case == "kvstore_dram" else case
                if mt_name in mt_cases:
                    eng.batch([fresh(64) for _ in range(a.mt_clients)], a.mt_output)  # warm the batched decode
                    eng.llm.reset_prefix_cache()
                    for j, regime in enumerate(REGIMES):
                        if mt_name == "recompute" and j > 0:
                            mt[("recompute", regime)] = mt[("recompute", REGIMES[0])]
                            continue
                        # the same prompts for every case within a regime (seed by regime)
                        mt[(mt_name, regime)] = multi_turn(eng, a, seed=100 + j, pressure=regime == "hbm_pressure",
                                                           advance=lambda: bar.advance(task))
            finally:
                eng.close()
    work.cleanup()
    rows = []
    for n in lengths:
        base = statistics.median(times[("recompute", n)])
        vp = statistics.median(times[("vllm_prefix", n)])
        for case in ttft_cases:
            t = statistics.median(times[(case, n)])
            rows.append({"prompt_tokens": n, "case": case, "ttft_ms": t * 1e3, "cached_tokens": cached[(case, n)],
                         "vs_recompute": t / base, "vs_vllm_prefix": t / vp})
    mt_rows = []
    for regime in REGIMES if do_mt else []:
        base = mt[("recompute", regime)]
        for case in mt_cases:
            r = mt[(case, regime)]
            mt_rows.append({"regime": regime, "case": case, "turns": a.mt_turns, "clients": a.mt_clients,
                            "max_prompt_tokens": r["max_prompt_tokens"], "prompt_tokens": r["prompt_tokens"],
                            "cached_share": r["cached_tokens"] / max(1, r["prompt_tokens"]),
                            "mean_ttft_ms": r["mean_ttft_ms"], "p90_ttft_ms": r["p90_ttft_ms"], "wall_s": r["wall_s"],
                            "throughput_tok_s": r["throughput_tok_s"],
                            "x_recompute": r["throughput_tok_s"] / base["throughput_tok_s"],
                            "per_turn": r["per_turn"]})
    data = {"results": rows, "multi_turn": mt_rows, "peers": peers,
            "params": {"lengths": lengths, "repeats": a.repeats, "block_size": a.block_size, "hidden": a.hidden,
                       "layers": a.layers, "mt_clients": a.mt_clients, "mt_turns": a.mt_turns,
                       "mt_max_tokens": a.mt_max_tokens, "mt_system": a.mt_system, "mt_first": a.mt_first,
                       "mt_output": a.mt_output, "device": "cuda" if _cuda() else "cpu"}}
    print(render(data))
    write_json(a.json, data)
    if a.plots:
        plot(data, a.plots)
    return data


def render(data: dict) -> str:
    out = []
    if data["results"]:
        out.append("TTFT of one prompt (median; a 1-token generation):\n")
        out.append(markdown_table(data["results"], ["prompt_tokens", "case", "ttft_ms", "cached_tokens", "vs_recompute",
                                                    "vs_vllm_prefix"],
                                  ["prompt tokens", "case", "TTFT ms", "cached tokens", "x recompute",
                                   "x vLLM prefix hit"]))
    if data["multi_turn"]:
        p = data["params"]
        out.append(f"\nMulti-turn: {p['mt_clients']} clients x {p['mt_turns']} turns, shared {p['mt_system']}-token "
                   f"system prompt, prompts growing to ~{p['mt_max_tokens']} tokens, {p['mt_output']} output tokens "
                   "a turn. hbm_pressure = vLLM's prefix cache reset between turns. Throughput = (prompt + output "
                   "tokens) / wall time.\n")
        rows = [{**r, "cached": f"{100 * r['cached_share']:.1f}%"} for r in data["multi_turn"]]
        out.append(markdown_table(rows, ["regime", "case", "max_prompt_tokens", "prompt_tokens", "cached",
                                         "mean_ttft_ms", "p90_ttft_ms", "wall_s", "throughput_tok_s", "x_recompute"],
                                  ["regime", "case", "last prompt tokens", "prompt tokens", "from cache",
                                   "mean TTFT ms", "p90 TTFT ms", "wall s", "tokens/s", "x recompute"]))
    notes = [f"- {s['label']}: {'driven in this run' if s['available'] else 'not run: ' + s['why']}"
             for s in data["peers"].values()]
    out.append("\nPeers (device: " + data["params"]["device"] + "):\n" + "\n".join(notes))
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
        for case in dict.fromkeys(r["case"] for r in rows):
            pts = [(r["prompt_tokens"], r["ttft_ms"]) for r in rows if r["case"] == case]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=case)
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
        cases = list(dict.fromkeys(r["case"] for r in data["multi_turn"]))
        x = np.arange(len(regimes))
        w = 0.8 / max(1, len(cases))
        for k, case in enumerate(cases):
            by = {r["regime"]: r for r in data["multi_turn"] if r["case"] == case}
            axes[0].bar(x + k * w, [by[g]["throughput_tok_s"] for g in regimes], w, label=case)
            axes[1].bar(x + k * w, [by[g]["mean_ttft_ms"] for g in regimes], w, label=case)
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
    return paths


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="kvstore bench e2e", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    main()
