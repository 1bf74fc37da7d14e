"""kvstore bench route: routing policies over several vLLM engines with kvstore (issue 32).

Starts ``--engines`` engine processes (each a vLLM engine on the tiny model with kvstore: DRAM,
NVMe in its own folder, and with ``--redis on`` a shared Redis tier; vLLM's own KV cache cut to
``--gpu-blocks`` so it cannot hold every session), and replays one agent workload: ``--sessions``
sessions of ``--turns`` turns, every prompt starting with the same system prompt, each turn the
previous prompt, its answer and a new user message. Up to ``--concurrency`` sessions have a
request in flight at once (a session's next turn waits for its answer); each request goes to the
engine a policy of the reference router (bench/route/router.py) picks, and the engines batch what they
get. TTFT counts from the router's send: queueing at a busy engine is part of it.

* ``round_robin``; ``session`` (session affinity); ``prefix`` (llm-d's default profile: the prefix
  held, scored from the engines' KV-event streams, where kvstore announces its DRAM and NVMe
  blocks, with llm-d's weights GPU 1.0, CPU 0.8, STORAGE 0.4, weighed 3:2 against the engines'
  requests in flight).

Reported per policy, with and without Redis: the share of prompt tokens the engine already had
(vLLM's prefix cache) and kvstore served per tier, mean and p90 TTFT, requests per engine.

``--node`` (issue 46): instead, the engines attach to one ``kvstore serve`` of the host (no Redis,
no store of their own) holding the DRAM they would have held together (``--engines`` x
``--dram-blocks``), NVMe in a folder of its own; a turn that lands on the other engine finds its
history in the daemon's DRAM, announced on that engine's own KV-event stream. The engines share
``PYTHONHASHSEED`` (vLLM's block hashes), as engines sharing a daemon must.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import queue
import statistics
import sys
import tempfile
import time
from collections import deque

import numpy as np

from kvstore.bench.common import harness

BLOCK_KIB = 128  # the tiny model's block of 32 tokens: 4 layers x K,V x 2 heads x 64 x fp32


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--sessions", type=int, default=12)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=4, help="sessions with a request in flight at once")
    p.add_argument("--system-tokens", type=int, default=512)
    p.add_argument("--user-tokens", type=int, default=96)
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--policies", default="round_robin,session,prefix")
    p.add_argument("--redis", choices=("both", "off", "on"), default="both")
    p.add_argument("--node", action="store_true", help="the engines attach to one kvstore serve daemon instead "
                   "(no Redis): the node cache's rows only")
    p.add_argument("--gpu-blocks", type=int, default=64, help="vLLM's own KV cache per engine, in blocks")
    p.add_argument("--dram-blocks", type=int, default=160, help="kvstore's DRAM tier per engine, in blocks")
    p.add_argument("--seed", type=int, default=0)
    harness.json_switch(p, "print JSON instead of the Markdown table")


def _engine_main(idx: int, model: str, store: str | None, redis_url: str | None, port: int, a: dict, inq, outq) -> None:
    """One engine process: requests in, (TTFT, output, cached tokens) out, kvstore's summary last;
    a failure goes out as ("error", idx, text) so the bench stops instead of waiting. Its output
    (vLLM's logs) goes to stderr: stdout is the bench's table or JSON alone."""
    os.dup2(2, 1)
    try:
        _engine_loop(idx, model, store, redis_url, port, a, inq, outq)
    except BaseException:
        import traceback

        outq.put(("error", idx, traceback.format_exc()))


def _engine_loop(idx: int, model: str, store: str | None, redis_url: str | None, port: int, a: dict, inq, outq
                 ) -> None:
    """``store``: its NVMe folder (None: ``a["node"]`` names the node daemon it attaches to)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(idx % (os.cpu_count() or 1))
    from vllm import SamplingParams
    from vllm.config import KVEventsConfig

    from kvstore.bench.common.engine import Engine, connector_config, kv_transfer
    from kvstore.offload import shared as shared_mod

    if store is None:  # node mode: the engines announce each other's blocks under the same hashes
        os.environ["PYTHONHASHSEED"] = "0"
        cfg = {"mode": "node", "node": {"name": a["node"]}}
    else:
        cfg = connector_config(store, dram_gb=a["dram_blocks"] * BLOCK_KIB / 2**20, nvme_gb=1,
                               remote={"url": redis_url, "timeout_ms": 500} if redis_url else None)
    # every hit is loaded: on the tiny CPU model a recompute costs about what a load does, and the
    # default (io.load_only_if_faster) would cut most of them (slower_than_recompute)
    cfg["io"] = {"load_only_if_faster": False}
    if redis_url:
        cfg["events"] = {"remote": {"medium": "STORAGE", "locality": "REMOTE"}}
    eng = Engine(model, block_size=32, max_len=min(4096, 32 * (a["gpu_blocks"] - 2)), kv_transfer=kv_transfer(cfg),
                 kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                                 endpoint=f"tcp://*:{port}", topic="kv"),
                 num_gpu_blocks_override=a["gpu_blocks"])
    outq.put(("ready", idx))
    core = eng.llm.llm_engine
    sp = SamplingParams(max_tokens=a["output_tokens"], temperature=0, ignore_eos=True)
    sent: dict[str, list] = {}  # request id -> [the router's send time, TTFT]
    stop = False
    while not (stop and not core.has_unfinished_requests()):
        msgs = [] if core.has_unfinished_requests() or stop else [inq.get()]  # idle: wait for work
        while True:  # and take whatever else arrived: it joins the running batch
            try:
                msgs.append(inq.get_nowait())
            except queue.Empty:
                break
        for msg in msgs:
            if msg is None:
                stop = True
                continue
            rid, tokens, t_sent = msg
            core.add_request(rid, {"prompt_token_ids": tokens}, sp)
            sent[rid] = [t_sent, None]
        if not core.has_unfinished_requests():
            continue
        for o in core.step():
            s = sent[o.request_id]
            if s[1] is None and o.outputs and o.outputs[0].token_ids:
                s[1] = time.monotonic() - s[0]  # CLOCK_MONOTONIC: one clock for every process
            if o.finished:
                del sent[o.request_id]
                outq.put(("done", idx, o.request_id, s[1], list(o.outputs[0].token_ids),
                          int(o.num_cached_tokens or 0)))
    outq.put(("summary", idx, shared_mod.live()[0].metrics.summary()))
    eng.close()


