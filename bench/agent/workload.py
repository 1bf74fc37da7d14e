"""A synthetic, seeded agent workload: many sessions over one shared prefix, append-only turns.

Every session starts with the same system prompt plus one of ``tool_sets`` tool-schema blocks
(shared by all sessions that picked it), then a first user message. Each later turn's prompt is
the previous prompt + the previous output + new content (a tool result or a user message), so
prompts only grow. Between turns the client "thinks" for a time drawn from a heavy-tailed
mixture: with probability ``think.agent_prob`` an agent-loop pause (seconds), otherwise a human
pause (minutes to hours). ``time_scale`` > 1 compresses every time (arrivals, think times).

Two sources of *replays* (an identical prompt sent again):

* ``replay_prob``: after a turn, the same prompt is re-sent after an agent-loop pause (a retry,
  a regenerate);
* ``rerun_frac``: that fraction of sessions is re-run from the start with identical prompts
  after ``rerun_delay`` (an eval harness, a scheduled agent doing the same task again).

The organic variant has few replays; the replay-heavy one many. Both draw the organic sessions
from the same seeds, so they share them exactly.

Prompts are token ids; what leaves the generator is each request's block keys: real
``chain_keys`` hash chains seeded by a :class:`~kvstore.keys.ModelFingerprint`, so they are what
the connector would compute for the same tokens. :func:`write_trace` writes them in the trace
format of :mod:`kvstore.trace` (what ``kvstore tune`` reads); :func:`from_trace` reads one back.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from kvstore.keys import ModelFingerprint, chain_keys, root_of

# Every knob, with its default (configs/bench_agent.yaml's ``workload:`` section mirrors this).
DEFAULTS: dict[str, Any] = {
    "seed": 0,
    "sessions": 120,               # organic sessions
    "arrival_window_s": 3600.0,    # session starts: a Poisson process over this window
    "turns": {"mean": 8.0, "min": 1, "max": 40},  # turns per session: 1 + geometric, clipped
    "block_tokens": 16,
    "vocab": 32000,
    "system_tokens": 1024,         # shared by every session
    "tool_schema_tokens": 2048,    # shared by the sessions of one tool set
    "tool_sets": 2,                # distinct tool-schema sets (sessions pick one uniformly)
    "first_user_tokens": {"median": 300, "sigma": 0.8},
    "new_tokens": {"median": 350, "sigma": 1.0},       # tool result / user message per turn
    "output_tokens": {"median": 150, "sigma": 0.7},
    "max_context_tokens": 16384,   # a session ends when its next prompt would be longer
    "think": {
        "agent_prob": 0.85,
        "agent": {"dist": "lognormal", "median_s": 3.0, "sigma": 1.0, "max_s": 600.0},
        "human": {"dist": "lognormal", "median_s": 300.0, "sigma": 1.5, "max_s": 6 * 3600.0},
    },
    "time_scale": 1.0,             # > 1 compresses every time by this factor
    "replay_prob": 0.02,           # per turn: the same prompt re-sent (retry)
    "rerun_frac": 0.0,             # fraction of sessions re-run with identical prompts
    "rerun_delay": {"median_s": 600.0, "sigma": 1.0},
    "model": "bench-agent-7b",     # the fingerprint's model name (keys depend on it)
}


@dataclass(frozen=True, slots=True)
class Request:
    """One prompt sent to the server."""

    t: float
    session: str
    keys: tuple[bytes, ...]  # chain keys of the prompt's full blocks
    prompt_tokens: int
    output_tokens: int
    kind: str = "turn"  # turn | retry | rerun | trace (generator ground truth; the bench decides replay by keys)


def merged(base: Mapping, override: Mapping | None) -> dict:
    """Deep merge (mappings merge, everything else replaces)."""
    out = copy.deepcopy(dict(base))
    for k, v in (override or {}).items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = merged(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def check_params(p: Mapping) -> dict:
    """Defaults < ``p``; unknown keys are errors that name the key."""
    def walk(d: Mapping, ref: Mapping, prefix: str) -> None:
        for k, v in d.items():
            if k not in ref:
                raise ValueError(f"workload key '{prefix}{k}' is unknown; known keys here: {', '.join(ref)}")
            if isinstance(ref[k], Mapping) and isinstance(v, Mapping):
                walk(v, ref[k], f"{prefix}{k}.")

    walk(p, DEFAULTS, "")
    out = merged(DEFAULTS, p)
    if out["block_tokens"] <= 0 or out["sessions"] < 0 or out["time_scale"] <= 0:
        raise ValueError("workload: block_tokens > 0, sessions >= 0 and time_scale > 0 are required")
    return out


def fingerprint(p: Mapping) -> ModelFingerprint:
    return ModelFingerprint(model=str(p["model"]), dtype="float16", block_size=int(p["block_tokens"]),
                            num_layers=32, num_kv_heads=8, head_size=128)


def _lognormal(rng: np.random.Generator, spec: Mapping, key: str = "median") -> float:
    return float(spec[key]) * math.exp(float(spec.get("sigma", 1.0)) * rng.standard_normal())


def _think(rng: np.random.Generator, spec: Mapping) -> float:
    dist = spec.get("dist", "lognormal")
    if dist == "lognormal":
        x = _lognormal(rng, spec, "median_s")
    elif dist == "pareto":  # x_min * (1 + Lomax): heavy tail with index alpha
        x = float(spec["min_s"]) * (1.0 + rng.pareto(float(spec["alpha"])))
    elif dist == "exponential":
        x = rng.exponential(float(spec["mean_s"]))
    elif dist == "fixed":
        x = float(spec["value_s"])
    else:
        raise ValueError(f"think-time dist must be lognormal | pareto | exponential | fixed, got {dist!r}")
    return min(x, float(spec.get("max_s", math.inf)))


def think_time(rng: np.random.Generator, think: Mapping) -> tuple[float, str]:
    """One pause between turns: (seconds, 'agent' | 'human')."""
    if rng.random() < float(think["agent_prob"]):
        return _think(rng, think["agent"]), "agent"
    return _think(rng, think["human"]), "human"


def _tokens(n: int, p: Mapping, rng: np.random.Generator) -> np.ndarray:
    return rng.integers(4, int(p["vocab"]), size=max(0, int(n)), dtype=np.int64)


def _size(rng: np.random.Generator, spec: Mapping | int | float) -> int:
    if isinstance(spec, Mapping):
        return max(1, int(round(_lognormal(rng, spec))))
    return max(0, int(spec))


class _Chain:
    """A growing token sequence, keyed incrementally (keys of full blocks + the partial tail)."""

    __slots__ = ("root", "bt", "keys", "tail", "n")

    def __init__(self, root: bytes, bt: int):
        self.root, self.bt, self.keys, self.tail, self.n = root, bt, [], np.zeros(0, np.int64), 0

    def extend(self, toks: np.ndarray) -> None:
        buf = np.concatenate([self.tail, toks]) if self.tail.size else toks
        full = len(buf) // self.bt * self.bt
        if full:
            self.keys += chain_keys(self.root, buf[:full], self.bt, parent=self.keys[-1] if self.keys else None)
        self.tail = buf[full:].copy()
        self.n += len(toks)

    def clone(self) -> "_Chain":
        c = _Chain(self.root, self.bt)
        c.keys, c.tail, c.n = list(self.keys), self.tail.copy(), self.n
        return c


def generate(params: Mapping | None = None) -> list[Request]:
    """The workload's requests, in time order. Deterministic for a given ``params`` (incl. seed)."""
    p = check_params(params or {})
    seed, bt = int(p["seed"]), int(p["block_tokens"])
    root = root_of(fingerprint(p))
    # shared prefixes: the system prompt, then one tool-schema set
    srng = np.random.default_rng([seed, 1])
    system = _tokens(p["system_tokens"], p, srng)
    shared: list[_Chain] = []
    for i in range(max(1, int(p["tool_sets"]))):
        c = _Chain(root, bt)
        c.extend(np.concatenate([system, _tokens(p["tool_schema_tokens"], p, np.random.default_rng([seed, 2, i]))]))
        shared.append(c)
    arng = np.random.default_rng([seed, 3])
    n_sessions = int(p["sessions"])
    gaps = arng.exponential(float(p["arrival_window_s"]) / max(1, n_sessions), size=n_sessions)
    starts = np.cumsum(gaps) - gaps[0] if n_sessions else gaps
    turns_cfg = p["turns"]
    mean_extra = max(0.0, float(turns_cfg["mean"]) - 1.0)
    out: list[Request] = []
    by_session: list[list[Request]] = []
    for s in range(n_sessions):
        rng = np.random.default_rng([seed, 10, s])     # the conversation
        rrng = np.random.default_rng([seed, 11, s])    # retries only: organic sessions stay identical
        sid = f"s{s}"
        n_turns = 1 + (int(rng.geometric(1.0 / (1.0 + mean_extra))) - 1 if mean_extra > 0 else 0)
        n_turns = int(np.clip(n_turns, int(turns_cfg["min"]), int(turns_cfg["max"])))
        chain = shared[int(rng.integers(len(shared)))].clone()
        t = float(starts[s])
        new = _size(rng, p["first_user_tokens"])
        mine: list[Request] = []
        for _turn in range(n_turns):
            if chain.n + new > int(p["max_context_tokens"]):
                break
            chain.extend(_tokens(new, p, rng))
            n_out = _size(rng, p["output_tokens"])
            req = Request(t, sid, tuple(chain.keys), chain.n, n_out, "turn")
            mine.append(req)
            if rrng.random() < float(p["replay_prob"]):
                t += _think(rrng, p["think"]["agent"])
                mine.append(Request(t, sid, req.keys, req.prompt_tokens, n_out, "retry"))
            chain.extend(_tokens(n_out, p, rng))
            t += think_time(rng, p["think"])[0]
            new = _size(rng, p["new_tokens"])
        by_session.append(mine)
        out += mine
    # reruns: identical prompts, same relative timing, after a delay
    n_rerun = int(round(float(p["rerun_frac"]) * n_sessions))
    if n_rerun and n_sessions:
        rr = np.random.default_rng([seed, 4])
        src = rr.choice(n_sessions, size=n_rerun, replace=n_rerun > n_sessions)
        for j, s in enumerate(src):
            reqs = by_session[int(s)]
            if not reqs:
                continue
            delay = _lognormal(rr, p["rerun_delay"], "median_s")
            sid = f"s{s}-rerun{j}"
            out += [Request(r.t + delay, sid, r.keys, r.prompt_tokens, r.output_tokens, "rerun") for r in reqs]
    scale = float(p["time_scale"])
    out.sort(key=lambda r: r.t)
    if scale != 1.0:
        out = [Request(r.t / scale, r.session, r.keys, r.prompt_tokens, r.output_tokens, r.kind) for r in out]
    return out


