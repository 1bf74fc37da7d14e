"""Traces in memory for replay (keys interned to ints), and synthetic traces of known structure.

The file format is :mod:`kvstore.trace` (JSONL, hashes only). :func:`load_trace` reads it once
into compact lists (a block key becomes a small int, a session an int; lines are put in time
order: the connector writes a request when it finishes, stamped with its arrival time), and
marks each request that is a *replay* (its exact block list was seen before).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator

import numpy as np
import xxhash

from kvstore.trace import RECORDED_KEY, TraceError, TraceRecord, recorded_fields  # noqa: F401 (re-exported)


@dataclass
class Trace:
    t: list[float] = field(default_factory=list)
    session: list[int] = field(default_factory=list)
    keys: list[tuple[int, ...]] = field(default_factory=list)
    prompt_tokens: list[int] = field(default_factory=list)
    block_tokens: list[int] = field(default_factory=list)
    output_tokens: list[int] = field(default_factory=list)
    replay: list[bool] = field(default_factory=list)
    n_keys: int = 0
    n_sessions: int = 0
    recorded: dict | None = None  # what recorded the trace (RECORDED_KEY of its lines; the last one wins)

    def __len__(self) -> int:
        return len(self.t)

    @property
    def block_visits(self) -> int:
        """Blocks looked up over all requests (what a replay's cost is proportional to)."""
        return sum(map(len, self.keys))

    def requests(self) -> Iterator[tuple]:
        """(t, session, keys, prompt_tokens, block_tokens, replay) per request, for Simulator.request."""
        return zip(self.t, self.session, self.keys, self.prompt_tokens, self.block_tokens, self.replay)

    @property
    def duration_s(self) -> float:
        return (self.t[-1] - self.t[0]) if self.t else 0.0

    def sample_sessions(self, rate: float, seed: int = 0) -> "Trace":
        """The requests of about ``rate`` of the sessions (chosen by a hash of the session id).

        Replaying whole sessions with every capacity scaled by ``rate`` approximates the full
        trace (spatial sampling, as in SHARDS for cache simulation): each session's reuse and
        idle times are intact, and the sampled working set is ``rate`` of the whole.
        """
        if not 0 < rate <= 1:
            raise ValueError(f"a sample rate must be in (0, 1], got {rate}")
        if rate >= 1:
            return self
        cut = int(rate * (1 << 32))
        keep = {s for s in range(self.n_sessions)
                if xxhash.xxh32_intdigest(s.to_bytes(8, "little"), seed) < cut}
        out = Trace()
        seen_keys: set = set()
        for i, s in enumerate(self.session):
            if s in keep:
                out.t.append(self.t[i])
                out.session.append(s)
                out.keys.append(self.keys[i])
                seen_keys.update(self.keys[i])
                out.prompt_tokens.append(self.prompt_tokens[i])
                out.block_tokens.append(self.block_tokens[i])
                out.output_tokens.append(self.output_tokens[i])
                out.replay.append(self.replay[i])
        out.n_keys, out.n_sessions = len(seen_keys), len(keep)
        out.recorded = self.recorded
        return out

    def summary(self) -> dict:
        bt = sorted(set(self.block_tokens))
        return {"requests": len(self), "sessions": self.n_sessions, "distinct_blocks": self.n_keys,
                "duration_s": self.duration_s, "prompt_tokens": sum(self.prompt_tokens),
                "block_tokens": bt[0] if len(bt) == 1 else bt,
                "blocks_per_request": (sum(len(k) for k in self.keys) / len(self)) if len(self) else 0.0,
                "replay_requests": sum(self.replay)}


def from_records(records: Iterable) -> Trace:
    """Build a :class:`Trace` from TraceRecord-like objects or dicts (blocks as bytes or hex)."""
    rows = []
    for r in records:
        if isinstance(r, dict):
            rows.append((float(r["t"]), str(r["session"]), list(r["blocks"]), int(r["block_tokens"]),
                         int(r["prompt_tokens"]), int(r.get("output_tokens", 0))))
        else:
            rows.append((r.t, r.session, list(r.blocks), r.block_tokens, r.prompt_tokens, r.output_tokens))
    return _build(rows)


def _recorded(d: dict, path, i: int) -> dict:
    from kvstore.config import ConfigError, from_dict

    r = d[RECORDED_KEY]
    try:
        if not isinstance(r, dict) or int(r.get("block_bytes", 1)) <= 0:
            raise ValueError("a mapping with block_bytes > 0")
        from_dict({"tiers": r.get("tiers") or {}})
    except (ConfigError, TypeError, ValueError) as e:
        raise TraceError(f"{path}: line {i}: {RECORDED_KEY}: {e}") from None
    return r


def load_trace(path: str | os.PathLike, limit: int | None = None) -> Trace:
    """Read a JSONL trace (see :mod:`kvstore.trace`); extra fields are ignored but ``recorded``
    (:func:`recorded_fields`), kept as ``Trace.recorded``."""
    rows = []
    recorded = None
    loads = json.loads
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                d = loads(line)
                row = (float(d["t"]), str(d["session"]), d["blocks"], int(d["block_tokens"]),
                       int(d["prompt_tokens"]), int(d.get("output_tokens", 0)))
            except (KeyError, TypeError, ValueError) as e:
                raise TraceError(f"{path}: line {i}: {e!r}; expected {{t, session, blocks, block_tokens, "
                                 f"prompt_tokens, output_tokens}}") from None
            if not isinstance(row[2], list) or row[3] <= 0 or row[4] < 0 or not math.isfinite(row[0]):
                raise TraceError(f"{path}: line {i}: blocks must be a list, block_tokens > 0, prompt_tokens >= 0, "
                                 f"t finite")
            if not _hex_keys(row[2]):
                raise TraceError(f"{path}: line {i}: blocks must be 32-hex-digit block keys")
            if RECORDED_KEY in d:
                recorded = _recorded(d, path, i)
            rows.append(row)
            if limit is not None and len(rows) >= limit:
                break
    tr = _build(rows)
    tr.recorded = recorded
    return tr


def _hex_keys(blocks: list) -> bool:
    """Every item a 32-hex-digit string (one C-speed check per line, not per key)."""
    try:
        return (not blocks or set(map(len, blocks)) == {32}) and len(bytes.fromhex("".join(blocks))) == 16 * len(blocks)
    except (TypeError, ValueError):
        return False


def _build(rows: list[tuple]) -> Trace:
    rows.sort(key=lambda r: r[0])  # stable: equal times keep file order
    tr = Trace()
    kid: dict = {}
    sid: dict = {}
    seen: set = set()
    intern = kid.setdefault  # a key's id: its first appearance's rank
    last: dict = {}  # session -> (its last prompt's keys, their ids)
    for t, s, blocks, bt, pt, ot in rows:
        si = sid.get(s)
        if si is None:
            si = sid[s] = len(sid)
        try:  # upper-case hex digits name the same key
            joined = "".join(blocks)
            if joined.lower() != joined:
                blocks = [b.lower() for b in blocks]
        except TypeError:  # bytes keys, or text and bytes mixed
            if any(isinstance(b, str) for b in blocks):
                blocks = [b.lower() if isinstance(b, str) else b for b in blocks]
        # an append-only session resends its last prompt: those keys' ids are known (one list compare
        # in C instead of a dict lookup per key: interning was 1.8 of 4 s loading 100,000 requests)
        prev = last.get(si)
        n = len(prev[0]) if prev is not None else 0
        if n and blocks[:n] == prev[0]:
            keys = prev[1] + tuple([intern(b, len(kid)) for b in blocks[n:]])
        else:
            keys = tuple([intern(b, len(kid)) for b in blocks])
        last[si] = (blocks, keys)
        h = hash(keys)
        rep = bool(keys) and h in seen
        seen.add(h)
        tr.t.append(t)
        tr.session.append(si)
        tr.keys.append(keys)
        tr.prompt_tokens.append(pt)
        tr.block_tokens.append(bt)
        tr.output_tokens.append(ot)
        tr.replay.append(rep)
    tr.n_keys, tr.n_sessions = len(kid), len(sid)
    return tr


# -- synthetic traces ----------------------------------------------------------------------------


def synth_records(*, sessions: int = 100, turns: int = 10, think: Callable[[np.random.Generator], float] |
                  tuple[float, float] = (5.0, 50.0), system_blocks: int = 4, first_blocks: int = 2,
                  blocks_per_turn: int = 2, block_tokens: int = 16, output_tokens: int = 32,
                  arrival_s: float = 3600.0, replay_prob: float = 0.0, seed: int = 0) -> list[TraceRecord]:
    """Agent/chat sessions of known structure, in time order.

    Every session starts with the same ``system_blocks`` (a shared system prompt), then
    ``first_blocks`` of its own; each later turn resends the whole prompt plus
    ``blocks_per_turn`` new blocks, ``think`` seconds (uniform ``(lo, hi)`` or a callable)
    after the previous turn. Sessions start uniformly over ``arrival_s`` seconds. With
    ``replay_prob`` a turn is resent identically one second later (a retry: a replay).
    Keys are chain hashes, as the store's.
    """
    rng = np.random.default_rng(seed)
    if isinstance(think, tuple):
        lo, hi = think
        think_fn = lambda r: float(r.uniform(lo, hi))  # noqa: E731
    else:
        think_fn = think
    root = b"\x00" * 16
    sys_keys = []
    k = root
    for i in range(system_blocks):
        k = xxhash.xxh3_128_digest(k + b"sys%d" % i)
        sys_keys.append(k)
    out: list[TraceRecord] = []
    starts = np.sort(rng.uniform(0.0, arrival_s, size=sessions))
    for s, t in enumerate(starts):
        keys = list(sys_keys)
        k = keys[-1] if keys else root
        t = float(t)
        for turn in range(turns):
            for i in range(first_blocks if turn == 0 else blocks_per_turn):
                k = xxhash.xxh3_128_digest(k + b"s%d.t%d.b%d" % (s, turn, i))
                keys.append(k)
            pt = len(keys) * block_tokens + int(rng.integers(0, block_tokens))
            out.append(TraceRecord(t, f"s{s}", tuple(keys), block_tokens, pt, output_tokens))
            if replay_prob and rng.random() < replay_prob:
                out.append(TraceRecord(t + 1.0, f"s{s}", tuple(keys), block_tokens, pt, output_tokens))
            t += think_fn(rng)
    out.sort(key=lambda r: r.t)
    return out


def write_records(path: str | os.PathLike, records: Iterable[TraceRecord]) -> None:
    with open(path, "w") as f:
        for r in records:
            f.write(r.to_json() + "\n")