class _Events:
    """The router's subscription to every engine's KV-event stream."""

    def __init__(self, ports: list[int]):
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        self.ctx = zmq.Context()
        self.socks = []
        for p in ports:
            s = self.ctx.socket(zmq.SUB)
            s.setsockopt(zmq.SUBSCRIBE, b"kv")
            s.connect(f"tcp://127.0.0.1:{p}")
            self.socks.append(s)
        self.poller = zmq.Poller()
        for s in self.socks:
            self.poller.register(s, zmq.POLLIN)
        self.decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.count = 0

    def drain(self, router, wait_ms: int = 0) -> None:
        while True:
            ready = dict(self.poller.poll(wait_ms))
            if not ready:
                return
            wait_ms = 0
            for i, s in enumerate(self.socks):
                if s in ready:
                    _t, _seq, payload = s.recv_multipart()
                    batch = self.decoder.decode(payload)
                    self.count += len(batch.events)
                    router.apply(i, batch.events)

    def close(self) -> None:
        for s in self.socks:
            s.close(0)
        self.ctx.term()


def _workload(a) -> tuple[list[int], list[list[int]], list[str]]:
    rng = np.random.default_rng(a.seed)
    system = [int(x) for x in rng.integers(4, 500, size=a.system_tokens)]
    users = [[[int(x) for x in rng.integers(4, 500, size=a.user_tokens)] for _ in range(a.turns)]
             for _ in range(a.sessions)]
    return system, users, [f"s{i}" for i in range(a.sessions)]


