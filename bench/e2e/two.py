"""``two_engines`` of ``kvstore bench e2e``: engine A (its own process and folders) computes fresh
prompts and writes them through to one Redis; engine B (another process, empty folders) then gets
the same prompts: a remote hit. Each engine runs in a process of its own (bench/common/engine_job.py)."""

from __future__ import annotations

import os
import statistics
import time

import numpy as np

from kvstore.bench.common import engine_job
from kvstore.bench.common.report import markdown_table
from kvstore.bench.e2e.cases import TE_OUTPUT, new_engine


def _full_blocks(n: int, block_size: int) -> int:
    """Tokens a prefix hit can supply: every full block but the block of the last token (vLLM computes it)."""
    return (n - 1) // block_size * block_size


def _engine_job(job: dict) -> dict:
    """The body of one two-engine child process (bench/common/engine_job.py runs it on the job).

    ``job["recompute"]``: each prompt once on vLLM without prefix caching and no connector (TTFT,
    output tokens). Then the kvstore engine (own folders, ``job["remote"]``): each of
    ``job["prompts"]`` once in order (TTFT, output tokens, cached tokens; the caller drops the
    warm-up ones). The engine's background writes are flushed before it closes (A's blocks are
    all in Redis when its process exits)."""
    bs, max_len, k = job["block_size"], job["max_len"], job["max_tokens"]
    out: dict = {"recompute": [], "runs": [], "counters": {}, "phase_s": {}}
    t0 = time.perf_counter()
    if job.get("recompute"):
        eng = new_engine(job["model"], bs, max_len, prefix_caching=False)
        try:
            eng.batch([job["warmup"]], 1)
            for p in job["recompute"]:
                r = eng.batch([p], k)
                out["recompute"].append({"tokens": len(p), "ttft_s": r["ttft_s"][0], "outputs": r["outputs"][0]})
        finally:
            eng.close()
        out["phase_s"]["recompute"] = time.perf_counter() - t0
        t0 = time.perf_counter()
    eng = new_engine(job["model"], bs, max_len, "kvstore", job["store"], job["dram_gb"], True, 0.0, job["design"],
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


def _spawn_job(name: str, job: dict, folder: str, password: str | None) -> dict:
    """Run one engine job in a fresh Python process (bench/common/engine_job.py: its output in
    ``folder/NAME.log``); its result, with the process's wall time. A failure raises with the tail
    of that log. (A and B run one after the other: started together, the two start-ups took
    longer on a 2-core machine than in turn, 46 s vs 34 s.)"""
    t0 = time.perf_counter()
    res = engine_job.spawn("kvstore.bench.e2e.two:_engine_job", name, job, folder, what="two_engines",
                           env={"KVSTORE_REDIS_PASSWORD": password} if password else None)
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
        from kvstore.bench.common import redis_local

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
        ra = _spawn_job("a", dict(base, store=os.path.join(work, "te-a"), recompute=recompute, warmup=toks(64)),
                        work, password)
        if advance:
            advance()
        # B starts after A's process is gone: every block A computed is in Redis
        rb = _spawn_job("b", dict(base, store=os.path.join(work, "te-b"), recompute=[], warmup=toks(64)),
                        work, password)
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
