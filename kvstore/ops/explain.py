"""``kvstore explain --trace T``: where each turn's prompt stopped sharing the previous turn's.

A session's turns are its requests in time order (the trace's ``session``: the vLLM connector
records a request's ``cache_salt``; a request without one is its own session, so it is only
ever a first turn). Each turn is compared with the previous turn of its session, block by
block, on the chain keys the trace holds (a key hashes every token before it, so the first
differing key is the first block that differs)::

    d        first block whose key differs (= the number of leading blocks the two share)
    shared   min(full blocks of the previous prompt, full blocks of this prompt)
    offer    (prompt_tokens - 1) // block_tokens: full blocks that may be offered (the engine
             computes the prompt's last token itself)
    want     min(shared, offer): what the previous turn could have given this one
    got      (local_tokens + hit_tokens) // block_tokens: what the engine's own prefix cache and
             kvstore gave at the first lookup (recorded by the connector)

Classes (first match wins):

* ``first_turn``: the session's first request; nothing to compare; not a problem.
* ``head_changed``: ``d < shared`` and ``d <= 1``: the prompt changed at its top, in block 0 or 1
  (a timestamp, a request id, a date in the system prompt): almost nothing is reusable, by any
  later turn either. Fix: move volatile content to the end of the prompt.
* ``history_rewritten``: ``1 < d < shared``: the turn diverges before the end of the previous
  prompt (a summarized, trimmed or re-rendered history; a tool result edited). Only the blocks
  before ``d`` are reusable. Fix: append, never edit what was sent.
* ``expired_evicted``: append-only (``d >= shared``) but ``got < want``: it would have hit. The
  store's miss reason says why (``expired`` by TTL, ``evicted`` for capacity, ``never_stored``:
  the previous turn's blocks were not stored yet or were skipped, ``corrupt``, ``store_error``).
  Fix: TTLs and capacities (``kvstore tune``).
* ``append_only``: ``d >= shared`` and ``got >= want``: healthy.
* ``append_unknown``: append-only, but the trace does not record what the turn got (no
  ``hit_tokens``: a synthetic trace, ``bench agent``'s, or one from an older connector): healthy
  or expired / evicted cannot be told. Never counted as either: its lost tokens are unknown,
  and the report lists the fields the trace lacks.

A turn's ``lost_tokens`` are the reusable tokens it did not get: ``(want - d) * block_tokens`` for
a divergence, ``(want - got) * block_tokens`` for expired / evicted. Where the divergence is:
the block ``d``, i.e. tokens ``[d * bt, (d + 1) * bt)``; with ``trace_tokens: true`` (the trace
keeps token ids) the first differing token exactly, with a few tokens either side. Equal
tokens under differing keys mean the extra keys changed (LoRA, cache salt, multimodal inputs).
"""

from __future__ import annotations

import heapq
import os
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Iterable

from kvstore.trace import TraceRecord, read_trace

FIRST, APPEND, HEAD, REWRITE, LOST = "first_turn", "append_only", "head_changed", "history_rewritten", \
    "expired_evicted"
UNKNOWN = "append_unknown"
CLASSES = (FIRST, APPEND, HEAD, REWRITE, LOST, UNKNOWN)
RECORDED = ("local_tokens", "hit_tokens", "miss_reason", "replay", "tokens")  # what a connector's trace adds
PROBLEMS = (HEAD, REWRITE, LOST)
HEAD_BLOCKS = 2  # a divergence in block 0 or 1 is a changed head
CONTEXT = 6  # tokens shown either side of the first differing token


@dataclass
class Turn:
    session: str
    turn: int  # 1 = the session's first request
    t: float
    prompt_tokens: int
    cls: str
    previous_prompt_tokens: int | None = None
    diverged_block: int | None = None  # d: None when nothing differs within ``shared``
    diverged_tokens: tuple[int, int] | None = None  # [lo, hi) of the first differing block
    diverged_token: int | None = None  # exact, with token ids in the trace
    shared_blocks: int = 0
    want_blocks: int = 0
    got_blocks: int | None = None  # None: the trace has no hit fields
    lost_tokens: int = 0
    reason: str | None = None  # the store's miss reason (expired_evicted)
    context: dict | None = None  # tokens around the first differing token (with token ids)
    note: str | None = None
    replay: bool | None = None

    def to_json(self) -> dict:
        d = asdict(self)
        d["class"] = d.pop("cls")
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in d.items() if v is not None}


