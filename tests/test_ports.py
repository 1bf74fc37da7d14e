"""The benches' and tests' own ports (bench/common/ports.py) come from below the kernel's ephemeral range,
where no ``bind(0)`` elsewhere (vLLM's own port picks, outgoing connections) can take them between
the pick and the server's bind."""

from __future__ import annotations

import socket

import pytest

from kvstore.bench.common import ports


def test_ports_are_free_distinct_and_below_the_ephemeral_range():
    start = ports._ephemeral_start()
    got = ports.free_ports(8)
    assert len(set(got)) == 8
    for p in got:
        assert ports.LOW <= p < start, (p, start)
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))  # free: nothing listens there
    p = ports.free_port(span=10000)  # a Redis cluster node: its bus port too
    assert p + 10000 < start and ports.bindable(p + 10000)


def test_a_port_in_use_is_never_given():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        assert not ports.bindable(taken)
        assert all(p != taken for p in ports.free_ports(50))


def test_no_room_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(ports, "bindable", lambda port, host="127.0.0.1": False)
    with pytest.raises(RuntimeError, match="no 1 free ports"):
        ports.free_port()
