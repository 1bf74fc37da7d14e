"""The ``trust`` family's engines of different secrets on one Redis (issue 45 finding 3; the
family itself: :mod:`.trust`), as a staging engine on the production Redis or a rotation rolled
out without ``KVSTORE_REMOTE_SECRET_PREVIOUS`` would meet them:

engine A (secret A) stores a prompt's blocks; engine B (secret B) looks the prompt up, loads
it, then stores its own (it computed them); an engine in the middle of a rotation (secret B,
previous A) loads A's. Then a fresh engine of fleet A loads the prompt.

Figures: ``trust_cross_secret_deleted`` (A's values gone after B's lookup and load),
``trust_cross_secret_lost`` (A's blocks the fresh A engine could not serve after B stored its
own), ``trust_cross_secret_served`` (A's blocks that B served: B cannot check them), all 0;
``trust_rotation_served`` (A's blocks the rotating engine served: all). Before issue 45, B
deleted every value it looked at (8 of 8) and its own stores then took A's names (8 lost)."""

from __future__ import annotations

from typing import Callable

import numpy as np

from kvstore.bench.faults.families.common import block_of, key_of

N = 8


def cross_secret(srv, make_remote: Callable, seed: int, *, secret_a: str, secret_b: str) -> dict:
    """``make_remote(url, password, secret=, previous=)``: a remote-only store of that environment."""
    c = srv.client(socket_timeout=5)
    a = make_remote(srv.url, srv.password, secret=secret_a)
    b = make_remote(srv.url, srv.password, secret=secret_b)
    rotating = make_remote(srv.url, srv.password, secret=secret_b, previous=secret_a)
    stores = [a, b, rotating]
    try:
        bb = a.block_bytes
        keys = [key_of(f"cross-{seed}", i) for i in range(N)]
        blocks = np.stack([block_of(k, bb) for k in keys])
        a.put(keys, blocks)
        names = [a.remote.client.redis_key(k) for k in keys]
        before = sum(c.exists(n) for n in names)
        b.contains_prefix(keys)
        b_served = _served(b, keys)
        after = sum(c.exists(n) for n in names)  # before B stores: its own values may take the names
        b.put(keys, blocks)  # B computed them: its own values
        rot_served = _served(rotating, keys)
        fresh = make_remote(srv.url, srv.password, secret=secret_a)
        stores.append(fresh)
        fresh.contains_prefix(keys)
        a_served = _served(fresh, keys)
        return {"trust_cross_secret_blocks": before, "trust_cross_secret_deleted": before - after,
                "trust_cross_secret_lost": before - a_served, "trust_cross_secret_served": b_served,
                "trust_rotation_served": rot_served,
                "trust_cross_secret_b_refused": sum(b.remote.corrupt_reasons.values())}
    finally:
        for s in stores:
            s.close()
        c.close()


def _served(store, keys: list[bytes]) -> int:
    """Blocks served with the right bytes (a wrong one would be counted by the forged check)."""
    bb = store.block_bytes
    out = np.zeros((len(keys), bb), np.uint8)
    n = store.get(keys, out)
    return sum(np.array_equal(out[i], block_of(keys[i], bb)) for i in range(n))
