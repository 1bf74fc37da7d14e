"""Per-request retention hints, from vLLM's ``kv_transfer_params`` (the OpenAI API's
``kv_transfer_params`` field, or ``SamplingParams(extra_args={"kv_transfer_params": ...})``):

    {"kvstore": {"ttl_s": 3600}}   keep this request's blocks (those it stores, and those it
                                   hits) idle for at least an hour, in every tier
    {"kvstore": {"store": false}}  a one-off request: its blocks are never stored (it may hit)
    {"kvstore": {"session": "c42"}} the conversation (agent run) the request belongs to, where vLLM's
                                   own ``session_id`` is not given: feeds ``ttl_shared_s``,
                                   ``lru_shared``, the trace and ``kvstore explain``. Never the cache
                                   salt: that isolates tenants (it is part of every block hash)
    {"kvstore": {"tag": "search"}}  a label of the request's kind (an agent, a tool, a tenant): hit
                                   rate per tag in the metrics, ``kvstore stats`` and the trace

A bad hint never fails the request: it is logged as an error that names the request, the key,
the value and what is allowed, and the config applies instead.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping

from kvstore.store.handles import check_ttl

log = logging.getLogger(__name__)

KEY = "kvstore"


def parse(params: Any, req_id: str) -> tuple[float | None, bool]:
    """(ttl_s or None, store) from a request's ``kv_transfer_params``."""
    if not isinstance(params, Mapping) or KEY not in params:
        return None, True
    hints = params[KEY]
    if not isinstance(hints, Mapping):
        _bad(req_id, KEY, hints, 'a mapping, e.g. {"ttl_s": 3600} or {"store": false}')
        return None, True
    ttl, store = None, True
    for k, v in hints.items():
        if k == "ttl_s":
            try:
                ttl = check_ttl(v)  # the store's own check
            except ValueError:
                _bad(req_id, f"{KEY}.ttl_s", v, "a positive number of seconds, or null")
        elif k == "store":
            if isinstance(v, bool):
                store = v
            else:
                _bad(req_id, f"{KEY}.store", v, "true | false")
        elif k not in WORDS:
            _bad(req_id, f"{KEY}.{k}", v, "known keys are ttl_s, store, " + ", ".join(WORDS))
    return ttl, store


WORDS = ("session", "tag")  # short names a request may carry (labels, never parsed for meaning)
MAX_WORD = 256


def word(params: Any, name: str, req_id: str) -> str | None:
    """A short name from ``kv_transfer_params["kvstore"][name]`` (a string or an integer of at most
    256 characters), or None; a bad one is logged and ignored."""
    if not isinstance(params, Mapping) or not isinstance(params.get(KEY), Mapping):
        return None
    v = params[KEY].get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (str, int)) or not str(v) or len(str(v)) > MAX_WORD:
        _bad(req_id, f"{KEY}.{name}", v, f"a string of 1 to {MAX_WORD} characters")
        return None
    return str(v)


def _bad(req_id: str, key: str, value: Any, allowed: str) -> None:
    log.error("kvstore: request %s: kv_transfer_params key '%s': invalid value %r; allowed: %s; "
              "the config applies to this request", req_id, key, value, allowed)
