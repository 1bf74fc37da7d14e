"""Request traces for TTL tuning and workload replay (JSONL, one request per line).

    {"t": 12.5, "session": "s17", "blocks": ["<32 hex>", ...], "block_tokens": 16,
     "prompt_tokens": 1040, "output_tokens": 200}

``t`` is seconds (any origin; lines in time order), ``blocks`` the chain keys of the prompt's
full blocks, in order — hashes only, no token text, so a production trace is safe to share.
Extra fields are allowed and ignored by readers. The connector records one when
``trace_path`` is set; ``bench agent`` writes synthetic ones; ``kvstore tune`` reads them.

Optional fields (absent when unknown; ``kvstore explain`` reads them, the tuner ignores them).
The connector writes the first four for every request, as its first lookup found them:

* ``local_tokens``: prompt tokens the engine already had in its own prefix cache;
* ``hit_tokens``: prompt tokens kvstore promised and pinned for loading (a load that then fails
  on the worker is still in here; the Prometheus counters count only what was served);
* ``miss_reason``: the store's reason for the first block it lacked (``null``: every block that
  may be offered was stored; ``store_error``: the store could not be asked);
* ``replay``: the exact prompt (tokens and extra keys) was seen before (kvstore.offload.replay);
* ``tokens``: the prompt's token ids, only with ``trace_tokens: true`` (opt-in: prompts can be
  private).
"""

from __future__ import annotations

import atexit
import errno
import json
import logging
import math
import os
import stat
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

from kvstore.configfields import ConfigError

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class TraceRecord:
    t: float
    session: str
    blocks: tuple[bytes, ...]
    block_tokens: int
    prompt_tokens: int
    output_tokens: int
    local_tokens: int | None = None
    hit_tokens: int | None = None
    miss_reason: str | None = None
    replay: bool | None = None
    tokens: tuple[int, ...] | None = None
    tag: str | None = None  # the request's tag (kv_transfer_params kvstore.tag)

    def to_json(self) -> str:
        d = {"t": round(self.t, 6), "session": self.session, "blocks": [b.hex() for b in self.blocks],
             "block_tokens": self.block_tokens, "prompt_tokens": self.prompt_tokens,
             "output_tokens": self.output_tokens}
        for k in OPTIONAL:
            v = getattr(self, k)
            if v is not None:
                d[k] = list(v) if k == "tokens" else v
        return json.dumps(d, separators=(",", ":"))


OPTIONAL = ("local_tokens", "hit_tokens", "miss_reason", "replay", "tokens", "tag")  # omitted when None


def _optional(d: dict) -> dict:
    """The optional fields of a parsed line, typed (absent or null: None)."""
    out = {}
    for k, conv in (("local_tokens", int), ("hit_tokens", int), ("miss_reason", str), ("replay", bool),
                         ("tag", str)):
        if d.get(k) is not None:
            out[k] = conv(d[k])
    if d.get("tokens") is not None:
        out["tokens"] = tuple(int(x) for x in d["tokens"])
    return out


class TraceError(ValueError):
    pass


def parse_line(line: str, lineno: int = 0) -> TraceRecord:
    try:
        d = json.loads(line)
        blocks = tuple(bytes.fromhex(h) for h in d["blocks"])
        rec = TraceRecord(float(d["t"]), str(d["session"]), blocks, int(d["block_tokens"]), int(d["prompt_tokens"]),
                          int(d.get("output_tokens", 0)), **_optional(d))
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


def own_link(path: str | os.PathLike) -> bool:
    """Is ``path`` a symlink of this user's (which is followed; another user's is refused)?"""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISLNK(st.st_mode) and st.st_uid == os.geteuid()


TRACE_ALLOWED = "a file path this process can create or append to (a regular file of this user's, mode 0600), or null"


def not_private(st: os.stat_result) -> str | None:
    """Why an existing trace file is not one kvstore may append to (None: it may): it must be this
    user's and open to no one else, since its lines name sessions and tags (and hold prompt token
    ids with trace_tokens). A file another user made first at the name (in a shared folder such as
    /tmp) is theirs to read, whatever its mode."""
    me = os.geteuid()
    if st.st_uid != me:
        return f"the file is owned by uid {st.st_uid}, not by this user (uid {me}): another user made it"
    if st.st_mode & 0o077:
        return f"its mode {stat.S_IMODE(st.st_mode):04o} opens it to group or others: chmod 600 it"
    return None