def summary(requests: Sequence[Request]) -> dict:
    """Counts that describe a workload (for the report)."""
    if not requests:
        return {"requests": 0, "sessions": 0, "prompt_tokens": 0, "duration_s": 0.0}
    sessions = {r.session for r in requests}
    gaps: dict[str, float] = {}
    think = []
    for r in requests:
        if r.session in gaps:
            think.append(r.t - gaps[r.session])
        gaps[r.session] = r.t
    think_arr = np.array(think) if think else np.zeros(1)
    return {
        "requests": len(requests),
        "sessions": len(sessions),
        "prompt_tokens": int(sum(r.prompt_tokens for r in requests)),
        "max_prompt_tokens": int(max(r.prompt_tokens for r in requests)),
        "duration_s": float(requests[-1].t - requests[0].t),
        "kinds": {k: sum(1 for r in requests if r.kind == k) for k in sorted({r.kind for r in requests})},
        "gap_p50_s": float(np.percentile(think_arr, 50)),
        "gap_p90_s": float(np.percentile(think_arr, 90)),
        "gap_p99_s": float(np.percentile(think_arr, 99)),
    }


def write_trace(requests: Iterable[Request], path: str, block_tokens: int) -> int:
    """Write requests as a JSONL trace (:mod:`kvstore.trace`). Returns the number of lines."""
    from kvstore.trace import TraceWriter

    import os

    if os.path.exists(path):
        os.unlink(path)  # TraceWriter appends; a bench run writes a fresh file
    w = TraceWriter(path)
    n = 0
    try:
        for r in requests:
            w.write(r.t, r.session, r.keys, block_tokens, r.prompt_tokens, r.output_tokens)
            n += 1
    finally:
        w.close()
    return n


def from_trace(path: str) -> tuple[list[Request], int]:
    """Requests of a recorded trace (any source: the connector, ``bench agent``). Returns
    (requests in time order, block_tokens)."""
    from kvstore.trace import read_trace

    reqs, bt = [], None
    for rec in read_trace(path):
        if bt is None:
            bt = rec.block_tokens
        elif rec.block_tokens != bt:
            raise ValueError(f"{path}: mixed block_tokens ({bt} and {rec.block_tokens}); replay one model at a time")
        reqs.append(Request(rec.t, rec.session, rec.blocks, rec.prompt_tokens, rec.output_tokens, "trace"))
    reqs.sort(key=lambda r: r.t)
    return reqs, bt or 16
