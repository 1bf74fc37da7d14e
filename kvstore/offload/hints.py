"""Per-request retention hints, from vLLM's ``kv_transfer_params`` (the OpenAI API's
``kv_transfer_params`` field, or ``SamplingParams(extra_args={"kv_transfer_params": ...})``):

    {"kvstore": {"ttl_s": 3600}}   keep this request's blocks (those it stores, and those it
                                   hits) idle for at least an hour, in every tier; at most the
                                   operator's cap (``max_hint_ttl_s``): a longer one is cut to it
    {"kvstore": {"store": false}}  a one-off request: its blocks are never stored (it may hit)
    {"kvstore": {"session": "c42"}} the conversation (agent run) the request belongs to, where vLLM's
                                   own ``session_id`` is not given: feeds ``ttl_shared_s``,
                                   ``lru_shared``, the trace and ``kvstore explain``. Never the cache
                                   salt: that isolates tenants (it is part of every block hash)
    {"kvstore": {"tag": "search"}}  a label of the request's kind (an agent, a tool, a tenant): hit
                                   rate per tag in the metrics, ``kvstore stats`` and the trace

A session or a tag is a *name*: 1 to 256 printable characters (no control, format or separator
character but the space: nothing that moves a terminal's cursor, ends a log line or reorders
text), or an integer of at most 64 bits. vLLM's own ``session_id`` is held to the same rule.

Any API client can send these, so a hint is untrusted input:

* A bad hint never fails the request: it is logged as an error that names the request, the key,
  the value and what is allowed, and the config applies instead (a bad name: none).
* A log line shows a key, a value or a request id escaped (``repr``: a newline is ``\\n``, an
  ESC ``\\x1b``) and cut to ``SHOWN`` characters, with the full length said: a client can neither
  forge a line nor grow the log by the size of its request.
* At most ``LINES_PER_MINUTE`` such lines a minute per process, then one line saying so; the
  next minute's first line says how many were left out. Counting one costs a lock and a clock read;
  a request is never refused or slowed for its hints.
"""

from __future__ import annotations

import logging
import reprlib
import threading
import time
from typing import Any, Callable, Mapping

from kvstore.store.handles import check_ttl

log = logging.getLogger(__name__)

KEY = "kvstore"
WORDS = ("session", "tag")  # short names a request may carry (labels, never parsed for meaning)
MAX_WORD = 256
WORD_RULE = f"1 to {MAX_WORD} printable characters (no control or format character), or an integer of <= 64 bits"
SHOWN = 100  # characters of a key, a value or a request id a log line shows
LINES_PER_MINUTE = 10  # bad-hint lines a minute: a client sending one a request writes ~5 KB a minute, not GBs


class LogLimit:
    """At most ``per_minute`` lines a minute (windows of 60 s from the first line), then one line
    saying the rest are counted; the next window's first line says how many were left out."""

    def __init__(self, per_minute: int = LINES_PER_MINUTE, clock: Callable[[], float] = time.monotonic):
        self.per_minute, self.clock = per_minute, clock
        self._lock = threading.Lock()
        self._start: float | None = None
        self._n = self._dropped = 0

    def allow(self) -> bool:
        with self._lock:
            now = self.clock()
            if self._start is None or now - self._start >= 60.0:
                if self._dropped:
                    log.warning("kvstore: %d more bad kv_transfer_params hints were not logged in the last "
                                "minute (at most %d lines a minute)", self._dropped, self.per_minute)
                self._start, self._n, self._dropped = now, 0, 0
            if self._n < self.per_minute:
                self._n += 1
                return True
            if not self._dropped:
                log.warning("kvstore: %d bad kv_transfer_params hints in under a minute: the next are counted, not "
                            "logged, until the minute is over", self.per_minute)
            self._dropped += 1
            return False


limit = LogLimit()  # this process's (a test may put its own in, with its own clock)