def run_one(a, model: str, policy: str, redis_url: str | None, node: str | None = None, tries: int = 3) -> dict:
    """:func:`_run_one`, again with other ports when an engine's event publisher found its port
    taken meanwhile (a free port is picked before the engine binds it). ``node``: the name of the
    node daemon the engines attach to."""
    for i in range(tries):
        try:
            return _run_one(a, model, policy, redis_url, node)
        except RuntimeError as e:
            if "Address already in use" not in str(e) or i == tries - 1:
                raise


def _run_one(a, model: str, policy: str, redis_url: str | None, node: str | None) -> dict:
    import multiprocessing as mp

    from kvstore.bench.route.router import Router

    ctx = mp.get_context("spawn")
    from kvstore.bench.common.ports import free_ports

    ports = free_ports(a.engines, host="0.0.0.0")  # as the publisher binds (tcp://*:PORT)
    tmp = tempfile.mkdtemp(prefix="kvstore-route-")
    inqs = [ctx.Queue() for _ in range(a.engines)]
    outq = ctx.Queue()
    args = {k: getattr(a, k) for k in ("gpu_blocks", "dram_blocks", "output_tokens")} | {"node": node}
    procs = [ctx.Process(target=_engine_main, args=(i, model, None if node else os.path.join(tmp, f"nvme{i}"),
                                                    redis_url, ports[i], args, inqs[i], outq), daemon=True)
             for i in range(a.engines)]
    for p in procs:
        p.start()
    def get():
        msg = outq.get(timeout=600)
        if msg[0] == "error":
            raise RuntimeError(f"engine {msg[1]} failed:\n{msg[2]}")
        return msg

    ready = 0
    try:
        while ready < a.engines:
            ready += get()[0] == "ready"
    except BaseException:
        for p in procs:
            p.kill()
        raise
    events = _Events(ports)
    time.sleep(0.5)  # ZMQ's slow joiner
    router = Router(a.engines, policy, block_size=32)
    system, users, sessions = _workload(a)
    prompts = {s: list(system) for s in sessions}
    ttfts, routed = [], [0] * a.engines
    ready = deque(int(i) for i in np.random.default_rng(a.seed + 1).permutation(len(sessions)))
    turn = [0] * len(sessions)
    inflight: dict[str, tuple[int, int, list[int]]] = {}  # request id -> (session, engine, prompt)
    n = 0
    try:
        while ready or inflight:
            while ready and len(inflight) < max(1, a.concurrency):
                si = ready.popleft()
                prompt = prompts[sessions[si]] + users[si][turn[si]]
                events.drain(router)
                e = router.pick(sessions[si], prompt)
                routed[e] += 1
                inflight[f"r{n}"] = (si, e, prompt)
                inqs[e].put((f"r{n}", prompt, time.monotonic()))
                n += 1
            msg = get()
            si, e, prompt = inflight.pop(msg[2])
            router.done(e)
            ttfts.append(msg[3])
            prompts[sessions[si]] = prompt + msg[4]
            turn[si] += 1
            if turn[si] < a.turns:
                ready.append(si)  # its next turn, after the sessions already waiting
            events.drain(router, wait_ms=20 if not inflight else 2)  # what the request's last steps announced
        for q in inqs:
            q.put(None)
        summaries = {}
        while len(summaries) < a.engines:
            msg = get()
            if msg[0] == "summary":
                summaries[msg[1]] = msg[2]
    finally:
        events.close()
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    if policy == "prefix" and not events.count:
        print("kvstore bench route: the router saw no KV events (is the publisher's endpoint bound?): "
              "the prefix policy fell back to the least-loaded engine every time", file=sys.stderr)
    prompt_tokens = sum(s["prompt_tokens"] for s in summaries.values())
    local = sum(s["engine_local_hit_tokens"] for s in summaries.values())
    served = {t: sum(s["served_tokens"][t] for s in summaries.values()) for t in ("dram", "nvme", "remote")}
    ms = sorted(x * 1000 for x in ttfts)
    return {"policy": policy, "redis": redis_url is not None, "node": node is not None, "requests": n,
            "requests_per_engine": routed,
            "prompt_tokens": prompt_tokens, "engine_local_share": local / prompt_tokens,
            "kvstore_share": {t: v / prompt_tokens for t, v in served.items()},
            "ttft_mean_ms": statistics.fmean(ms), "ttft_p90_ms": ms[int(0.9 * (len(ms) - 1))],
            "prefix_fallbacks": router.fallbacks if policy == "prefix" else None, "events": events.count,
            "unplaced_events": router.index.skipped}


