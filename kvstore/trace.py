"""Request traces for TTL tuning and workload replay (JSONL, one request per line).

    {"t": 12.5, "session": "s17", "blocks": ["<32 hex>", ...], "block_tokens": 16,
     "prompt_tokens": 1040, "output_tokens": 200}

``t`` is seconds (any origin; lines in time order), ``blocks`` the chain keys of the prompt's
full blocks, in order — hashes only, no token text, so a production trace is safe to share.
Extra fields are allowed and ignored by readers. The connector records one when
``trace_path`` is set; ``bench agent`` writes synthetic ones; ``kvstore tune`` reads them.
"""

from __future__ import annotations

import json
import math
import os
import threading
from dataclasses import dataclass
from typing import IO, Iterator, Sequence


@dataclass(frozen=True, slots=True)
class TraceRecord:
    t: float
    session: str
    blocks: tuple[bytes, ...]
    block_tokens: int
    prompt_tokens: int
    output_tokens: int

    def to_json(self) -> str:
        return json.dumps({"t": round(self.t, 6), "session": self.session, "blocks": [b.hex() for b in self.blocks],
                           "block_tokens": self.block_tokens, "prompt_tokens": self.prompt_tokens,
                           "output_tokens": self.output_tokens}, separators=(",", ":"))


class TraceError(ValueError):
    pass


def parse_line(line: str, lineno: int = 0) -> TraceRecord:
    try:
        d = json.loads(line)
        blocks = tuple(bytes.fromhex(h) for h in d["blocks"])
        rec = TraceRecord(float(d["t"]), str(d["session"]), blocks, int(d["block_tokens"]), int(d["prompt_tokens"]),
                          int(d.get("output_tokens", 0)))
    except (KeyError, TypeError, ValueError) as e:
        raise TraceError(f"trace line {lineno}: {e!r}; expected {{t, session, blocks, block_tokens, "
                         f"prompt_tokens, output_tokens}}") from None
    if rec.block_tokens <= 0 or rec.prompt_tokens < 0 or not math.isfinite(rec.t):
        raise TraceError(f"trace line {lineno}: block_tokens must be > 0, prompt_tokens >= 0 and t finite")
    return rec


def read_trace(path: str | os.PathLike) -> Iterator[TraceRecord]:
    """Yield the records of a JSONL trace (blank lines skipped; a bad line raises TraceError)."""
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if line.strip():
                yield parse_line(line, i)


class TraceWriter:
    """Appends records to a JSONL file; thread-safe; buffered (cheap on the hot path)."""

    def __init__(self, path: str | os.PathLike, flush_every: int = 256):
        d = os.path.dirname(os.fspath(path))
        if d:
            os.makedirs(d, exist_ok=True)
        self.path = os.fspath(path)
        self._f: IO[str] = open(self.path, "a", buffering=1 << 16)
        self._lock = threading.Lock()
        self._n = 0
        self.flush_every = flush_every

    def write(self, t: float, session: str, blocks: Sequence[bytes], block_tokens: int, prompt_tokens: int,
              output_tokens: int) -> None:
        line = TraceRecord(t, session, tuple(blocks), block_tokens, prompt_tokens, output_tokens).to_json()
        with self._lock:
            if self._f.closed:
                return
            self._f.write(line + "\n")
            self._n += 1
            if self._n % self.flush_every == 0:
                self._f.flush()

    def close(self) -> None:
        with self._lock:
            if not self._f.closed:
                self._f.close()