def parse(params: Any, req_id: str, cap: float | None = None) -> tuple[float | None, bool]:
    """(ttl_s or None, store) from a request's ``kv_transfer_params``; a ``ttl_s`` above ``cap``
    (``StoreConfig.hint_ttl_cap``; None: no cap) is cut to it."""
    if not isinstance(params, Mapping) or KEY not in params:
        return None, True
    hints = params[KEY]
    if not isinstance(hints, Mapping):
        _bad(req_id, None, hints, 'a mapping, e.g. {"ttl_s": 3600} or {"store": false}')
        return None, True
    ttl, store = None, True
    for k, v in hints.items():
        if k == "ttl_s":
            try:
                ttl = check_ttl(v)  # the store's own check
            except ValueError:
                _bad(req_id, k, v, "a positive number of seconds, or null")
            if ttl is not None and cap is not None and ttl > cap:
                if limit.allow():
                    log.warning("kvstore: request %s: kv_transfer_params key 'kvstore.ttl_s': %s is above "
                                "max_hint_ttl_s (%g s): cut to %g s", shown(req_id), shown(v), cap, cap)
                ttl = float(cap)
        elif k == "store":
            if isinstance(v, bool):
                store = v
            else:
                _bad(req_id, k, v, "true | false")
        elif k not in WORDS:
            _bad(req_id, k, v, "known keys are ttl_s, store, " + ", ".join(WORDS))
    return ttl, store


def word(params: Any, name: str, req_id: str) -> str | None:
    """A name from ``kv_transfer_params["kvstore"][name]`` (see :func:`checked`), or None."""
    if not isinstance(params, Mapping) or not isinstance(params.get(KEY), Mapping):
        return None
    return checked(params[KEY].get(name), name, req_id)


def checked(v: Any, name: str, req_id: str, field: str | None = None) -> str | None:
    """``v`` as a name (a session or a tag: ``WORD_RULE``), None for None; a bad one is logged
    (as ``kv_transfer_params`` key ``kvstore.<name>``, or as ``field``: vLLM's ``session_id``) and None."""
    if v is None:
        return None
    if isinstance(v, int) and not isinstance(v, bool) and v.bit_length() <= 64:
        return str(v)
    if isinstance(v, str) and 0 < len(v) <= MAX_WORD and v.isprintable():
        return v
    _bad(req_id, name, v, WORD_RULE, field=field, then=f"the request goes on without a {name}")
    return None


def shown(v: Any, most: int = SHOWN) -> str:
    """``v`` for a log line: its repr (every control, format and separator character escaped), at
    most ``most`` characters of it, the full length said; bounded work whatever ``v`` is."""
    if isinstance(v, str):
        return repr(v[:most]) + (f"... ({len(v)} characters)" if len(v) > most else "")
    if isinstance(v, int) and not isinstance(v, bool) and v.bit_length() > 64:
        return f"an integer of {v.bit_length()} bits"
    try:
        text = _REPR.repr(v)
    except Exception:  # noqa: BLE001 - a caller's object whose repr fails (or an int over 4300 digits inside)
        text = f"<{type(v).__name__}>"
    cut = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text[:most])  # a caller's own __repr__
    return cut + (f"... (a {type(v).__name__})" if len(text) > most else "")


_REPR = reprlib.Repr()  # bounded: a 5 MB list or a deep one costs a few items of each level
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother = 3, SHOWN, SHOWN


def _bad(req_id: str, key: Any, value: Any, allowed: str, field: str | None = None,
         then: str = "the config applies to this request") -> None:
    """An error line for a bad hint (``key`` under ``kvstore``, None for ``kvstore`` itself; or ``field``,
    a request field of vLLM's), when the limit allows one."""
    if not limit.allow():  # counted, not logged: nothing formatted, nothing copied
        return
    if field is None:
        name = f"'{KEY}'" if key is None else f"'{KEY}.{key}'" if isinstance(key, str) and len(key) <= SHOWN \
            and key.isprintable() else f"{KEY}[{shown(key)}]"  # a forged or huge key name, escaped
        field = f"kv_transfer_params key {name}"
    log.error("kvstore: request %s: %s: invalid value %s; allowed: %s; %s", shown(req_id), field, shown(value),
              allowed, then)