FLUSH_BYTES = 1 << 16  # lines are appended once this many bytes (or flush_every lines) are buffered
FLUSH_S = 2.0  # ... or once the oldest buffered line is this old: all a kill can lose (see TraceWriter)
_open_writers: "weakref.WeakSet[TraceWriter]" = weakref.WeakSet()  # flushed at interpreter exit


class TraceWriter:
    """Appends records to a JSONL file; thread-safe; buffered (cheap on the hot path).

    The file must be this user's, mode 0600 (:func:`not_private`): one it finds otherwise, made
    first by someone else or opened to others, is refused with a ConfigError naming trace_path.

    When lines reach the file: once ``flush_every`` lines or 64 KiB are buffered, once the oldest
    buffered line is ``flush_s`` old (at the next write, and by a flusher thread when none comes),
    when the caller says the engine is idle (:meth:`flush`: the planner, when its last request in
    flight finishes), and at :meth:`close` or interpreter exit. What is in the file survives any
    stop; what a kill (SIGKILL, a crash, vLLM's default ``--shutdown-timeout 0``, which SIGKILLs
    the engine core at once) loses is at most the lines of the last ``flush_s`` seconds, and only
    those of requests that finished while others were still running.

    A write that fails (a full disk, EIO) never reaches the caller, which is vLLM's scheduler
    finishing a request: the buffered lines are dropped and counted (``dropped``), a warning is
    logged once per run of failures, and the file is cut back to where that write began, so no
    torn line is left for a reader (``read_trace`` refuses one). The file grows by one line per
    finished request (about 35 bytes per block of the prompt, plus its tokens with
    ``trace_tokens``); it is the operator's to rotate (``copytruncate``: it is opened for append)."""

    def __init__(self, path: str | os.PathLike, flush_every: int = 256, recorded: dict | None = None,
                 flush_s: float | None = FLUSH_S, clock: Callable[[], float] = time.monotonic):
        """``recorded``: what records the trace (the store's tiers and its KV block), written into
        the first line as ``"recorded"``: ``kvstore tune`` takes its budget and block size from it
        (:func:`kvstore.tune.trace_memory.recorded_fields`; readers that do not know it skip it).
        ``flush_s``: the oldest a buffered line gets (None: no time bound, no flusher thread);
        ``clock``: what measures it (the flusher thread waits by real time)."""
        if flush_s is not None and not flush_s > 0:
            raise ValueError(f"flush_s must be > 0 seconds or None, got {flush_s!r}")
        missing, d = [], os.path.dirname(os.fspath(path))
        while d and not os.path.isdir(d):  # the folders it creates are 0700 (os.makedirs: the leaf only)
            missing.append(d)
            d = os.path.dirname(d)
        for d in reversed(missing):
            try:
                os.mkdir(d, 0o700)
            except FileExistsError:
                pass
        self.path = os.fspath(path)
        # 0600 when it creates the file (a trace names sessions and prompt hashes); never through a
        # symlink another user planted at the name (O_NOFOLLOW; this user's own link is the
        # operator's choice), never blocking on a FIFO (O_NONBLOCK, then a regular file is required);
        # a file found there must be this user's and private (checked on the open file: no race)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NONBLOCK
                     | (0 if own_link(self.path) else os.O_NOFOLLOW), 0o600)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise OSError(errno.EINVAL, "not a regular file", self.path)
            why = not_private(st)
            if why is not None:
                raise ConfigError("trace_path", self.path, TRACE_ALLOWED, why)
            os.set_blocking(fd, True)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self._buf: list[str] = []
        self._bytes = 0
        self._oldest = 0.0  # clock() at the first line in the buffer
        # two locks, so that a write (the scheduler) never waits on the file: _lock guards the
        # buffer and is held for an append or a swap only; _io is held over a write to the file, by
        # one flush at a time, taken before the swap so that lines reach the file in order
        self._lock = threading.Lock()
        self._io = threading.Lock()
        self.flush_every = flush_every
        self.flush_s = flush_s
        self._clock = clock
        self._recorded = recorded
        self.dropped = 0  # lines lost to failed writes
        self._failing = False
        self._stop = threading.Event()
        _open_writers.add(self)
        if flush_s is not None:  # an idle server's last lines reach the file too
            threading.Thread(target=self._flush_loop, name="kvstore-trace-flush", daemon=True).start()

    def write(self, t: float, session: str, blocks: Sequence[bytes], block_tokens: int, prompt_tokens: int,
              output_tokens: int, **optional) -> None:
        """``optional``: any of ``OPTIONAL`` (a None value is left out of the line)."""
        line = TraceRecord(t, session, tuple(blocks), block_tokens, prompt_tokens, output_tokens,
                           **optional).to_json()
        now = self._clock()
        with self._lock:
            if self._fd < 0:
                return
            if self._recorded is not None:  # the first line says what recorded the trace
                line = line[:-1] + ',"recorded":' + json.dumps(self._recorded, separators=(",", ":")) + "}"
                self._recorded = None
            if not self._buf:
                self._oldest = now
            self._buf.append(line + "\n")
            self._bytes += len(line) + 1
            due = (len(self._buf) >= self.flush_every or self._bytes >= FLUSH_BYTES  # a line with tokens: ~1 MB
                   or (self.flush_s is not None and now - self._oldest >= self.flush_s))
        if due:
            self.flush(wait=False)  # the flusher thread writing already: these lines go next time

    def flush(self, wait: bool = True) -> None:
        """Append the buffered lines now (a no-op when none are); ``wait=False``: not if another
        flush is writing (the scheduler never waits on the file)."""
        if not self._io.acquire(blocking=wait):
            return
        try:
            with self._lock:
                lines, self._buf, self._bytes = self._buf, [], 0
                fd = self._fd
            if lines and fd >= 0:
                self._append(fd, lines)
        finally:
            self._io.release()

    def _flush_loop(self) -> None:
        """The flusher thread: every flush_s, whatever is buffered (so no line waits longer)."""
        while not self._stop.wait(self.flush_s):
            self.flush()

    def _append(self, fd: int, lines: list[str]) -> None:
        """Append ``lines`` (under _io); a failure drops them (see the class doc)."""
        data, start, sent = memoryview("".join(lines).encode()), None, 0
        try:
            start = os.fstat(fd).st_size
            while data:
                k = os.write(fd, data)
                data, sent = data[k:], sent + k
        except OSError as e:
            self.dropped += len(lines)
            try:  # no torn line; only where nothing else was appended since (another engine's lines)
                if start is not None and sent and os.fstat(fd).st_size == start + sent:
                    os.ftruncate(fd, start)
            except OSError:
                pass
            if not self._failing:
                log.warning("kvstore: trace_path %s: a write failed (%s); its %d lines are dropped, and so "
                            "is every line until a write succeeds (counted)", self.path, e.strerror or e, len(lines))
            self._failing = True
        else:
            self._failing = False

    def close(self) -> None:
        self._stop.set()
        with self._io:
            with self._lock:
                lines, self._buf, self._bytes = self._buf, [], 0
                fd, self._fd = self._fd, -1  # a write from now on is ignored
            if fd >= 0:
                if lines:
                    self._append(fd, lines)
                os.close(fd)
        _open_writers.discard(self)


@atexit.register
def _flush_at_exit() -> None:
    """An engine that exits without closing its connector (an LLM left to the interpreter's exit)
    keeps its last lines: the flusher thread is a daemon, stopped without a last round."""
    for w in list(_open_writers):
        w.flush()


RECORDED_KEY = "recorded"  # an optional field of a line: the config and block that recorded the trace


def recorded_fields(tiers: dict, block_bytes: int, block_tokens: int, by: str, **extra) -> dict:
    """What a trace writer puts under ``"recorded"`` in its first line (extra fields are ignored by
    every reader, so older ones read such a trace): the store's sections of its local tiers
    (capacities, TTLs, policies, folders) and the KV block it stored, which ``kvstore tune`` takes
    as its default budget, base config and block size."""
    from kvstore.tiers.registry import SPECS

    return {"by": by, "tiers": {s.name: dict(tiers.get(s.name) or {}) for s in SPECS if s.local},
            "block_bytes": int(block_bytes), "block_tokens": int(block_tokens), **extra}
