"""The node daemon's control path (issue 46): a lookup of an 8k-token prompt (512 keys of 16-token
blocks) as it crosses the socket, and the whole round trip against the same lookup in process.

* ``test_lookup_frame[msgpack]``: the node wire's encode + decode of the request (kvstore.node.wire)
* ``test_lookup_frame[json]``: the scheduler RPC's JSON with hex keys, for comparison (measured here:
  msgpack 15 us, JSON 152 us, min of 7 x 200)
* ``test_lookup_round_trip[node]``: ``NodeStore.contains_prefix`` to a daemon in this process, over
  its Unix socket; ``[embedded]``: ``KVStore.contains_prefix`` in process, the same stored prefix

Run: ``make microbench``.
"""

from __future__ import annotations

import json
import os
import uuid

import msgspec
import numpy as np
import pytest

from conftest import BS, ROUNDS, WARMUP, tokens
from kvstore.config import from_dict
from kvstore.keys import ModelFingerprint, chain_keys
from kvstore.node.client import NodeStore
from kvstore.node.daemon import NodeDaemon
from kvstore.store import KVStore

FP = ModelFingerprint(model="micro-node", dtype="float16", block_size=BS)
BB = 8192


def _run(benchmark, fn):
    return benchmark.pedantic(fn, rounds=ROUNDS, warmup_rounds=WARMUP, iterations=1)


@pytest.mark.parametrize("codec", ["msgpack", "json"])
def test_lookup_frame(benchmark, codec):
    keys = [os.urandom(16) for _ in range(512)]
    if codec == "msgpack":
        enc, dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder()
        _run(benchmark, lambda: dec.decode(enc.encode(["lookup", keys, False, None, 0])))
    else:
        def js():
            m = json.loads(json.dumps({"op": "contains_prefix", "args": {"keys": [k.hex() for k in keys]}}))
            return [bytes.fromhex(h) for h in m["args"]["keys"]]
        _run(benchmark, js)


@pytest.mark.parametrize("where", ["node", "embedded"])
def test_lookup_round_trip(benchmark, tmp_path, where):
    cfg = from_dict({"tiers": {"dram": {"capacity_gb": 0.01, "pin_memory": False},
                               "nvme": {"path": str(tmp_path / "n"), "capacity_gb": 0.05}},
                     "mode": "node", "node": {"name": f"micro-{uuid.uuid4().hex[:8]}"}})
    keys = chain_keys(FP, tokens("chat", 8192), BS)[:512]
    daemon = store = None
    try:
        if where == "node":
            daemon = NodeDaemon(cfg).start()
            store = NodeStore(cfg, block_bytes=BB, fingerprint=FP, block_tokens=BS)
        else:
            store = KVStore(cfg, block_bytes=BB, fingerprint=FP, block_tokens=BS)
        h = store.begin_store(keys[:256])
        for v in h.views:
            if v is not None:
                v[:] = np.uint8(1)
        store.end_store(h, True)
        m = _run(benchmark, lambda: store.contains_prefix(keys, record=False))
        assert m.num_blocks > 0
    finally:
        if store is not None:
            store.close()
        if daemon is not None:
            daemon.close(persist=False)
