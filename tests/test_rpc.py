"""The scheduler->store calls across processes (kvstore.offload.rpc) without vLLM: a real
StoreServer on a real store, a RemoteClient on its Unix socket, every call answered as the
in-process LocalClient answers it; the framing over a socketpair (length prefix, JSON only,
an oversized message refused); a bad call answered with an error while the server goes on; a
server gone is a quick ConnectionError, and the client reconnects after its back-off."""

from __future__ import annotations

import os
import socket
import struct
import time

import pytest

from kvstore.offload import rpc
from kvstore.offload.client import LocalClient
from kvstore.offload.metrics import OffloadMetrics, RequestOutcome
from kvstore.offload.shared import SharedStore
from kvstore.store import KVStore

from conftest import BLOCK, FP, blocks_for, make_keys, tiny_config


@pytest.fixture
def served(tmp_path):
    store = KVStore(tiny_config(tmp_path / "nvme", dram_blocks=8, nvme_blocks=32), block_bytes=BLOCK,
                    fingerprint=FP, block_tokens=FP.block_size)
    shared = SharedStore(store, OffloadMetrics(store.metrics.registry))
    name = f"test-rpc-{os.getpid()}-{time.monotonic_ns()}"
    server = rpc.StoreServer(shared, name)
    client = rpc.RemoteClient(name, connect_timeout_s=5, timeout_s=5)
    yield store, shared, server, client, name
    client.close()
    server.close()
    store.close()


def test_socketpair_framing_and_limits():
    a, b = socket.socketpair()
    with a, b:
        rpc._send(a, {"op": "ping", "args": {"keys": ["00ff"]}})
        assert rpc._recv(b) == {"op": "ping", "args": {"keys": ["00ff"]}}
        a.sendall(struct.pack("<I", rpc.MAX_MSG + 1))  # a length past the limit: refused unread
        with pytest.raises(ConnectionError, match="refused"):
            rpc._recv(b)
        body = b"\x80\x04K\x01."  # a pickle: not JSON, never unpickled
        a.sendall(struct.pack("<I", len(body)) + body)
        with pytest.raises(ValueError):
            rpc._recv(b)
    a, b = socket.socketpair()
    a.sendall(struct.pack("<I", 10) + b"{}")
    a.close()  # closed mid-message
    with b, pytest.raises(ConnectionError, match="closed"):
        rpc._recv(b)


def test_every_call_answers_as_in_process(served):
    store, shared, _server, client, _ = served
    local = LocalClient(shared)
    keys = make_keys(6, seed=5)
    assert store.put(keys[:4], blocks_for(keys[:4])) == 4
    m_remote, m_local = client.contains_prefix(keys), local.contains_prefix(keys)
    assert m_remote == m_local and m_remote.num_blocks == 4 and m_remote.miss_reason == m_local.miss_reason
    token = client.prefetch(keys)
    deadline = time.monotonic() + 5
    while not client.prefetch_done(token):
        assert time.monotonic() < deadline
    hid, n, tiers = client.begin_load(keys, session="s1")
    assert n == 4 and len(tiers) == 4 and set(tiers) <= {"dram", "nvme"}
    h = shared.handles[hid]  # the worker side holds the pinned handle under that id
    assert h.num_blocks == 4 and list(h.keys[:4]) == keys[:4]
    client.end_load(hid)
    assert hid not in shared.handles
    client.record_request(RequestOutcome("r1", prompt=96, local=0, promised=64, got=64, tiers=("dram",) * 4))
    assert shared.request_log[-1] == ("r1", 96, 0, 64, ("dram",) * 4)
    assert client.saves_done("r1") is True  # no copy jobs: nothing pending
    assert client._call("ping") == "pong"


def test_a_bad_call_is_an_error_and_the_server_goes_on(served):
    _store, _shared, _server, client, _ = served
    with pytest.raises(RuntimeError, match="unknown op 'drop_tables'"):
        client._call("drop_tables")
    with pytest.raises(RuntimeError, match="contains_prefix"):
        client._call("contains_prefix", keys=["not hex"])
    assert client.contains_prefix(make_keys(2, seed=6)).num_blocks == 0  # same connection, still served


def test_server_gone_then_back(served):
    store, shared, server, client, name = served
    server.close()
    client._close_sock()  # the worker died: its end of the socket is gone
    t0 = time.monotonic()
    with pytest.raises(ConnectionError):
        client.contains_prefix(make_keys(2, seed=7))
    with pytest.raises(ConnectionError, match="reconnecting"):  # within the back-off: no connect at all
        client.contains_prefix(make_keys(2, seed=7))
    assert time.monotonic() - t0 < 1.0 and client.failures >= 1
    server2 = rpc.StoreServer(shared, name)
    try:
        time.sleep(0.25)  # past the first back-off (0.1 s, doubled once)
        keys = make_keys(3, seed=8)
        store.put(keys, blocks_for(keys))
        assert client.contains_prefix(keys).num_blocks == 3
    finally:
        server2.close()


def test_socket_is_private(served):
    _store, _shared, server, _client, _ = served
    st = os.stat(server.path)
    assert st.st_mode & 0o777 == 0o600
    assert os.stat(os.path.dirname(server.path)).st_mode & 0o777 == 0o700
