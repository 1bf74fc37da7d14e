"""Per-request retention hints, from vLLM's ``kv_transfer_params`` (the OpenAI API's
``kv_transfer_params`` field, or ``SamplingParams(extra_args={"kv_transfer_params": ...})``):

    {"kvstore": {"ttl_s": 3600}}   keep this request's blocks (those it stores, and those it
                                   hits) idle for at least an hour, in every tier
    {"kvstore": {"store": false}}  a one-off request: its blocks are never stored (it may hit)

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
        else:
            _bad(req_id, f"{KEY}.{k}", v, "known keys are ttl_s, store")
    return ttl, store


def _bad(req_id: str, key: str, value: Any, allowed: str) -> None:
    log.error("kvstore: request %s: kv_transfer_params key '%s': invalid value %r; allowed: %s; "
              "the config applies to this request", req_id, key, value, allowed)