def report(rows: list[dict], a) -> str:
    out = [f"kvstore bench route: {a.engines} engines, {a.sessions} sessions x {a.turns} turns, system prompt "
           f"{a.system_tokens} tokens, +{a.user_tokens} user / {a.output_tokens} output tokens a turn; vLLM's own "
           f"cache {a.gpu_blocks} blocks, kvstore DRAM {a.dram_blocks} blocks per engine; {a.concurrency} "
           f"session(s) in flight",
           "", "| policy | store | requests per engine | engine-local hit | kvstore dram | nvme | redis | "
           "TTFT mean ms | p90 ms |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        k = r["kvstore_share"]
        where = "node daemon" if r.get("node") else "own + redis" if r["redis"] else "own"
        out.append(f"| {r['policy']} | {where} | {'/'.join(map(str, r['requests_per_engine']))}"
                   f" | {r['engine_local_share']:.1%} | {k['dram']:.1%} | {k['nvme']:.1%} | {k['remote']:.1%} | "
                   f"{r['ttft_mean_ms']:.1f} | {r['ttft_p90_ms']:.1f} |")
    out.append("")
    out.append("Shares are of all prompt tokens; TTFT from the router's send (queueing included). prefix: "
               "llm-d's default profile, 3 x the prefix held (tier weights GPU 1.0, CPU 0.8, STORAGE 0.4, from "
               "the engines' KV events) + 2 x the queue score (requests in flight).")
    return "\n".join(out)


@contextlib.contextmanager
def _daemon(a):
    """A ``kvstore serve`` process holding the DRAM the engines would have held together; its name."""
    import uuid

    from kvstore.bench.common.node_daemon import node_daemon

    tmp = tempfile.mkdtemp(prefix="kvstore-route-node-")
    name = f"route-{uuid.uuid4().hex[:10]}"
    cfg = {"tiers": {"dram": {"capacity_gb": a.engines * a.dram_blocks * BLOCK_KIB / 2**20, "ttl_s": None},
                     "nvme": {"path": os.path.join(tmp, "nvme"), "capacity_gb": 1, "ttl_s": None}},
           "mode": "node", "node": {"name": name}}
    with node_daemon(cfg, tmp):
        yield name


def run(a: argparse.Namespace) -> dict:
    from kvstore.bench.common import redis_local
    from kvstore.bench.common.tiny_model import build_tiny_llama

    model = build_tiny_llama(tempfile.mkdtemp(prefix="kvstore-route-model-"), hidden=256, layers=4, seed=0)
    policies = [p.strip() for p in a.policies.split(",") if p.strip()]
    modes = {"both": (False, True), "off": (False,), "on": (True,)}[a.redis]
    rows = []
    if a.node:
        for policy in policies:
            with _daemon(a) as name:
                rows.append(run_one(a, model, policy, None, node=name))
        modes = ()
    for with_redis in modes:
        for policy in policies:
            if with_redis:
                with redis_local.start() as r:
                    rows.append(run_one(a, model, policy, r.url))
            else:
                rows.append(run_one(a, model, policy, None))
    res = {"rows": rows}
    return harness.show(a, res, lambda r: report(r["rows"], a))


def main(argv=None) -> dict:
    return harness.main(__name__, argv)