def _lcp(a: tuple, b: tuple) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _first_token_diff(a: tuple, b: tuple) -> int | None:
    """The first index where ``a`` and ``b`` differ, None when one is a prefix of the other."""
    i = _lcp(a, b)
    return i if i < min(len(a), len(b)) else None


def classify(prev: TraceRecord | None, cur: TraceRecord, turn: int = 1) -> Turn:
    """``cur`` against the previous turn of its session (None: it is the first)."""
    tn = Turn(cur.session, turn, cur.t, cur.prompt_tokens, FIRST, replay=cur.replay)
    if prev is None:
        return tn
    bt = cur.block_tokens
    tn.previous_prompt_tokens = prev.prompt_tokens
    if prev.block_tokens != bt:
        tn.cls, tn.note = APPEND, f"block size changed ({prev.block_tokens} -> {bt}): not compared"
        return tn
    d = _lcp(prev.blocks, cur.blocks)
    shared = min(len(prev.blocks), len(cur.blocks))
    want = min(shared, max(0, (cur.prompt_tokens - 1) // bt))
    tn.shared_blocks, tn.want_blocks = shared, want
    if cur.hit_tokens is not None:
        tn.got_blocks = ((cur.local_tokens or 0) + cur.hit_tokens) // bt
    if d < shared:
        tn.cls = HEAD if d < HEAD_BLOCKS else REWRITE
        tn.diverged_block, tn.diverged_tokens = d, (d * bt, (d + 1) * bt)
        tn.lost_tokens = max(0, want - d) * bt
        _locate(tn, prev, cur, d, bt)
    elif tn.got_blocks is None:
        tn.cls = UNKNOWN  # append-only; what it got is not in the trace
    elif tn.got_blocks < want:
        tn.cls, tn.reason = LOST, cur.miss_reason or "unknown"
        tn.lost_tokens = (want - tn.got_blocks) * bt
    else:
        tn.cls = APPEND
    return tn


def _locate(tn: Turn, prev: TraceRecord, cur: TraceRecord, d: int, bt: int) -> None:
    """With token ids on both turns: the first differing token, and the tokens around it."""
    if prev.tokens is None or cur.tokens is None:
        return
    i = _first_token_diff(prev.tokens, cur.tokens)
    if i is None or i >= (d + 1) * bt:  # the keys of block d differ but its tokens do not
        tn.note = "same tokens in the first differing block: the extra keys (LoRA, cache salt, multimodal " \
                  "inputs) differ"
        return
    tn.diverged_token = i
    lo = max(0, i - CONTEXT)
    tn.context = {"from": lo, "previous": list(prev.tokens[lo:i + CONTEXT + 1]),
                  "this": list(cur.tokens[lo:i + CONTEXT + 1])}


@dataclass
class _Session:
    turns: Counter = field(default_factory=Counter)
    lost: int = 0


class Explainer:
    """Feed records in time order (:meth:`add`), then :meth:`report`. Memory: the previous
    record of each session, counts per session, and ``examples`` turns per problem class."""

    def __init__(self, examples: int = 3):
        self.examples = examples
        self._prev: dict[str, TraceRecord] = {}
        self._n: dict[str, int] = {}
        self._sessions: dict[str, _Session] = {}
        self._heaps: dict[str, list] = {c: [] for c in PROBLEMS}
        self._seq = 0
        self.counts: Counter = Counter()
        self.lost: Counter = Counter()
        self.reasons: Counter = Counter()
        self.divergence_blocks: Counter = Counter()
        self.block_tokens: set[int] = set()
        self.requests = self.with_hits = self.with_tokens = self.replays = self.with_replay = 0
        self.missing: Counter = Counter()  # optional field -> requests without it

    def add(self, rec: TraceRecord) -> Turn:
        self.requests += 1
        for k in RECORDED:
            self.missing[k] += getattr(rec, k) is None
        self.block_tokens.add(rec.block_tokens)
        self.with_tokens += rec.tokens is not None
        if rec.replay is not None:
            self.with_replay += 1
            self.replays += bool(rec.replay)
        n = self._n[rec.session] = self._n.get(rec.session, 0) + 1
        tn = classify(self._prev.get(rec.session), rec, n)
        self._prev[rec.session] = rec
        if tn.cls != FIRST:
            self.with_hits += rec.hit_tokens is not None
        self.counts[tn.cls] += 1
        self.lost[tn.cls] += tn.lost_tokens
        s = self._sessions.setdefault(rec.session, _Session())
        s.turns[tn.cls] += 1
        s.lost += tn.lost_tokens
        if tn.cls == LOST:
            self.reasons[tn.reason] += 1
        if tn.diverged_block is not None:
            self.divergence_blocks[tn.diverged_block] += 1
        if tn.cls in self._heaps and self.examples > 0:
            self._seq += 1  # the biggest losses first; among equals, the earliest
            item = (tn.lost_tokens, -tn.t, -self._seq, tn)
            h = self._heaps[tn.cls]
            if len(h) < self.examples:
                heapq.heappush(h, item)
            elif item[:3] > h[0][:3]:
                heapq.heapreplace(h, item)
        return tn

    def report(self, max_sessions: int = 20) -> dict:
        follow = self.requests - self.counts[FIRST]
        classes = {c: {"turns": self.counts[c], "share_of_requests": _frac(self.counts[c], self.requests),
                       "share_of_followups": None if c == FIRST else _frac(self.counts[c], follow),
                       "lost_tokens": None if c == UNKNOWN else self.lost[c]} for c in CLASSES}
        top = sorted(self._sessions.items(), key=lambda kv: (-kv[1].lost, kv[0]))[:max(0, max_sessions)]
        bt = sorted(self.block_tokens)
        return {
            "requests": self.requests,
            "sessions": len(self._sessions),
            "single_request_sessions": sum(1 for n in self._n.values() if n == 1),
            "followup_turns": follow,
            "block_tokens": bt[0] if len(bt) == 1 else bt,
            "hits_recorded": self.with_hits == follow,
            "followups_with_hits": self.with_hits,
            # optional fields the trace lacks, with the requests lacking each (tokens: opt-in, trace_tokens)
            "fields_missing": {k: self.missing[k] for k in RECORDED if self.missing[k]},
            # what the turns without hit fields lost to expiry or eviction: unknown, never 0
            "lost_tokens_unknown_turns": self.counts[UNKNOWN],
            "tokens_recorded": self.requests > 0 and self.with_tokens == self.requests,
            "replay_requests": self.replays if self.with_replay else None,
            "classes": classes,
            "lost_tokens": sum(self.lost.values()),
            "expired_evicted_reasons": dict(self.reasons.most_common()),
            "divergence_blocks": {str(k): v for k, v in sorted(self.divergence_blocks.items())},
            "sessions_top": [{"session": s, "turns": sum(v.turns.values()), "lost_tokens": v.lost,
                              **{c: v.turns[c] for c in CLASSES}} for s, v in top],
            "examples": {c: [it[3].to_json() for it in sorted(self._heaps[c], reverse=True)] for c in PROBLEMS},
        }


def _frac(a: int, b: int) -> float:
    return a / b if b else 0.0


def explain(records: Iterable[TraceRecord], examples: int = 3, max_sessions: int = 20) -> dict:
    """The report of a trace's records (put in time order: the connector writes a request when it
    finishes, stamped with its arrival; equal times keep file order)."""
    ex = Explainer(examples)
    for r in sorted(records, key=lambda r: r.t):
        ex.add(r)
    return ex.report(max_sessions)


def explain_file(path: str | os.PathLike, examples: int = 3, max_sessions: int = 20) -> dict:
    out = explain(read_trace(path), examples, max_sessions)
    return {"trace": os.fspath(path), **out}
